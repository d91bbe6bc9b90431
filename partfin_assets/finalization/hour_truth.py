"""What an hour partition shows: the whole hour's truth from the late-data ledger, never one commit's share.

Each hour partition of cdc_<table> and base_<table> reports, after the commits that touched it,
the totals of the hour over every checkpoint the ledger recorded (iceberg/ledger.py
`hour_totals`): records, late records, event-time min/max/p50/p99, whether the hour is final
under the layer's watermark, when it finalized (`finalized_at`: the commit clock of the first
ledger row whose watermark passed the hour's end) and `finalization_lag_seconds` = finalized_at
- hour end. Per-commit facts (checkpoint id, commit latency, watermark) are table-level
observations instead (`checkpoint_facts`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import polars as pl

from partfin_assets.finalization.hours import hour_key, is_finalized
from partfin_assets.iceberg.ledger import hour_totals
from partfin_assets.model import summary_keys as K
from partfin_assets.model.ids import id_text
from partfin_assets.model.timeutil import US_PER_HOUR, US_PER_SECOND, floor_hour_us, format_duration, iso_z, parse_iso, shown_time, to_us


@dataclass(frozen=True)
class HourTruth:
    hour_us: int
    records: int
    late_records: int
    event_time_min_us: int | None
    event_time_max_us: int | None
    p50_us: int | None
    p99_us: int | None
    finalized: bool
    finalized_at_us: int | None
    # arrival delay (arrival - event time) of the hour's records, seconds: p50, p99, max; None without digests
    arrival_delay_s: tuple[float, float, float] | None = None

    @property
    def partition_key(self) -> str:
        return hour_key(self.hour_us)

    @property
    def finalization_lag_seconds(self) -> float | None:
        """How long after its end the hour became final (event time vs the committing clock)."""
        if not self.finalized or self.finalized_at_us is None:
            return None
        return round((self.finalized_at_us - (self.hour_us + US_PER_HOUR)) / US_PER_SECOND, 3)

    @property
    def finality(self) -> str:
        """Whether the hour is final, since when, and whether late data reached it after, in one line."""
        if not self.finalized:
            return f"not final: the watermark has not passed {iso_z(self.hour_us + US_PER_HOUR)} yet"
        since = (f" since {shown_time(self.finalized_at_us)} ({format_duration(self.finalization_lag_seconds)} after the hour's end)"
                 if self.finalized_at_us is not None else "")
        late = (f"{self.late_records} late record(s) reached it after it was final" if self.late_records
                else "no late data reached it after")
        return f"final{since}; {late}"

    def metadata(self) -> dict[str, Any]:
        """Plain values; numbers stay numbers so the asset page plots them across partitions."""

        def iso(us: int | None) -> str | None:
            return shown_time(us) if us is not None else None

        return {
            "finality": self.finality,  # first: the one line the partition page shows on top
            "hour": iso_z(self.hour_us),
            "records": self.records,
            "late_records": self.late_records,
            "event_time_min": iso(self.event_time_min_us),
            "event_time_max": iso(self.event_time_max_us),
            "event_time_p50": iso(self.p50_us),
            "event_time_p99": iso(self.p99_us),
            "finalized": self.finalized,
            "finalized_at": iso(self.finalized_at_us) if self.finalized else None,
            "finalization_lag_seconds": self.finalization_lag_seconds,  # a number: Dagster plots it across events
            "finalization_lag": format_duration(self.finalization_lag_seconds),  # the same, as people read it: "6 h 0 min"
            # how late the hour's records arrived, and the share that came after the hour was final
            **({f"arrival_delay_{name}": format_duration(value) for name, value in zip(("p50", "p99", "max"), self.arrival_delay_s)}
               if self.arrival_delay_s else {}),
            "late_share": f"{self.late_records / self.records:.2%}" if self.records else None,
        }


def finalization_times(ledger: pl.DataFrame, hours: Iterable[int]) -> dict[int, int]:
    """hour -> the commit clock of the first ledger row whose watermark reached the hour's end."""
    steps = (
        ledger.filter(pl.col("watermark").is_not_null())
        .group_by("watermark")
        .agg(pl.col("commit_time").min())
        .with_columns(pl.col("watermark", "commit_time").dt.epoch("us"))
        .sort("watermark")
    )
    if steps.is_empty():
        return {}
    watermarks = steps["watermark"].to_list()
    # the earliest commit at or above each watermark: a suffix minimum over ascending watermarks
    earliest = steps["commit_time"].reverse().cum_min().reverse().to_list()
    out = {}
    for hour in hours:
        end = floor_hour_us(hour) + US_PER_HOUR
        i = next((i for i, w in enumerate(watermarks) if w >= end), None)
        if i is not None:
            out[hour] = earliest[i]
    return out


def hour_truths(
    ledger: pl.DataFrame,
    hours: Iterable[int],
    watermark_us: int | None,
    finalized_at: Mapping[int, int] | None = None,
) -> list[HourTruth]:
    """The truth of each of `hours` (epoch us) under `watermark_us` (the layer's: cdc or base).

    `finalized_at` overrides the ledger's finalization time of an hour (base_<table>: the upsert
    that carried the watermark past it); hours the ledger has no rows for report 0 records.
    """
    wanted = sorted({floor_hour_us(h) for h in hours})
    if not wanted:
        return []
    totals = hour_totals(ledger.filter(pl.col("hour").dt.epoch("us").is_in(wanted)))
    by_hour = {row["hour"]: row for row in totals.with_columns(
        pl.col("hour", "event_time_min", "event_time_max", "p50", "p99").dt.epoch("us")).iter_rows(named=True)}
    final_times = finalization_times(ledger, wanted)
    final_times.update(finalized_at or {})
    out = []
    for hour in wanted:
        row = by_hour.get(hour, {})
        out.append(HourTruth(
            hour_us=hour,
            records=int(row.get("records") or 0),
            late_records=int(row.get("late_records") or 0),
            event_time_min_us=row.get("event_time_min"),
            event_time_max_us=row.get("event_time_max"),
            p50_us=row.get("p50"),
            p99_us=row.get("p99"),
            finalized=is_finalized(hour, watermark_us),
            finalized_at_us=final_times.get(hour),
            arrival_delay_s=(row["arrival_delay_p50_s"], row["arrival_delay_p99_s"], row["arrival_delay_max_s"])
            if row.get("arrival_delay_p50_s") is not None else None,
        ))
    return out


def newly_final_hours(before_us: int | None, after_us: int | None, first_hour_us: int) -> list[int]:
    """Hours that a watermark move from `before` to `after` finalized (not before `first_hour_us`)."""
    if after_us is None:
        return []
    start = max(floor_hour_us(before_us) if before_us is not None else first_hour_us, first_hour_us)
    end = floor_hour_us(after_us)  # hours H with H + 1h <= after
    return list(range(start, end, US_PER_HOUR))


def checkpoint_facts(summary: Mapping[str, str], committed_at_us: int) -> dict[str, Any]:
    """A checkpoint's own facts for the table-level observation series (not an hour's)."""
    newest = summary.get(K.EVENT_TIME_MAX)
    latency = round((committed_at_us - to_us(parse_iso(newest))) / US_PER_SECOND, 3) if newest else None
    checkpoint = summary.get(K.CHECKPOINT_ID)
    return {
        "checkpoint_id": id_text(int(checkpoint)) if checkpoint else None,
        "records": int(summary.get(K.EVENT_TIME_COUNT, "0")),
        "late_records": int(summary.get(K.LATE_RECORDS, "0")),
        "watermark": summary.get(K.WATERMARK),
        # commit clock minus the checkpoint's newest event time: how far commits trail the events
        "commit_latency_seconds": latency,
        "commit_latency": format_duration(latency),
        "committed_at": shown_time(committed_at_us),
    }
