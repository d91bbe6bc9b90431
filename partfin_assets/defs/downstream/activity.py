"""A downstream team's asset: hourly activity of each table, computed with polars from base.<table>.

Owned by the analytics team. Partition H reads the base rows whose event time falls in
[H, H+1h) and writes per-5-minute counts to $PARTFIN_HOME/activity/<table>/<H>.parquet.
It runs once per hour, requested by the finalization sensor when H is final; a manual
run of a hour that is not final yet fails at once unless run config sets `force: true`.
"""


import polars as pl
from dagster import AssetExecutionContext, Failure, MaterializeResult, asset, define_asset_job, in_process_executor
from pyiceberg.expressions import And, GreaterThanOrEqual, LessThan

from partfin_assets.defs.force import ForceConfig, refuse_unless_forced
from partfin_assets.defs.resources import IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable
from partfin_assets.finalization.hours import hour_from_key, is_finalized, not_finalized_reason
from partfin_assets.iceberg.history import watermark_of
from partfin_assets.model import summary_keys as K
from partfin_assets.model.timeutil import US_PER_HOUR, iso_z
from partfin_assets.testing.faults import fail_once


class ActivityConfig(ForceConfig):
    """force: materialize even though the hour is not finalized yet (the result may change)."""


class NotFinalized(Failure):
    pass


def build_activity_asset(table: PartfinTable):
    name = table.name

    @asset(
        key=table.activity_key,
        deps=[table.base_key],
        partitions_def=table.partitions_def(),
        group_name="activity",
        owners=[table.downstream_owner],
        kinds={"polars", "parquet"},
        description=f"Hourly activity of {name}: rows changed per 5 minutes (live / deleted), from base.{name}, "
        "computed once per finalized hour.",
    )
    def activity(context: AssetExecutionContext, config: ActivityConfig, catalog: IcebergCatalogResource) -> MaterializeResult:
        partition_key = context.partition_key
        hour = hour_from_key(partition_key)
        iceberg = catalog.load()
        base = iceberg.load_table(f"base.{name}")  # one metadata version: watermark and rows agree
        watermark = watermark_of(base.properties)
        refusal = not_finalized_reason(hour, watermark, f"base.{name}")
        refuse_unless_forced(config, refusal, table.activity_key, NotFinalized)
        home = catalog.config().home
        fail_once(name, partition_key, home)

        rows = base.scan(
            row_filter=And(GreaterThanOrEqual("_event_time", hour), LessThan("_event_time", hour + US_PER_HOUR)),
            selected_fields=("_event_time", "_deleted"),
        ).to_arrow()
        frame = pl.from_arrow(rows)
        assert isinstance(frame, pl.DataFrame)
        buckets = (
            frame.with_columns(pl.col("_event_time").dt.truncate("5m").alias("bucket"))
            .group_by("bucket")
            .agg(
                pl.len().alias("rows"),
                (~pl.col("_deleted")).sum().alias("live"),
                pl.col("_deleted").sum().alias("deleted"),
            )
            .sort("bucket")
        )
        out_dir = home / "activity" / name
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{partition_key.replace(':', '')}.parquet"
        buckets.write_parquet(path)

        source_snapshot = base.properties.get(K.PROP_SOURCE_SNAPSHOT_ID)
        cdc_sequence = None
        if source_snapshot:
            cdc = iceberg.load_table(f"cdc.{name}")
            snapshot = cdc.metadata.snapshot_by_id(int(source_snapshot))
            cdc_sequence = snapshot.sequence_number if snapshot else None
        live = int(buckets["live"].sum()) if buckets.height else 0
        deleted = int(buckets["deleted"].sum()) if buckets.height else 0
        return MaterializeResult(
            metadata=
                {
                    "hour": iso_z(hour),
                    "rows": frame.height,
                    "live_rows": live,
                    "deleted_rows": deleted,
                    "watermark": iso_z(watermark) if watermark is not None else None,
                    "finalized": is_finalized(hour, watermark),
                    "forced": bool(config.force and not is_finalized(hour, watermark)),
                    "base_snapshot_id": base.current_snapshot().snapshot_id if base.current_snapshot() else None,
                    "cdc_snapshot_id": int(source_snapshot) if source_snapshot else None,
                    "cdc_sequence_number": cdc_sequence,
                    "path": str(path),
                }
            
        )

    job = define_asset_job(
        f"activity_{name}_job",
        selection=[table.activity_key],
        executor_def=in_process_executor,  # one process per run: a run is one small step
        tags={"partfin/table": name, "partfin/downstream": name},
        description=f"One finalized hour of {table.activity_key.to_user_string()}; launched by finalize_{name}_sensor.",
    )
    return activity, job
