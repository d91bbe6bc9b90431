"""Reproducible downstream runs: the run of hour H reads base at the snapshot named by H's
finalization (or amendment) event, whenever it runs; a re-run for late data reads the snapshot that carried it.

In process, as Dagster runs it: the sync job, the finalization sensor (its asset events recorded as the daemon
records them), partfin's own downstream asset `activity_orders_hourly` and the downstream team's example
asset `revenue_team/orders_revenue_hourly`.
"""

from __future__ import annotations

import dataclasses

import pytest
from dagster import AssetKey, AssetRecordsFilter, DagsterInstance, build_sensor_context

from partfin_assets.sources.synthetic import ORDERS_SPEC
from partfin_assets_tests.scenario_helpers import append_lines, change, hour_of_changes, ms
from partfin_assets_tests.test_dagster_downstream_example import load_example

HOURS = ["2026-11-01T00:00:00Z", "2026-11-01T01:00:00Z", "2026-11-01T02:00:00Z", "2026-11-01T03:00:00Z"]
H1_KEY = "2026-11-01-01:00"
FINALIZED, ACTIVITY = AssetKey("finalized_orders"), AssetKey("activity_orders_hourly")


class Pipeline:
    """partfin's definitions over a Debezium file of `orders`, one ephemeral instance, the example location."""

    def __init__(self, path, instance):
        from partfin_assets.defs import build_definitions
        from partfin_assets.defs.tables import PartfinTable

        spec = dataclasses.replace(ORDERS_SPEC, watermark_policy="min-of-last:2")
        self.path = path
        self.instance = instance
        self.defs = build_definitions([PartfinTable(spec=spec, source=f"debezium:{path}")])
        self.example = load_example()
        self.cursor = None

    def sync(self) -> None:
        assert self.defs.resolve_job_def("sync_orders").execute_in_process(instance=self.instance).success

    def finalization_tick(self):
        """One tick of finalize_orders_sensor; its asset events are recorded as the daemon records them."""
        sensor = self.defs.resolve_sensor_def("finalize_orders_sensor")
        resources = self.defs.get_repository_def().get_top_level_resources()
        with build_sensor_context(instance=self.instance, cursor=self.cursor, resources=resources) as ctx:
            result = sensor(ctx)
        for event in result.asset_events or []:
            self.instance.report_runless_asset_event(event)
        self.cursor = result.cursor
        return result

    def activity(self, partition_key: str, tags: dict | None = None) -> dict:
        job = self.defs.resolve_job_def("activity_orders_job")
        result = job.execute_in_process(instance=self.instance, partition_key=partition_key, tags=tags or {})
        assert result.success
        (event,) = result.get_asset_materialization_events()
        return {k: v.value for k, v in event.materialization.metadata.items()}

    def revenue(self, partition_key: str) -> dict:
        job = self.example.defs.resolve_job_def("orders_revenue_hourly_job")
        result = job.execute_in_process(instance=self.instance, partition_key=partition_key)
        assert result.success
        (event,) = result.get_asset_materialization_events()
        return {k: v.value for k, v in event.materialization.metadata.items()}

    def events(self, partition_key: str) -> list[dict]:
        records = self.instance.fetch_materializations(
            AssetRecordsFilter(asset_key=FINALIZED, asset_partitions=[partition_key]), limit=100, ascending=True
        ).records
        return [{k: v.value for k, v in r.event_log_entry.asset_materialization.metadata.items()} for r in records]


@pytest.fixture
def pipeline(tmp_path, monkeypatch):
    path = tmp_path / "orders.jsonl"
    for n, hour in enumerate(HOURS):
        append_lines(path, hour_of_changes(hour, range(100 * n + 1, 100 * n + 21), minute_step=2.5, status="paid"))
    monkeypatch.setenv("PARTFIN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PARTFIN_SOURCE", raising=False)
    monkeypatch.setenv("PARTFIN_PARTITIONS_START", "2026-11-01-00:00")
    monkeypatch.setenv("PARTFIN_MAX_RECORDS", "10")
    with DagsterInstance.ephemeral() as instance:
        yield Pipeline(path, instance)


def test_downstream_hour_reads_base_at_its_finalization_snapshot(pipeline):
    """Before: a run of H1 after a row of H1 was updated later (its newest change now in H3) saw 19 rows, not 20,
    and the example's revenue dropped from 200.0 to 190.0: the result depended on when the run happened."""
    pipeline.sync()
    first_tick = pipeline.finalization_tick()
    request = {r.partition_key: r for r in first_tick.run_requests}[H1_KEY]
    (finalization,) = pipeline.events(H1_KEY)
    first = pipeline.activity(H1_KEY, request.tags)
    revenue_first = pipeline.revenue(H1_KEY)
    assert first["rows"] == 20 and revenue_first["revenue"] == 200.0

    # later: order 101 (an H1 row) changes at 03:10; its newest version now belongs to hour 03:00
    append_lines(pipeline.path, [change("u", 101, ms(HOURS[3]) + 10 * 60_000, status="shipped")])
    pipeline.sync()
    retry = pipeline.activity(H1_KEY, request.tags)  # what a run retry gets: the original run's tags
    later = pipeline.activity(H1_KEY)  # a manual run of the partition, days later
    revenue_later = pipeline.revenue(H1_KEY)
    print(f"downstream H1: rows {first['rows']} -> retry {retry['rows']}, later run {later['rows']}; "
          f"revenue {revenue_first['revenue']} -> {revenue_later['revenue']}")
    assert retry["rows"] == later["rows"] == first["rows"] == 20
    assert revenue_later["revenue"] == revenue_first["revenue"]
    for result in (first, retry, later):  # each materialization records the snapshot it read
        assert result["base_snapshot_id"] == finalization["base_snapshot_id"]
    assert revenue_later["base_snapshot_id"] == finalization["base_snapshot_id"]


def test_rerun_for_late_data_reads_the_snapshot_that_carried_it(pipeline):
    """Late records for H1 arrive after H1 was final. The finalization sensor records an amendment of H1 naming
    the base snapshot that carried them and requests a re-run; that run (and any retry or later run) reads
    exactly that snapshot: the late rows, and nothing that changed after."""
    pipeline.sync()
    pipeline.finalization_tick()
    assert pipeline.activity(H1_KEY)["rows"] == 20

    append_lines(pipeline.path, [change("c", 5000 + i, ms(HOURS[1]) + (30 + i) * 60_000, status="paid") for i in range(2)])
    pipeline.sync()
    tick = pipeline.finalization_tick()
    (rerun,) = [r for r in tick.run_requests if r.partition_key == H1_KEY]
    finalization, amendment = pipeline.events(H1_KEY)
    assert amendment["amendment"] is True and amendment["late_records"] == 2
    assert amendment["base_snapshot_id"] != finalization["base_snapshot_id"]
    amended = pipeline.activity(H1_KEY, rerun.tags)
    assert amended["rows"] == 22 and amended["base_snapshot_id"] == amendment["base_snapshot_id"]

    # base moves on (an H1 row updated in H3); the re-run's retry and a later manual run still read the amendment
    append_lines(pipeline.path, [change("u", 105, ms(HOURS[3]) + 20 * 60_000, status="shipped")])
    pipeline.sync()
    assert not [r for r in pipeline.finalization_tick().run_requests if r.partition_key == H1_KEY]  # not late data
    for result in (pipeline.activity(H1_KEY, rerun.tags), pipeline.activity(H1_KEY)):
        assert result["rows"] == 22 and result["base_snapshot_id"] == amendment["base_snapshot_id"]
    assert pipeline.revenue(H1_KEY)["revenue"] == 220.0


def _step_failure(result) -> str:
    """What the user reads: the Failure's description, else the error's message line."""
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    data = failure.event_specific_data
    return data.user_failure_data.description if data.user_failure_data else data.error.message.strip()


FORCE = {"ops": {"activity_orders_hourly": {"config": {"force": True}}}}


@pytest.mark.parametrize("change_after", ["expiry", "privacy_delete"])
def test_unreadable_finalization_snapshot_fails_in_one_line_unless_forced(pipeline, change_after):
    """H1's finalization snapshot is gone (maintain_orders expired it) or predates a privacy delete (reading it would
    bring erased rows back): a run of H1 fails at once, in one line naming the snapshot and how to force it; forced, it
    reads the current base and records that. The example's asset fails in one line too, never reads no rows."""
    pipeline.sync()
    if change_after == "expiry":  # H1's finalization tag (which keeps its snapshot from expiry) has aged out by then
        from partfin_assets.iceberg.catalog import load_partfin_catalog
        from partfin_assets.iceberg.commit import set_table_properties
        from partfin_assets.model import summary_keys as K

        set_table_properties(load_partfin_catalog(), "base.orders", {K.PROP_FINALIZED_TAG_MAX_AGE: "0.001s"})
    pipeline.finalization_tick()
    (finalization,) = pipeline.events(H1_KEY)
    append_lines(pipeline.path, [change("u", 101, ms(HOURS[3]) + 10 * 60_000, status="shipped")])  # 101 leaves H1
    pipeline.sync()
    if change_after == "expiry":
        maintain = pipeline.defs.resolve_job_def("maintain_orders")
        config = {"ops": {"expire_snapshots_orders": {"config": {"keep_last": 1}}}}
        assert maintain.execute_in_process(instance=pipeline.instance, run_config=config).success
        expected = f"base.orders no longer holds snapshot {finalization['base_snapshot_id']} (expired by snapshot expiry)"
    else:
        privacy = pipeline.defs.resolve_job_def("privacy_delete_orders")
        config = {"ops": {"privacy_delete_orders_op": {"config": {"keys": [{"id": 102}], "request_id": "gdpr-7"}}}}
        assert privacy.execute_in_process(instance=pipeline.instance, run_config=config).success
        expected = f"privacy delete gdpr-7 on base.orders ran after snapshot {finalization['base_snapshot_id']}"

    job = pipeline.defs.resolve_job_def("activity_orders_job")
    refused = job.execute_in_process(instance=pipeline.instance, partition_key=H1_KEY, raise_on_error=False)
    message = _step_failure(refused)
    print(message)
    assert not refused.success and expected in message and "finalization event" in message
    assert "config.force: true" in message and "\n" not in message

    forced = job.execute_in_process(instance=pipeline.instance, partition_key=H1_KEY, run_config=FORCE)
    (event,) = forced.get_asset_materialization_events()
    meta = {k: v.value for k, v in event.materialization.metadata.items()}
    assert meta["forced"] is True and meta["base_snapshot_id"] != finalization["base_snapshot_id"]
    assert meta["rows"] == (19 if change_after == "expiry" else 18)  # now: 101 moved to H3 (and 102 erased)
    assert meta["base_snapshot_origin"].startswith("current snapshot (forced")

    revenue = pipeline.example.defs.resolve_job_def("orders_revenue_hourly_job").execute_in_process(
        instance=pipeline.instance, partition_key=H1_KEY, raise_on_error=False
    )
    assert not revenue.success and expected in _step_failure(revenue)
