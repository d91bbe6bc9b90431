"""Conflict retry for ops: a job that lost a race (DESIGN §6) runs again from a fresh snapshot, bounded.

`CommitConflictError` (an UPDATE/DELETE or MERGE job whose partitions another commit changed
first) and `UpsertConflict` (the upsert kept losing to concurrent base commits) mean "nothing
of this attempt is visible, try again": the op raises `RetryRequested`, and Dagster re-runs the
op body, which starts a new core job (`Job.start` reads the then-current snapshot). Every other
error fails the op at once.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

from dagster import OpExecutionContext, RetryRequested

from partfin_assets.jobs.conflicts import CommitConflictError
from partfin_assets.jobs.upsert import UpsertConflict

CONFLICTS = (CommitConflictError, UpsertConflict)
MAX_CONFLICT_RETRIES = 3
BACKOFF_SECONDS = 2.0  # 2 s, 4 s, 8 s (+ up to 50% jitter): the winner usually finished long before


def backoff_seconds(retry_number: int, base: float | None = None) -> float:
    delay = (BACKOFF_SECONDS if base is None else base) * (2**retry_number)
    return delay + random.uniform(0, delay / 2)


@contextmanager
def retry_on_conflict(context: OpExecutionContext, what: str, max_retries: int = MAX_CONFLICT_RETRIES, base: float | None = None) -> Iterator[None]:
    """Turn a conflict raised in the block into a bounded step retry (attempt = context.retry_number + 1)."""
    try:
        yield
    except CONFLICTS as exc:
        attempt = context.retry_number + 1
        if attempt > max_retries:
            context.log.error(f"{what}: conflict on attempt {attempt}, no retries left: {exc}")
            raise
        wait = backoff_seconds(context.retry_number, base)
        context.log.warning(f"{what}: conflict on attempt {attempt} of {max_retries + 1}; retrying from a fresh snapshot in {wait:.1f}s: {exc}")
        raise RetryRequested(max_retries=max_retries, seconds_to_wait=wait) from exc
