"""cdc_<table> and base_<table>: one multi-asset, the CDC writer and the upsert, run by Dagster on a short cadence.

Both layers are stream-fed and hourly partitioned, and written by one op (`cdc_and_base_<table>`,
pool `partfin_cdc_<table>`), so that the `sync_<table>` job is an asset job of the two assets: the
sync sensor that targets it is listed on both asset pages. Which work a run does depends on its
partition:

- **no partition: the sync** (every run of `sync_<table>`, the sensor's and one launched by hand).
  The CDC writer commits checkpoints, then the upsert merges them into base. Neither returns an
  output (both are optional): the run reports one materialization per hour partition it touched or
  finalized, showing the whole hour from the late-data ledger (finalization/hour_truth.py), one
  observation per checkpoint on cdc_<table>, and then the layer's checks (so the latest
  materialization always carries its check results). A sync run plans no partition, so while it
  runs or after it failed no hour shows as in progress or failed.
- **an hour partition: by hand** (UI "Materialize", a backfill: one run per partition). cdc_<table>
  replays the hour (defs/platform/replay.py); base_<table> runs the upsert now.

A conflict of the upsert (CommitConflictError) re-runs the upsert alone, in process, with the one
retry policy (jobs/retry.py): a step retry would run the writer again.
"""

import time

from dagster import (
    AssetExecutionContext,
    AssetMaterialization,
    AssetObservation,
    AssetSelection,
    AssetSpec,
    DagsterRunStatus,
    MaterializeResult,
    MetadataValue,
    OpExecutionContext,
    RunRequest,
    RunsFilter,
    SensorEvaluationContext,
    SkipReason,
    define_asset_job,
    in_process_executor,
    multi_asset,
)

from partfin_assets.defs.checks.watermark_checks import sync_check_evaluations
from partfin_assets.defs.platform.replay import ReplayConfig, cdc_pool, replay_partition
from partfin_assets.defs.asset_history import latest_partition_materialization
from partfin_assets.defs.resources import CdcSourceResource, IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable, table_sensor
from partfin_assets.finalization.hour_truth import HourTruth, checkpoint_facts, hour_truths, newly_final_hours
from partfin_assets.finalization.hours import hour_from_key, hour_key, lag_seconds
from partfin_assets.finalization.late_data import late_by_hour_of
from partfin_assets.finalization.partition_metadata import checkpoint_hours
from partfin_assets.finalization.report import finalization_picture, markdown_report, report_dir, report_is_stale, write_report
from partfin_assets.iceberg.history import watermark_of
from partfin_assets.iceberg.ledger import read_ledger
from pyiceberg.table import Table
from partfin_assets.iceberg.tables import ensure_base_table
from partfin_assets.ingest.session import IngestSession
from partfin_assets.ingest.writer import CdcWriter, CheckpointResult
from partfin_assets.jobs.retry import retry_on_conflict
from partfin_assets.jobs.upsert import run_upsert
from partfin_assets.model.errors import first_line
from partfin_assets.model.ids import id_text
from partfin_assets.model.table_options import WATERMARK_POLICY
from partfin_assets.model.timeutil import floor_hour_us, format_duration, iso_z, now_utc, parse_iso, to_us

REPORT_REFRESH_SECONDS = 60  # `partfin report`'s page, refreshed by sync runs at most this often (plotting costs a second or two)
IN_FLIGHT = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED]


def _iso(us: int | None) -> str | None:
    return iso_z(us) if us is not None else None


def build_platform_assets(table: PartfinTable):
    """cdc_<table> and base_<table> as one multi-asset (see the module docstring)."""
    name = table.name

    @multi_asset(
        name=table.platform_op_name,
        specs=[
            AssetSpec(
                table.cdc_key, skippable=True, group_name="platform", owners=[table.platform_owner], kinds={"iceberg"},
                tags={"partfin/table": name},
                metadata={"iceberg_table": f"cdc.{name}", "finalization_report": f"asset {table.report_key.to_user_string()}"},
                description=f"cdc.{name}: append-only change ledger, hidden partitioning hour(event_time). Written by the "
                f"`sync_{name}` job (every run reports each hour its commits touched or finalized, with the hour's totals). "
                f"Materializing a partition by hand (or a backfill) replays that hour from the history the writer read, up "
                f"to what it committed: an OVERWRITE of the hour in cdc.{name} that keeps what the writer appends meanwhile.",
            ),
            AssetSpec(
                table.base_key, deps=[table.cdc_key], skippable=True, group_name="platform", owners=[table.platform_owner],
                kinds={"iceberg"}, tags={"partfin/table": name},
                metadata={"iceberg_table": f"base.{name}", "primary_key": ",".join(table.spec.primary_key)},
                description=f"base.{name}: current state, upserted (last writer wins) from cdc.{name}; carries the watermark "
                f"of the CDC snapshot it merged. The `sync_{name}` job's upsert reports every hour it changed or finalized; "
                f"materializing a partition by hand runs that upsert now (it merges every new CDC snapshot, whatever the "
                "hour) and shows the partition's hour.",
            ),
        ],
        partitions_def=table.partitions_def(),
        can_subset=True,
        pool=cdc_pool(table),
    )
    def cdc_and_base(context: AssetExecutionContext, config: ReplayConfig, catalog: IcebergCatalogResource, cdc_source: CdcSourceResource):
        iceberg = catalog.load()
        selected = context.selected_asset_keys
        if not context.has_partition_key:  # the sync: every hour it touched is reported as a materialization of its own
            if table.cdc_key in selected:
                ingest_and_report(context, table, iceberg, cdc_source)
            if table.base_key in selected:
                upsert_and_report(context, table, iceberg)
                refresh_report(context, table, iceberg, catalog)
            return
        hour = hour_from_key(context.partition_key)
        if table.cdc_key in selected:
            yield MaterializeResult(asset_key=table.cdc_key, metadata=replay_partition(context, table, iceberg, cdc_source, config.force))
        if table.base_key in selected:
            truths = upsert_and_report(context, table, iceberg, skip_hours={hour})
            if hour not in truths:
                watermark = watermark_of(iceberg.load_table(f"base.{name}").properties)
                truths[hour] = hour_truths(read_ledger(iceberg, table.spec.cdc_identifier), [hour], watermark,
                                           _previous_finalized_at(context, table, table.base_key, [hour]))[0]
            yield MaterializeResult(asset_key=table.base_key, metadata=truths[hour].metadata())

    return cdc_and_base


def upsert_and_report(context, table: PartfinTable, iceberg, skip_hours: set[int] = frozenset()) -> dict[int, HourTruth]:
    """Merge new CDC snapshots into base.<table>; report the base hours it changed or finalized (but `skip_hours`,
    which the caller reports itself) and the base checks. Returns the hours' truths."""
    name = table.name
    before = ensure_base_table(iceberg, table.spec)
    watermark_before = watermark_of(before.properties)
    result = retry_on_conflict(  # a new job each time: re-planned from a fresh snapshot
        lambda: run_upsert(iceberg, name),
        on_conflict=lambda exc, attempt: context.log.warning(f"upsert into base.{name}: conflict on attempt {attempt}, "
                                                             f"retrying from a fresh snapshot: {first_line(str(exc))}"))
    context.log.info(result.describe())
    truths: dict[int, HourTruth] = {}
    if result.base_snapshot_id is not None:
        base = iceberg.load_table(f"base.{name}")
        snapshot = base.metadata.snapshot_by_id(result.base_snapshot_id)
        committed_at = snapshot.timestamp_ms * 1000 if snapshot else to_us(now_utc())
        watermark = watermark_of(base.properties)
        newly_final = newly_final_hours(watermark_before, watermark, table.start_us)
        touched = {to_us(parse_iso(h)) for h in result.hours_touched}
        # base finalizes when the upsert carries the watermark past the hour: this commit, or an earlier one
        finalized_at = _previous_finalized_at(context, table, table.base_key, sorted(touched - set(newly_final)))
        finalized_at.update({h: committed_at for h in newly_final})
        found = hour_truths(read_ledger(iceberg, table.spec.cdc_identifier), touched | set(newly_final), watermark, finalized_at)
        truths = {t.hour_us: t for t in found}
        checks = _checks(context, table, iceberg, "base")
        _log_hours(context, table, table.base_key, [t for t in found if t.hour_us not in skip_hours], to_us(now_utc()), {
            "watermark": _iso(watermark),
            "base_snapshot_id": id_text(result.base_snapshot_id),
            "cdc_snapshot_id": id_text(result.cdc_snapshot_id),
        })
        _log_events(context, checks)
    else:
        _log_events(context, _checks(context, table, iceberg, "base"))
    return truths


def _reportable(table: PartfinTable, hour_us: int, now_us: int) -> bool:
    """Only hours that exist as partitions (from the start date up to the current hour)."""
    return table.start_us <= hour_us <= floor_hour_us(now_us)


def _log_hours(context: AssetExecutionContext, table: PartfinTable, asset_key, truths: list[HourTruth], now_us: int, extra: dict) -> int:
    """One materialization per hour partition, showing the whole hour (finalization/hour_truth.py)."""
    logged = 0
    for truth in truths:
        if not _reportable(table, truth.hour_us, now_us):
            context.log.warning(f"{asset_key.to_user_string()}: hour {iso_z(truth.hour_us)} is outside the partitions; not reported")
            continue
        context.log_event(
            AssetMaterialization(
                asset_key=asset_key,
                partition=truth.partition_key,
                description=f"{asset_key.to_user_string()} partition {truth.partition_key}: {truth.records} record(s) in the hour, "
                f"{truth.late_records} late, finalized: {truth.finalized}",
                metadata={**truth.metadata(), **extra},
            )
        )
        logged += 1
    return logged


def _checks(context: AssetExecutionContext | OpExecutionContext, table: PartfinTable, iceberg, layer: str) -> list:
    """The layer's checks after this run's commits (metadata and ledger only). Evaluated before the run logs its
    materializations and logged right after them, so a page never shows a new materialization without its checks."""
    return sync_check_evaluations(table, iceberg, context.instance, layer)


def _log_events(context: AssetExecutionContext | OpExecutionContext, events: list) -> None:
    for event in events:
        context.log_event(event)


def _previous_finalized_at(context: AssetExecutionContext, table: PartfinTable, key, hours: list[int]) -> dict[int, int]:
    """finalized_at that earlier materializations of these partitions recorded (base hours touched again by late data)."""
    out = {}
    for hour in hours:
        entry = latest_partition_materialization(context.instance, table, key, hour_key(hour))
        materialization = entry.asset_materialization if entry else None
        value = materialization.metadata.get("finalized_at") if materialization else None
        if value is not None and isinstance(value.value, str):
            out[hour] = to_us(parse_iso(value.value))
    return out


def ingest_and_report(context: AssetExecutionContext, table: PartfinTable, iceberg, cdc_source: CdcSourceResource) -> None:
    """Run the CDC writer: up to N checkpoints, one Iceberg commit each, from the committed offset; then report
    every hour they touched or finalized with the hour's totals, and evaluate the cdc checks."""
    # <table>-writer, as `partfin ingest`: one source position per table; the table's declared policy takes effect
    with cdc_source.redacted(), IngestSession(iceberg, table.spec, cdc_source.open(table), subtasks=cdc_source.subtasks,
                                              heartbeat_interval_s=cdc_source.heartbeat_interval_seconds) as session:
        writer = session.writer
        watermark_before = watermark_of(writer.table.properties)
        checkpoints, touched = commit_and_report(context, table, session, cdc_source, max_checkpoints=cdc_source.max_checkpoints_per_run)
    report_ingest(context, table, iceberg, writer.table, watermark_before, touched, checkpoints)


def commit_and_report(context: AssetExecutionContext | OpExecutionContext, table: PartfinTable, session: IngestSession,
                      cdc_source: CdcSourceResource, *, max_checkpoints: int | None = None) -> tuple[int, set[int]]:
    """Commit the session's checkpoints (up to `max_checkpoints`, within the run's time budget), each reported as it
    lands; how many, and the hours they touched."""
    touched: set[int] = set()
    checkpoints = 0
    started = time.monotonic()
    for result in session.run(max_records=cdc_source.max_records, max_checkpoints=max_checkpoints):
        checkpoints += 1
        touched.update(report_checkpoint(context, table, session.writer, result))
        if time.monotonic() - started > cdc_source.max_seconds_per_run:
            context.log.info(f"time budget of {cdc_source.max_seconds_per_run}s used: the next run goes on from here")
            break
    return checkpoints, touched


def report_checkpoint(context: AssetExecutionContext | OpExecutionContext, table: PartfinTable, writer: CdcWriter,
                      result: CheckpointResult) -> list[int]:
    """One observation on cdc_<table> per committed checkpoint (a table-level time series; the hours show their
    totals at the end of the run): the hours it touched."""
    snapshot = writer.table.metadata.snapshot_by_id(result.snapshot_id)
    committed_at = snapshot.timestamp_ms * 1000 if snapshot else to_us(now_utc())
    hours = [h.hour_us for h in checkpoint_hours(result.summary)]
    context.log_event(AssetObservation(asset_key=table.cdc_key, metadata={
        **checkpoint_facts(result.summary, committed_at), "snapshot_id": id_text(result.snapshot_id), "hours_touched": len(hours)}))
    return hours


def report_ingest(context: AssetExecutionContext | OpExecutionContext, table: PartfinTable, iceberg, cdc: Table,
                  watermark_before: int | None, touched: set[int], checkpoints: int) -> None:
    """After a run's checkpoints (`cdc`: the table after them): every hour they touched or finalized with the hour's
    totals, the table's watermark and late data, and the cdc checks."""
    watermark = watermark_of(cdc.properties)
    policy = WATERMARK_POLICY.text(cdc.properties)  # in force: the table's, whatever was declared
    now_us = to_us(now_utc())
    ledger = read_ledger(iceberg, table.spec.cdc_identifier)
    hours = touched | set(newly_final_hours(watermark_before, watermark, table.start_us))
    checks = _checks(context, table, iceberg, "cdc")
    late = late_by_hour_of(ledger)  # the ledger, as the late_data check and `partfin status`
    context.log_event(
        AssetObservation(
            asset_key=table.cdc_key,
            metadata={
                "watermark": _iso(watermark),
                "watermark_policy": policy,
                "watermark_lag_seconds": lag_seconds(watermark, now_us),  # a number: Dagster plots it across observations
                "watermark_lag": format_duration(lag_seconds(watermark, now_us)),
                "checkpoints_this_run": checkpoints,
                "late_records_total": sum(h.records for h in late.values()),
                "late_partitions": len(late),
            },
        )
    )
    logged = _log_hours(context, table, table.cdc_key, hour_truths(ledger, hours, watermark), now_us,
                        {"watermark": _iso(watermark), "watermark_policy": policy})
    _log_events(context, checks)
    context.log.info(f"{checkpoints} checkpoint(s), {logged} hour partition(s) reported, watermark {_iso(watermark)}")


def report_spec(table: PartfinTable) -> AssetSpec:
    """report_<table>: the finalization report where the UI shows it. Its only events are the observations sync runs
    log (refresh_report), so its overview's Metadata is the newest report: Dagster 1.13 shows the latest
    materialization's metadata there when an asset has one (cdc_<table> always has), else the latest observation's."""
    return AssetSpec(
        table.report_key, deps=[table.cdc_key], group_name="platform", owners=[table.platform_owner], kinds={"matplotlib"},
        tags={"partfin/table": table.name},
        description=f"The finalization report of cdc.{table.name}: open `finalization_report` under Metadata ([Show Markdown]) "
        "for the plots of the watermark vs the wall clock, the finalization lag per hour and the late records per hour, "
        f"and their tables. Observed by the `sync_{table.name}` job at most every {REPORT_REFRESH_SECONDS} s; "
        f"`partfin report --table {table.name}` writes the same as an HTML page and a PNG.",
    )


def refresh_report(context: AssetExecutionContext, table: PartfinTable, iceberg, catalog: IcebergCatalogResource) -> None:
    """The finalization report (`partfin report`), at most once a minute; last in the run, so the picture never
    delays the base commit, hence finalization. Dagster shows it as markdown, plots included, on report_<table>
    (report_spec): any browser that reaches the UI reads it; the HTML page and PNG stay on the server for
    `partfin report`'s readers."""
    report = report_dir(catalog.config().home) / f"{table.name}.html"
    if report_is_stale(report, REPORT_REFRESH_SECONDS):
        picture = finalization_picture(iceberg, table.name)
        write_report(picture, report.parent)
        context.log_event(AssetObservation(asset_key=table.report_key, metadata={
            "finalization_report": MetadataValue.md(markdown_report(picture)), **picture.facts()}))


def build_sync_job(table: PartfinTable):
    name = table.name
    return define_asset_job(
        f"sync_{name}",
        # the checks are evaluated inside the sync (after its materializations), not as steps of their own
        selection=AssetSelection.assets(table.cdc_key, table.base_key).without_checks(),
        executor_def=in_process_executor,
        description=f"CDC writer then upsert for {name}: commits checkpoints into cdc.{name}, merges them into base.{name}. "
        "Launched without a partition: each hour it touches is reported as a materialization of its own.",
        tags={"partfin/table": name, "partfin/writer": f"cdc.{name}", "dagster/max_retries": "1", "dagster/priority": "10"},
    )


def build_sync_sensor(table: PartfinTable, sync_job):
    @table_sensor(table, "sync", table.sync_interval_seconds, job=sync_job,
                  description=f"Starts a sync run for {table.name} every {table.sync_interval_seconds}s unless one is queued or running.")
    def sync_sensor(context: SensorEvaluationContext):
        in_flight = context.instance.get_runs(filters=RunsFilter(job_name=sync_job.name, statuses=IN_FLIGHT), limit=1)
        if in_flight:
            return SkipReason(f"sync run {in_flight[0].run_id} is still {in_flight[0].status.value}")
        return RunRequest()

    return sync_sensor

