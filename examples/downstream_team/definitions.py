"""A downstream team's own code location, built only on partfin's finalization event.

Contract (partfin README, "Subscribing to finalized hours"): when hour H of table T is
final, exactly one runless materialization of asset `finalized/<T>` with partition H
(`YYYY-MM-DD-HH:00`, UTC) is recorded, in hour order.

This sensor reads every new materialization of `finalized/orders` after the storage id
in its cursor, so several hours that finalize in one tick all get a run (an
`@asset_sensor` only sees the newest event per tick and would skip hours). The run_key
`revenue:<hour>` lets the daemon drop a repeat if a tick dies before its cursor is stored.

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
    HourlyPartitionsDefinition,
    MaterializeResult,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    asset,
    define_asset_job,
    sensor,
)

FINALIZED_ORDERS = AssetKey(["finalized", "orders"])  # partfin's well-known key
HOURLY = HourlyPartitionsDefinition(
    start_date=os.environ.get("PARTFIN_PARTITIONS_START", "2026-01-01-00:00"), end_offset=1, timezone="UTC"
)
MAX_EVENTS_PER_TICK = 200


@asset(
    key=AssetKey(["revenue_team", "orders_revenue_hourly"]),
    deps=[FINALIZED_ORDERS],
    partitions_def=HOURLY,
    owners=["team:revenue"],
    group_name="revenue_team",
)
def orders_revenue_hourly(context: AssetExecutionContext) -> MaterializeResult:
    """Paid revenue per hour from base.orders, for hours partfin has declared final."""
    from datetime import datetime, timedelta, timezone

    from pyiceberg.expressions import And, GreaterThanOrEqual, LessThan

    from partfin_assets.iceberg.catalog import load_partfin_catalog

    start = datetime.strptime(context.partition_key, "%Y-%m-%d-%H:%M").replace(tzinfo=timezone.utc)
    lo = int(start.timestamp() * 1_000_000)
    hi = int((start + timedelta(hours=1)).timestamp() * 1_000_000)
    base = load_partfin_catalog().load_table("base.orders")
    rows = pl.from_arrow(
        base.scan(row_filter=And(GreaterThanOrEqual("_event_time", lo), LessThan("_event_time", hi))).to_arrow()
    )
    live = rows.filter(~pl.col("_deleted")) if rows.height else rows
    paid = live.filter(pl.col("status") == "paid") if live.height else live
    revenue = float(paid["amount"].sum()) if paid.height else 0.0
    return MaterializeResult(metadata={"paid_orders": paid.height, "revenue": revenue})


revenue_job = define_asset_job("orders_revenue_hourly_job", selection=[orders_revenue_hourly])


@sensor(job=revenue_job, minimum_interval_seconds=30)
def on_orders_hour_finalized(context: SensorEvaluationContext) -> SensorResult:
    """One run per finalized hour of orders: every new `finalized/orders` event, in order."""
    after = int(context.cursor) if context.cursor else None
    result = context.instance.fetch_materializations(
        AssetRecordsFilter(asset_key=FINALIZED_ORDERS, after_storage_id=after),
        limit=MAX_EVENTS_PER_TICK,
        ascending=True,
    )
    requests = [
        RunRequest(run_key=f"revenue:{record.partition_key}", partition_key=record.partition_key)
        for record in result.records
        if record.partition_key is not None
    ]
    cursor = str(result.records[-1].storage_id) if result.records else context.cursor
    return SensorResult(run_requests=requests, cursor=cursor)


defs = Definitions(assets=[orders_revenue_hourly], jobs=[revenue_job], sensors=[on_orders_hour_finalized])
