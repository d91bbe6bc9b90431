"""The Dagster layer in process, one scenario a test: definitions, sync job, finalization sensor, downstream guard, checks."""

from __future__ import annotations

import base64
import dataclasses
import re
import struct

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
from partfin_assets.finalization.read_points import AMENDMENT_TAG
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


def test_asset_names_say_layer_and_table_and_lineage_reads_cdc_base_finalized_downstream():
    """Dagster's graph nodes show a key's last component only: it must name the layer and the table. The downstream
    asset depends on finalized_<table> as Dagster sees dependencies (cdc -> base -> finalized -> downstream)."""
    from partfin_assets.definitions import defs
    from partfin_assets.defs.tables import TABLES

    graph = defs.get_repository_def().asset_graph
    for table in TABLES:
        chain = [table.cdc_key, table.base_key, table.finalized_key, table.activity_key]
        shown = [key.path[-1] for key in chain]
        assert len(set(shown)) == 4
        for name, layer in zip(shown, ("cdc", "base", "finalized", "activity")):
            assert layer in name and table.name in name, name
        for upstream, downstream in zip(chain, chain[1:]):
            assert graph.get(downstream).parent_keys == {upstream}, downstream


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
        for name in (f"sync_{table.name}", f"activity_{table.name}_job", f"checks_{table.name}"):
            assert repo.has_job(name)
        sensors = {s.name: s for s in repo.sensor_defs}
        for name in (f"sync_{table.name}_sensor", f"finalize_{table.name}_sensor", f"checks_{table.name}_sensor"):
            assert sensors[name].default_status.value == "RUNNING"
        checks = {k.name for k in repo.asset_graph.asset_check_keys if k.asset_key == table.cdc_key}
        assert checks == {"watermark_fresh", "watermark_monotonic", "late_data", "rejected_input", "writer_clocks"}


CDC, BASE = AssetKey("cdc_orders"), AssetKey("base_orders")
FINALIZED, ACTIVITY = AssetKey("finalized_orders"), AssetKey("activity_orders_hourly")
REPORT = AssetKey("report_orders")
STREAM_START_US = 1767225600_000_000  # START


@pytest.fixture
def synced(env):
    """`env` after one sync run of orders (cdc and base written, nothing finalized yet)."""
    defs, instance, table = env
    assert defs.resolve_job_def("sync_orders").execute_in_process(instance=instance).success
    return defs, instance, table


def _tick(defs, instance, cursor=None):
    """One evaluation of the finalization sensor, as the daemon runs it."""
    sensor = defs.resolve_sensor_def("finalize_orders_sensor")
    with build_sensor_context(instance=instance, cursor=cursor, resources=defs.get_repository_def().get_top_level_resources()) as ctx:
        return sensor(ctx)


def _finalize(defs, instance):
    """A sensor tick whose finalization events are stored, as the daemon stores SensorResult.asset_events."""
    result = _tick(defs, instance)
    for event in result.asset_events:
        instance.report_runless_asset_event(event)
    return result


def _base_watermark() -> int:
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets.iceberg.history import watermark_of

    return watermark_of(load_partfin_catalog().load_table("base.orders").properties)


def test_sync_reports_every_hour_it_touched_with_its_metadata(env):
    defs, instance, table = env
    # every hour a run touched or finalized shows the hour's totals (from the ledger), and the run
    # evaluates the cdc and base checks after its materializations
    result = defs.resolve_job_def("sync_orders").execute_in_process(instance=instance)
    assert result.success
    cdc_events = _materializations(instance, CDC)
    assert cdc_events
    meta = cdc_events[0].asset_materialization.metadata
    for name in ("records", "late_records", "event_time_min", "event_time_max", "event_time_p50", "event_time_p99", "watermark",
                 "finalized", "finalized_at", "finalization_lag_seconds"):
        assert name in meta, name
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets.iceberg.ledger import hour_totals, read_ledger

    totals = hour_totals(read_ledger(load_partfin_catalog(), "cdc.orders"))
    expected = {hour_key(int(h.timestamp()) * 1_000_000): n for h, n in zip(totals["hour"].to_list(), totals["records"].to_list())}
    shown = {}
    for event in reversed(cdc_events):  # oldest first: the newest materialization of a partition wins
        shown[event.dagster_event.partition] = event.asset_materialization.metadata["records"].value
    assert shown == expected  # one run: each hour once, with all its records (not one checkpoint's share)
    finals = [e.asset_materialization.metadata for e in cdc_events if e.asset_materialization.metadata["finalized"].value]
    assert finals and all(isinstance(m["finalization_lag_seconds"].value, float) and m["finalization_lag_seconds"].value >= 0
                          for m in finals)
    # the one line a partition page shows on top: final since when, and whether late data reached it after
    assert all(re.fullmatch(r"final since \S+Z \(.+ after the hour's end\); (no late data reached it after|\d+ late record\(s\) "
                            r"reached it after it was final)", m["finality"].value) for m in finals)
    assert all(m["finality"].value.startswith("not final: the watermark has not passed ")
               for e in cdc_events if not (m := e.asset_materialization.metadata)["finalized"].value)
    assert list(finals[0])[0] == "finality"
    partitions = {e.dagster_event.partition for e in cdc_events}
    assert "2026-01-01-00:00" in partitions and "2026-01-01-06:00" in partitions
    base_events = _materializations(instance, BASE)
    assert {e.dagster_event.partition for e in base_events} >= {"2026-01-01-00:00", "2026-01-01-05:00"}
    assert "records" in base_events[0].asset_materialization.metadata
    # base_orders is an executable asset: materializing a partition by hand runs the upsert and shows the hour
    by_hand = defs.resolve_implicit_global_asset_job_def().execute_in_process(
        instance=instance, partition_key="2026-01-01-02:00", asset_selection=[BASE])
    (shown_base,) = [e.materialization for e in by_hand.get_asset_materialization_events() if e.materialization.partition == "2026-01-01-02:00"]
    assert shown_base.metadata["records"].value == expected["2026-01-01-02:00"] and shown_base.metadata["finalized"].value is True
    # per-commit facts are a table-level series
    observed = [r.event_log_entry.asset_observation.metadata for r in instance.fetch_observations(CDC, limit=1000).records]
    assert any("checkpoint_id" in m and "commit_latency_seconds" in m for m in observed)
    # the finalization report as markdown, its plots PNG data: URIs, the one event of report_orders (its overview shows
    # the latest observation's metadata): the UI renders it, no path on the server's disk
    assert not any("finalization_report" in m for m in observed)
    (reported,) = [r.event_log_entry.asset_observation.metadata for r in instance.fetch_observations(REPORT, limit=10).records]
    report = reported["finalization_report"].value
    assert report.startswith(r"## Finalization of cdc\.orders") and "### Watermark vs wall clock" in report
    assert "| hour (UTC) | final | finalization lag | late records |" in report
    plots = re.findall(r"!\[([^\]]+)\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", report)
    assert [title for title, _ in plots] == ["Watermark over wall time", "Finalization lag per hour (h)", "Late records per hour"]
    for _, data in plots:  # a real PNG each, of the size asked (small: the report is stored on every refresh)
        png = base64.b64decode(data)
        assert png.startswith(b"\x89PNG") and struct.unpack(">II", png[16:24]) == (600, 224) and len(png) < 40_000
    assert reported["table"].value == "cdc.orders" and "finalized through" in reported
    # the checks ran in the sync run itself: the UI shows them on the latest materialization
    in_run = {(e.asset_key, e.check_name): e for e in result.get_asset_check_evaluations()}
    assert {c for k, c in in_run if k == CDC} == {"watermark_fresh", "watermark_monotonic", "late_data", "rejected_input", "writer_clocks"}
    assert {c for k, c in in_run if k == BASE} == {"watermark_matches_merged_cdc_snapshot", "watermark_lag_vs_cdc",
                                                   "quarantined_changes"}
    in_run_late = in_run[(CDC, "late_data")]
    assert not in_run_late.passed and in_run_late.severity == AssetCheckSeverity.WARN
    from partfin_assets.finalization.status import all_table_status

    status = {s.name: s for s in all_table_status(load_partfin_catalog())}
    assert in_run_late.metadata["late_records"].value == status["cdc.orders"].late_records  # `partfin status` agrees


def test_finalization_sensor_requests_every_final_hour_once_in_order(synced):
    defs, instance, table = synced
    first = _finalize(defs, instance)
    keys = [r.partition_key for r in first.run_requests]
    assert keys == sorted(keys) and keys[0] == "2026-01-01-00:00"
    assert len(keys) == (_base_watermark() - STREAM_START_US) // US_PER_HOUR  # every hour below the base watermark
    assert len(set(r.run_key for r in first.run_requests)) == len(keys)
    assert [e.partition for e in first.asset_events] == keys
    assert len(_materializations(instance, FINALIZED)) == len(keys)
    second = _tick(defs, instance, cursor=first.cursor)
    assert not second.run_requests and not second.asset_events


def test_a_lost_cursor_requests_the_same_runs_and_publishes_no_event_twice(synced):
    defs, instance, table = synced
    first = _finalize(defs, instance)
    again = _tick(defs, instance)  # no cursor: the run_keys repeat (the daemon dedupes them), the events do not
    assert not again.asset_events
    assert [r.run_key for r in again.run_requests] == [r.run_key for r in first.run_requests]
    assert len(_materializations(instance, FINALIZED)) == len(first.run_requests)


def test_the_downstream_example_computes_from_a_finalized_hour(synced):
    from partfin_assets_tests.test_dagster_downstream_example import load_example

    defs, instance, table = synced
    first_hour = _finalize(defs, instance).run_requests[0].partition_key
    example = load_example()  # the downstream team's own code location
    revenue = example.defs.resolve_job_def("orders_revenue_hourly_job").execute_in_process(instance=instance, partition_key=first_hour)
    assert revenue.success


def test_downstream_runs_a_final_hour_and_refuses_an_open_one_unless_forced(synced):
    from partfin_assets.finalization.hours import is_finalized

    defs, instance, table = synced
    first_hour = _finalize(defs, instance).run_requests[0].partition_key
    job = defs.resolve_job_def("activity_orders_job")
    assert job.execute_in_process(instance=instance, partition_key=first_hour).success
    done = _materializations(instance, ACTIVITY)[0].asset_materialization.metadata
    assert done["finalized"].value is True and done["rows"].value > 0

    watermark = _base_watermark()
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
        run_config=RunConfig(ops={"activity_orders_hourly": {"config": {"force": True}}}),
    )
    assert forced.success


def test_checks_warn_on_late_data_and_name_the_commits_that_brought_it(synced):
    defs, instance, table = synced
    checks = defs.resolve_job_def("checks_orders").execute_in_process(instance=instance)
    evaluations = {e.check_name: e for e in checks.get_asset_check_evaluations()}
    assert evaluations["watermark_monotonic"].passed
    assert evaluations["watermark_matches_merged_cdc_snapshot"].passed
    late = evaluations["late_data"]  # the generated stream has a late tail the policy lets through
    assert not late.passed and late.severity == AssetCheckSeverity.WARN
    by_partition, commits = late.metadata["by_partition"].value, late.metadata["commits"].value
    assert len(by_partition) == late.metadata["late_partitions"].value  # a short stream: every late hour is listed
    assert sum(by_partition.values()) == late.metadata["late_records"].value > 0
    assert set(commits) == set(by_partition)
    assert all(ids and len(set(ids)) == len(ids) for ids in commits.values())  # each hour names its commits, once
    # the current policy as the table's own watermark did: late share and lag, from the ledger, measured by a job of
    # its own (its schedule, not the sync path): an observation of the cdc asset
    measured = defs.resolve_job_def("measure_policy_orders").execute_in_process(instance=instance)
    observed = [e.event_specific_data.asset_observation for e in measured.all_events if e.event_type_value == "ASSET_OBSERVATION"]
    assert [o.asset_key for o in observed] == [table.cdc_key]
    policy = observed[0].metadata
    assert policy["watermark_policy"].value == table.spec.watermark_policy
    assert 0 < policy["late_share_after_finalization"].value < 1
    assert policy["median_finalization_lag_seconds"].value > 0
    # a 2026-01-01 stream the sync just read in a burst is a writer catching up (it committed now, its source clock
    # gains on the wall clock), not a stale watermark; once the writer stops committing, it is
    fresh = evaluations["watermark_fresh"]
    assert fresh.passed and fresh.metadata["catching_up"].value and "catching up" in fresh.description
    from partfin_assets.finalization.table_checks import CheckThresholds, watermark_fresh
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets.model.timeutil import now_utc, to_us

    limits = CheckThresholds(table.lag_warn_seconds, table.lag_error_seconds, table.base_max_lag_seconds)
    stalled = watermark_fresh(load_partfin_catalog(), "orders", limits, now_us=to_us(now_utc()) + (limits.live_writer_seconds + 1) * 1_000_000)
    assert not stalled.passed and "trails now by" in stalled.description
    assert evaluations["late_data_after_run"].passed  # no downstream run yet
    assert evaluations["rejected_input"].passed and evaluations["quarantined_changes"].passed
    assert evaluations["writer_clocks"].passed  # one writer: no clock to disagree with


def test_late_rows_in_hours_that_ran_ask_for_a_rerun_of_those_hours(synced, monkeypatch):
    from partfin_assets.defs import build_definitions

    defs, instance, table = synced
    first = _finalize(defs, instance)
    keys = [r.partition_key for r in first.run_requests]
    job = defs.resolve_job_def("activity_orders_job")
    for request in first.run_requests:
        assert job.execute_in_process(instance=instance, partition_key=request.partition_key, tags=request.tags).success
    open_hour = hour_key(_base_watermark())  # run too, by force
    force = RunConfig(ops={"activity_orders_hourly": {"config": {"force": True}}})
    assert job.execute_in_process(instance=instance, partition_key=open_hour, run_config=force).success
    # the stream goes on and late rows land in hours that ran
    monkeypatch.setenv("PARTFIN_SOURCE", STREAM.replace("end=2026-01-01T06:30:00Z", "end=2026-01-01T10:00:00Z"))
    later = build_definitions([table])
    assert later.resolve_job_def("sync_orders").execute_in_process(instance=instance).success
    checks = later.resolve_job_def("checks_orders").execute_in_process(instance=instance)
    after = {e.check_name: e for e in checks.get_asset_check_evaluations()}["late_data_after_run"]
    assert not after.passed and after.severity == AssetCheckSeverity.WARN
    rerun = after.metadata["partitions_to_rerun"].value
    assert rerun and set(rerun) <= set(keys) | {open_hour}
    assert "re-run" in after.description

    # the late_data WARN stays (the ledger is its evidence) until every affected hour ran again with its late rows
    sticky = {e.check_name: e for e in checks.get_asset_check_evaluations()}["late_data"]
    assert not sticky.passed and sticky.severity == AssetCheckSeverity.WARN
    to_rerun = sticky.metadata["partitions_to_rerun"].value
    assert set(rerun) <= set(to_rerun)
    again = later.resolve_job_def("checks_orders").execute_in_process(instance=instance)
    assert not {e.check_name: e for e in again.get_asset_check_evaluations()}["late_data"].passed  # nothing re-run: still WARN
    # the finalization sensor amends the hours that ran before their late records came and requests them again
    resources = later.get_repository_def().get_top_level_resources()
    sensor = later.resolve_sensor_def("finalize_orders_sensor")
    with build_sensor_context(instance=instance, cursor=first.cursor, resources=resources) as ctx:
        amended = sensor(ctx)
    for event in amended.asset_events:
        instance.report_runless_asset_event(event)
    requests = {r.partition_key: r for r in amended.run_requests}
    assert set(rerun) <= set(requests)
    amendments = [r for r in amended.run_requests if r.tags.get(AMENDMENT_TAG) == "true"]
    assert amendments and all(r.run_key.startswith(f"orders:{r.partition_key}:amendment:") for r in amendments)
    assert {r.partition_key for r in amendments} == set(rerun) & set(keys)
    from partfin_assets.iceberg.catalog import load_partfin_catalog

    amended_tags = {n for n in load_partfin_catalog().load_table("base.orders").metadata.refs if "-amend-" in n}
    assert amended_tags == {"finalized-" + r.partition_key.replace(":00", "") + "-amend-1" for r in amendments}  # any engine sees them
    for key in to_rerun:
        tags = requests[key].tags if key in requests else {}
        assert later.resolve_job_def("activity_orders_job").execute_in_process(instance=instance, partition_key=key, tags=tags).success
    with build_sensor_context(instance=instance, cursor=amended.cursor, resources=resources) as ctx:
        done = sensor(ctx)
    assert not [r for r in (done.run_requests or []) if r.tags.get(AMENDMENT_TAG) == "true"]
    cleared = later.resolve_job_def("checks_orders").execute_in_process(instance=instance)
    by_name = {e.check_name: e for e in cleared.get_asset_check_evaluations()}
    assert by_name["late_data"].passed and by_name["late_data_after_run"].passed
    assert by_name["late_data"].metadata["late_records"].value == sticky.metadata["late_records"].value  # totals stay


def test_each_finalized_hour_is_an_iceberg_tag_other_engines_read(synced):
    """Each hour the sensor finalizes gets a tag `finalized-<hour>` on base.orders at the snapshot its event names,
    with a retention (max-ref-age); DuckDB finds it in the table's metadata and reads the hour as it was final."""
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets.iceberg.tables import read_base
    from partfin_assets_tests.engines import duckdb_read_tag, plain_rows

    defs, instance, table = synced
    first = _finalize(defs, instance)
    catalog = load_partfin_catalog()
    base = catalog.load_table("base.orders")
    events = {e.dagster_event.partition: e.asset_materialization.metadata for e in _materializations(instance, FINALIZED)}
    tags = {name: ref for name, ref in base.metadata.refs.items() if name.startswith("finalized-")}
    expected = {"finalized-" + key.replace(":00", ""): meta["base_snapshot_id"].value for key, meta in events.items()}
    assert len(expected) == len(first.run_requests) > 0
    assert {name: str(ref.snapshot_id) for name, ref in tags.items()} == expected  # ids are text in the metadata
    assert all(ref.snapshot_ref_type == "tag" and ref.max_ref_age_ms == 7 * 24 * 3600 * 1000 for ref in tags.values())
    assert not _tick(defs, instance).asset_events  # a repeated tick (cursor lost) tags nothing twice
    assert set(catalog.load_table("base.orders").metadata.refs) == set(base.metadata.refs)

    newest = max(tags)
    from_duckdb = duckdb_read_tag(base, newest)
    expected_rows = read_base(catalog, "orders", include_deleted=True, snapshot_id=tags[newest].snapshot_id)
    assert plain_rows(from_duckdb, expected_rows.column_names) == plain_rows(expected_rows)
    from partfin_assets.finalization.status import all_table_status

    status = {s.name: s for s in all_table_status(catalog)}["base.orders"]
    assert status.finalized_tags == len(expected) and status.newest_finalized_tag == newest
    assert status.metadata_location == catalog.load_table("base.orders").metadata_location  # what DuckDB reads


def test_first_sync_run_of_a_new_table_catching_up_passes_watermark_fresh(tmp_path, monkeypatch):
    """A new table's first sync run, the demo's start: 7 hours of backlog delivered at once to late-budget:0.001 (the
    default). Its first commit finds the ledger empty (the writer records ledger rows a few checkpoints at a time), so
    the whole run commits on the fallback, which a backlog delivered at once holds near its first hour: the watermark
    trails the newest record by hours. A catch-up, not a fault: watermark_fresh passes and says the policy is learning
    (it WARNed before), in this run and the next."""
    from datetime import UTC, datetime, timedelta

    from partfin_assets.defs import build_definitions
    from partfin_assets.defs.tables import PartfinTable

    now = datetime.now(UTC)
    start = now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=7)
    for key, value in {"PARTFIN_HOME": str(tmp_path / "home"), "DAGSTER_HOME": str(tmp_path / "dagster"),
                       # the browser test's demo: 5 h 40 min of history at once, then a 40x event clock
                       "PARTFIN_SOURCE": f"synthetic:rate=4,late_fraction=0.0005,key_space=1000000,start={start:%Y-%m-%dT%H:%M:%SZ},"
                                         f"speed=40,speed_since={now:%Y-%m-%dT%H:%M:%SZ},"
                                         f"speed_event={start + timedelta(hours=5, minutes=40):%Y-%m-%dT%H:%M:%SZ}",
                       "PARTFIN_PARTITIONS_START": f"{start:%Y-%m-%d-%H:00}", "PARTFIN_MAX_RECORDS": "10000"}.items():
        monkeypatch.setenv(key, value)
    (tmp_path / "dagster").mkdir()
    defs = build_definitions([PartfinTable(spec=ORDERS_SPEC, source="synthetic")])
    instance = DagsterInstance.ephemeral()
    fresh = []
    for _ in range(2):
        result = defs.resolve_job_def("sync_orders").execute_in_process(instance=instance)
        fresh.append({e.check_name: e for e in result.get_asset_check_evaluations()}["watermark_fresh"])
    first, second = fresh
    assert first.passed and "catching_up" in first.metadata and first.metadata["policy_learning"].value, (first.description, dict(first.metadata))
    assert "has not learned yet" in first.description
    assert second.passed, (second.description, dict(second.metadata))  # learned or not: a catch-up
    instance.dispose()
