"""One step of a stream under a policy, the same for the writer (ingest/watermark_processor.py, inside the
checkpoint commit) and the policy lab's replay (jobs/policy_lab.py): the window, the stream's progress, the
table's watermark. A window in arrival time looks at the same arrivals whatever the checkpoint cadence; a count
of commits does not. The watermark is max(previous, candidate): late data never moves it back."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from partfin_assets.model.stats import CommitStats, CommitWindow
from partfin_assets.model.timeutil import floor_hour_us
from partfin_assets.watermark.policy import WatermarkPolicy


def window_of(window: CommitWindow, this: Sequence[CommitStats], older: Iterable[CommitStats]) -> tuple[list[CommitStats], CommitStats | None]:
    """The commit being made, then the older ones (newest first) `window` holds; and the first it does not
    (None: `older` ran out first)."""
    newest = this[0].arrival_clock_us
    found = list(this)
    for commit in older:
        if not window.holds(len(found), commit.arrival_clock_us, newest):
            return found, commit
        found.append(commit)
    return found, None


def stream_progress(policy: WatermarkPolicy, state: Any, window: Sequence[CommitStats], clock_us: int) -> int | None:
    """The stream's candidate, never past the hour that has begun on `clock_us`."""
    candidate = policy.candidate_us(window, state)
    return None if candidate is None else min(candidate, floor_hour_us(clock_us))


def advance(previous_us: int | None, candidate_us: int | None) -> int | None:
    """Monotonic: the watermark only ever moves forward."""
    if candidate_us is None:
        return previous_us
    if previous_us is None:
        return candidate_us
    return max(previous_us, candidate_us)
