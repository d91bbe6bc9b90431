"""Asset checks of each table: thin wrappers over finalization/table_checks.py (metadata and the late-data ledger only).

cdc_<table>:  watermark_fresh, watermark_monotonic, late_data, rejected_input, writer_clocks
base_<table>: watermark_matches_merged_cdc_snapshot, watermark_lag_vs_cdc, quarantined_changes
downstream:   late_data_after_run

The cdc and base checks are evaluated twice with the same code: by the checks job, and inside
every sync run right after its materializations (`sync_check_evaluations`), so the latest
materialization of cdc_<table> and base_<table> always carries its check results.
"""

from collections.abc import Callable

from dagster import (
    AssetCheckEvaluation,
    AssetCheckKey,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetSelection,
    DagsterInstance,
    RunRequest,
    SensorEvaluationContext,
    asset_check,
    define_asset_job,
    in_process_executor,
)
from pyiceberg.catalog import Catalog

from partfin_assets.defs.asset_history import latest_partition_materialization
from partfin_assets.defs.resources import IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable, table_sensor
from partfin_assets.finalization import table_checks as tc
from partfin_assets.finalization.hours import hour_key
from partfin_assets.iceberg.catalog import load_table_if_exists
from partfin_assets.model.ids import id_value
from partfin_assets.model.timeutil import format_duration


def _limits(table: PartfinTable) -> tc.CheckThresholds:
    return tc.CheckThresholds(table.lag_warn_seconds, table.lag_error_seconds, table.base_max_lag_seconds)


def downstream_runs(instance: DagsterInstance, table: PartfinTable) -> Callable[[list[int]], dict[int, tc.DownstreamRun]]:
    """hours -> the latest materialization of each hour's downstream partition (what it read, when)."""

    def runs(hours: list[int]) -> dict[int, tc.DownstreamRun]:
        out = {}
        for hour in hours:
            entry = latest_partition_materialization(instance, table, table.activity_key, hour_key(hour))
            if entry is None:
                continue
            materialization = entry.asset_materialization
            seq = materialization.metadata.get("cdc_sequence_number") if materialization else None
            out[hour] = tc.DownstreamRun(id_value(seq.value) if seq is not None else None,
                                         int(entry.timestamp * 1_000_000))
        return out

    return runs


def table_check_outcomes(table: PartfinTable, catalog: Catalog, instance: DagsterInstance, layer: str) -> dict[str, tc.CheckOutcome]:
    """check name -> outcome, for the checks of `layer` (cdc | base) of `table`."""
    name = table.name
    if layer == "cdc":
        return {
            "watermark_fresh": tc.watermark_fresh(catalog, name, _limits(table)),
            "watermark_monotonic": tc.watermark_monotonic(catalog, name),
            "late_data": tc.late_data_outcome(catalog, name, downstream_runs(instance, table), table.start_us),
            "rejected_input": tc.bad_input(catalog, f"cdc.{name}__rejected", f"source line(s) of cdc.{name} could not be read"),
            "writer_clocks": tc.clock_disagreements(catalog, name),
        }
    return {
        "watermark_matches_merged_cdc_snapshot": tc.base_matches_cdc(catalog, name),
        "watermark_lag_vs_cdc": tc.base_lag(catalog, name, _limits(table)),
        "quarantined_changes": tc.bad_input(
            catalog, f"base.{name}__rejected", f"change(s) of cdc.{name} could not be decoded into base.{name}"),
    }


def _result(outcome: tc.CheckOutcome) -> AssetCheckResult:
    return AssetCheckResult(passed=outcome.passed, severity=AssetCheckSeverity(outcome.severity),
                            description=outcome.description, metadata=outcome.metadata)


def sync_check_evaluations(table: PartfinTable, catalog: Catalog, instance: DagsterInstance, layer: str) -> list[AssetCheckEvaluation]:
    """The checks of cdc_<table> or base_<table> as events of the sync run that just materialized it."""
    key = table.cdc_key if layer == "cdc" else table.base_key
    return [
        AssetCheckEvaluation(asset_key=key, check_name=check, passed=o.passed, severity=AssetCheckSeverity(o.severity),
                             description=o.description, metadata=o.metadata)
        for check, o in table_check_outcomes(table, catalog, instance, layer).items()
    ]


CDC_CHECK_DESCRIPTIONS = {
    "watermark_fresh": "partfin.watermark is set on cdc.{name} and trails now by at most {warn} (WARN) / {error} (ERROR), or its writer is catching up on a backlog.",
    "watermark_monotonic": "The watermark recorded by every retained snapshot of cdc.{name} never decreases, and the table "
    "property is not behind the newest one.",
    "late_data": "Late records (below the watermark in force) per hour partition of cdc.{name}, from its late-data ledger: WARN "
    "while an hour holds late records neither re-run downstream nor acknowledged (the evidence never expires); says how late they came.",
    "rejected_input": "Source lines or changes cdc.{name}'s writer could not read (cdc.{name}__rejected: raw line and reason); WARN.",
    "writer_clocks": "A writer of cdc.{name} whose clock was found ahead of another writer's by more than the table's "
    "tolerance (its commit clock beyond the clock of a later commit); WARN until a later commit finds them agreeing.",
}
BASE_CHECK_DESCRIPTIONS = {
    "watermark_matches_merged_cdc_snapshot": "base.{name}'s watermark equals the watermark of the cdc.{name} snapshot it merged "
    "(partfin.source-snapshot-id).",
    "watermark_lag_vs_cdc": "base.{name}'s watermark lags cdc.{name}'s by at most {base_lag}.",
    "quarantined_changes": "CDC changes the upsert could not decode into base.{name} (base.{name}__rejected: key, source position, "
    "column, reason); the rest of the table merges on. WARN.",
}


def _layer_check(table: PartfinTable, layer: str, check: str, description: str):
    key = table.cdc_key if layer == "cdc" else table.base_key

    @asset_check(asset=key, name=check, description=description.format(
        name=table.name, warn=format_duration(table.lag_warn_seconds), error=format_duration(table.lag_error_seconds),
        base_lag=format_duration(table.base_max_lag_seconds)))
    def layer_check(context, catalog: IcebergCatalogResource) -> AssetCheckResult:
        return _result(table_check_outcomes(table, catalog.load(), context.instance, layer)[check])

    return layer_check


def build_checks(table: PartfinTable):
    name = table.name
    cdc_checks = [_layer_check(table, "cdc", c, d) for c, d in CDC_CHECK_DESCRIPTIONS.items()]
    base_checks = [_layer_check(table, "base", c, d) for c, d in BASE_CHECK_DESCRIPTIONS.items()]

    @asset_check(asset=table.activity_key, name="late_data_after_run",
                 description=f"Late records arrived in cdc.{name} for an hour after that hour's partition ran; names the partitions to re-run (WARN).")
    def late_after(context, catalog: IcebergCatalogResource) -> AssetCheckResult:
        return _result(tc.late_data_after_run(catalog.load(), name, downstream_runs(context.instance, table), table.start_us))

    checks = [*cdc_checks, *base_checks, late_after]
    checks_job = define_asset_job(
        f"checks_{name}",
        selection=AssetSelection.checks(*checks),
        executor_def=in_process_executor,
        tags={"partfin/table": name, "partfin/layer": "checks", "dagster/priority": "5"},
        description=f"Evaluates the watermark checks of {name} (metadata only).",
    )
    return checks, checks_job


def build_checks_sensor(table: PartfinTable, checks_job):
    @table_sensor(table, "checks", table.checks_interval_seconds, job=checks_job, description=(
        f"Runs late_data_after_run of {table.activity_key.to_user_string()} whenever cdc, base or the downstream "
        f"asset changed (the cdc_{table.name} and base_{table.name} checks run inside every sync run)."))
    def checks_sensor(context: SensorEvaluationContext, catalog: IcebergCatalogResource):
        state = []
        for identifier in (f"cdc.{table.name}", f"base.{table.name}"):
            loaded = load_table_if_exists(catalog.load(), identifier)
            snapshot = loaded.current_snapshot() if loaded is not None else None
            state.append(str(snapshot.snapshot_id) if snapshot else "-")
        latest = context.instance.get_latest_materialization_event(table.activity_key)
        state.append(str(latest.storage_id) if latest is not None and hasattr(latest, "storage_id") else
                     str(latest.timestamp) if latest is not None else "-")
        # only the downstream check: a checks run of cdc/base would show them "In Progress" while it waits
        return RunRequest(run_key=f"checks:{':'.join(state)}", asset_check_keys=[AssetCheckKey(table.activity_key, "late_data_after_run")])

    return checks_sensor
