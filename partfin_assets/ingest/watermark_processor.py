"""The watermark policy as a CommitProcessor: computed inside the checkpoint commit itself."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
from pyiceberg.expressions import EqualTo, GreaterThanOrEqual
from pyiceberg.table.snapshots import Snapshot

from partfin_assets.iceberg.expiry import window_retained
from partfin_assets.iceberg.history import StreamWindow, applied_policy, late_records_total, snapshot_commit_stats, stream_window, watermark_of
from partfin_assets.iceberg.ledger import COMMIT_STATS_COLUMNS, dotted_identifier, ledger_commit_stats, read_ledger
from partfin_assets.iceberg.streams import active_streams, idle_timeout_us, progress_floor, streams_of
from partfin_assets.ingest.event_time import EventTimeAccumulator, EventTimes
from partfin_assets.ingest.extensions import CommitContext, CommitProcessor
from partfin_assets.model import summary_keys as K
from partfin_assets.model.table_options import FUTURE_TOLERANCE
from partfin_assets.model.stats import CommitStats, compact_json, hour_bounds, suspect_future
from partfin_assets.model.timeutil import US_PER_SECOND, floor_hour_us, from_us, iso_z
from partfin_assets.watermark.change import PolicyChange
from partfin_assets.watermark.policy import WatermarkPolicy
from partfin_assets.watermark.registry import table_policy
from partfin_assets.watermark.step import advance, stream_progress, window_of

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


DEFAULT_FUTURE_TOLERANCE = timedelta(microseconds=FUTURE_TOLERANCE.default_value)


def future_tolerance_us(properties: Mapping[str, str]) -> int:
    """How far past the commit's clock an event time is still plausible (`partfin.event-time.future-tolerance`)."""
    return FUTURE_TOLERANCE.read(properties)


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
    """The minimum progress over the table's active streams, this commit's own stream included, capped at
    the hour that has begun on the committing writer's trusted clock.

    The streams are judged as this commit leaves them (a Kafka writer's own stream, retired by its
    partitions' first checkpoint, does not hold it) and by the committing writer's own clock (their
    silence, on its stream clock: iceberg/streams.py). None (the watermark stays) while an active
    stream claims no progress yet: a writer that registered but has not committed stats holds the
    watermark, whatever the others did.
    """
    properties = ctx.table.metadata.properties
    streams = ctx.streams if ctx.streams is not None else streams_of(properties)
    timeout = ctx.idle_timeout_us if ctx.idle_timeout_us is not None else idle_timeout_us(properties)
    others = active_streams(streams, ctx.writer_id, ctx.stream_clock, timeout)
    others.pop(ctx.stream, None)
    floor = progress_floor(others) if others else ctx.stream_progress_us
    if ctx.stream_progress_us is None or floor is None:
        return None
    return min(ctx.stream_progress_us, floor, floor_hour_us(ctx.trusted_clock))


def _ledger_commits(ctx: CommitContext, policy: WatermarkPolicy, tolerance_us: int) -> list[CommitStats]:
    """The stream's commits as the late-data ledger recorded them (every checkpoint reaches it before its snapshot
    can expire)."""
    rows = read_ledger(ctx.table.catalog, dotted_identifier(ctx.table), columns=COMMIT_STATS_COLUMNS,
                       row_filter=EqualTo("stream", ctx.stream))
    return ledger_commit_stats(rows, tolerance_us, with_digest=policy.needs_digest)


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
        # per (table, stream, with digests): the stream's commits a window longer than what expiry keeps may reach,
        # by snapshot id: read from the ledger once, then every retained commit seen (before it can expire) and every
        # commit of its own added
        self._history: dict[tuple[str, str, bool], dict[int, CommitStats]] = {}

    def pre_commit(self, ctx: CommitContext) -> None:
        event_times: EventTimes = ctx.accumulated[EventTimeAccumulator.name]
        metadata = ctx.table.metadata
        policy = table_policy(metadata.properties)
        previous = watermark_of(metadata.properties)
        change = self._policy_change(ctx, policy)
        ctx.summary[K.WATERMARK_POLICY_APPLIED] = str(policy)

        tolerance = future_tolerance_us(metadata.properties)
        heartbeat = ctx.heartbeat_us if event_times.stats.is_empty else None
        # the future begins at the commit clock as checked against the other writers' (a clock found ahead counts less)
        suspect = suspect_future_entry(event_times.event_time_us, heartbeat, ctx.trusted_clock, tolerance)
        if suspect:
            ctx.summary[K.SUSPECT_FUTURE] = compact_json(suspect)
        # what this commit claims: its min event time (ascending, so never a suspect one unless all
        # are), or its heartbeat; nothing when all of it lay in the future
        limit = ctx.trusted_clock + tolerance
        arrival = ctx.arrival_us if ctx.arrival_us is not None and ctx.arrival_us <= limit else None
        this_commit: list[CommitStats] = []
        if not event_times.stats.is_empty and suspect.get("records", 0) < event_times.stats.count:
            plausible = int(np.searchsorted(event_times.event_time_us, limit, side="right"))
            high = int(event_times.event_time_us[plausible - 1])
            this_commit = [CommitStats(None, event_times.stats.min_us, event_times.stats, ctx.clock_us, arrival, high, ctx.source_clock_us)]
        elif heartbeat is not None and "heartbeat" not in suspect:
            this_commit = [CommitStats(None, heartbeat, event_times.stats, ctx.clock_us, heartbeat, heartbeat, ctx.source_clock_us)]
        if this_commit:  # a commit without stats leaves its stream's progress where it is
            state = self._policy_state(ctx, policy)
            window = self._window(ctx, policy, change, tolerance, this_commit) if policy.window_needed(state) else this_commit
            if window is not None:  # None: the new policy's history is not there yet, the stream holds
                ctx.stream_progress_us = stream_progress(policy, state, window, ctx.trusted_clock)
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

    # ---- the window, and changes of the policy

    def _window(self, ctx: CommitContext, policy: WatermarkPolicy, change: PolicyChange | None, tolerance_us: int,
                this_commit: list[CommitStats]) -> list[CommitStats] | None:
        """This commit and the stream's older ones in the policy's window, from the retained snapshots.

        Right after the policy changed to one that looks further back than the one before, part of
        its window may have expired: until the window holds only commits made since the change
        (expiry keeps the new window from then on), the rest comes from the late-data ledger, which
        records every checkpoint before its snapshot can expire. None: not even the ledger has it.
        """
        found = stream_window(ctx.table.metadata, policy.window, taken=1, newest_arrival_us=this_commit[0].arrival_clock_us,
                              with_digest=policy.needs_digest, writer_id=ctx.writer_id, stream_id=ctx.stream)
        retained = this_commit + found.commits
        if change is None or change.settled(policy.window, retained, found.boundary):
            if window_retained(policy.window, ctx.table.metadata):
                return retained
            return self._with_history(ctx, policy, tolerance_us, this_commit, found)
        recorded = _ledger_commits(ctx, policy, tolerance_us)
        known = {c.snapshot_id: c for c in recorded if c.clock_us < ctx.clock_us}
        known.update({c.snapshot_id: c for c in [*found.commits, found.boundary] if c is not None})
        window, beyond = window_of(policy.window, this_commit, sorted(known.values(), key=lambda c: c.clock_us, reverse=True))
        # beyond: a commit older than the window, the window is whole; None: it reaches back to the stream's first
        # known commit, older ones, if any, only the ledger could hold (it records every checkpoint before its
        # snapshot expires), unless the table is older than it
        complete = beyond is not None or len(window) == policy.window.commits or bool(recorded)
        if not complete:
            log.warning("%s: the window of policy %s reaches past what the table and its ledger hold: stream %s holds "
                        "its progress until it has that history", ctx.table_name, policy, ctx.stream)
            return None
        if change.effective_at_us is None:
            ctx.properties[K.PROP_WATERMARK_POLICY_CHANGE] = change.effective(ctx.clock_us).encode()
        return window

    def _with_history(self, ctx: CommitContext, policy: WatermarkPolicy, tolerance_us: int, this_commit: list[CommitStats],
                      found: StreamWindow) -> list[CommitStats]:
        """The window of a policy that reaches further back than expiry keeps snapshots (a span, a long count): the
        retained commits, then the stream's older ones as the ledger recorded them (every checkpoint reaches it before
        its snapshot can expire), read once per stream, then every retained commit seen added before it can expire,
        and this processor's own commits once they landed."""
        key = (ctx.table_name, ctx.stream, policy.needs_digest)
        history = self._history.get(key)
        retained = {c.snapshot_id: c for c in [*found.commits, found.boundary] if c is not None}
        if history is None or (retained and history.keys().isdisjoint(retained)):
            # first use, or another process committed on this stream meanwhile beyond what is retained (a fenced twin);
            # a stream's first checkpoint has nothing to read (its position, compared and set, says none landed)
            first = ctx.checkpoint_id == 1 and not retained
            history = self._history[key] = {} if first else {c.snapshot_id: c for c in _ledger_commits(ctx, policy, tolerance_us)}
        history.update(retained)  # as the snapshots recorded them: the ledger has them once they expire
        window, beyond = window_of(policy.window, this_commit, sorted(history.values(), key=lambda c: c.clock_us or 0, reverse=True))
        if beyond is not None and len(history) > 2 * len(window) + 64:  # forget what no window can reach any more
            self._history[key] = {i: c for i, c in history.items() if (c.clock_us or 0) >= (beyond.clock_us or 0)}
        return window

    def _policy_change(self, ctx: CommitContext, policy: WatermarkPolicy) -> PolicyChange | None:
        """The table's last policy change; a new one when the property differs from the policy last applied."""
        properties = ctx.table.metadata.properties
        change = PolicyChange.decode(properties.get(K.PROP_WATERMARK_POLICY_CHANGE))
        before = change.to if change is not None else applied_policy(ctx.table.metadata)
        if before is None or before == str(policy):
            return change
        change = PolicyChange(before, str(policy), ctx.clock_us, None)
        if change.before_covers(policy.window):
            change = change.effective(ctx.clock_us)  # what expiry kept for the old policy is enough
        log.warning("%s: watermark policy changed from %s to %s", ctx.table_name, before, policy)
        ctx.properties[K.PROP_WATERMARK_POLICY_CHANGE] = change.encode()
        return change

    def _policy_state(self, ctx: CommitContext, policy: WatermarkPolicy) -> object:
        """The state a learning policy keeps: as its table property recorded it, learned again when the policy says."""
        if policy.state_property is None:
            return None
        stored = policy.load_state(ctx.table.metadata.properties.get(policy.state_property))

        def ledger(columns, from_hour_us: int):
            return read_ledger(ctx.table.catalog, dotted_identifier(ctx.table), columns=columns,
                               row_filter=GreaterThanOrEqual("hour", from_us(from_hour_us).isoformat()))

        state, persist = policy.refresh_state(stored, ctx.clock_us, ledger)
        if persist is not None:
            ctx.properties[policy.state_property] = persist
        return state

    def post_commit(self, ctx: CommitContext, snapshot: Snapshot) -> None:
        for with_digest in (False, True):
            history = self._history.get((ctx.table_name, ctx.stream, with_digest))
            entry = snapshot_commit_stats(snapshot, with_digest) if history is not None else None
            if entry is not None:  # known at once: expiry may keep only a stream's newest commit
                history[snapshot.snapshot_id] = entry
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
