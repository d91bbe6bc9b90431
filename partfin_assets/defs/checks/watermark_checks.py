"""Asset checks that read table metadata (table properties, snapshot summaries) and the late-data ledger.

cdc/<table>:  watermark_fresh, watermark_monotonic, late_data, rejected_input
base/<table>: watermark_matches_merged_cdc_snapshot, watermark_lag_vs_cdc, quarantined_changes
downstream:   late_data_after_run
"""

import math

from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetRecordsFilter,
    AssetSelection,
    RunRequest,
    SensorEvaluationContext,
    asset_check,
    define_asset_job,
    in_process_executor,
    sensor,
)

from partfin_assets.defs.resources import IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable, sensor_default_status, sensor_interval
from partfin_assets.finalization.hours import hour_key, lag_seconds
from partfin_assets.finalization.late_data import late_after_run, late_data, watermark_regressions
from partfin_assets.iceberg.catalog import load_table_if_exists
from partfin_assets.iceberg.history import summary_of, total_records, watermark_history, watermark_of
from partfin_assets.jobs.policy_lab import measured_policy
from partfin_assets.model import summary_keys as K
from partfin_assets.model.timeutil import iso_z, now_utc, to_us

MAX_LISTED = 24  # hours / commits listed in check metadata


def _iso(us: int | None) -> str | None:
    return iso_z(us) if us is not None else None


def build_checks(table: PartfinTable):
    name = table.name

    @asset_check(asset=table.cdc_key, name="watermark_fresh", description=(
        f"partfin.watermark is set on cdc.{name} and trails now by at most {table.lag_warn_seconds}s (WARN) / "
        f"{table.lag_error_seconds}s (ERROR)."))
    def watermark_fresh(catalog: IcebergCatalogResource) -> AssetCheckResult:
        cdc = load_table_if_exists(catalog.load(), f"cdc.{name}")
        watermark = watermark_of(cdc.properties) if cdc is not None else None
        if watermark is None:
            return AssetCheckResult(passed=False, severity=AssetCheckSeverity.ERROR, description=f"cdc.{name} has no watermark yet")
        lag = lag_seconds(watermark, to_us(now_utc()))
        severity = AssetCheckSeverity.WARN
        passed = lag <= table.lag_warn_seconds
        if lag > table.lag_error_seconds:
            severity = AssetCheckSeverity.ERROR
        return AssetCheckResult(
            passed=passed,
            severity=severity,
            description=f"watermark {iso_z(watermark)} trails now by {lag:.0f}s",
            metadata={"watermark": iso_z(watermark), "lag_seconds": lag,
                                        "warn_after_seconds": table.lag_warn_seconds, "error_after_seconds": table.lag_error_seconds},
        )

    @asset_check(asset=table.cdc_key, name="watermark_monotonic",
                 description=f"The watermark recorded by every retained snapshot of cdc.{name} never decreases, and the table property is not behind the newest one.")
    def watermark_monotonic(catalog: IcebergCatalogResource) -> AssetCheckResult:
        cdc = load_table_if_exists(catalog.load(), f"cdc.{name}")
        if cdc is None:
            return AssetCheckResult(passed=True, description=f"cdc.{name} does not exist yet")
        history = watermark_history(cdc.metadata)
        regressions = watermark_regressions(history)
        prop = watermark_of(cdc.properties)
        behind = bool(history) and prop is not None and prop < history[-1][1]
        passed = not regressions and not behind
        return AssetCheckResult(
            passed=passed,
            severity=AssetCheckSeverity.ERROR,
            description="monotonic" if passed else f"{len(regressions)} regression(s); property behind newest snapshot: {behind}",
            metadata={
                "snapshots_checked": len(history),
                "watermark": _iso(prop),
                "regressions": [{"from_snapshot": a.snapshot_id, "from": iso_z(a.watermark_us), "to_snapshot": b.snapshot_id,
                                 "to": iso_z(b.watermark_us)} for a, b in regressions[:MAX_LISTED]],
            },
        )

    @asset_check(asset=table.cdc_key, name="late_data",
                 description=f"Records that arrived below the watermark in force, per hour partition of cdc.{name}, with the commits that brought them, over the table's whole history (its late-data ledger); WARN.")
    def late_data_check(catalog: IcebergCatalogResource) -> AssetCheckResult:
        cdc = load_table_if_exists(catalog.load(), f"cdc.{name}")
        if cdc is None:
            return AssetCheckResult(passed=True, description=f"cdc.{name} does not exist yet")
        late = late_data(catalog.load(), f"cdc.{name}")  # the durable ledger: outlives snapshot expiry
        policy = _policy_metadata(catalog.load(), name)
        if not late:
            return AssetCheckResult(passed=True, description="no late records", metadata=policy)
        total = sum(h.records for h in late.values())
        newest = sorted(late.values(), key=lambda h: h.hour_us)[-MAX_LISTED:]
        return AssetCheckResult(
            passed=False,
            severity=AssetCheckSeverity.WARN,
            description=f"{total} late record(s) in {len(late)} hour partition(s): {', '.join(hour_key(h.hour_us) for h in newest)}",
            metadata={
                "late_records": total,
                "late_partitions": len(late),
                "by_partition": {hour_key(h.hour_us): h.records for h in newest},
                "commits": {hour_key(h.hour_us): [c.snapshot_id for c in h.commits] for h in newest},
                **policy,
            },
        )

    @asset_check(asset=table.base_key, name="watermark_matches_merged_cdc_snapshot",
                 description=f"base.{name}'s watermark equals the watermark of the cdc.{name} snapshot it merged (partfin.source-snapshot-id).")
    def base_matches_cdc(catalog: IcebergCatalogResource) -> AssetCheckResult:
        base = load_table_if_exists(catalog.load(), f"base.{name}")
        cdc = load_table_if_exists(catalog.load(), f"cdc.{name}")
        if base is None or cdc is None or not base.properties.get(K.PROP_SOURCE_SNAPSHOT_ID):
            return AssetCheckResult(passed=True, description="nothing merged yet")
        source_id = int(base.properties[K.PROP_SOURCE_SNAPSHOT_ID])
        snapshot = cdc.metadata.snapshot_by_id(source_id)
        if snapshot is None:
            return AssetCheckResult(passed=False, severity=AssetCheckSeverity.WARN,
                                    description=f"merged cdc snapshot {source_id} is no longer in cdc.{name}'s metadata")
        expected = summary_of(snapshot).get(K.WATERMARK)
        actual = base.properties.get(K.PROP_WATERMARK)
        return AssetCheckResult(
            passed=expected == actual,
            severity=AssetCheckSeverity.ERROR,
            description=f"base watermark {actual}, merged cdc snapshot {source_id} watermark {expected}",
            metadata={"base_watermark": actual, "cdc_snapshot_watermark": expected, "cdc_snapshot_id": source_id},
        )

    @asset_check(asset=table.base_key, name="watermark_lag_vs_cdc",
                 description=f"base.{name}'s watermark lags cdc.{name}'s by at most {table.base_max_lag_seconds}s.")
    def base_lag(catalog: IcebergCatalogResource) -> AssetCheckResult:
        base = load_table_if_exists(catalog.load(), f"base.{name}")
        cdc = load_table_if_exists(catalog.load(), f"cdc.{name}")
        cdc_w = watermark_of(cdc.properties) if cdc is not None else None
        base_w = watermark_of(base.properties) if base is not None else None
        if cdc_w is None:
            return AssetCheckResult(passed=True, description=f"cdc.{name} has no watermark yet")
        if base_w is None:
            return AssetCheckResult(passed=False, severity=AssetCheckSeverity.WARN, description=f"base.{name} has no watermark yet")
        lag = (cdc_w - base_w) / 1_000_000
        return AssetCheckResult(
            passed=lag <= table.base_max_lag_seconds,
            severity=AssetCheckSeverity.WARN,
            description=f"base lags cdc by {lag:.0f}s (bound {table.base_max_lag_seconds}s)",
            metadata={"cdc_watermark": iso_z(cdc_w), "base_watermark": iso_z(base_w), "lag_seconds": float(lag),
                                        "bound_seconds": table.base_max_lag_seconds},
        )

    @asset_check(asset=table.activity_key, name="late_data_after_run",
                 description=f"Late records arrived in cdc.{name} for an hour after that hour's partition ran; names the partitions to re-run (WARN).")
    def late_after(context: AssetCheckExecutionContext, catalog: IcebergCatalogResource) -> AssetCheckResult:
        cdc = load_table_if_exists(catalog.load(), f"cdc.{name}")
        if cdc is None:
            return AssetCheckResult(passed=True, description=f"cdc.{name} does not exist yet")
        late = late_data(catalog.load(), f"cdc.{name}")
        stale: dict[str, dict] = {}
        for hour in late:
            key = hour_key(hour)
            records = context.instance.fetch_materializations(
                AssetRecordsFilter(asset_key=table.activity_key, asset_partitions=[key]), limit=1
            ).records
            if not records:
                continue  # never ran: it will see the late rows when it does
            entry = records[0].event_log_entry
            materialization = entry.asset_materialization
            seq = materialization.metadata.get("cdc_sequence_number") if materialization else None
            seq_value = int(seq.value) if seq is not None and isinstance(seq.value, int) else None
            missed = late_after_run(late, hour, seq_value, int(entry.timestamp * 1_000_000))
            if missed:
                stale[key] = {"late_records": sum(c.records for c in missed), "commits": [c.snapshot_id for c in missed],
                              "ran_at": iso_z(int(entry.timestamp * 1_000_000))}
        if not stale:
            return AssetCheckResult(passed=True, description="no late data after any partition ran")
        keys = sorted(stale)
        return AssetCheckResult(
            passed=False,
            severity=AssetCheckSeverity.WARN,
            description=f"late data arrived after these partitions ran; re-run them: {', '.join(keys[-MAX_LISTED:])}",
            metadata={"partitions_to_rerun": keys[-MAX_LISTED:], "details": {k: stale[k] for k in keys[-MAX_LISTED:]}},
        )

    @asset_check(asset=table.cdc_key, name="rejected_input", description=(
        f"Source lines or changes cdc.{name}'s writer could not read (cdc.{name}__rejected: raw line and reason); WARN."))
    def rejected_input(catalog: IcebergCatalogResource) -> AssetCheckResult:
        return _bad_input_result(catalog, f"cdc.{name}__rejected", f"source line(s) of cdc.{name} could not be read")

    @asset_check(asset=table.base_key, name="quarantined_changes", description=(
        f"CDC changes the upsert could not decode into base.{name} (base.{name}__rejected: key, source position, "
        "column, reason); the rest of the table merges on. WARN."))
    def quarantined_changes(catalog: IcebergCatalogResource) -> AssetCheckResult:
        return _bad_input_result(catalog, f"base.{name}__rejected", f"change(s) of cdc.{name} could not be decoded into base.{name}")

    checks = [watermark_fresh, watermark_monotonic, late_data_check, rejected_input, base_matches_cdc, base_lag, quarantined_changes, late_after]
    checks_job = define_asset_job(
        f"checks_{name}",
        selection=AssetSelection.checks(*checks),
        executor_def=in_process_executor,
        tags={"partfin/table": name, "partfin/layer": "checks", "dagster/priority": "5"},
        description=f"Evaluates the watermark checks of {name} (metadata only).",
    )
    return checks, checks_job


def _bad_input_result(catalog: IcebergCatalogResource, identifier: str, what: str) -> AssetCheckResult:
    held = load_table_if_exists(catalog.load(), identifier)
    count = total_records(held) if held is not None else 0
    metadata = {"records": count, "table": identifier}
    if not count:
        return AssetCheckResult(passed=True, description=f"{identifier} is empty", metadata=metadata)
    return AssetCheckResult(
        passed=False,
        severity=AssetCheckSeverity.WARN,
        description=f"{count} {what}: see {identifier} (with the reason of each)",
        metadata=metadata,
    )


def build_checks_sensor(table: PartfinTable, checks_job):
    @sensor(
        name=f"checks_{table.name}_sensor",
        job=checks_job,
        minimum_interval_seconds=sensor_interval("checks", table.checks_interval_seconds),
        default_status=sensor_default_status("checks"),
        description=f"Runs the watermark checks of {table.name} whenever cdc, base or the downstream asset changed.",
    )
    def checks_sensor(context: SensorEvaluationContext, catalog: IcebergCatalogResource):
        state = []
        for identifier in (f"cdc.{table.name}", f"base.{table.name}"):
            loaded = load_table_if_exists(catalog.load(), identifier)
            snapshot = loaded.current_snapshot() if loaded is not None else None
            state.append(str(snapshot.snapshot_id) if snapshot else "-")
        latest = context.instance.get_latest_materialization_event(table.activity_key)
        state.append(str(latest.storage_id) if latest is not None and hasattr(latest, "storage_id") else
                     str(latest.timestamp) if latest is not None else "-")
        return RunRequest(run_key=f"checks:{':'.join(state)}")

    return checks_sensor


def _policy_metadata(catalog, name: str) -> dict:
    """The current watermark policy as the table's own watermark did (jobs/policy_lab.py): late share, median lag."""
    outcome = measured_policy(catalog, name)
    if outcome is None:
        return {}
    measured = {"watermark_policy": outcome.name, "late_share_after_finalization": outcome.late_share}
    if math.isfinite(outcome.median_lag_s):
        measured["median_finalization_lag_seconds"] = outcome.median_lag_s
    if math.isfinite(outcome.lag_ratio):
        measured["finalization_lag_vs_oracle"] = outcome.lag_ratio
    return measured
