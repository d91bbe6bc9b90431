"""The watermark policy as a CommitProcessor: computed inside the checkpoint commit itself."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from pyiceberg.table.snapshots import Snapshot

from partfin_assets.iceberg.history import late_records_total, recent_commit_stats, watermark_of
from partfin_assets.iceberg.streams import active_streams, progress_floor
from partfin_assets.ingest.event_time import EventTimeAccumulator, EventTimes
from partfin_assets.ingest.extensions import CommitContext, CommitProcessor
from partfin_assets.ingest.watermark_policy import WatermarkPolicy, advance
from partfin_assets.model import summary_keys as K
from partfin_assets.model.stats import CommitStats, compact_json, hour_bounds
from partfin_assets.model.timeutil import floor_hour_us, iso_z

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LateDataAlert:
    table: str
    snapshot_id: int
    checkpoint_id: int
    late_records: int
    by_hour: dict[str, int]  # hour (ISO Z) -> late records in that hour
    watermark: str  # the watermark in force before the commit


def log_late_data(alert: LateDataAlert) -> None:
    log.warning(
        "late data in %s: %d record(s) below watermark %s in checkpoint %d (snapshot %d): %s",
        alert.table, alert.late_records, alert.watermark, alert.checkpoint_id, alert.snapshot_id, alert.by_hour,
    )


def late_records_by_hour(sorted_event_time_us: np.ndarray, watermark_us: int) -> dict[str, int]:
    late = sorted_event_time_us[: np.searchsorted(sorted_event_time_us, watermark_us)]
    bounds = hour_bounds(late)
    return {iso_z(floor_hour_us(late[start])): end - start for start, end in zip(bounds, bounds[1:])}


def table_candidate(ctx: CommitContext) -> int | None:
    """The minimum progress over the table's active streams, this commit's own stream included.

    None (the watermark stays) while an active stream claims no progress yet: a writer that
    registered but has not committed stats holds the watermark, whatever the others did.
    """
    others = active_streams(ctx.table.metadata.properties, ctx.clock_us)
    others.pop(ctx.writer_id, None)
    if ctx.stream_progress_us is None or not others:
        return ctx.stream_progress_us
    floor = progress_floor(others)
    return None if floor is None else min(ctx.stream_progress_us, floor)


class WatermarkProcessor(CommitProcessor):
    """Advances partfin.watermark in the same commit as the data; counts and alerts on late records.

    The policy runs over the committing writer's own last X commits (its stream's candidate);
    the table's candidate is the minimum over its active streams (iceberg/streams.py), so one
    writer never moves the watermark past data another has not committed yet.

    Runs on every commit attempt against that attempt's fresh metadata, so the update is a
    compare-and-set: a concurrent writer's newer watermark is seen and never overwritten.
    """

    required_accumulators = (EventTimeAccumulator.name,)

    def __init__(self, alert_hooks: list[Callable[[LateDataAlert], None]] | None = None) -> None:
        self.alert_hooks = alert_hooks if alert_hooks is not None else [log_late_data]

    def pre_commit(self, ctx: CommitContext) -> None:
        event_times: EventTimes = ctx.accumulated[EventTimeAccumulator.name]
        metadata = ctx.table.metadata
        policy = WatermarkPolicy.parse(metadata.properties.get(K.PROP_WATERMARK_POLICY))
        previous = watermark_of(metadata.properties)

        this_commit: list[CommitStats] = []
        if not event_times.stats.is_empty:
            this_commit = [CommitStats(None, event_times.stats.min_us, event_times.stats)]
        elif ctx.heartbeat_us is not None:
            this_commit = [CommitStats(None, ctx.heartbeat_us, event_times.stats)]
        if this_commit:  # a commit without stats leaves its stream's progress where it is
            window = this_commit + recent_commit_stats(
                metadata, policy.lookback - 1, with_digest=policy.quantile is not None, writer_id=ctx.writer_id
            )
            ctx.stream_progress_us = policy.candidate_us(window)
        watermark = advance(previous, table_candidate(ctx))

        late = late_records_by_hour(event_times.event_time_us, previous) if previous is not None else {}
        late_count = sum(late.values())
        ctx.summary[K.LATE_RECORDS] = str(late_count)
        ctx.summary[K.LATE_RECORDS_TOTAL] = str(late_records_total(metadata) + late_count)
        if late:
            ctx.summary[K.LATE_RECORDS_BY_HOUR] = compact_json(late)
        if watermark is not None:
            ctx.summary[K.WATERMARK] = iso_z(watermark)
            if watermark != previous:
                ctx.properties[K.PROP_WATERMARK] = iso_z(watermark)

    def post_commit(self, ctx: CommitContext, snapshot: Snapshot) -> None:
        late = int(ctx.summary.get(K.LATE_RECORDS, "0"))
        if not late:
            return
        alert = LateDataAlert(
            table=ctx.table_name,
            snapshot_id=snapshot.snapshot_id,
            checkpoint_id=ctx.checkpoint_id,
            late_records=late,
            by_hour=json.loads(ctx.summary[K.LATE_RECORDS_BY_HOUR]),
            watermark=ctx.table.metadata.properties.get(K.PROP_WATERMARK, ""),
        )
        for hook in self.alert_hooks:
            hook(alert)
