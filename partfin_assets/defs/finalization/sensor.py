"""Exactly once per finalized hour: the watermark-driven sensor and the runless `finalized_<table>` event.

Each tick reads base.<table>'s metadata (its `partfin.watermark` property and current snapshot) and
walks the hours from its cursor up to that watermark in order:

- a RunRequest per newly finalized hour of the downstream asset, run_key `<table>:<hour>`, tagged
  with the base snapshot the run reads (finalization/read_points.py): the cursor makes each hour
  come up once, the run_key makes the daemon drop a re-request if a tick dies after submitting but
  before storing its cursor;
- a runless AssetMaterialization of `finalized_<table>`, partition = the hour, naming that base
  snapshot, for other teams' sensors; emitted only for hours not recorded yet, so a repeated tick
  does not emit it twice;
- an Iceberg tag `finalized-<hour>` on base.<table> at that snapshot (`-amend-N` for an amendment),
  for engines outside Dagster (finalization/tags.py).

When base merged new cdc commits since the last tick, the late data of those commits says whether
late records reached hours already requested (finalization/late_data.py: the ledger, and the commits
whose ledger rows their writer has not written yet, so the cursor never passes one unseen); each such
hour gets an *amendment* event (`amendment: true`, `late_records`, the base snapshot that carries
them) and a re-run, run_key `<table>:<hour>:amendment:<base snapshot id>`, unless an acknowledgement
covers those late records (`partfin late-data ack`: no re-run needed).

The sensor targets the downstream job `activity_<table>_job`, so its runs appear under that name
(not Dagster's jobless `__ASSET_JOB`), each tagged with which event of the hour it is for and why
(`partfin/run-for`, `partfin/reason`). A job cannot hold `finalized_<table>`, which only the sensor
records, and a sensor targets either jobs or an asset selection: so the asset page of
`finalized_<table>` names the sensor in its description and metadata, not under Automations.

The cursor is the first hour not yet handled and the cdc sequence number base had merged; with the
daemon down nothing is lost: the next tick walks every hour that finalized meanwhile (at most
`MAX_HOURS_PER_TICK` per tick) and every late record merged meanwhile.
"""


from dagster import (
    AssetMaterialization,
    AssetSpec,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
)

from partfin_assets.defs.asset_history import latest_partition_materialization, materialized_partitions
from partfin_assets.defs.resources import IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable, table_sensor
from partfin_assets.finalization.hours import FinalizationCursor, hour_from_key, hour_key, newly_finalized
from partfin_assets.finalization.late_acks import acks_of, unacknowledged_late
from partfin_assets.finalization.late_data import LateHour, late_data
from partfin_assets.finalization.read_points import (
    BasePosition,
    amendments,
    base_position,
    finalization_metadata,
    read_tags,
    run_reason_tags,
)
from partfin_assets.finalization.tags import Finalization, tag_finalizations
from partfin_assets.iceberg.catalog import load_existing_table, load_table_if_exists
from partfin_assets.iceberg.history import watermark_of
from partfin_assets.model import summary_keys as K
from partfin_assets.model.ids import id_value
from partfin_assets.model.timeutil import US_PER_HOUR, floor_hour_us, iso_z

MAX_HOURS_PER_TICK = 200


def finalized_spec(table: PartfinTable) -> AssetSpec:
    return AssetSpec(
        table.finalized_key,
        deps=[table.base_key],
        description=(
            f"Finalization events of base.{table.name}. Partition H receives exactly one runless materialization "
            f"when hour H finalizes (H + 1h <= base watermark). Subscribe with a sensor that reads all new "
            f"materializations of {table.finalized_key.to_user_string()} after a storage-id cursor (see docs/dagster.md). "
            f"Recorded by sensor finalize_{table.name}_sensor, which requests each hour's run of job activity_{table.name}_job."
        ),
        group_name="finalization",
        owners=[table.platform_owner],
        partitions_def=table.partitions_def(),
        metadata={"contract": "one runless materialization per finalized hour, in hour order",
                  "recorded_by": f"sensor finalize_{table.name}_sensor"},
    )


def first_data_hour(iceberg, table: PartfinTable) -> int | None:
    """The earliest hour partition cdc.<table> holds (manifest metadata, read once to seed the cursor)."""
    cdc = load_table_if_exists(iceberg, f"cdc.{table.name}")
    if cdc is None or cdc.current_snapshot() is None:
        return None
    partitions = cdc.inspect.partitions().column("partition").to_pylist()
    hours = [p["event_time_hour"] for p in partitions if p and p.get("event_time_hour") is not None]
    return min(hours) * US_PER_HOUR if hours else None


def newest_finalization_event(instance, table: PartfinTable, partition_key: str) -> dict | None:
    """Metadata values of the newest `finalized_<table>` event (finalization or amendment) of one hour."""
    entry = latest_partition_materialization(instance, table, table.finalized_key, partition_key)
    if entry is None or entry.asset_materialization is None:
        return None
    return {k: v.value for k, v in entry.asset_materialization.metadata.items()}


def evaluate_finalization(context: SensorEvaluationContext, table: PartfinTable, iceberg_resource: IcebergCatalogResource, job_name: str | None = None):
    iceberg = iceberg_resource.load()
    base = load_table_if_exists(iceberg, f"base.{table.name}")
    if base is None:
        return SkipReason(f"base.{table.name} does not exist yet")
    watermark = watermark_of(base.properties)
    if watermark is None:
        return SkipReason(f"base.{table.name} has no {K.PROP_WATERMARK} yet")
    position = base_position(iceberg, base)
    cursor = FinalizationCursor.decode(context.cursor)
    if cursor is None:
        first = first_data_hour(iceberg, table)
        if first is None:
            return SkipReason(f"cdc.{table.name} holds no data yet")
        cursor = FinalizationCursor(max(first, table.start_us))
    # hours before the partitions' start date (moved later by PARTFIN_PARTITIONS_START) are not partitions
    cursor = FinalizationCursor(max(cursor.next_hour_us, table.start_us), cursor.merged_sequence)
    amended = late_hours_to_amend(context, table, iceberg, cursor, position)
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
    merged = position.cdc_sequence_number if position.cdc_sequence_number is not None else cursor.merged_sequence
    next_cursor = FinalizationCursor(hours[-1] + US_PER_HOUR if hours else cursor.next_hour_us, merged)
    if not hours and not amended:
        return SensorResult(
            skip_reason=SkipReason(f"no new hour finalized: base watermark {iso_z(watermark)}, next hour {iso_z(cursor.next_hour_us)}"),
            cursor=next_cursor.encode(),
        )
    # a repeated tick (cursor lost) must not record an hour's finalization twice
    recorded = materialized_partitions(context.instance, table, table.finalized_key, [hour_key(h) for h in hours])
    run_requests = []
    events = []
    for hour, late in [*amended.items(), *((h, None) for h in hours)]:
        key = hour_key(hour)
        kind = "amendment" if late is not None else "finalization"
        run_requests.append(
            RunRequest(
                # an amendment is a new run of the hour: a run_key of its own, per base snapshot read
                run_key=f"{table.name}:{key}" + (f":amendment:{position.snapshot_id}" if late is not None else ""),
                partition_key=key,
                tags={**table.downstream_tags, "partfin/hour": iso_z(hour), "dagster/max_retries": "2",
                      "partfin/downstream-hour": f"{table.name}:{key}",  # dagster.yaml: one run of an hour at a time
                      **read_tags(position.snapshot_id, amendment=late is not None), **run_reason_tags(hour, late)},
            )
        )
        if late is None and key in recorded:
            continue
        description = (f"{late.records} late record(s) reached hour {iso_z(hour)} of base.{table.name} after it was final"
                       if late is not None else f"hour {iso_z(hour)} of base.{table.name} is final")
        events.append(
            AssetMaterialization(
                asset_key=table.finalized_key,
                partition=key,
                description=f"{description} (watermark {iso_z(watermark)}; {kind} reads base snapshot {position.snapshot_id})",
                metadata=finalization_metadata(hour, watermark, position, late),
            )
        )
    if position.snapshot_id is not None:  # before the events: a tick that fails here is repeated, tags are idempotent
        tags = tag_finalizations(iceberg, f"base.{table.name}", [
            Finalization(hour, position.snapshot_id, late is not None) for hour, late in [*amended.items(), *((h, None) for h in hours)]])
        if tags:
            context.log.info(f"base.{table.name}: tagged {', '.join(tags)}")
    if amended:
        context.log.info(f"{table.name}: late data in {len(amended)} final hour(s): re-runs requested")
    if hours:
        context.log.info(f"{table.name}: {len(hours)} hour(s) finalized up to {iso_z(floor_hour_us(watermark))}")
    return SensorResult(run_requests=run_requests, asset_events=events, cursor=next_cursor.encode())


def late_hours_to_amend(context, table: PartfinTable, iceberg, cursor: FinalizationCursor, position: BasePosition) -> dict[int, LateHour]:
    """Hours already requested whose late records base merged since the last tick (read only when base merged new cdc
    commits; `late_data` sees them whether or not their ledger rows are written yet), minus those the hour's newest
    event already saw and those an acknowledgement covers."""
    if cursor.merged_sequence is None or position.cdc_sequence_number is None or position.cdc_sequence_number <= cursor.merged_sequence:
        return {}
    identifier = f"cdc.{table.name}"
    late = late_data(iceberg, identifier, after_sequence=cursor.merged_sequence, up_to_sequence=position.cdc_sequence_number)
    if late:
        late = unacknowledged_late(late, acks_of(load_existing_table(iceberg, identifier).properties))
    handled = [hour for hour in late if table.start_us <= hour < cursor.next_hour_us]
    seen = {}
    for hour in handled:
        event = newest_finalization_event(context.instance, table, hour_key(hour))
        seen[hour] = id_value(event.get("cdc_sequence_number")) if event else None
    return amendments(late, seen)


def build_finalization_sensor(table: PartfinTable, downstream_job):
    @table_sensor(table, "finalize", table.finalization_interval_seconds, job=downstream_job, description=(
        f"Requests each partition of {table.activity_key.to_user_string()} exactly once when its hour finalizes "
        f"(hour + 1h <= base.{table.name} watermark), in hour order, and publishes {table.finalized_key.to_user_string()}."))
    def finalization_sensor(context: SensorEvaluationContext, catalog: IcebergCatalogResource):
        return evaluate_finalization(context, table, catalog)

    return finalization_sensor
