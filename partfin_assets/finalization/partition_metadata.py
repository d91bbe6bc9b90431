"""Which hour partitions one checkpoint touched, from its snapshot summary (no Dagster import, no data files).

Per-hour records and event-time min/max/p50/p99 of the commit (`partfin.event-time.by-hour`,
written by the writer's EventTimeAccumulator). These are one commit's share of each hour: what
a partition *shows* is the whole hour's totals from the ledger (finalization/hour_truth.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from partfin_assets.finalization.late_data import late_by_hour
from partfin_assets.model import summary_keys as K
from partfin_assets.model.stats import HourStats, decode_by_hour
from partfin_assets.model.timeutil import US_PER_HOUR, floor_hour_us, parse_iso, to_us

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
