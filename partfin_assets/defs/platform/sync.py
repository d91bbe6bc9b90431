"""cdc/<table> and base/<table>: the CDC writer and the upsert, run by Dagster on a short cadence.

Both layers are stream-fed and hourly partitioned: the sync job's ops report, per commit, a
materialization for every hour partition the commit touched (records, event-time
min/max/p50/p99, watermark, late records, lag, finalized). base/<table> is an asset spec;
cdc/<table> is an executable asset whose own materialization replays an hour from the source
(defs/platform/replay.py). A conflict of the upsert (CommitConflictError) retries the upsert op.
"""

import time

from dagster import (
    AssetMaterialization,
    AssetObservation,
    AssetSpec,
    DagsterRunStatus,
    In,
    Nothing,
    OpExecutionContext,
    Out,
    RunRequest,
    RunsFilter,
    SensorEvaluationContext,
    SkipReason,
    in_process_executor,
    job,
    op,
    sensor,
)

from partfin_assets.defs.platform.replay import build_cdc_asset
from partfin_assets.defs.resources import CdcSourceResource, IcebergCatalogResource
from partfin_assets.defs.retry import retry_on_conflict
from partfin_assets.defs.tables import PartfinTable, sensor_default_status, sensor_interval
from partfin_assets.finalization.hours import lag_seconds
from partfin_assets.finalization.late_data import late_data
from partfin_assets.finalization.partition_metadata import PartitionReport, checkpoint_reports, upsert_reports
from partfin_assets.iceberg.history import summary_of, watermark_of
from partfin_assets.iceberg.tables import ensure_base_table
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.jobs.upsert import run_upsert
from partfin_assets.model import summary_keys as K
from partfin_assets.model.timeutil import floor_hour_us, iso_z, now_utc, parse_iso, to_us

IN_FLIGHT = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED]


def layer_specs(table: PartfinTable) -> list:
    """cdc/<table> (an executable asset: a manual materialization replays the hour, defs/platform/replay.py)
    and base/<table> (a spec: only the sync job's upsert writes it)."""
    partitions = table.partitions_def()
    return [
        build_cdc_asset(table),
        AssetSpec(
            table.base_key,
            deps=[table.cdc_key],
            description=f"base.{table.name}: current state, upserted (last writer wins) from cdc.{table.name}; "
            "carries the watermark of the CDC snapshot it merged.",
            group_name="platform",
            owners=[table.platform_owner],
            kinds={"iceberg"},
            partitions_def=partitions,
            metadata={"iceberg_table": f"base.{table.name}", "primary_key": ",".join(table.spec.primary_key)},
        ),
    ]


def _reportable(table: PartfinTable, report: PartitionReport, now_us: int) -> bool:
    """Only hours that exist as partitions (from the start date up to the current hour)."""
    return table.start_us <= report.hour_us <= floor_hour_us(now_us)


def _log_reports(context: OpExecutionContext, table: PartfinTable, asset_key, reports: list[PartitionReport], now_us: int) -> int:
    logged = 0
    for report in reports:
        if not _reportable(table, report, now_us):
            context.log.warning(f"{asset_key.to_user_string()}: hour {iso_z(report.hour_us)} is outside the partitions; not reported")
            continue
        context.log_event(
            AssetMaterialization(
                asset_key=asset_key,
                partition=report.partition_key,
                description=f"{asset_key.to_user_string()} partition {report.partition_key}: {report.stats.records} record(s) "
                f"by snapshot {report.snapshot_id}, finalized: {report.finalized}",
                metadata=report.metadata(),
            )
        )
        logged += 1
    return logged


def build_sync_job(table: PartfinTable):
    name = table.name

    @op(name=f"ingest_{name}", out=Out(Nothing), tags={"kind": "iceberg"})
    def ingest(context: OpExecutionContext, catalog: IcebergCatalogResource, cdc_source: CdcSourceResource) -> None:
        """Run the CDC writer: up to N checkpoints, one Iceberg commit each, from the committed offset."""
        iceberg = catalog.load()
        writer = CdcWriter(
            iceberg,
            table.spec,
            writer_id=None,  # <table>-writer, as `partfin ingest`: one source position per table
            subtasks=cdc_source.subtasks,
            heartbeat_interval_s=cdc_source.heartbeat_interval_seconds,
        )
        source = None
        try:
            with cdc_source.redacted():  # a source may fail with its DSN in the message
                source = cdc_source.open(table)
                checkpoints = 0
                started = time.monotonic()
                for result in writer.run(source, max_records=cdc_source.max_records, max_checkpoints=cdc_source.max_checkpoints_per_run):
                    checkpoints += 1
                    if time.monotonic() - started > cdc_source.max_seconds_per_run:
                        context.log.info(f"time budget of {cdc_source.max_seconds_per_run}s used: the next run goes on from here")
                        break
                    if result.snapshot_id is None:
                        continue
                    snapshot = writer.table.metadata.snapshot_by_id(result.snapshot_id)
                    committed_at = snapshot.timestamp_ms * 1000 if snapshot else to_us(now_utc())
                    reports = checkpoint_reports(name, result.summary, result.snapshot_id, committed_at)
                    logged = _log_reports(context, table, table.cdc_key, reports, committed_at)
                    context.log.info(
                        f"checkpoint {result.checkpoint_id}: {result.records} records, {logged} hour partition(s), "
                        f"watermark {result.summary.get(K.WATERMARK)}, late {result.summary.get(K.LATE_RECORDS, '0')}"
                    )
        finally:
            writer.close()
            close = getattr(source, "close", None)  # e.g. a Kafka consumer leaves its group at once
            if close is not None:
                close()
        watermark = watermark_of(writer.table.properties)
        now_us = to_us(now_utc())
        late = late_data(iceberg, table.spec.cdc_identifier)  # the ledger, as the late_data check and `partfin status`
        context.log_event(
            AssetObservation(
                asset_key=table.cdc_key,
                metadata=
                    {
                        "watermark": iso_z(watermark) if watermark is not None else None,
                        "watermark_lag_seconds": lag_seconds(watermark, now_us),
                        "checkpoints_this_run": checkpoints,
                        "late_records_total": sum(h.records for h in late.values()),
                        "late_partitions": len(late),
                    }
                ,
            )
        )

    @op(name=f"upsert_{name}", ins={"after": In(Nothing)}, tags={"kind": "iceberg"})
    def upsert(context: OpExecutionContext, catalog: IcebergCatalogResource) -> None:
        """Merge new CDC snapshots into base.<table>; report the base hours it changed."""

        iceberg = catalog.load()
        ensure_base_table(iceberg, table.spec)
        with retry_on_conflict(context, f"upsert into base.{name}"):  # a new job: re-planned from a fresh snapshot
            result = run_upsert(iceberg, name)
        context.log.info(result.describe())
        if result.base_snapshot_id is None:
            return
        cdc = iceberg.load_table(f"cdc.{name}")
        summaries = []
        for snapshot_id in result.cdc_snapshot_ids_merged:
            snapshot = cdc.metadata.snapshot_by_id(snapshot_id)
            if snapshot is not None:
                summaries.append(summary_of(snapshot))
        base = iceberg.load_table(f"base.{name}")
        snapshot = base.metadata.snapshot_by_id(result.base_snapshot_id)
        committed_at = snapshot.timestamp_ms * 1000 if snapshot else 0
        watermark = to_us(parse_iso(result.watermark)) if result.watermark else None
        reports = upsert_reports(
            name,
            summaries,
            [to_us(parse_iso(h)) for h in result.hours_touched],
            result.base_snapshot_id,
            watermark,
            committed_at,
            extra={
                "cdc_snapshot_id": result.cdc_snapshot_id,
                "run_inserted": result.inserted,
                "run_updated": result.updated,
                "run_deleted": result.deleted,
            },
        )
        _log_reports(context, table, table.base_key, reports, committed_at)

    @job(
        name=f"sync_{name}",
        executor_def=in_process_executor,
        description=f"CDC writer then upsert for {name}: commits checkpoints into cdc.{name}, merges them into base.{name}.",
        tags={"partfin/table": name, "partfin/writer": f"cdc.{name}", "dagster/max_retries": "1", "dagster/priority": "10"},
    )
    def sync_job():
        upsert(after=ingest())

    return sync_job


def build_sync_sensor(table: PartfinTable, sync_job):
    @sensor(
        name=f"sync_{table.name}_sensor",
        job=sync_job,
        minimum_interval_seconds=sensor_interval("sync", table.sync_interval_seconds),
        default_status=sensor_default_status("sync"),
        description=f"Starts a sync run for {table.name} every {table.sync_interval_seconds}s unless one is queued or running.",
    )
    def sync_sensor(context: SensorEvaluationContext):
        in_flight = context.instance.get_runs(filters=RunsFilter(job_name=sync_job.name, statuses=IN_FLIGHT), limit=1)
        if in_flight:
            return SkipReason(f"sync run {in_flight[0].run_id} is still {in_flight[0].status.value}")
        return RunRequest()

    return sync_sensor

