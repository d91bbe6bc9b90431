"""Table jobs in Dagster: replay as a cdc partition materialization, compaction with a conflict retry,
privacy delete (resumable), maintenance, and the instance's per-table limits under a real daemon."""

import dataclasses
import os
import shutil
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest
from dagster import AssetKey, AssetRecordsFilter, DagsterEventType, DagsterInstance, RunConfig

from partfin_assets.finalization.hours import hour_from_key, is_finalized
from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.files import live_files, read_files
from partfin_assets.iceberg.history import watermark_of
from partfin_assets.jobs import compaction as compaction_core
from partfin_assets.jobs.job import Job
from partfin_assets.jobs.privacy import cdc_key_filter, delete_where
from partfin_assets.jobs.retry import ConflictRetryPolicy
from partfin_assets.model.record_keys import canonical_key
from partfin_assets.model.summary_keys import JobKind
from partfin_assets.model.timeutil import US_PER_HOUR
from partfin_assets.sources.synthetic import ORDERS_SPEC
from partfin_assets_tests.table_helpers import commit_append, files_per_partition

REPO = Path(__file__).resolve().parents[1]
START = "2026-01-01T00:00:00Z"
STREAM = f"synthetic:start={START},end=2026-01-01T05:30:00Z,rate=0.3,late_fraction=0.01,idle_every=off,seed=9"
CDC, BASE = AssetKey("cdc_orders"), AssetKey("base_orders")


@pytest.fixture
def synced(tmp_path, monkeypatch):
    """Definitions for one orders table, an ephemeral instance, and cdc/base written by one sync run."""
    monkeypatch.setenv("PARTFIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PARTFIN_SOURCE", STREAM)
    monkeypatch.setenv("PARTFIN_PARTITIONS_START", "2026-01-01-00:00")
    monkeypatch.setenv("PARTFIN_MAX_RECORDS", "300")  # many small checkpoints: many small files per hour
    monkeypatch.setenv("PARTFIN_MAX_CHECKPOINTS_PER_RUN", "100")
    monkeypatch.setattr("partfin_assets.jobs.retry.CONFLICT_RETRY", ConflictRetryPolicy(base_delay_s=0.05))
    from partfin_assets.defs import build_definitions
    from partfin_assets.defs.tables import PartfinTable

    table = PartfinTable(spec=dataclasses.replace(ORDERS_SPEC, watermark_policy="percentile:0.05:last:2"), source=STREAM)
    defs = build_definitions([table])
    instance = DagsterInstance.ephemeral()
    assert defs.resolve_job_def("sync_orders").execute_in_process(instance=instance).success
    yield defs, instance, load_partfin_catalog(tmp_path / "home")
    instance.dispose()


def observations(instance, key):
    records = instance.fetch_observations(AssetRecordsFilter(asset_key=key), limit=1000).records
    return [r.event_log_entry.asset_observation.metadata for r in records]


def hour_rows(catalog, hour_us):
    table = catalog.load_table("cdc.orders")
    rows = table.scan().to_arrow()
    times = pc.cast(rows.column("event_time"), "int64")
    rows = rows.filter(pc.and_(pc.greater_equal(times, hour_us), pc.less(times, hour_us + US_PER_HOUR)))
    return sorted(zip(rows.column("key").to_pylist(), rows.column("source_seq").to_pylist()))


def step_events(result, step_key, event_type):
    return [e for e in result.all_events if e.step_key == step_key and e.event_type == event_type]


def test_definitions_and_instance_limits():
    from partfin_assets.definitions import defs
    from partfin_assets.defs.tables import TABLES

    repo = defs.get_repository_def()
    for table in TABLES:
        name = table.name
        cdc = repo.asset_graph.get(table.cdc_key)
        assert cdc.is_executable and cdc.is_materializable  # the UI's Materialize runs the replay
        assets_def = repo.assets_defs_by_key[table.cdc_key]
        assert assets_def.backfill_policy is None  # a backfill: one run per partition
        assert assets_def.op.pool == f"partfin_cdc_{name}"  # a sync or a replay: one step writing cdc at a time
        base = repo.asset_graph.get(table.base_key)
        assert base.is_executable and base.is_materializable  # not an External Asset: Materialize runs the upsert now
        for job_name, tag in ((f"compact_{name}", "partfin/maintenance"), (f"maintain_{name}", "partfin/maintenance"),
                              (f"privacy_delete_{name}", "partfin/privacy"), (f"sync_{name}", "partfin/writer")):
            assert tag in repo.get_job(job_name).tags, job_name
        schedules = {s.name: s for s in repo.schedule_defs}
        for schedule in (f"compact_{name}_schedule", f"maintain_{name}_schedule", f"measure_policy_{name}_schedule"):
            assert schedules[schedule].default_status.value == "RUNNING"

    # privacy deletes of a table, one request at a time (the other limits are proven by behaviour:
    # test_one_writer_and_one_maintenance_run_per_table_under_the_daemon, the backfill test below,
    # test_dagster_daemon's run retry and test_postgres_deployment's downstream runs)
    home = Path(__import__("tempfile").mkdtemp())
    try:
        shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
        instance = DagsterInstance.from_config(str(home))
        limits = {t["key"]: t for t in instance.get_concurrency_config().run_queue_config.tag_concurrency_limits}
        assert limits["partfin/privacy"]["limit"] == 1 and limits["partfin/privacy"]["value"] == {"applyLimitPerUniqueValue": True}
        # runs of one downstream hour never overlap: an amendment's re-run writes after the earlier run
        assert limits["partfin/downstream-hour"]["limit"] == 1
        instance.dispose()
    finally:
        shutil.rmtree(home)


@pytest.mark.timeout(600)
def test_one_writer_and_one_maintenance_run_per_table_under_the_daemon(tmp_path):
    """Two sync runs and a compaction + a maintenance run of orders, all queued before a real dagster-daemon
    (the repo's dagster.yaml, room for 4 runs) starts: both pairs run one after the other, never at once."""
    import subprocess

    from dagster import DagsterRunStatus

    from partfin_assets.testing import dagster_processes

    home, dagster_home = tmp_path / "partfin", tmp_path / "dagster"
    env = dagster_processes.dagster_env(
        home, dagster_home, PARTFIN_SENSORS="", PARTFIN_SCHEDULES="", PARTFIN_SOURCE=STREAM,
        PARTFIN_PARTITIONS_START="2026-01-01-00:00", PARTFIN_MAX_RECORDS="300",
    )
    launch = [dagster_processes.bin_path("dagster"), "job", "launch", "-w", str(REPO / "workspace.yaml"), "-j"]
    jobs = ["sync_orders", "sync_orders", "compact_orders", "maintain_orders"]
    for name in jobs:  # queued: the daemon's run queue starts them
        done = subprocess.run([*launch, name], env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
    instance = DagsterInstance.from_config(str(dagster_home))
    assert [r.status for r in instance.get_runs()] == [DagsterRunStatus.QUEUED] * len(jobs)

    finished = {DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}
    proc = dagster_processes.daemon(env, tmp_path / "daemon.log").start()
    try:
        dagster_processes.wait_for(lambda: all(r.status in finished for r in instance.get_runs()), 420,
                                   "the queued runs to finish", on_timeout=proc.log_tail)
    finally:
        proc.stop()
    records = instance.get_run_records()
    assert all(r.dagster_run.status == DagsterRunStatus.SUCCESS for r in records), [(r.dagster_run.job_name, r.dagster_run.status) for r in records]
    for names in (("sync_orders",), ("compact_orders", "maintain_orders")):
        spans = sorted((r.start_time, r.end_time) for r in records if r.dagster_run.job_name in names)
        assert len(spans) == 2 and spans[0][1] <= spans[1][0], (names, spans)
    instance.dispose()


def test_replay_is_the_cdc_partition_materialization(synced):
    defs, instance, catalog = synced
    watermark = watermark_of(catalog.load_table("cdc.orders").properties)
    key = "2026-01-01-01:00"
    hour = hour_from_key(key)
    assert is_finalized(hour, watermark)
    ingested = hour_rows(catalog, hour)
    assert ingested

    # a privacy delete of one key that has rows in the hour (records per table, by request id)
    erased_key = {"id": int(__import__("json").loads(ingested[0][0])["id"])}
    privacy = defs.resolve_job_def("privacy_delete_orders")
    config = RunConfig(ops={"privacy_delete_orders_op": {"config": {"keys": [erased_key], "request_id": "req-1"}}})
    assert privacy.execute_in_process(instance=instance, run_config=config).success
    by_table = {str(m["iceberg_table"].value): m for m in observations(instance, CDC) + observations(instance, BASE)
                if "privacy_request_id" in m}
    assert set(by_table) == {"cdc.orders", "cdc.orders__rejected", "base.orders", "base.orders__rejected"}
    assert by_table["cdc.orders"]["deleted_records"].value > 0 and by_table["base.orders"]["deleted_records"].value > 0
    erased = ingested
    ingested = hour_rows(catalog, hour)
    assert 0 < len(ingested) < len(erased)

    # the same request again: resumes, nothing left to delete, still succeeds
    assert privacy.execute_in_process(instance=instance, run_config=config).success
    for identifier in ("cdc.orders", "base.orders"):
        newest, first = [m for m in observations(instance, CDC) + observations(instance, BASE)
                         if "privacy_request_id" in m and m["iceberg_table"].value == identifier]  # newest first
        assert newest["deleted_records"].value == 0 and first["deleted_records"].value > 0

    # records lost some other way (an UPDATE/DELETE of another key: not a privacy request)
    other_key = next(k for k, _ in ingested if k != canonical_key(erased_key))
    prune, mask = cdc_key_filter([__import__("json").loads(other_key)])
    assert delete_where(catalog, "cdc.orders", prune, mask).deleted_records > 0
    lost = len(ingested) - len(hour_rows(catalog, hour))
    assert lost > 0

    # materializing cdc_orders partition H = replay of H from the source: the hour is whole again, except for
    # the erased key, which the request keeps out of every replay
    replay_job = defs.resolve_implicit_global_asset_job_def()
    result = replay_job.execute_in_process(instance=instance, partition_key=key, asset_selection=[CDC])
    assert result.success
    assert hour_rows(catalog, hour) == ingested
    (event,) = [e for e in result.get_asset_materialization_events()]
    meta = event.materialization.metadata
    assert event.materialization.partition == key
    assert meta["replay_records"].value == len(ingested) and meta["added_records"].value == lost
    # the partition shows the hour's totals: every record it received, the replay's restored ones (late) included
    assert meta["records"].value == len(erased) + lost  # what it received (the erased key's too: counts, no keys)
    assert meta["removed_records"].value == 0 and meta["replaced_records"].value == len(ingested) - lost
    for name in ("event_time_min", "event_time_p50", "event_time_p99", "event_time_max", "watermark", "finalized",
                 "finalization_lag_seconds", "finalized_at", "late_records", "snapshot_id", "job_id"):
        assert name in meta, name
    assert meta["finalized"].value is True and meta["late_records"].value >= lost
    snapshot = catalog.load_table("cdc.orders").current_snapshot()
    assert snapshot.summary.additional_properties["partfin.job-kind"] == JobKind.OVERWRITE.value
    assert watermark_of(catalog.load_table("cdc.orders").properties) == watermark  # a replay never moves it

    # several hours (what a backfill runs: one run per partition), an open hour too: a replay reads only what the
    # writer committed, so it reproduces each hour as it is and the writer never appends a record twice
    for other in ("2026-01-01-00:00", "2026-01-01-02:00", "2026-01-01-05:00"):
        before = hour_rows(catalog, hour_from_key(other))
        assert replay_job.execute_in_process(instance=instance, partition_key=other, asset_selection=[CDC]).success
        assert hour_rows(catalog, hour_from_key(other)) == before

    # the next sync run's upsert counts no replayed or deleted records as new
    assert defs.resolve_job_def("sync_orders").execute_in_process(instance=instance).success


def test_compaction_loses_a_race_once_and_succeeds_on_its_second_attempt(synced, monkeypatch):
    defs, instance, catalog = synced
    before = catalog.load_table("cdc.orders").scan().to_arrow().num_rows
    watermark = watermark_of(catalog.load_table("cdc.orders").properties)
    files_before = files_per_partition(catalog, "cdc.orders")
    assert max(files_before.values()) > 2
    raced: list[str] = []
    real_compact = compaction_core.compact

    def append_into_target(job: Job) -> None:
        """Commits 3 rows into a partition the compaction is about to rewrite (once)."""
        if raced or job.identifier != "cdc.orders":
            return
        partition = sorted(job.partitions)[0]
        raced.append(partition)
        with Job.start(catalog, "cdc.orders", JobKind.INTO) as writer:
            rows = read_files(writer.table, live_files(writer.table, None, [partition])[partition]).slice(0, 3)
            rows = rows.set_column(rows.schema.get_field_index("source_seq"), "source_seq", pc.add(rows.column("source_seq"), 10**12))
            commit_append(writer, writer.write(rows))

    def compact_with_race(*args, **kwargs):
        return real_compact(*args, before_commit=append_into_target, **kwargs)

    monkeypatch.setattr(compaction_core, "compact", compact_with_race)
    result = defs.resolve_job_def("compact_orders").execute_in_process(instance=instance)
    assert result.success and raced
    assert len(step_events(result, "compact_cdc_orders", DagsterEventType.STEP_UP_FOR_RETRY)) == 1
    assert len(step_events(result, "compact_cdc_orders", DagsterEventType.STEP_RESTARTED)) == 1
    # the second attempt read a fresh snapshot: the raced rows are there and compacted too
    table = catalog.load_table("cdc.orders")
    assert table.scan().to_arrow().num_rows == before + 3
    after = files_per_partition(catalog, "cdc.orders")
    for partition, count in after.items():
        hour = hour_from_key(partition.split("=")[1] + ":00")
        if is_finalized(hour, watermark):
            assert count == 1, (partition, count)
    (cdc_obs,) = [m for m in observations(instance, CDC) if "compaction" in m]
    assert cdc_obs["attempt"].value == 2
    assert cdc_obs["files_before"].value > cdc_obs["files_after"].value
    summary = table.current_snapshot().summary.additional_properties
    assert summary["partfin.job-kind"] == JobKind.MERGE.value
    assert any("compaction" in m for m in observations(instance, BASE))

    # other errors fail at once, without a retry
    def broken(*args, **kwargs):
        raise ValueError("not a conflict")

    monkeypatch.setattr(compaction_core, "compact", broken)
    failed = defs.resolve_job_def("compact_orders").execute_in_process(instance=instance, raise_on_error=False)
    assert not failed.success
    assert not step_events(failed, "compact_cdc_orders", DagsterEventType.STEP_UP_FOR_RETRY)


def test_conflict_retries_are_bounded(synced, monkeypatch):
    defs, instance, catalog = synced
    real_compact = compaction_core.compact

    def always_lose(job: Job) -> None:
        if job.identifier == "cdc.orders":
            partition = sorted(job.partitions)[0]
            with Job.start(catalog, "cdc.orders", JobKind.INTO) as writer:
                rows = read_files(writer.table, live_files(writer.table, None, [partition])[partition][:1]).slice(0, 1)
                commit_append(writer, writer.write(rows))

    monkeypatch.setattr(compaction_core, "compact", lambda *a, **k: real_compact(*a, before_commit=always_lose, **k))
    result = defs.resolve_job_def("compact_orders").execute_in_process(instance=instance, raise_on_error=False)
    assert not result.success
    assert len(step_events(result, "compact_cdc_orders", DagsterEventType.STEP_UP_FOR_RETRY)) == 3
    (failure,) = step_events(result, "compact_cdc_orders", DagsterEventType.STEP_FAILURE)
    error = failure.event_specific_data.error
    assert (error.cause or error).cls_name == "CommitConflictError"  # 4 attempts in all, then the conflict itself


def test_maintenance_expires_snapshots_and_removes_orphans(synced):
    defs, instance, catalog = synced
    rows = catalog.load_table("cdc.orders").scan().to_arrow().num_rows
    assert defs.resolve_job_def("compact_orders").execute_in_process(instance=instance).success
    # a file no snapshot references (what a crashed writer leaves behind), two days old
    location = catalog.load_table("cdc.orders").metadata.location
    stray = Path(location.removeprefix("file://")) / "data" / "stray-crashed-writer.parquet"
    stray.write_bytes(b"PAR1")
    os.utime(stray, (time.time() - 2 * 86400, time.time() - 2 * 86400))
    young = stray.with_name("young.parquet")
    young.write_bytes(b"PAR1")
    config = {"keep_last": 1, "orphan_min_age_seconds": 3600}
    result = defs.resolve_job_def("maintain_orders").execute_in_process(
        instance=instance, run_config=RunConfig(ops={"expire_snapshots_orders": {"config": config}, "remove_orphans_orders": {"config": config}})
    )
    assert result.success
    obs = observations(instance, CDC)
    expired = [m for m in obs if "snapshots_expired" in m and str(m["iceberg_table"].value) == "cdc.orders"]
    orphans = [m for m in obs if "orphan_files" in m and str(m["iceberg_table"].value) == "cdc.orders"]
    assert expired[0]["snapshots_expired"].value > 0
    assert orphans[0]["orphan_files"].value >= 1 and orphans[0]["too_young"].value >= 1
    assert not stray.exists() and young.exists()  # the safety age keeps files a running job may still commit
    assert catalog.load_table("cdc.orders").scan().to_arrow().num_rows == rows
    assert {str(m["iceberg_table"].value) for m in observations(instance, BASE) if "orphan_files" in m} == {"base.orders"}
    # and the tables partfin keeps beside cdc.orders: its late-data ledger and rejected lines
    for kind in ("snapshots_expired", "orphan_files"):
        assert {str(m["iceberg_table"].value) for m in obs if kind in m} == {"cdc.orders", "cdc.orders__ledger", "cdc.orders__rejected"}


@pytest.mark.timeout(720)  # above the 600 s the backfill may take on a loaded machine, so its own timeout names it
def test_replay_backfill_runs_one_partition_per_run_one_at_a_time(tmp_path):
    """A backfill of cdc_orders over 3 hours, run by a real dagster-daemon with the repo's dagster.yaml:
    one run per partition, each a replay that leaves the hour as the source has it, never two at once
    (pool partfin_cdc_orders, limit 1)."""
    from dagster._core.execution.backfill import BulkActionStatus, PartitionBackfill
    from dagster._core.utils import make_new_backfill_id

    from partfin_assets.defs import build_definitions
    from partfin_assets.defs.tables import PartfinTable
    from partfin_assets.ingest.writer import CdcWriter
    from partfin_assets.sources.registry import make_source
    from partfin_assets.testing import dagster_processes

    home, dagster_home = tmp_path / "partfin", tmp_path / "dagster"
    env = dagster_processes.dagster_env(
        home, dagster_home, PARTFIN_SENSORS="", PARTFIN_SCHEDULES="", PARTFIN_SOURCE=STREAM,
        PARTFIN_PARTITIONS_START="2026-01-01-00:00",
    )
    table = PartfinTable(spec=dataclasses.replace(ORDERS_SPEC, watermark_policy="percentile:0.05:last:2"), source=STREAM)
    catalog = load_partfin_catalog(home)
    writer = CdcWriter(catalog, table.spec)
    try:
        for _ in writer.run(make_source(STREAM, table.spec), max_records=2000):
            pass
    finally:
        writer.close()
    keys = ["2026-01-01-00:00", "2026-01-01-01:00", "2026-01-01-02:00"]
    before = {k: hour_rows(catalog, hour_from_key(k)) for k in keys}

    instance = DagsterInstance.from_config(str(dagster_home))
    asset_graph = build_definitions([table]).get_repository_def().asset_graph
    backfill = PartitionBackfill.from_asset_partitions(
        backfill_id=make_new_backfill_id(), asset_graph=asset_graph, partition_names=keys, asset_selection=[CDC],
        backfill_timestamp=time.time(), tags={}, dynamic_partitions_store=instance, all_partitions=False,
        title="replay three hours", description=None, run_config=None,
    )
    instance.add_backfill(backfill)
    proc = dagster_processes.daemon(env, tmp_path / "daemon.log").start()
    try:
        dagster_processes.wait_for(
            lambda: instance.get_backfill(backfill.backfill_id).status != BulkActionStatus.REQUESTED, 600,  # 3 runs: minutes on a loaded machine
            "the backfill to finish", on_timeout=proc.log_tail,
        )
    finally:
        proc.stop()
    assert instance.get_backfill(backfill.backfill_id).status == BulkActionStatus.COMPLETED_SUCCESS
    runs = instance.get_runs()
    assert sorted(r.tags["dagster/partition"] for r in runs) == keys and all(r.status.value == "SUCCESS" for r in runs)
    spans = []  # the replay step of each run: never two at once
    for run in runs:
        (start,) = [e.timestamp for e in instance.all_logs(run.run_id, of_type=DagsterEventType.STEP_START) if e.step_key == "cdc_and_base_orders"]
        (end,) = [e.timestamp for e in instance.all_logs(run.run_id, of_type=DagsterEventType.STEP_SUCCESS) if e.step_key == "cdc_and_base_orders"]
        spans.append((start, end))
    spans.sort()
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:])), spans
    for key in keys:
        assert hour_rows(catalog, hour_from_key(key)) == before[key]
    replays = [r.event_log_entry.asset_materialization for r in
               instance.fetch_materializations(AssetRecordsFilter(asset_key=CDC), limit=100).records]
    assert sorted(m.partition for m in replays) == keys
    assert all(m.metadata["added_records"].value == 0 and m.metadata["removed_records"].value == 0 for m in replays)
    instance.dispose()
