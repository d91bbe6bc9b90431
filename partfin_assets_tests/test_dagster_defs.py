"""The Dagster layer in process: definitions, sync job, finalization sensor, downstream guard, checks."""

from __future__ import annotations

import dataclasses
import json

import pytest
from dagster import (
    AssetCheckSeverity,
    AssetKey,
    DagsterInstance,
    HourlyPartitionsDefinition,
    RunConfig,
    build_sensor_context,
)

from partfin_assets.finalization.hours import hour_key
from partfin_assets.model.timeutil import US_PER_HOUR
from partfin_assets.sources.synthetic import ORDERS_SPEC

START = "2026-01-01T00:00:00Z"
STREAM = f"synthetic:start={START},end=2026-01-01T06:30:00Z,rate=0.5,late_fraction=0.02,idle_every=off,seed=5"


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("PARTFIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PARTFIN_SOURCE", STREAM)
    monkeypatch.setenv("PARTFIN_PARTITIONS_START", "2026-01-01-00:00")
    monkeypatch.setenv("PARTFIN_MAX_RECORDS", "400")
    monkeypatch.setenv("PARTFIN_MAX_CHECKPOINTS_PER_RUN", "100")
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    (tmp_path / "dagster").mkdir()
    from partfin_assets.defs import build_definitions
    from partfin_assets.defs.tables import PartfinTable

    # a declaration of its own: a policy that lets a 2% late tail through as late data
    table = PartfinTable(spec=dataclasses.replace(ORDERS_SPEC, watermark_policy="percentile:0.05:last:2"), source=STREAM)
    instance = DagsterInstance.ephemeral()
    yield build_definitions([table]), instance, table
    instance.dispose()


def _materializations(instance, key):
    from dagster import AssetRecordsFilter

    records = instance.fetch_materializations(AssetRecordsFilter(asset_key=key), limit=10_000).records
    return [r.event_log_entry for r in records]


def test_definitions_declare_three_layers_per_table():
    from partfin_assets.definitions import defs
    from partfin_assets.defs.tables import TABLES

    repo = defs.get_repository_def()
    keys = set(repo.asset_graph.get_all_asset_keys())
    for table in TABLES:
        for key in (table.cdc_key, table.base_key, table.finalized_key, table.activity_key):
            assert key in keys
            partitions = repo.asset_graph.get(key).partitions_def
            assert isinstance(partitions, HourlyPartitionsDefinition) and partitions.timezone == "UTC"
        assert repo.asset_graph.get(table.base_key).parent_keys == {table.cdc_key}
        assert table.base_key in repo.asset_graph.get(table.activity_key).parent_keys
        for name in (f"sync_{table.name}", f"activity_{table.name}_job", f"checks_{table.name}"):
            assert repo.has_job(name)
        sensors = {s.name: s for s in repo.sensor_defs}
        for name in (f"sync_{table.name}_sensor", f"finalize_{table.name}_sensor", f"checks_{table.name}_sensor"):
            assert sensors[name].default_status.value == "RUNNING"
        checks = {k.name for k in repo.asset_graph.asset_check_keys if k.asset_key == table.cdc_key}
        assert checks == {"watermark_fresh", "watermark_monotonic", "late_data", "rejected_input"}


def test_pipeline_in_process(env, monkeypatch):
    from partfin_assets.defs import build_definitions

    defs, instance, table = env
    cdc, base = AssetKey(["cdc", "orders"]), AssetKey(["base", "orders"])
    finalized, activity = AssetKey(["finalized", "orders"]), AssetKey(["activity", "orders_hourly"])

    # sync: checkpoints report the hour partitions they touched, with metadata
    result = defs.resolve_job_def("sync_orders").execute_in_process(instance=instance)
    assert result.success
    cdc_events = _materializations(instance, cdc)
    assert cdc_events
    meta = cdc_events[0].asset_materialization.metadata
    for name in ("records", "event_time_min", "event_time_max", "event_time_p50", "event_time_p99", "watermark",
                 "late_records", "lag_seconds", "finalized"):
        assert name in meta, name
    assert isinstance(meta["lag_seconds"].value, float)
    partitions = {e.dagster_event.partition for e in cdc_events}
    assert "2026-01-01-00:00" in partitions and "2026-01-01-06:00" in partitions
    base_events = _materializations(instance, base)
    assert {e.dagster_event.partition for e in base_events} >= {"2026-01-01-00:00", "2026-01-01-05:00"}
    assert "records" in base_events[0].asset_materialization.metadata

    # the finalization sensor: every hour below the base watermark, in order, once
    sensor = defs.resolve_sensor_def("finalize_orders_sensor")
    with build_sensor_context(instance=instance, resources=defs.get_repository_def().get_top_level_resources()) as ctx:
        first = sensor(ctx)
    keys = [r.partition_key for r in first.run_requests]
    assert keys == sorted(keys) and keys[0] == "2026-01-01-00:00"
    assert len(set(r.run_key for r in first.run_requests)) == len(keys)
    assert [e.partition for e in first.asset_events] == keys
    from partfin_assets.finalization.hours import is_finalized
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets.iceberg.history import watermark_of

    watermark = watermark_of(load_partfin_catalog().load_table("base.orders").properties)
    assert len(keys) == (watermark - 1767225600_000_000) // US_PER_HOUR
    for event in first.asset_events:  # what the daemon does with SensorResult.asset_events
        instance.report_runless_asset_event(event)
    with build_sensor_context(instance=instance, cursor=first.cursor, resources=defs.get_repository_def().get_top_level_resources()) as ctx:
        second = sensor(ctx)
    assert not second.run_requests and not second.asset_events
    # a lost cursor does not re-emit the finalization events (run_keys are deduped by the daemon)
    with build_sensor_context(instance=instance, resources=defs.get_repository_def().get_top_level_resources()) as ctx:
        replay = sensor(ctx)
    assert not replay.asset_events and [r.run_key for r in replay.run_requests] == [r.run_key for r in first.run_requests]
    assert len(_materializations(instance, finalized)) == len(keys)

    # the downstream team's example (its own code location) computes from a finalized hour
    from partfin_assets_tests.test_dagster_downstream_example import load_example

    example = load_example()
    revenue = example.defs.resolve_job_def("orders_revenue_hourly_job").execute_in_process(instance=instance, partition_key=keys[0])
    assert revenue.success

    # downstream: a finalized hour runs; an open hour is refused at once, unless forced
    job = defs.resolve_job_def("activity_orders_job")
    ok = job.execute_in_process(instance=instance, partition_key=keys[0])
    assert ok.success
    done = _materializations(instance, activity)[0].asset_materialization.metadata
    assert done["finalized"].value is True and done["rows"].value > 0
    open_hour = hour_key(watermark)
    assert not is_finalized(watermark, watermark)
    refused = job.execute_in_process(instance=instance, partition_key=open_hour, raise_on_error=False)
    assert not refused.success
    failure = [e for e in refused.all_events if e.event_type_value == "STEP_FAILURE"][0]
    message = failure.event_specific_data.error.message + str(failure.event_specific_data.user_failure_data)
    assert "2026-01-01T" in message and "not finalized" in message and "watermark" in message
    forced = job.execute_in_process(
        instance=instance,
        partition_key=open_hour,
        run_config=RunConfig(ops={"activity__orders_hourly": {"config": {"force": True}}}),
    )
    assert forced.success

    # checks read metadata only; the generated stream has late data -> WARN
    checks = defs.resolve_job_def("checks_orders").execute_in_process(instance=instance)
    evaluations = {e.check_name: e for e in checks.get_asset_check_evaluations()}
    assert evaluations["watermark_monotonic"].passed
    assert evaluations["watermark_matches_merged_cdc_snapshot"].passed
    late = evaluations["late_data"]
    assert not late.passed and late.severity == AssetCheckSeverity.WARN
    assert late.metadata["late_records"].value > 0
    assert json.dumps(late.metadata["commits"].value)
    # the current policy as the table's own watermark did (issue 13): late share and lag, from the ledger
    assert late.metadata["watermark_policy"].value == table.spec.watermark_policy
    assert 0 < late.metadata["late_share_after_finalization"].value < 1
    assert late.metadata["median_finalization_lag_seconds"].value > 0
    assert not evaluations["watermark_fresh"].passed  # a 2026-01-01 stream is months old
    assert evaluations["late_data_after_run"].passed
    assert evaluations["rejected_input"].passed and evaluations["quarantined_changes"].passed

    # every finalized hour runs; then the stream goes on and late rows land in hours that ran
    for key in keys[1:]:
        assert job.execute_in_process(instance=instance, partition_key=key).success
    monkeypatch.setenv("PARTFIN_SOURCE", STREAM.replace("end=2026-01-01T06:30:00Z", "end=2026-01-01T10:00:00Z"))
    later = build_definitions([table])
    assert later.resolve_job_def("sync_orders").execute_in_process(instance=instance).success
    checks = later.resolve_job_def("checks_orders").execute_in_process(instance=instance)
    after = {e.check_name: e for e in checks.get_asset_check_evaluations()}["late_data_after_run"]
    assert not after.passed and after.severity == AssetCheckSeverity.WARN
    rerun = after.metadata["partitions_to_rerun"].value
    assert rerun and set(rerun) <= set(keys) | {open_hour}
    assert "re-run" in after.description
