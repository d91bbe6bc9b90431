"""One retry policy for jobs that lose a race (docs/concurrency.md): re-run from a fresh snapshot, bounded.

A `CommitConflictError` means nothing of the attempt is visible, so running the whole job
again (it starts a new `Job` on the then-current snapshot) is always safe. The policy is
defined once here; the CLI runs it in process (`retry_on_conflict`), the Dagster layer
expresses the same policy as step retries (defs/retry.py), so a run is never retried by both.
Every other error fails at once.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from partfin_assets.jobs.conflicts import CommitConflictError

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class ConflictRetryPolicy:
    max_retries: int = 3  # re-runs after the first attempt
    base_delay_s: float = 2.0  # 2 s, 4 s, 8 s (+ up to 50% jitter): the winner usually finished long before

    def delay_s(self, retry_number: int) -> float:
        """Wait before re-run `retry_number + 1` (retry_number counts the re-runs so far)."""
        delay = self.base_delay_s * (2**retry_number)
        return delay + random.uniform(0, delay / 2)


CONFLICT_RETRY = ConflictRetryPolicy()


def retry_on_conflict(
    run: Callable[[], T],
    policy: ConflictRetryPolicy | None = None,
    *,
    sleep: Callable[[float], None] = time.sleep,
    on_conflict: Callable[[CommitConflictError, int], None] | None = None,
) -> T:
    """Run a job function, and again from a fresh snapshot while it fails with CommitConflictError (bounded)."""
    policy = policy or CONFLICT_RETRY
    for retry_number in range(policy.max_retries + 1):
        try:
            return run()
        except CommitConflictError as exc:
            if retry_number == policy.max_retries:
                raise
            wait = policy.delay_s(retry_number)
            log.info("%s (attempt %d of %d); re-running from a fresh snapshot in %.1fs",
                     exc, retry_number + 1, policy.max_retries + 1, wait)
            if on_conflict is not None:
                on_conflict(exc, retry_number + 1)
            sleep(wait)
    raise AssertionError("unreachable")
