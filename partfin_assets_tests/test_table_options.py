"""Per-table configuration has one source of truth: the table's properties, read through model/table_options.py.

A declared watermark policy that differs from the one in force takes effect as a policy change
(recorded by the first checkpoint under it, as `partfin ingest --watermark-policy` does); the
writer's spec and the Dagster metadata show what is in force, never a declaration that was ignored.
"""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest
from dagster import AssetKey, AssetRecordsFilter, DagsterEventType, DagsterInstance, EventRecordsFilter

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.watermark.change import PolicyChange
from partfin_assets.model import summary_keys as K
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.sources.synthetic import ORDERS_SPEC
from partfin_assets_tests.cdc_files import partfin

STREAM = "synthetic:start=2026-01-01T00:00:00Z,end=2026-01-01T03:00:00Z,rate=0.5,late_fraction=0.0,idle_every=off,seed=7"
CREATED_WITH, DECLARED = "min-of-last:3", "percentile:0.05:last:2"
CDC = AssetKey("cdc_orders")

def _in_force(home) -> tuple[str, str, PolicyChange | None]:
    """The cdc.orders policy property, the policy its newest checkpoint applied, and the recorded change."""
    table = load_partfin_catalog(home).load_table("cdc.orders")
    summary = table.current_snapshot().summary
    return (table.properties[K.PROP_WATERMARK_POLICY], summary[K.WATERMARK_POLICY_APPLIED],
            PolicyChange.decode(table.properties.get(K.PROP_WATERMARK_POLICY_CHANGE)))

def test_a_sync_run_declaring_another_policy_changes_it_and_shows_what_is_in_force(tmp_path, monkeypatch):
    home = tmp_path / "home"
    created = partfin(home, "ingest", "--table", "orders", "--source", STREAM, "--max-checkpoints", "2",
                      "--checkpoint-records", "300", "--watermark-policy", CREATED_WITH)
    assert created.returncode == 0, created.stderr
    assert _in_force(home)[:2] == (CREATED_WITH, CREATED_WITH)

    monkeypatch.setenv("PARTFIN_HOME", str(home))
    monkeypatch.setenv("PARTFIN_SOURCE", STREAM)
    monkeypatch.setenv("PARTFIN_PARTITIONS_START", "2026-01-01-00:00")
    monkeypatch.setenv("PARTFIN_MAX_RECORDS", "300")
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    (tmp_path / "dagster").mkdir()
    from partfin_assets.defs import build_definitions
    from partfin_assets.defs.tables import PartfinTable

    table = PartfinTable(spec=dataclasses.replace(ORDERS_SPEC, watermark_policy=DECLARED), source=STREAM)
    instance = DagsterInstance.ephemeral()
    try:
        assert build_definitions([table]).resolve_job_def("sync_orders").execute_in_process(instance=instance).success
        policy, applied, change = _in_force(home)
        assert (policy, applied) == (DECLARED, DECLARED)
        assert change is not None and (change.before, change.to) == (CREATED_WITH, DECLARED)
        # the run's observation of cdc_orders shows the policy in force
        observed = instance.get_event_records(EventRecordsFilter(DagsterEventType.ASSET_OBSERVATION, asset_key=CDC), ascending=True)
        runs = [r.event_log_entry.asset_observation.metadata for r in observed]
        assert [m["watermark_policy"].value for m in runs if "watermark_lag_seconds" in m] == [DECLARED]
        latest = instance.fetch_materializations(AssetRecordsFilter(asset_key=CDC), limit=1).records
        assert latest[0].event_log_entry.asset_materialization.metadata["watermark_policy"].value == DECLARED
    finally:
        instance.dispose()

def test_a_writer_declaring_another_policy_runs_under_it(catalog):
    from partfin_assets.ingest.writer import CdcWriter
    from partfin_assets.sources.registry import make_source

    created = TableSpec("events", ORDERS_SPEC.primary_key, dict(ORDERS_SPEC.columns), watermark_policy=CREATED_WITH)
    source = "synthetic:start=2026-01-01T00:00:00Z,end=2026-01-01T01:00:00Z,rate=0.2,idle_every=off,seed=3"
    for spec in (created, dataclasses.replace(created, watermark_policy=DECLARED)):
        writer = CdcWriter(catalog, spec)
        try:
            for _ in writer.run(make_source(source, spec), max_records=200, max_checkpoints=1):
                pass
        finally:
            writer.close()
        table = catalog.load_table("cdc.events")
        assert writer.spec.watermark_policy == table.properties[K.PROP_WATERMARK_POLICY] == spec.watermark_policy
        assert table.current_snapshot().summary[K.WATERMARK_POLICY_APPLIED] == spec.watermark_policy

def test_a_declaration_survives_its_properties():
    spec = TableSpec("events", ("id",), {"id": pa.int64(), "at": pa.timestamp("us", tz="UTC")}, watermark_policy=DECLARED)
    assert TableSpec.from_properties("events", spec.to_properties()) == spec


def test_the_settings_table_of_the_docs_is_the_options():
    from pathlib import Path

    from partfin_assets.model.table_options import TABLE_OPTIONS, options_table

    page = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    assert options_table() in page, "docs/operations.md's per-table settings table differs from model/table_options.py"
    for option in TABLE_OPTIONS:  # every default parses as a stored value would
        option.default_value


def test_a_bad_declared_policy_is_refused_before_any_table_is_created(catalog):
    from partfin_assets.watermark.policy import PolicyError
    from partfin_assets.ingest.writer import CdcWriter

    with pytest.raises(PolicyError, match="not valid"):
        CdcWriter(catalog, TableSpec("events", ORDERS_SPEC.primary_key, dict(ORDERS_SPEC.columns), watermark_policy="min-of-last:x"))
    assert not catalog.table_exists("cdc.events")
