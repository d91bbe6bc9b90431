"""Hour partitions from table metadata: the pure logic under the Dagster layer (no Dagster import).

Everything here reads snapshot summaries and table properties, never data files:

- which hour partitions a checkpoint touched, with per-hour records and event-time
  min/max/p50/p99 (`partfin.event-time.by-hour`, written by the writer's EventTimeAccumulator);
- the same for the base table, merged over the CDC snapshots one upsert read;
- which hours are finalized (`hour + 1h <= watermark`) and which are newly so;
- late data per hour, with the commits that brought it;
- watermark monotonicity across snapshots and the cursor the finalization sensor keeps.

Hour keys are Dagster's hourly partition keys (`YYYY-MM-DD-HH:00`, UTC); the functions
take and return epoch microseconds as everywhere else in core.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from fastdigest import TDigest

from partfin_assets.finalization.hours import hour_key, is_finalized
from partfin_assets.finalization.late_data import late_by_hour
from partfin_assets.iceberg.history import watermark_of
from partfin_assets.model import summary_keys as K
from partfin_assets.model.stats import BY_HOUR_CENTROIDS, HourStats, decode_by_hour
from partfin_assets.model.timeutil import US_PER_HOUR, US_PER_SECOND, floor_hour_us, iso_z, parse_iso, to_us

# PyIceberg's per-partition summary entries of cdc.<table> (hidden partition `event_time_hour`)
PARTITION_SUMMARY_PREFIX = "partitions.event_time_hour="


def partition_counts(summary: Mapping[str, str]) -> dict[int, int]:
    """Records added per hour partition, from PyIceberg's `partitions.event_time_hour=...` entries."""
    out: dict[int, int] = {}
    for key, value in summary.items():
        if not key.startswith(PARTITION_SUMMARY_PREFIX):
            continue
        hour_text = key[len(PARTITION_SUMMARY_PREFIX) :]
        if hour_text in ("null", ""):
            continue
        hour_us = to_us(datetime.strptime(hour_text, "%Y-%m-%d-%H").replace(tzinfo=UTC))
        fields = dict(item.split("=", 1) for item in value.split(",") if "=" in item)
        out[hour_us] = int(fields.get("added-records", "0"))
    return out


def checkpoint_hours(summary: Mapping[str, str]) -> list[HourStats]:
    """The hour partitions one CDC checkpoint touched, with what its summary says about each.

    Records come from the per-partition counts (or the by-hour entry); event-time stats from
    the by-hour entry when present, else the commit-wide min/max clamped to the hour.
    """
    counts = partition_counts(summary)
    by_hour = decode_by_hour(summary.get(K.EVENT_TIME_BY_HOUR))
    late = late_by_hour(summary)
    hours = sorted(set(counts) | set(by_hour))
    if not hours and summary.get(K.EVENT_TIME_COUNT, "0") != "0" and K.EVENT_TIME_MIN in summary:
        low = to_us(parse_iso(summary[K.EVENT_TIME_MIN]))
        high = to_us(parse_iso(summary[K.EVENT_TIME_MAX]))
        if floor_hour_us(low) == floor_hour_us(high):  # one hour: the commit's stats are the hour's
            hours = [floor_hour_us(low)]
            counts = {hours[0]: int(summary[K.EVENT_TIME_COUNT])}
    out = []
    for hour in hours:
        entry = by_hour.get(hour)
        if entry is not None:
            out.append(HourStats(hour, counts.get(hour, entry.records), entry.min_us, entry.max_us, entry.p50_us, entry.p99_us, late.get(hour, 0), entry.centroids))
            continue
        low = high = None
        if K.EVENT_TIME_MIN in summary:
            low = max(to_us(parse_iso(summary[K.EVENT_TIME_MIN])), hour)
            high = min(to_us(parse_iso(summary[K.EVENT_TIME_MAX])), hour + US_PER_HOUR - 1)
        out.append(HourStats(hour, counts.get(hour, 0), low, high, None, None, late.get(hour, 0)))
    return out


# Job kinds of cdc commits that rewrite records already there (compaction) or remove some
# (privacy delete): no new records in any hour.
REWRITE_JOB_KINDS = frozenset({K.JobKind.MERGE, K.JobKind.UPDATE_DELETE})


def new_records_by_hour(summary: Mapping[str, str]) -> dict[int, int] | None:
    """Records one cdc commit brought into each hour as *new* records, by its `partfin.job-kind`.

    INTO (the CDC writer; also commits without the key): PyIceberg's `partitions.*` added-records,
    or None when the commit has no partition summaries (checkpoint_hours then decides).
    OVERWRITE (a replay): only the records new to the replayed hour (`partfin.replay.added-records`),
    not the hour's whole rewritten content. MERGE and UPDATE/DELETE: none, although their
    `partitions.*` added-records count every record of the files they rewrote.
    """
    kind = summary.get(K.JOB_KIND)
    if kind in REWRITE_JOB_KINDS:
        return {}
    if kind == K.JobKind.OVERWRITE:
        hour = summary.get(K.REPLAY_HOUR)
        return {to_us(parse_iso(hour)): int(summary.get(K.REPLAY_ADDED_RECORDS, "0"))} if hour else {}
    return partition_counts(summary) or None


def new_record_hours(summary: Mapping[str, str]) -> list[HourStats]:
    """checkpoint_hours with `records` = the new records of each hour (see new_records_by_hour).

    What per-hour record counts summed over several commits must use (the CDC snapshots an upsert
    merged may include compactions, replays and privacy deletes). Event-time stats stay those the
    commit recorded (for a replay: of the hour's content).
    """
    new = new_records_by_hour(summary)
    hours = checkpoint_hours(summary)
    if new is None:
        return hours
    return [dataclasses.replace(h, records=new[h.hour_us]) for h in hours if h.hour_us in new]


def merge_hours(per_commit: Iterable[Iterable[HourStats]]) -> dict[int, HourStats]:
    """Per-hour stats over several commits (the CDC snapshots one upsert merged)."""
    grouped: dict[int, list[HourStats]] = {}
    for commit in per_commit:
        for stats in commit:
            grouped.setdefault(stats.hour_us, []).append(stats)
    out = {}
    for hour, parts in sorted(grouped.items()):
        if len(parts) == 1:
            out[hour] = parts[0]
            continue
        lows = [p.min_us for p in parts if p.min_us is not None]
        highs = [p.max_us for p in parts if p.max_us is not None]
        p50 = p99 = None
        centroids = [c for p in parts for c in p.centroids]
        if centroids and all(p.centroids for p in parts):
            digest = TDigest.from_dict({"max_centroids": BY_HOUR_CENTROIDS * 4, "centroids": [{"m": m, "c": c} for m, c in centroids]})
            low, high = min(lows), max(highs)
            p50 = min(max(int(round(digest.quantile(0.5) * US_PER_SECOND)), low), high)
            p99 = min(max(int(round(digest.quantile(0.99) * US_PER_SECOND)), low), high)
        out[hour] = HourStats(
            hour,
            sum(p.records for p in parts),
            min(lows) if lows else None,
            max(highs) if highs else None,
            p50,
            p99,
            sum(p.late_records for p in parts),
        )
    return out


# --------------------------------------------------------------------------- partition metadata


@dataclass(frozen=True)
class PartitionReport:
    """What one partition of cdc/<table> or base/<table> shows for one commit."""

    table: str
    hour_us: int
    stats: HourStats
    snapshot_id: int | None
    watermark_us: int | None
    committed_at_us: int  # the snapshot's commit time: lag is measured against it
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def partition_key(self) -> str:
        return hour_key(self.hour_us)

    @property
    def finalized(self) -> bool:
        return is_finalized(self.hour_us, self.watermark_us)

    @property
    def lag_seconds(self) -> float | None:
        """How far the watermark trails the commit (wall-clock) time, in seconds."""
        if self.watermark_us is None:
            return None
        return round((self.committed_at_us - self.watermark_us) / US_PER_SECOND, 3)

    def metadata(self) -> dict[str, Any]:
        """Plain values (str/int/float/bool/None); the Dagster layer wraps them."""
        s = self.stats
        out: dict[str, Any] = {
            "table": self.table,
            "hour": iso_z(self.hour_us),
            "records": s.records,
            "event_time_min": iso_z(s.min_us) if s.min_us is not None else None,
            "event_time_max": iso_z(s.max_us) if s.max_us is not None else None,
            "event_time_p50": iso_z(s.p50_us) if s.p50_us is not None else None,
            "event_time_p99": iso_z(s.p99_us) if s.p99_us is not None else None,
            "watermark": iso_z(self.watermark_us) if self.watermark_us is not None else None,
            "late_records": s.late_records,
            "lag_seconds": self.lag_seconds,
            "finalized": self.finalized,
            "snapshot_id": self.snapshot_id,
        }
        out.update(self.extra)
        return out


def checkpoint_reports(table: str, summary: Mapping[str, str], snapshot_id: int | None, committed_at_us: int) -> list[PartitionReport]:
    watermark = watermark_of(summary)
    checkpoint = summary.get(K.CHECKPOINT_ID)
    extra = {"checkpoint_id": int(checkpoint)} if checkpoint else {}
    return [PartitionReport(table, h.hour_us, h, snapshot_id, watermark, committed_at_us, dict(extra)) for h in checkpoint_hours(summary)]


def upsert_reports(
    table: str,
    cdc_summaries: Sequence[Mapping[str, str]],
    hours_touched: Iterable[int],
    base_snapshot_id: int | None,
    watermark_us: int | None,
    committed_at_us: int,
    extra: Mapping[str, Any] | None = None,
) -> list[PartitionReport]:
    """Partitions of base/<table> one upsert changed, with the merged CDC commits' per-hour stats."""
    merged = merge_hours(new_record_hours(s) for s in cdc_summaries)  # compactions, replays, deletes add no records
    out = []
    for hour in sorted(set(hours_touched) | set(merged)):
        stats = merged.get(hour, HourStats(hour, 0))
        out.append(PartitionReport(table, hour, stats, base_snapshot_id, watermark_us, committed_at_us, dict(extra or {})))
    return out
