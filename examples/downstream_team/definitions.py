"""A downstream team's own code location, built only on partfin's finalization event (and its Dagster-free readers).

Contract (partfin docs/dagster.md, "Subscribing to finalized hours"): when hour H of table T is
final, one runless materialization of asset `finalized_<T>` with partition H
(`YYYY-MM-DD-HH:00`, UTC) is recorded, in hour order, naming the base snapshot
(`base_snapshot_id`) that holds the hour's final rows. When late records reach H after
that, an amendment of H is recorded (`amendment: true`, `late_records`, the base snapshot
that carries them).

This sensor reads every new materialization of `finalized_orders` after the storage id
in its cursor, so several hours that finalize in one tick all get a run (an
`@asset_sensor` only sees the newest event per tick and would skip hours), and amendments
get a re-run. Each run is tagged with the event's base snapshot and reads base.orders at it
(Iceberg time travel), so a retry gives the same result; a run launched by hand reads the
snapshot of the hour's newest event. The run_key `revenue:<hour>` (`...:<snapshot>` for an
amendment) lets the daemon drop a repeat if a tick dies before its cursor is stored.

Load it next to partfin's location, e.g. in your workspace.yaml:
    - python_file: {relative_path: examples/downstream_team/definitions.py, location_name: revenue_team}
"""

import os

import polars as pl
from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetRecordsFilter,
    Definitions,
    Failure,
    HourlyPartitionsDefinition,
    MaterializeResult,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    asset,
    define_asset_job,
    sensor,
)

FINALIZED_ORDERS = AssetKey("finalized_orders")  # partfin's well-known key
HOURLY = HourlyPartitionsDefinition(
    start_date=os.environ.get("PARTFIN_PARTITIONS_START", "2026-01-01-00:00"), end_offset=1, timezone="UTC"
)
MAX_EVENTS_PER_TICK = 200


def newest_finalization(context: AssetExecutionContext) -> dict:
    """Metadata of the newest `finalized_orders` event (finalization or amendment) of this run's hour."""
    records = context.instance.fetch_materializations(
        AssetRecordsFilter(asset_key=FINALIZED_ORDERS, asset_partitions=[context.partition_key]), limit=1
    ).records
    event = records[0].event_log_entry.asset_materialization if records else None
    return {k: v.value for k, v in event.metadata.items()} if event else {}


@asset(
    key=AssetKey(["revenue_team", "orders_revenue_hourly"]),
    deps=[FINALIZED_ORDERS],
    partitions_def=HOURLY,
    owners=["team:revenue"],
    group_name="revenue_team",
)
def orders_revenue_hourly(context: AssetExecutionContext) -> MaterializeResult:
    """Paid revenue per hour from base.orders at the snapshot partfin's finalization (or amendment) names."""
    from datetime import datetime, timedelta, timezone

    from pyiceberg.expressions import And, GreaterThanOrEqual, LessThan

    from partfin_assets.finalization.read_points import read_point
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets.iceberg.tables import read_base
    from partfin_assets.model.errors import SnapshotUnavailable
    from partfin_assets.model.ids import id_text

    start = datetime.strptime(context.partition_key, "%Y-%m-%d-%H:%M").replace(tzinfo=timezone.utc)
    lo = int(start.timestamp() * 1_000_000)
    hi = int((start + timedelta(hours=1)).timestamp() * 1_000_000)
    # the run's tag (set by the sensor below; a retry keeps it), else the hour's newest event
    point = read_point(context.run.tags, newest_finalization(context))
    if point.snapshot_id is None:
        raise Failure(f"no finalized_orders event of hour {context.partition_key} names a base snapshot: the hour is not final yet", allow_retries=False)
    try:  # the live rows of the hour at that snapshot
        rows = read_base(load_partfin_catalog(), "orders", snapshot_id=point.snapshot_id,
                         row_filter=And(GreaterThanOrEqual("_event_time", lo), LessThan("_event_time", hi)))
    except SnapshotUnavailable as unavailable:  # expired, or before a privacy delete: a retry would not help
        raise Failure(f"hour {context.partition_key}: {unavailable}", allow_retries=False) from None
    live = pl.from_arrow(rows)
    paid = live.filter(pl.col("status") == "paid") if live.height else live
    revenue = float(paid["amount"].sum()) if paid.height else 0.0
    return MaterializeResult(
        metadata={"paid_orders": paid.height, "revenue": revenue, "base_snapshot_id": id_text(point.snapshot_id), "base_snapshot_origin": point.origin}
    )


revenue_job = define_asset_job("orders_revenue_hourly_job", selection=[orders_revenue_hourly])


@sensor(job=revenue_job, minimum_interval_seconds=30)
def on_orders_hour_finalized(context: SensorEvaluationContext) -> SensorResult:
    """One run per finalized hour of orders, and one per amendment: every new `finalized_orders` event, in order."""
    from partfin_assets.finalization.read_points import read_tags

    after = int(context.cursor) if context.cursor else None
    result = context.instance.fetch_materializations(
        AssetRecordsFilter(asset_key=FINALIZED_ORDERS, after_storage_id=after),
        limit=MAX_EVENTS_PER_TICK,
        ascending=True,
    )
    requests = []
    for record in result.records:
        if record.partition_key is None:
            continue
        meta = {k: v.value for k, v in record.event_log_entry.asset_materialization.metadata.items()}
        snapshot, amendment = meta.get("base_snapshot_id"), bool(meta.get("amendment"))
        requests.append(RunRequest(
            run_key=f"revenue:{record.partition_key}" + (f":{snapshot}" if amendment else ""),
            partition_key=record.partition_key,
            tags=read_tags(snapshot, amendment=amendment),
        ))
    cursor = str(result.records[-1].storage_id) if result.records else context.cursor
    return SensorResult(run_requests=requests, cursor=cursor)


defs = Definitions(assets=[orders_revenue_hourly], jobs=[revenue_job], sensors=[on_orders_hour_finalized])
