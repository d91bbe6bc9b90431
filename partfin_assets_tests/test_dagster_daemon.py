"""Exactly once per finalized hour, against a real Dagster instance and `dagster-daemon`.

The test drives the stream itself (CDC writer + upsert in this process, sync sensor off),
runs the daemon, stops it mid-way while more hours finalize, restarts it, and checks:
one successful downstream run per finalized hour, none for unfinalized hours, one
`finalized_orders` event per finalized hour, and a run that failed once was retried
(bounded, via run retries in dagster.yaml) without ever duplicating a success, reading the
same base snapshot. Late records that reached an hour already final give an amendment event
and one re-run of that hour, reading the snapshot the amendment names.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from dagster import AssetKey, AssetRecordsFilter, DagsterInstance, DagsterRunStatus, RunsFilter

from partfin_assets.defs.tables import TABLES
from partfin_assets.finalization.hours import hour_from_key, hour_key, newly_finalized
from partfin_assets.finalization.read_points import AMENDMENT_TAG, BASE_SNAPSHOT_TAG, REASON_TAG, RUN_FOR_TAG
from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.history import watermark_of
from partfin_assets.iceberg.tables import ensure_base_table
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.jobs.upsert import run_upsert
from partfin_assets.model.timeutil import iso_z, to_us
from partfin_assets.sources.synthetic import SyntheticSource
from partfin_assets.testing import dagster_processes

pytestmark = pytest.mark.timeout(420)

START = datetime(2026, 1, 1, tzinfo=UTC)
DOWNSTREAM = {"partfin/downstream": "orders"}  # the finalization sensor's runs: runs of the downstream asset
FINALIZED = AssetKey("finalized_orders")
FAIL_ONCE_HOUR = "2026-01-01-01:00"
IN_FLIGHT = {DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED}


def stream_until(home, end: datetime, late_fraction: float = 0.002) -> int:
    """Ingest the synthetic stream up to `end` and merge it into base; return the base watermark."""
    spec = TABLES[0].spec
    catalog = load_partfin_catalog(home)
    source = SyntheticSource(seed=11, rate=0.3, start=START, end=end, late_fraction=late_fraction, idle_every=None)
    writer = CdcWriter(catalog, spec, writer_id="test-stream")
    try:
        for _ in writer.run(source, max_records=500):
            pass
    finally:
        writer.close()
    ensure_base_table(catalog, spec)
    run_upsert(catalog, spec.name)
    return watermark_of(catalog.load_table(f"base.{spec.name}").properties)


def downstream_runs(instance):
    return instance.get_runs(filters=RunsFilter(tags=DOWNSTREAM))


def settled(instance, expected: list[str]):
    runs = downstream_runs(instance)
    if any(r.status in IN_FLIGHT for r in runs):
        return False
    succeeded = {r.tags.get("dagster/partition") for r in runs if r.status == DagsterRunStatus.SUCCESS}
    return set(expected) <= succeeded


def finalize_ticks(instance) -> int:
    for state in instance.all_instigator_state():
        if state.instigator_name == "finalize_orders_sensor":
            return len(instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=10_000))
    return 0


def run_daemon_until_settled(instance, env, log, expected: list[str], more_ticks: bool = True) -> None:
    """Run dagster-daemon until every expected hour ran (then, with `more_ticks`, three more finalization ticks: nothing
    new may be requested, and until the runs settled); stop it."""
    proc = dagster_processes.daemon(env, log).start()
    try:
        dagster_processes.wait_for(lambda: settled(instance, expected), 240, f"runs of {expected}", on_timeout=proc.log_tail)
        if not more_ticks:
            return
        ticks = finalize_ticks(instance)
        dagster_processes.wait_for(lambda: finalize_ticks(instance) >= ticks + 3, 60, "three more sensor ticks", on_timeout=proc.log_tail)
        dagster_processes.wait_for(lambda: settled(instance, expected), 60, "runs to settle")
    finally:
        proc.stop()


def test_exactly_once_across_daemon_restart(tmp_path):
    home, dagster_home = tmp_path / "partfin", tmp_path / "dagster"
    env = dagster_processes.dagster_env(
        home, dagster_home,
        PARTFIN_SENSORS="finalize",  # the test drives the stream; only the finalization sensor runs
        PARTFIN_FINALIZE_INTERVAL="3",
        PARTFIN_PARTITIONS_START="2026-01-01-00:00",
        PARTFIN_FAIL_ONCE=f"orders:{FAIL_ONCE_HOUR}",
    )
    first_w = stream_until(home, START + timedelta(hours=4))
    phase1 = [hour_key(h) for h in newly_finalized(to_us(START), first_w)]
    assert FAIL_ONCE_HOUR in phase1, f"watermark {iso_z(first_w)} too low for the test"

    instance = DagsterInstance.from_config(str(dagster_home))
    run_daemon_until_settled(instance, env, tmp_path / "daemon-1.log", phase1, more_ticks=False)

    # the daemon is down while more hours finalize
    second_w = stream_until(home, START + timedelta(hours=9))
    expected = [hour_key(h) for h in newly_finalized(to_us(START), second_w)]
    assert len(expected) >= len(phase1) + 2, f"{iso_z(first_w)} -> {iso_z(second_w)}"
    assert not settled(instance, expected)

    run_daemon_until_settled(instance, env, tmp_path / "daemon-2.log", expected)

    all_runs = downstream_runs(instance)
    by_status = Counter((r.tags.get("dagster/partition"), r.status) for r in all_runs)
    # re-runs for late data that reached an hour after it was final (the stream has some) are amendments
    runs = [r for r in all_runs if r.tags.get(AMENDMENT_TAG) != "true"]
    amendment_runs = [r for r in all_runs if r.tags.get(AMENDMENT_TAG) == "true"]
    successes = Counter(r.tags.get("dagster/partition") for r in runs if r.status == DagsterRunStatus.SUCCESS)
    assert successes == Counter({key: 1 for key in expected}), by_status
    assert {r.tags.get("dagster/partition") for r in all_runs} == set(expected)  # nothing for unfinalized hours
    # hour order of the requests
    first_runs = sorted((r for r in runs if "dagster/parent_run_id" not in r.tags), key=lambda r: instance.get_run_record_by_id(r.run_id).create_timestamp)
    assert [r.tags["dagster/partition"] for r in first_runs] == expected
    # every downstream run is a run of the named job, saying which event of the hour it is for and why
    assert {r.job_name for r in all_runs} == {"activity_orders_job"}
    assert {r.tags[RUN_FOR_TAG] for r in runs} == {"finalization"} and all("became final" in r.tags[REASON_TAG] for r in runs)
    assert all(r.tags[RUN_FOR_TAG] == "amendment" and r.tags[REASON_TAG].startswith("late data: ") for r in amendment_runs)
    # the injected failure was retried once by the daemon, with the same partition and the same base snapshot
    failed = [r for r in all_runs if r.status == DagsterRunStatus.FAILURE]
    assert [r.tags["dagster/partition"] for r in failed] == [FAIL_ONCE_HOUR]
    retry = [r for r in all_runs if r.tags.get("dagster/parent_run_id") == failed[0].run_id]
    assert len(retry) == 1 and retry[0].status == DagsterRunStatus.SUCCESS
    assert retry[0].tags[BASE_SNAPSHOT_TAG] == failed[0].tags[BASE_SNAPSHOT_TAG]
    # the runless finalization event: once per finalized hour, in hour order, naming the snapshot its run read
    records = instance.fetch_materializations(AssetRecordsFilter(asset_key=FINALIZED), limit=10_000, ascending=True).records
    events = [(r.partition_key, {k: v.value for k, v in r.event_log_entry.asset_materialization.metadata.items()}) for r in records]
    finalizations = [(key, meta) for key, meta in events if not meta["amendment"]]
    assert [key for key, _ in finalizations] == expected
    read = {(r.tags["dagster/partition"], r.tags[BASE_SNAPSHOT_TAG]) for r in first_runs}
    assert read == {(key, str(meta["base_snapshot_id"])) for key, meta in finalizations}
    # each amendment (late records for an hour final before the daemon stopped): one successful re-run reading its snapshot
    amendments = [(key, meta) for key, meta in events if meta["amendment"]]
    print(f"{len(amendments)} amendment(s): {[(key, meta['late_records']) for key, meta in amendments]}")
    assert all(key in phase1 and meta["late_records"] > 0 for key, meta in amendments)
    assert sorted((r.tags["dagster/partition"], r.tags[BASE_SNAPSHOT_TAG]) for r in amendment_runs if r.status == DagsterRunStatus.SUCCESS) \
        == sorted((key, str(meta["base_snapshot_id"])) for key, meta in amendments)
    # every finalization and amendment is also an Iceberg tag on base.orders at its event's snapshot (engines outside Dagster)
    refs = load_partfin_catalog(home).load_table("base.orders").metadata.refs
    tagged = sorted((name, ref.snapshot_id) for name, ref in refs.items() if name.startswith("finalized-"))
    numbered = {key: 0 for key, _ in events}
    wanted = []
    for key, meta in events:
        name = "finalized-" + key.replace(":00", "") + (f"-amend-{numbered[key]}" if numbered[key] else "")
        numbered[key] += 1
        wanted.append((name, int(meta["base_snapshot_id"])))  # text in the metadata: exact
    assert tagged == sorted(wanted)
    instance.dispose()


# the keys the release before flat `<layer>_<table>` keys recorded its events under
PREVIOUS_KEYS = {AssetKey("finalized_orders"): AssetKey(["finalized", "orders"]),
                 AssetKey("activity_orders_hourly"): AssetKey(["activity", "orders_hourly"])}


def as_the_previous_release_left_it(dagster_home) -> None:
    """Rewrite the instance's storage (SQLite, the daemon stopped) so each event of a flat key names the key the
    previous release recorded it under, as that release left it: the events, their index, the asset rows and the check
    executions (Dagster has no way to rename a key; the sensor's cursor and its runs' run keys are named by sensor)."""
    renames = {json.dumps(key.path): json.dumps(previous.path) for key, previous in PREVIOUS_KEYS.items()}
    for path in sorted(Path(dagster_home).rglob("*.db")):
        with closing(sqlite3.connect(path)) as db, db:
            for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
                columns = [row[1] for row in db.execute(f"PRAGMA table_info({table})") if row[2].upper() in ("TEXT", "VARCHAR", "")]
                for column in columns:
                    for new, old in renames.items():
                        db.execute(f"UPDATE {table} SET {column} = replace({column}, ?, ?) WHERE instr({column}, ?) > 0",
                                   (new, old, new))


def test_an_instance_upgraded_from_the_previous_keys_runs_no_hour_again(tmp_path):
    from partfin_assets.defs.checks.watermark_checks import downstream_runs as downstream_runs_of
    from partfin_assets.defs.finalization.sensor import newest_finalization_event

    home, dagster_home = tmp_path / "partfin", tmp_path / "dagster"
    env = dagster_processes.dagster_env(home, dagster_home, PARTFIN_SENSORS="finalize", PARTFIN_FINALIZE_INTERVAL="3",
                                        PARTFIN_PARTITIONS_START="2026-01-01-00:00")
    before = [hour_key(h) for h in newly_finalized(to_us(START), stream_until(home, START + timedelta(hours=3), late_fraction=0))]
    assert before
    instance = DagsterInstance.from_config(str(dagster_home))
    run_daemon_until_settled(instance, env, tmp_path / "daemon-1.log", before, more_ticks=False)
    instance.dispose()
    as_the_previous_release_left_it(dagster_home)
    instance = DagsterInstance.from_config(str(dagster_home))
    for key, previous in PREVIOUS_KEYS.items():
        assert not instance.fetch_materializations(AssetRecordsFilter(asset_key=key), limit=1).records, key
        assert instance.fetch_materializations(AssetRecordsFilter(asset_key=previous), limit=1).records, previous

    # the upgrade: the same instance, more hours final, the daemon with the flat keys (no late data: the old hours get
    # no event under the new keys, so only what the previous release recorded can say they were finalized and run)
    expected = [hour_key(h) for h in newly_finalized(to_us(START), stream_until(home, START + timedelta(hours=6), late_fraction=0))]
    assert len(expected) > len(before)
    run_daemon_until_settled(instance, env, tmp_path / "daemon-2.log", expected)

    runs = [r for r in downstream_runs(instance) if r.tags.get(AMENDMENT_TAG) != "true"]
    successes = Counter(r.tags.get("dagster/partition") for r in runs if r.status == DagsterRunStatus.SUCCESS)
    assert successes == Counter({key: 1 for key in expected})  # no hour finalized before the upgrade ran again
    records = instance.fetch_materializations(AssetRecordsFilter(asset_key=FINALIZED), limit=10_000, ascending=True).records
    finalized_after = [r.partition_key for r in records if not r.event_log_entry.asset_materialization.metadata["amendment"].value]
    assert finalized_after == [key for key in expected if key not in before]
    # what the previous release recorded still counts: the finalization a run of an old hour by hand reads, and the
    # downstream run the late-data checks compare late records with
    assert all(newest_finalization_event(instance, TABLES[0], key) is not None for key in before)
    ran = downstream_runs_of(instance, TABLES[0])([hour_from_key(key) for key in expected])
    assert sorted(hour_key(h) for h in ran) == expected
    instance.dispose()
