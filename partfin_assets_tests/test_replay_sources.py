"""Replays reproduce, never invent: what a replay of hour H reads, and what it may remove.

Each test is a scenario as an operator meets it: `partfin ingest` as a real process, then a replay
of the hour as Dagster runs it (a materialization of partition H of `cdc_<table>`).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from collections import Counter

import numpy as np
import pyarrow.compute as pc
import pytest
from dagster import AssetKey, DagsterEventType, DagsterInstance, RunConfig

from partfin_assets.finalization.hours import hour_key
from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.expiry import Retention
from partfin_assets.iceberg.history import watermark_of
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.jobs.job import Job
from partfin_assets.jobs.replay import replay_hour
from partfin_assets.model.summary_keys import JobKind
from partfin_assets.model.timeutil import US_PER_HOUR, floor_hour_us, iso_z
from partfin_assets.sources.synthetic import ORDERS_SPEC
from partfin_assets.testing import dagster_processes
from partfin_assets_tests.conftest import HOUR_US, MINUTE_US, ORDERS, T0_US, change_batch
from partfin_assets_tests.scenario_helpers import append_lines, change, hour_of_changes, ms, partfin

CDC = AssetKey("cdc_orders")
FILE_SPEC = dataclasses.replace(ORDERS_SPEC, watermark_policy="min-of-last:2")
HOURS = ["2026-11-01T00:00:00Z", "2026-11-01T01:00:00Z", "2026-11-01T02:00:00Z", "2026-11-01T03:00:00Z"]
H0_KEY = "2026-11-01-00:00"


def hour_rows(catalog, hour_us: int) -> list[tuple[str, int]]:
    """(key, source_seq) of every record of the hour in cdc.orders, duplicates kept."""
    rows = catalog.load_table("cdc.orders").scan().to_arrow()
    times = pc.cast(rows.column("event_time"), "int64")
    rows = rows.filter(pc.and_(pc.greater_equal(times, hour_us), pc.less(times, hour_us + US_PER_HOUR)))
    return sorted(zip(rows.column("key").to_pylist(), rows.column("source_seq").to_pylist()))


def replay_in_dagster(defs, instance, partition_key: str, *, force: bool = False):
    config = RunConfig(ops={"cdc_and_base_orders": {"config": {"force": True}}}) if force else None
    return defs.resolve_implicit_global_asset_job_def().execute_in_process(
        instance=instance, partition_key=partition_key, asset_selection=[CDC], run_config=config, raise_on_error=False
    )


def failure_message(result) -> str:
    (failure,) = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_FAILURE]
    data = failure.event_specific_data
    return f"{data.error.message if data.error else ''} {data.user_failure_data.description if data.user_failure_data else ''}"


def replay_figures(result) -> dict:
    (event,) = result.get_asset_materialization_events()
    meta = event.materialization.metadata
    return {name: meta[name].value for name in ("records", "replaced_records", "added_records", "removed_records")}


@pytest.fixture
def file_table(tmp_path, monkeypatch):
    """A Debezium file of four hours of `orders` inserts, ingested by `partfin ingest`; Dagster definitions over it."""
    path = tmp_path / "orders.jsonl"
    key = 1
    for hour in HOURS:
        append_lines(path, hour_of_changes(hour, range(key, key + 30), minute_step=2))
        key += 30
    home = tmp_path / "home"
    monkeypatch.setenv("PARTFIN_HOME", str(home))
    monkeypatch.delenv("PARTFIN_SOURCE", raising=False)
    monkeypatch.setenv("PARTFIN_PARTITIONS_START", "2026-11-01-00:00")
    monkeypatch.setenv("PARTFIN_MAX_RECORDS", "10")
    ingest = partfin(home, "ingest", "--table", "orders", "--source", f"debezium:{path}", "--primary-key", "id",
                     "--checkpoint-records", "10")
    assert ingest.returncode == 0, ingest.stderr
    from partfin_assets.defs import build_definitions
    from partfin_assets.defs.tables import PartfinTable

    defs = build_definitions([PartfinTable(spec=FILE_SPEC, source=f"debezium:{path}")])
    catalog = load_partfin_catalog(home)
    assert watermark_of(catalog.load_table("cdc.orders").properties) >= T0_US + 3 * HOUR_US  # H0..H2 final
    instance = DagsterInstance.ephemeral()
    yield path, home, defs, instance, catalog
    instance.dispose()


@pytest.mark.timeout(300)
def test_synthetic_replay_an_hour_later_reproduces_the_hour(tmp_path):
    """`partfin ingest` of a synthetic stream now; an hour later an operator replays two finalized hours with
    `dagster asset materialize` (run under libfaketime one hour ahead). Each hour must come back as it was.
    Before: the replay regenerated the stream from a new anchor: the hour inside the window was replaced by
    unrelated records, the oldest hour (now outside the window) wiped to 0."""
    home, dagster_home = tmp_path / "home", tmp_path / "dagster"
    spec = "synthetic:hours=3,rate=1,idle_every=off,late_fraction=0,seed=5"
    ingest = partfin(home, "ingest", "--table", "orders", "--source", spec, "--checkpoint-records", "500")
    assert ingest.returncode == 0, ingest.stderr
    catalog = load_partfin_catalog(home)
    times = pc.cast(catalog.load_table("cdc.orders").scan(selected_fields=("event_time",)).to_arrow().column("event_time"), "int64")
    oldest = floor_hour_us(pc.min(times).as_py())  # the stream's anchor hour
    inside = oldest + US_PER_HOUR
    watermark = watermark_of(catalog.load_table("cdc.orders").properties)
    assert watermark >= inside + US_PER_HOUR, "both hours must be final"
    before = {hour: hour_rows(catalog, hour) for hour in (oldest, inside)}
    assert all(before.values())

    env = dagster_processes.dagster_env(home, dagster_home, PARTFIN_SOURCE=spec, PARTFIN_PARTITIONS_START=hour_key(oldest),
                               PARTFIN_SENSORS="", PARTFIN_SCHEDULES="")
    figures = {}
    for hour in (inside, oldest):
        replay = subprocess.run(
            ["faketime", "-f", "+1h", dagster_processes.bin_path("dagster"), "asset", "materialize", "-m", "partfin_assets.definitions",
             "--select", "cdc_orders", "--partition", hour_key(hour)],
            cwd=dagster_processes.REPO, env=env, capture_output=True, text=True, timeout=240,
        )
        assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]
        after = hour_rows(catalog, hour)
        figures[iso_z(hour)] = {"before": len(before[hour]), "after": len(after),
                                "kept": len(set(before[hour]) & set(after))}
    print("synthetic replay an hour later:", json.dumps(figures))
    for hour in (inside, oldest):
        assert hour_rows(catalog, hour) == before[hour], figures


def test_replay_reads_only_what_the_writer_committed(file_table):
    """Late lines for H0 were appended to the file but not ingested yet. A replay of H0 must not take them
    (the writer will): before, the replay added them and the writer's next run added them again (doubled)."""
    path, home, defs, instance, catalog = file_table
    before = hour_rows(catalog, T0_US)
    append_lines(path, [change("c", 1000 + i, ms(HOURS[0]) + 59 * 60_000 + i) for i in range(5)])  # late, not ingested
    result = replay_in_dagster(defs, instance, H0_KEY)
    assert result.success, failure_message(result)
    figures = replay_figures(result)
    ingest = partfin(home, "ingest", "--table", "orders", "--source", f"debezium:{path}", "--checkpoint-records", "10")
    assert ingest.returncode == 0, ingest.stderr
    after = hour_rows(catalog, T0_US)
    doubled = sum(n - 1 for n in Counter(after).values() if n > 1)
    print(f"replay of H0 past the writer's position: {figures}; after the writer's next run {len(after)} records, {doubled} doubled")
    assert figures["added_records"] == 0 and figures["removed_records"] == 0
    assert doubled == 0 and len(after) == len(before) + 5


def test_replay_racing_the_writer_keeps_the_late_records(file_table, monkeypatch):
    """While a replay of H0 runs (it has read the source, not committed yet), late lines for H0 arrive and
    `partfin ingest` commits them. The replay must not remove them (before: it replaced H0 by what it had read,
    and the writer, already past those lines, never re-read them: lost for good)."""
    path, home, defs, instance, catalog = file_table
    before = hour_rows(catalog, T0_US)
    late = [change("c", 2000 + i, ms(HOURS[0]) + 58 * 60_000 + i) for i in range(5)]

    def writer_commits_late_records(job):
        append_lines(path, late)
        ingest = partfin(home, "ingest", "--table", "orders", "--source", f"debezium:{path}", "--checkpoint-records", "10")
        assert ingest.returncode == 0, ingest.stderr
        assert len(hour_rows(catalog, T0_US)) == len(before) + 5

    original = Job.start.__func__

    def start_with_race(cls, catalog_, identifier, kind, **kwargs):
        job = original(cls, catalog_, identifier, kind, **kwargs)
        if JobKind(kind) == JobKind.OVERWRITE:
            job.before_commit.append(writer_commits_late_records)  # after the replay read the source
        return job

    monkeypatch.setattr(Job, "start", classmethod(start_with_race))
    result = replay_in_dagster(defs, instance, H0_KEY)
    after = hour_rows(catalog, T0_US)
    again = partfin(home, "ingest", "--table", "orders", "--source", f"debezium:{path}", "--checkpoint-records", "10")
    assert again.returncode == 0, again.stderr
    final = hour_rows(catalog, T0_US)
    print(f"replay racing the writer: H0 {len(before)} + 5 late -> {len(after)} after the replay "
          f"(success={result.success}), {len(final)} after the writer's next run")
    assert len(final) == len(before) + 5 and Counter(final) == Counter(before + [(r, s) for r, s in final if (r, s) not in before])


def test_replay_of_a_changed_file_is_refused(file_table):
    """The file at the source path is no longer the one the writer read (replaced by another export).
    Before: the replay read the new file and replaced H0 by its records (fabricated)."""
    path, home, defs, instance, catalog = file_table
    before = hour_rows(catalog, T0_US)
    path.rename(path.with_suffix(".old"))
    append_lines(path, hour_of_changes(HOURS[0], range(500, 540), minute_step=1.5))
    result = replay_in_dagster(defs, instance, H0_KEY)
    after = hour_rows(catalog, T0_US)
    print(f"replay of H0 from a replaced file: {len(before)} records before, {len(after)} after "
          f"({len(set(before) & set(after))} kept); success={result.success}")
    assert not result.success
    print(f"refused: {failure_message(result)}")
    assert str(path) in failure_message(result)
    assert after == before


def test_overwrite_removing_far_more_than_it_adds_needs_force(catalog):
    """replay_hour (the OVERWRITE job) given only 5 of an hour's 100 records refuses unless forced."""
    writer = CdcWriter(catalog, ORDERS, retention=Retention(keep_last=1000))
    for i in range(5):
        writer.write_checkpoint(change_batch(T0_US + np.arange(20) * MINUTE_US // 2 + i * 10 * MINUTE_US, offset=f"a{i}", seq_start=i * 20))
    for h in range(1, 4):
        writer.write_checkpoint(change_batch(T0_US + h * HOUR_US + np.arange(10) * MINUTE_US, offset=f"b{h}", seq_start=1000 + h * 10))
    writer.close()
    rows = catalog.load_table("cdc.orders").scan().to_arrow()
    some = rows.filter(pc.less(rows.column("source_seq"), 5))
    with pytest.raises(Exception, match="force") as refused:
        replay_hour(catalog, "orders", T0_US, some)
    print(f"replay keeping 5 of 100 records: {refused.value}")
    assert len(hour_rows(catalog, T0_US)) == 100
    forced = replay_hour(catalog, "orders", T0_US, some, force=True)
    assert (forced.removed_records, forced.added_records) == (95, 0) and len(hour_rows(catalog, T0_US)) == 5
