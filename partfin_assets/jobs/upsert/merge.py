"""Upsert step 3, merge (polars, vectorized): the winning changes against the base rows of the buckets they touch.

A change replaces a base row only when it is strictly newer by (event time, source position).
Deletes become tombstones (`_deleted`), so an older update arriving later cannot resurrect the
row. Only the buckets where a change wins are rewritten; the buckets read are recorded for the
job's per-partition conflict check (DESIGN §6).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl
import pyarrow as pa
from pyiceberg.manifest import DataFile
from pyiceberg.transforms import BucketTransform

from partfin_assets.iceberg.files import data_files, read_files
from partfin_assets.iceberg.tables import DELETED, EVENT_TIME, META_COLUMNS, SOURCE_SEQ, base_columns
from partfin_assets.jobs.upsert.plan import UpsertPlan
from partfin_assets.model.timeutil import US_PER_HOUR, iso_z

_IN_BASE = "__in_base"
_IN_CHANGE = "__in_change"
_CHG = "__chg"


@dataclass(frozen=True)
class Merge:
    rows: pa.Table | None  # the rewritten buckets (None: no change)
    remove: list[DataFile]  # their files as read
    inserted: int
    updated: int
    deleted: int
    stale: int
    hours: list[str]  # hours (ISO Z) whose visible rows changed
    buckets_rewritten: int
    read_buckets: set[int] = field(default_factory=set)  # buckets read: the job's conflict targets


def bucket_ids(plan: UpsertPlan, values: pl.Series) -> pl.Series:
    assert plan.buckets is not None
    field_ = plan.base.spec().fields[0]
    source_type = plan.base.schema().find_field(field_.source_id).field_type
    bucket = BucketTransform(plan.buckets).pyarrow_transform(source_type)
    arrow = values.to_arrow()
    if pa.types.is_large_string(arrow.type):
        arrow = arrow.cast(pa.string())
    return pl.Series("bucket", bucket(arrow)).cast(pl.Int64)


def base_files(plan: UpsertPlan) -> list[tuple[DataFile, int | None]]:
    """Live files of base at the plan's snapshot with their bucket (None: a file of another spec)."""
    spec_id = plan.base.spec().spec_id
    return [
        (f, f.partition[0] if plan.buckets is not None and f.spec_id == spec_id else None)
        for f in data_files(plan.base, plan.base.current_snapshot())
    ]


def merge_changes(plan: UpsertPlan, winners: pl.DataFrame) -> Merge:
    """Join the winning changes with the base rows of the buckets they touch; last writer wins."""
    spec = plan.spec
    pk = list(spec.primary_key)
    columns = base_columns(spec)
    first_pk = pk[0] if plan.buckets is not None else None
    base_partition_field = plan.base.spec().fields[0] if plan.buckets is not None else None
    if base_partition_field is not None:
        first_pk = plan.base.schema().find_field(base_partition_field.source_id).name

    files = base_files(plan)
    if first_pk is not None:
        winners = winners.with_columns(bucket_ids(plan, winners.get_column(first_pk)).alias("__bucket"))
        touched = set(winners.get_column("__bucket").unique().to_list())
        # A file of another spec (None) is always read: its rows may belong anywhere.
        read = [(f, b) for f, b in files if b is None or b in touched]
    else:
        touched = set()
        read = files

    base_rows = read_files(plan.base, [f for f, _ in read])
    base_frame = pl.from_arrow(base_rows) if base_rows.num_rows else None
    if base_frame is None:
        base_frame = pl.DataFrame(schema=pl.from_arrow(plan.base.schema().as_arrow().empty_table()).schema)
    assert isinstance(base_frame, pl.DataFrame)
    value_columns = [c for c in columns if c not in pk] + list(META_COLUMNS)

    change_side = winners.select([*pk, *value_columns]).with_columns(pl.lit(True).alias(_IN_CHANGE))
    base_side = base_frame.select([*pk, *value_columns]).with_columns(pl.lit(True).alias(_IN_BASE))
    # Align key dtypes (e.g. base decimal vs decoded decimal) before joining.
    change_side = change_side.cast({c: base_side.schema[c] for c in pk})
    joined = base_side.join(change_side, on=pk, how="full", coalesce=True, suffix=_CHG)
    in_base = pl.col(_IN_BASE).fill_null(False)
    in_change = pl.col(_IN_CHANGE).fill_null(False)
    newer = (pl.col(EVENT_TIME + _CHG) > pl.col(EVENT_TIME)) | (
        (pl.col(EVENT_TIME + _CHG) == pl.col(EVENT_TIME)) & (pl.col(SOURCE_SEQ + _CHG) > pl.col(SOURCE_SEQ))
    )
    take = in_change & (~in_base | newer.fill_null(False))
    base_live = in_base & ~pl.col(DELETED).fill_null(True)
    change_delete = pl.col(DELETED + _CHG).fill_null(False)
    joined = joined.with_columns(
        take.alias("__take"),
        base_live.alias("__base_live"),
        change_delete.alias("__change_delete"),
        in_change.alias("__in_change"),
    )
    counts = joined.select(
        (pl.col("__take") & ~pl.col("__change_delete") & ~pl.col("__base_live")).sum().alias("inserted"),
        (pl.col("__take") & ~pl.col("__change_delete") & pl.col("__base_live")).sum().alias("updated"),
        (pl.col("__take") & pl.col("__change_delete") & pl.col("__base_live")).sum().alias("deleted"),
        (pl.col("__in_change") & ~pl.col("__take")).sum().alias("stale"),
        pl.col("__take").sum().alias("taken"),
    ).row(0, named=True)
    if counts["taken"] == 0:
        return Merge(None, [], 0, 0, 0, counts["stale"], [], 0, touched)

    # Hours whose visible rows changed: where rows appeared/changed (new) and where they left (old).
    new_hours = joined.filter(pl.col("__take") & ~pl.col("__change_delete")).get_column(EVENT_TIME + _CHG)
    old_hours = joined.filter(pl.col("__take") & pl.col("__base_live")).get_column(EVENT_TIME)
    hour_us = pl.concat([new_hours, old_hours]).dt.epoch("us") // US_PER_HOUR * US_PER_HOUR
    hours = [iso_z(int(h)) for h in hour_us.unique().sort().to_list()]

    merged = joined.select(
        *pk,
        *[pl.when(pl.col("__take")).then(pl.col(c + _CHG)).otherwise(pl.col(c)).alias(c) for c in value_columns],
        pl.col("__take"),
    )
    remove = [f for f, _ in read]
    if first_pk is not None:
        merged = merged.with_columns(bucket_ids(plan, merged.get_column(first_pk)).alias("__bucket"))
        rewrite = set(merged.filter(pl.col("__take")).get_column("__bucket").unique().to_list())
        merged = merged.filter(pl.col("__bucket").is_in(list(rewrite)))
        remove = [f for f, b in read if b is None or b in rewrite]
        buckets_rewritten = len(rewrite)
    else:
        buckets_rewritten = 1
    schema = plan.base.schema().as_arrow()
    rows = merged.select(schema.names).to_arrow().cast(schema)
    return Merge(
        rows, remove, counts["inserted"], counts["updated"], counts["deleted"], counts["stale"], hours, buckets_rewritten, touched
    )
