"""Late data per hour, from the durable late-data ledger (iceberg/ledger.py), and watermark history.

Every reader of late counts -- the late_data and late_data_after_run checks, `partfin status`,
the finalization sensor's amendments, acknowledgements, the Dagster metadata -- goes through
`late_data` here, so they agree, and keep agreeing after the snapshots that carried the late
records expired.

It sees every late record committed, whenever its ledger row is written: a writer records its
rows after its commits (a few checkpoints at a time; a killed one only when the next writer
start reconciles), so `late_data` adds the late records of the retained commits the ledger does
not hold yet, read from their snapshot summaries. The cdc table is read before the ledger: a
commit that expires in between was recorded first (reconcile runs before every expiry), so no
commit falls between the two reads. Hence an amendment, or an acknowledgement, never misses a
late record base already carries.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import polars as pl
from pyiceberg.catalog import Catalog
from pyiceberg.expressions import And, BooleanExpression, GreaterThan, LessThanOrEqual

from partfin_assets.iceberg.catalog import load_table_if_exists
from partfin_assets.iceberg.ledger import read_ledger, retained_late_rows
from partfin_assets.model import summary_keys as K
from partfin_assets.model.timeutil import parse_iso, to_us


def late_by_hour(summary: Mapping[str, str]) -> dict[int, int]:
    """Late records per hour of one commit, from its snapshot summary (per-commit metadata only)."""
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


LATE_COLUMNS = ("snapshot_id", "sequence_number", "commit_time", "hour", "late_records")


def late_data(
    catalog: Catalog, cdc_identifier: str, *, after_sequence: int | None = None, up_to_sequence: int | None = None
) -> dict[int, LateHour]:
    """Late records per hour over the table's whole history (its ledger, and the retained commits it does not hold
    yet), with the commits that brought them.

    With `after_sequence` / `up_to_sequence`: only the commits of cdc sequence numbers in that window.
    """
    cdc = load_table_if_exists(catalog, cdc_identifier)  # first: see the module docstring
    row_filter: BooleanExpression = GreaterThan("late_records", 0)
    if after_sequence is not None:
        row_filter = And(row_filter, GreaterThan("sequence_number", after_sequence))
    if up_to_sequence is not None:
        row_filter = And(row_filter, LessThanOrEqual("sequence_number", up_to_sequence))
    recorded = read_ledger(catalog, cdc_identifier, columns=LATE_COLUMNS, row_filter=row_filter)
    if cdc is None:
        return late_by_hour_of(recorded)
    retained = retained_late_rows(cdc, after_sequence=after_sequence, up_to_sequence=up_to_sequence).select(LATE_COLUMNS)
    not_yet_recorded = retained.filter(~pl.col("snapshot_id").is_in(recorded["snapshot_id"].unique().implode()))
    return late_by_hour_of(pl.concat([recorded, not_yet_recorded.cast(recorded.schema)]))


def late_by_hour_of(ledger: pl.DataFrame) -> dict[int, LateHour]:
    """late_data of ledger rows already read (they hold at least LATE_COLUMNS)."""
    rows = ledger.select(LATE_COLUMNS).filter(pl.col("late_records") > 0)
    found: dict[int, list[LateCommit]] = {}
    for row in rows.with_columns(pl.col("hour", "commit_time").dt.epoch("us")).iter_rows(named=True):
        found.setdefault(row["hour"], []).append(
            LateCommit(row["snapshot_id"], row["sequence_number"], row["commit_time"], row["late_records"])
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
