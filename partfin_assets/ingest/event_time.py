"""The built-in Accumulator: the event-time stats of a checkpoint (docs/contracts.md), overall and per hour."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from partfin_assets.ingest.extensions import Accumulator
from partfin_assets.model.stats import EventTimeProfile, EventTimeStats


@dataclass(frozen=True)
class EventTimes:
    profile: EventTimeProfile
    event_time_us: np.ndarray  # ascending; kept for exact late-record counts against the watermark at commit time
    summary: dict[str, str]  # encoded with the rest, while the subtask's files are written

    @property
    def stats(self) -> EventTimeStats:
        return self.profile.stats


class EventTimeAccumulator(Accumulator):
    """The event-time stats of a checkpoint, and the same per hour (partfin.event-time.by-hour)."""

    name = "event-time"

    def __init__(self) -> None:
        self._chunks: list[np.ndarray] = []

    def add(self, records: pa.Table) -> None:
        self._chunks.append(records.column("event_time").to_numpy().view(np.int64))  # no copy for one chunk

    def partial(self) -> EventTimes:
        return _event_times(self._chunks)

    @classmethod
    def merge(cls, partials: Sequence[EventTimes]) -> EventTimes:
        if len(partials) == 1:
            return partials[0]
        # rebuilt from all values: exact per-hour figures, and one result however the keys were split
        return _event_times([p.event_time_us for p in partials])

    @classmethod
    def summary(cls, merged: EventTimes) -> dict[str, str]:
        return merged.summary


def _event_times(chunks: Sequence[np.ndarray]) -> EventTimes:
    times = np.concatenate(chunks) if chunks else np.empty(0, dtype=np.int64)  # a copy of its own
    times.sort()
    profile = EventTimeProfile.of_sorted(times)
    return EventTimes(profile, times, profile.to_summary())
