"""A downstream team's asset: hourly activity of each table, computed with polars from base.<table>.

Owned by the analytics team. Partition H reads the base rows whose event time falls in
[H, H+1h) and writes per-5-minute counts to $PARTFIN_HOME/activity/<table>/<H>.parquet.
It runs once per hour, requested by the finalization sensor when H is final, and again when
late data for H arrived (an amendment). It reads base at the snapshot H's newest finalization
event names (finalization/read_points.py), so a retry or a later run gives the same result.
A manual run of a hour that is not final yet, or whose snapshot expired or predates a privacy
delete, fails at once unless run config sets `force: true` (then it reads the current base).
"""


import dataclasses

import polars as pl
from dagster import AssetExecutionContext, Failure, MaterializeResult, asset, define_asset_job, in_process_executor
from pyiceberg.expressions import And, GreaterThanOrEqual, LessThan

from partfin_assets.defs.force import ForceConfig, refuse_unless_forced
from partfin_assets.defs.finalization.sensor import newest_finalization_event
from partfin_assets.defs.resources import IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable
from partfin_assets.finalization.hours import hour_from_key, is_finalized, not_finalized_reason
from partfin_assets.finalization.read_points import (
    BASE_SNAPSHOT_TAG,
    REASON_TAG,
    RUN_FOR_TAG,
    ReadPoint,
    base_position,
    read_point,
    read_tags,
)
from partfin_assets.iceberg.tables import DELETED, EVENT_TIME, read_base, snapshot_unavailable_reason
from partfin_assets.model.ids import id_text
from partfin_assets.model.timeutil import US_PER_HOUR, iso_z
from partfin_assets.model.faults import faults


class ActivityConfig(ForceConfig):
    """force: materialize even though the hour is not finalized yet, or its finalization snapshot expired or
    predates a privacy delete (reads the current base: the result may change)."""


class NotFinalized(Failure):
    pass


class SnapshotUnusable(Failure):
    pass


def build_activity_asset(table: PartfinTable):
    name = table.name

    @asset(
        key=table.activity_key,
        # lineage follows the contract (cdc -> base -> finalized -> downstream): it runs once per finalized hour,
        # and reads base at the snapshot that hour's finalized event names
        deps=[table.finalized_key],
        partitions_def=table.partitions_def(),
        group_name="activity",
        owners=[table.downstream_owner],
        kinds={"polars", "parquet"},
        description=f"Hourly activity of {name}: rows changed per 5 minutes (live / deleted), from base.{name} at the "
        f"snapshot the hour's {table.finalized_key.to_user_string()} event names, computed once per finalized hour (and again "
        "for an amendment: late data).",
    )
    def activity(context: AssetExecutionContext, config: ActivityConfig, catalog: IcebergCatalogResource) -> MaterializeResult:
        partition_key = context.partition_key
        hour = hour_from_key(partition_key)
        iceberg = catalog.load()
        base = iceberg.load_table(f"base.{name}")
        point = read_point(context.run.tags, newest_finalization_event(context.instance, table, partition_key))
        if point.snapshot_id is None:  # no finalization event: the current snapshot of this one metadata version
            point = dataclasses.replace(point, snapshot_id=base.current_snapshot().snapshot_id if base.current_snapshot() else None)
        unavailable = snapshot_unavailable_reason(base, point.snapshot_id) if point.snapshot_id is not None else None
        if unavailable:
            refuse_unless_forced(config, f"hour {iso_z(hour)} reads the base snapshot its {point.origin} names, but {unavailable}; "
                                 f"forced, the run reads the current base.{name} (its rows of the hour may differ)",
                                 table.activity_key.to_python_identifier(), SnapshotUnusable)
            point = ReadPoint(base.current_snapshot().snapshot_id, f"current snapshot (forced: {point.snapshot_id} unavailable)")
        position = base_position(iceberg, base, point.snapshot_id)
        watermark = position.watermark_us
        refusal = not_finalized_reason(hour, watermark, f"base.{name}")
        refuse_unless_forced(config, refusal, table.activity_key.to_python_identifier(), NotFinalized)
        if point.snapshot_id is not None and BASE_SNAPSHOT_TAG not in context.run.tags:
            # pinned: a retry of this run keeps its tags, so it reads this snapshot too
            context.instance.add_run_tags(context.run.run_id, read_tags(point.snapshot_id, amendment=point.amendment))
        home = catalog.config().home
        faults().fail_once(name, partition_key, home)

        rows = read_base(
            iceberg, name, include_deleted=True, snapshot_id=point.snapshot_id, selected_fields=(EVENT_TIME, DELETED),
            row_filter=And(GreaterThanOrEqual(EVENT_TIME, hour), LessThan(EVENT_TIME, hour + US_PER_HOUR)),
        )
        frame = pl.from_arrow(rows)
        assert isinstance(frame, pl.DataFrame)
        buckets = (
            frame.with_columns(pl.col(EVENT_TIME).dt.truncate("5m").alias("bucket"))
            .group_by("bucket")
            .agg(
                pl.len().alias("rows"),
                (~pl.col(DELETED)).sum().alias("live"),
                pl.col(DELETED).sum().alias("deleted"),
            )
            .sort("bucket")
        )
        out_dir = home / "activity" / name
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{partition_key.replace(':', '')}.parquet"
        buckets.write_parquet(path)

        live = int(buckets["live"].sum()) if buckets.height else 0
        deleted = int(buckets["deleted"].sum()) if buckets.height else 0
        run_for = context.run.tags.get(RUN_FOR_TAG, "a run by hand")
        reason = context.run.tags.get(REASON_TAG, "launched by hand")
        return MaterializeResult(
            metadata=
                {
                    # first: what the partition page shows on top, the hour's finality and which event this run is for
                    "finality": (f"final (base watermark {iso_z(watermark)}); ran for the hour's {run_for}: {reason}"
                                 if is_finalized(hour, watermark) else f"not final: forced run ({reason})"),
                    "hour": iso_z(hour),
                    "rows": frame.height,
                    "live_rows": live,
                    "deleted_rows": deleted,
                    "watermark": iso_z(watermark) if watermark is not None else None,
                    "finalized": is_finalized(hour, watermark),
                    "forced": bool(config.force and (unavailable or not is_finalized(hour, watermark))),
                    "base_snapshot_id": id_text(point.snapshot_id),
                    "base_snapshot_origin": point.origin,
                    # which event of the hour this run is for, and why (the sensor's run tags; a run by hand has none)
                    "run_for": run_for,
                    "reason": reason,
                    "cdc_snapshot_id": id_text(position.cdc_snapshot_id),
                    "cdc_sequence_number": id_text(position.cdc_sequence_number),
                    "path": str(path),
                }
            
        )

    job = define_asset_job(
        f"activity_{name}_job",
        selection=[table.activity_key],
        executor_def=in_process_executor,  # one process per run: a run is one small step
        tags=table.downstream_tags,
        description=f"One hour of {table.activity_key.to_user_string()}: finalize_{name}_sensor runs it once per finalized "
        "hour and once per amendment (tags partfin/run-for, partfin/reason say which and why); by hand, any hour.",
    )
    return activity, job
