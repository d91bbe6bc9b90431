"""Exactly once per finalized hour: the watermark-driven sensor and the runless `finalized/<table>` event.

Each tick reads one thing from Iceberg, the `partfin.watermark` property of base.<table>
(table metadata only), and walks the hours from its cursor up to that watermark in order:

- a RunRequest per newly finalized hour for the downstream job, run_key `<table>:<hour>`:
  the cursor makes each hour come up once, the run_key makes the daemon drop a re-request
  if a tick dies after submitting but before storing its cursor;
- a runless AssetMaterialization of `finalized/<table>`, partition = the hour, for other
  teams' sensors; emitted only for hours after the newest one already recorded, so a
  repeated tick does not emit it twice.

The cursor is the first hour not yet handled; with the daemon down nothing is lost: the
next tick walks every hour that finalized meanwhile (at most `max_hours_per_tick` per tick).
"""


from dagster import (
    AssetKey,
    AssetMaterialization,
    AssetSpec,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from partfin_assets.defs.resources import IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable, sensor_default_status, sensor_interval
from partfin_assets.finalization.hours import FinalizationCursor, hour_from_key, hour_key, newly_finalized
from partfin_assets.iceberg.catalog import load_table_if_exists
from partfin_assets.iceberg.history import watermark_of
from partfin_assets.model import summary_keys as K
from partfin_assets.model.timeutil import US_PER_HOUR, floor_hour_us, iso_z

MAX_HOURS_PER_TICK = 200


def finalized_spec(table: PartfinTable) -> AssetSpec:
    return AssetSpec(
        table.finalized_key,
        deps=[table.base_key],
        description=(
            f"Finalization events of base.{table.name}. Partition H receives exactly one runless materialization "
            f"when hour H finalizes (H + 1h <= base watermark). Subscribe with a sensor that reads all new "
            f"materializations of {table.finalized_key.to_user_string()} after a storage-id cursor (see README)."
        ),
        group_name="finalization",
        owners=[table.platform_owner],
        partitions_def=table.partitions_def(),
        metadata={"contract": "one runless materialization per finalized hour, in hour order"},
    )


def first_data_hour(iceberg, table: PartfinTable) -> int | None:
    """The earliest hour partition cdc.<table> holds (manifest metadata, read once to seed the cursor)."""
    cdc = load_table_if_exists(iceberg, f"cdc.{table.name}")
    if cdc is None or cdc.current_snapshot() is None:
        return None
    partitions = cdc.inspect.partitions().column("partition").to_pylist()
    hours = [p["event_time_hour"] for p in partitions if p and p.get("event_time_hour") is not None]
    return min(hours) * US_PER_HOUR if hours else None


def last_emitted_hour(instance, key: AssetKey) -> int | None:
    event = instance.get_latest_materialization_event(key)
    if event is None or event.dagster_event is None or event.dagster_event.partition is None:
        return None
    return hour_from_key(event.dagster_event.partition)


def evaluate_finalization(context: SensorEvaluationContext, table: PartfinTable, iceberg_resource: IcebergCatalogResource, job_name: str | None = None):
    iceberg = iceberg_resource.load()
    base = load_table_if_exists(iceberg, f"base.{table.name}")
    if base is None:
        return SkipReason(f"base.{table.name} does not exist yet")
    watermark = watermark_of(base.properties)
    if watermark is None:
        return SkipReason(f"base.{table.name} has no {K.PROP_WATERMARK} yet")
    cursor = FinalizationCursor.decode(context.cursor)
    if cursor is None:
        first = first_data_hour(iceberg, table)
        if first is None:
            return SkipReason(f"cdc.{table.name} holds no data yet")
        cursor = FinalizationCursor(max(first, table.start_us))
    # hours before the partitions' start date (moved later by PARTFIN_PARTITIONS_START) are not partitions
    cursor = FinalizationCursor(max(cursor.next_hour_us, table.start_us))
    # Only hours that exist as partitions: a watermark past the newest one (a table written before
    # partfin capped it at the commit clock, or clocks that disagree) must not fail the whole tick
    # with DagsterUnknownPartitionError and starve the valid hours; later hours come once they exist.
    last_partition = hour_from_key(table.partitions_def().get_last_partition_key())
    reachable = min(watermark, last_partition + US_PER_HOUR)
    if reachable < watermark:
        context.log.warning(
            f"base.{table.name} watermark {iso_z(watermark)} is past the newest partition {hour_key(last_partition)}: "
            "hours after it are requested once they exist"
        )
    hours = newly_finalized(cursor.next_hour_us, reachable, MAX_HOURS_PER_TICK)
    if not hours:
        return SensorResult(
            skip_reason=SkipReason(f"no new hour finalized: base watermark {iso_z(watermark)}, next hour {iso_z(cursor.next_hour_us)}"),
            cursor=cursor.encode(),
        )
    emitted = last_emitted_hour(context.instance, table.finalized_key)
    source_snapshot = base.properties.get(K.PROP_SOURCE_SNAPSHOT_ID)
    base_snapshot = base.current_snapshot()
    run_requests = []
    events = []
    for hour in hours:
        key = hour_key(hour)
        run_requests.append(
            RunRequest(
                run_key=f"{table.name}:{key}",
                partition_key=key,
                tags={"partfin/table": table.name, "partfin/hour": iso_z(hour), "dagster/max_retries": "2"},
            )
        )
        if emitted is None or hour > emitted:
            events.append(
                AssetMaterialization(
                    asset_key=table.finalized_key,
                    partition=key,
                    description=f"hour {iso_z(hour)} of base.{table.name} is final (watermark {iso_z(watermark)})",
                    metadata=
                        {
                            "hour": iso_z(hour),
                            "watermark": iso_z(watermark),
                            "base_snapshot_id": base_snapshot.snapshot_id if base_snapshot else None,
                            "cdc_snapshot_id": int(source_snapshot) if source_snapshot else None,
                        }
                    ,
                )
            )
    next_cursor = FinalizationCursor(hours[-1] + US_PER_HOUR)
    context.log.info(f"{table.name}: {len(hours)} hour(s) finalized up to {iso_z(floor_hour_us(watermark))}")
    return SensorResult(run_requests=run_requests, asset_events=events, cursor=next_cursor.encode())


def build_finalization_sensor(table: PartfinTable, downstream_job):
    @sensor(
        name=f"finalize_{table.name}_sensor",
        job=downstream_job,
        minimum_interval_seconds=sensor_interval("finalize", table.finalization_interval_seconds),
        default_status=sensor_default_status("finalize"),
        description=(
            f"Requests each partition of {table.activity_key.to_user_string()} exactly once when its hour finalizes "
            f"(hour + 1h <= base.{table.name} watermark), in hour order, and publishes "
            f"{table.finalized_key.to_user_string()}."
        ),
    )
    def finalization_sensor(context: SensorEvaluationContext, catalog: IcebergCatalogResource):
        return evaluate_finalization(context, table, catalog)

    return finalization_sensor
