"""Late data and watermark history read from retained CDC snapshots: what came late, and when."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from partfin_assets.iceberg.history import lineage, summary_of
from partfin_assets.model import summary_keys as K
from partfin_assets.model.timeutil import parse_iso, to_us


def late_by_hour(summary: Mapping[str, str]) -> dict[int, int]:
    text = summary.get(K.LATE_RECORDS_BY_HOUR)
    if not text:
        return {}
    return {to_us(parse_iso(hour)): int(count) for hour, count in json.loads(text).items()}


@dataclass(frozen=True)
class LateCommit:
    snapshot_id: int
    sequence_number: int | None
    committed_at_us: int
    records: int


@dataclass(frozen=True)
class LateHour:
    hour_us: int
    records: int
    commits: tuple[LateCommit, ...]


def late_data(metadata) -> dict[int, LateHour]:
    """Late records per hour over the retained CDC snapshots, with the commits that brought them."""
    found: dict[int, list[LateCommit]] = {}
    for snapshot in lineage(metadata):
        for hour, count in late_by_hour(summary_of(snapshot)).items():
            found.setdefault(hour, []).append(
                LateCommit(snapshot.snapshot_id, snapshot.sequence_number, snapshot.timestamp_ms * 1000, count)
            )
    return {
        hour: LateHour(hour, sum(c.records for c in commits), tuple(sorted(commits, key=lambda c: c.committed_at_us)))
        for hour, commits in sorted(found.items())
    }


@dataclass(frozen=True)
class WatermarkStep:
    snapshot_id: int
    watermark_us: int


def watermark_regressions(history: Sequence[tuple[int, int]]) -> list[tuple[WatermarkStep, WatermarkStep]]:
    """Pairs (earlier, later) of consecutive recorded watermarks where the later one is smaller."""
    steps = [WatermarkStep(s, w) for s, w in history]
    return [(a, b) for a, b in zip(steps, steps[1:]) if b.watermark_us < a.watermark_us]


def late_after_run(late: Mapping[int, LateHour], hour_us: int, ran_with_sequence: int | None, ran_at_us: int) -> list[LateCommit]:
    """Late commits into `hour` that the downstream run of that hour did not see.

    A run that read base merged up to CDC sequence number S saw every commit with
    sequence <= S; without sequence numbers, the run's start time decides.
    """
    entry = late.get(hour_us)
    if entry is None:
        return []
    if ran_with_sequence is not None:
        return [c for c in entry.commits if c.sequence_number is not None and c.sequence_number > ran_with_sequence]
    return [c for c in entry.commits if c.committed_at_us > ran_at_us]
