"""The watermark policy as a CommitProcessor: computed inside the checkpoint commit itself."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
from pyiceberg.table.snapshots import Snapshot

from partfin_assets.iceberg.history import late_records_total, recent_commit_stats, watermark_of
from partfin_assets.iceberg.streams import active_streams, progress_floor
from partfin_assets.ingest.event_time import EventTimeAccumulator, EventTimes
from partfin_assets.ingest.extensions import CommitContext, CommitProcessor
from partfin_assets.ingest.watermark_policy import WatermarkPolicy, advance
from partfin_assets.model import summary_keys as K
from partfin_assets.model.stats import CommitStats, compact_json, hour_bounds, suspect_future
from partfin_assets.model.timeutil import US_PER_SECOND, floor_hour_us, iso_z, parse_duration

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
    return records_by_hour(sorted_event_time_us[: np.searchsorted(sorted_event_time_us, watermark_us)])


def records_by_hour(sorted_event_time_us: np.ndarray) -> dict[str, int]:
    bounds = hour_bounds(sorted_event_time_us)
    return {iso_z(floor_hour_us(sorted_event_time_us[start])): end - start for start, end in zip(bounds, bounds[1:])}


DEFAULT_FUTURE_TOLERANCE = timedelta(minutes=5)


def future_tolerance_us(properties: Mapping[str, str]) -> int:
    """How far past the commit's clock an event time is still plausible (`partfin.event-time.future-tolerance`)."""
    text = properties.get(K.PROP_FUTURE_TOLERANCE)
    return int((parse_duration(text) if text else DEFAULT_FUTURE_TOLERANCE).total_seconds() * US_PER_SECOND)


def suspect_future_entry(sorted_event_time_us: np.ndarray, heartbeat_us: int | None, clock_us: int, tolerance_us: int) -> dict:
    """What a commit carries beyond its clock + tolerance (empty: nothing): a source clock ahead of ours."""
    limit = clock_us + tolerance_us
    future = sorted_event_time_us[np.searchsorted(sorted_event_time_us, limit, side="right"):]
    entry: dict = {}
    if future.size:
        entry = {"records": int(future.size), "by-hour": records_by_hour(future), "max": iso_z(future[-1])}
    if heartbeat_us is not None and heartbeat_us > limit:
        entry["heartbeat"] = iso_z(heartbeat_us)
    if entry:
        entry.update({"clock": iso_z(clock_us), "tolerance-s": tolerance_us / US_PER_SECOND})
    return entry


def table_candidate(ctx: CommitContext) -> int | None:
    """The minimum progress over the table's active streams, this commit's own stream included.

    None (the watermark stays) while an active stream claims no progress yet: a writer that
    registered but has not committed stats holds the watermark, whatever the others did.
    """
    others = active_streams(ctx.table.metadata.properties, ctx.clock_us)
    others.pop(ctx.stream, None)
    if ctx.stream_progress_us is None or not others:
        return ctx.stream_progress_us
    floor = progress_floor(others)
    return None if floor is None else min(ctx.stream_progress_us, floor)


class WatermarkProcessor(CommitProcessor):
    """Advances partfin.watermark in the same commit as the data; counts and alerts on late records.

    The policy runs over the last X commits of the committing stream (the writer's own, or the
    source partition's the batch came from: its candidate); the table's candidate is the minimum
    over its active streams (iceberg/streams.py), so neither a writer nor a Kafka partition ever
    moves the watermark past data another has not committed yet.

    Time from the future: event times (or a heartbeat) beyond the commit's clock plus the table's
    tolerance are suspect -- a source clock ahead of ours, local time stored as UTC. They are
    written, counted (`partfin.suspect-future`) and logged, and claim no progress; and no stream's
    candidate ever passes floor_hour(commit clock), so the watermark never finalizes an hour that
    has not begun.

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

        heartbeat = ctx.heartbeat_us if event_times.stats.is_empty else None
        suspect = suspect_future_entry(event_times.event_time_us, heartbeat, ctx.clock_us, future_tolerance_us(metadata.properties))
        if suspect:
            ctx.summary[K.SUSPECT_FUTURE] = compact_json(suspect)
        # what this commit claims: its min event time (ascending, so never a suspect one unless all
        # are), or its heartbeat; nothing when all of it lay in the future
        this_commit: list[CommitStats] = []
        if not event_times.stats.is_empty and suspect.get("records", 0) < event_times.stats.count:
            this_commit = [CommitStats(None, event_times.stats.min_us, event_times.stats)]
        elif heartbeat is not None and "heartbeat" not in suspect:
            this_commit = [CommitStats(None, heartbeat, event_times.stats)]
        if this_commit:  # a commit without stats leaves its stream's progress where it is
            window = this_commit + recent_commit_stats(
                metadata, policy.lookback - 1, with_digest=policy.quantile is not None, writer_id=ctx.writer_id,
                stream_id=ctx.stream,
            )
            candidate = policy.candidate_us(window)
            ctx.stream_progress_us = None if candidate is None else min(candidate, floor_hour_us(ctx.clock_us))
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
        suspect = suspect_future(ctx.summary)
        if suspect:
            log.warning(
                "%s: checkpoint %d (snapshot %d) carries %d record(s) with event times up to %s%s, beyond its clock "
                "%s + %gs: a source clock ahead? They are written and counted, and never move the watermark",
                ctx.table_name, ctx.checkpoint_id, snapshot.snapshot_id, suspect.get("records", 0), suspect.get("max", "-"),
                f" and heartbeat {suspect['heartbeat']}" if "heartbeat" in suspect else "", suspect["clock"], suspect["tolerance-s"],
            )
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
