"""Conflict retry for ops: the jobs layer's one retry policy (jobs/retry.py) as Dagster step retries.

`CommitConflictError` (an UPDATE/DELETE or MERGE job, the upsert included, whose partitions or
expected properties another commit changed first) means "nothing of this attempt is visible, try
again": the op raises `RetryRequested` with the policy's count and backoff, and Dagster re-runs the
op body, which starts a new core job (`Job.start` reads the then-current snapshot). Every other
error fails the op at once. Core never retries a conflict itself, so attempts do not multiply.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dagster import OpExecutionContext, RetryRequested

from partfin_assets.jobs import retry as job_retry
from partfin_assets.jobs.conflicts import CommitConflictError
from partfin_assets.jobs.retry import ConflictRetryPolicy


@contextmanager
def retry_on_conflict(context: OpExecutionContext, what: str, policy: ConflictRetryPolicy | None = None) -> Iterator[None]:
    """Turn a conflict raised in the block into a bounded step retry (attempt = context.retry_number + 1)."""
    policy = policy or job_retry.CONFLICT_RETRY
    try:
        yield
    except CommitConflictError as exc:
        attempt = context.retry_number + 1
        if attempt > policy.max_retries:
            context.log.error(f"{what}: conflict on attempt {attempt}, no retries left: {exc}")
            raise
        wait = policy.delay_s(context.retry_number)
        context.log.warning(f"{what}: conflict on attempt {attempt} of {policy.max_retries + 1}; retrying from a fresh snapshot in {wait:.1f}s: {exc}")
        raise RetryRequested(max_retries=policy.max_retries, seconds_to_wait=wait) from exc
