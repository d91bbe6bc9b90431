"""The late-data ledger (cdc.<table>__ledger, iceberg/ledger.py): every checkpoint exactly once, whatever crashes.

`partfin ingest` processes are killed (SIGKILL) right after a CDC commit, before its ledger row
is written; snapshot expiry, the next writer start and compaction must still leave the ledger
with each checkpoint once, the same per-hour counts as the table, and digests a `tdigest` user
can read.
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from tdigest import TDigest as OracleDigest

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.expiry import Retention
from partfin_assets.iceberg.ledger import hour_totals, read_ledger, reconcile
from partfin_assets.iceberg.streams import writer_position
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.jobs.compaction import compact
from partfin_assets.jobs.maintenance import expire_table_snapshots
from partfin_assets.model.timeutil import US_PER_HOUR
from partfin_assets_tests.cdc_files import HOUR_MS, event_hours_of_table, orders_lines, partfin, stream_of, write_lines
from partfin_assets_tests.conftest import HOUR_US, ORDERS, T0_US, change_batch

pytestmark = pytest.mark.timeout(600)

START_MS = 1_795_000_000_000 // HOUR_MS * HOUR_MS


def _ingest(home, path, crash_at: str | None = None):
    extra = {"PARTFIN_CRASH_AT": crash_at} if crash_at else {}
    return partfin(home, "ingest", "--table", "orders", "--source", f"debezium:{path}", "--primary-key", "id",
                   "--checkpoint-records", "200", **extra)


def _checkpoints(frame) -> set:
    """The (stream, checkpoint) pairs of ledger rows, each row (stream, checkpoint, hour) once at most."""
    rows = Counter(zip(frame["stream"].to_list(), frame["checkpoint_id"].to_list(), frame["hour"].to_list()))
    assert not rows or max(rows.values()) == 1, [k for k, n in rows.items() if n > 1]
    return {(stream, checkpoint) for stream, checkpoint, _ in rows}


def test_checkpoints_reach_the_ledger_once_through_crashes_expiry_and_compaction(tmp_path):
    home = tmp_path / "home"
    path = tmp_path / "orders.jsonl"
    events, arrivals = stream_of(START_MS, START_MS + 6 * HOUR_MS, 7_000, seed=3)
    write_lines(path, orders_lines(events, arrivals, seed=3))

    # killed right after the commit of checkpoint 25, before its ledger row: expiry must record it first
    crashed = _ingest(home, path, "after-commit:25")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    catalog = load_partfin_catalog(home)
    recorded = _checkpoints(read_ledger(catalog, "cdc.orders"))
    assert ("orders-writer", 25) not in recorded  # (and the rows the writer held back to batch its ledger commits)
    expire_table_snapshots(catalog, "cdc.orders", Retention(keep_last=2))
    cdc = catalog.load_table("cdc.orders")
    retained = {int(s.summary.additional_properties["partfin.checkpoint-id"]) for s in cdc.metadata.snapshots}
    assert len(retained) < 25  # most of the crashed run's checkpoints are gone from the CDC metadata ...
    recorded = _checkpoints(read_ledger(catalog, "cdc.orders"))
    assert recorded >= {("orders-writer", i) for i in range(1, 26) if i not in retained}  # ... not from the ledger

    # killed again; the next writer start records what the crashed run did not
    assert _ingest(home, path, "after-commit:3").returncode == -signal.SIGKILL
    finished = _ingest(home, path)
    assert finished.returncode == 0, finished.stderr

    cdc = catalog.load_table("cdc.orders")
    last = writer_position(cdc.metadata, "orders-writer").checkpoint_id
    ledger = read_ledger(catalog, "cdc.orders")
    assert _checkpoints(ledger) == {("orders-writer", i) for i in range(1, last + 1)}  # each once, none missing
    totals = hour_totals(ledger)
    by_hour = dict(zip((int(h.timestamp()) // 3600 for h in totals["hour"].to_list()), totals["records"].to_list()))
    assert by_hour == dict(event_hours_of_table(cdc))
    assert ledger["records"].sum() == 7_000

    # what a `tdigest` user reads back: per hour, merged over checkpoints, against the exact values
    event_ms, arrival_ms = np.array(events), np.array(arrivals)
    hour_us = int(totals["hour"].to_list()[2].timestamp()) * 1_000_000
    in_hour = (event_ms * 1000 >= hour_us) & (event_ms * 1000 < hour_us + US_PER_HOUR)
    rows = ledger.filter(ledger["hour"].dt.epoch("us") == hour_us)
    event_digest, lateness_digest = OracleDigest(), OracleDigest()
    for event_text, lateness_text in zip(rows["event_time_digest"].to_list(), rows["lateness_digest"].to_list()):
        event_digest = event_digest + OracleDigest().update_from_dict(json.loads(event_text))
        lateness_digest = lateness_digest + OracleDigest().update_from_dict(json.loads(lateness_text))
    exact_events = np.sort(event_ms[in_hour] / 1000)
    exact_lateness = np.sort((arrival_ms[in_hour] - event_ms[in_hour]) / 1000)
    for q in (0.5, 0.9, 0.99):
        assert abs(np.searchsorted(exact_events, event_digest.percentile(q * 100)) / exact_events.size - q) < 0.02
        assert abs(np.searchsorted(exact_lateness, lateness_digest.percentile(q * 100)) / exact_lateness.size - q) < 0.02
    first = rows["arrival_min"].min()
    assert int(first.timestamp() * 1000) == int(arrival_ms[in_hour].min())

    # compaction and expiry of everything they allow leave the ledger as it was
    compact(catalog, "cdc.orders", finalized_only=False)
    expire_table_snapshots(catalog, "cdc.orders", Retention(keep_last=1))
    assert read_ledger(catalog, "cdc.orders").equals(ledger)


def test_rows_rebuilt_from_the_history_equal_the_ones_the_writer_recorded(catalog):
    writer = CdcWriter(catalog, ORDERS, retention=Retention(keep_last=50))
    try:
        for i in range(6):  # each checkpoint spans two hours; one carries late records for hour 0
            times = T0_US + i * HOUR_US // 2 + np.arange(0, 40) * 60_000_000
            writer.write_checkpoint(change_batch(times, offset=str(i), seq_start=i * 100))
        writer.write_checkpoint(change_batch(T0_US + np.arange(5) * 1_000_000, offset="late", seq_start=900))
        writer.write_checkpoint(change_batch([], offset="idle", heartbeat=_dt(T0_US + 4 * HOUR_US)))
    finally:
        writer.close()
    recorded = read_ledger(catalog, "cdc.orders")
    heartbeat = recorded.filter(recorded["checkpoint_id"] == 8)
    assert heartbeat["hour"].to_list() == [None] and heartbeat["records"].to_list() == [0]
    late = recorded.filter(recorded["checkpoint_id"] == 7)
    assert late["late_records"].to_list() == [5]  # the watermark had passed hour 0 when they came
    assert recorded["records"].sum() == 6 * 40 + 5

    catalog.drop_table("cdc.orders__ledger")
    reconcile(catalog, catalog.load_table("cdc.orders"))
    assert read_ledger(catalog, "cdc.orders").equals(recorded)


def test_reconcile_with_a_history_another_process_expired_meanwhile_reads_the_table_again(catalog, monkeypatch):
    """A writer starting (reconcile) beside another process's expiry: it read the ledger before the expiry recorded the
    checkpoints and the table's history before the expiry deleted their manifest lists (seen with three Kafka group
    members: the starting member died with FileNotFoundError). It reads the table again and records nothing twice."""
    writer = CdcWriter(catalog, ORDERS)
    for i in range(6):  # fewer than the appender's 10: none reaches the ledger before the expiry below
        writer.write_checkpoint(change_batch(T0_US + i * 60_000_000 + np.arange(10) * 1_000_000, offset=str(i), seq_start=i * 10))
    stale = catalog.load_table("cdc.orders")  # the starting writer's view
    ledger_before = catalog.load_table("cdc.orders__ledger").properties
    expire_table_snapshots(catalog, "cdc.orders", Retention(keep_last=1))  # another process: records them, then removes
    gone = [s for s in stale.metadata.snapshots if catalog.load_table("cdc.orders").metadata.snapshot_by_id(s.snapshot_id) is None]
    assert gone and not Path(gone[0].manifest_list.removeprefix("file://")).exists()

    import partfin_assets.iceberg.ledger as ledger_module
    real = ledger_module.recorded_checkpoints
    calls = []

    def read_before_the_expiry(properties):  # the interleaving: the ledger as it was when the writer read it
        calls.append(1)
        return real(ledger_before) if len(calls) == 1 else real(properties)

    monkeypatch.setattr(ledger_module, "recorded_checkpoints", read_before_the_expiry)
    reconcile(catalog, stale)
    monkeypatch.undo()
    writer.close()
    recorded = read_ledger(catalog, "cdc.orders")
    assert recorded["records"].sum() == 60 and not recorded.select("stream", "checkpoint_id", "hour").is_duplicated().any()


def test_records_without_arrival_time_take_the_commit_clock_as_arrival(catalog):
    writer = CdcWriter(catalog, ORDERS)
    try:
        batch = change_batch(T0_US + np.arange(10) * 1_000_000, offset="1")
        assert "arrival_time" not in batch.records.schema.names  # a source that knows no arrival time
        writer.write_checkpoint(batch)
    finally:
        writer.close()
    row = read_ledger(catalog, "cdc.orders").row(0, named=True)
    assert row["arrival_min"] is None and row["arrival_max"] is None
    lateness_s = sorted(c["m"] for c in json.loads(row["lateness_digest"])["centroids"])  # 10 values: one centroid each
    commit_s = row["commit_time"].timestamp()
    assert lateness_s == pytest.approx([commit_s - T0_US / 1e6 - i for i in range(9, -1, -1)], abs=2e-3)
    stored = catalog.load_table("cdc.orders").scan().to_arrow()
    assert pc.all(pc.is_null(stored.column("arrival_time"))).as_py()
    assert stored.schema.field("arrival_time").type == pa.timestamp("us", tz="UTC")


def _dt(us: int):
    from partfin_assets.model.timeutil import from_us

    return from_us(us)


def test_many_cli_checkpoints_then_expiry_status_and_checks_report_every_late_record(tmp_path, monkeypatch):
    """~130 checkpoints by `partfin ingest`, 60 late records among them, snapshots expired as the writer goes:
    `partfin status` (JSON and text), the `late_data` check and the CLI's own running count agree on 60."""
    from dagster import DagsterInstance

    from partfin_assets.defs import build_definitions
    from partfin_assets.defs.tables import PartfinTable
    from partfin_assets.model.tablespec import TableSpec

    home, path = tmp_path / "home", tmp_path / "orders.jsonl"
    seen: set[int] = set()
    write_lines(path, orders_lines(*stream_of(START_MS, START_MS + 6 * HOUR_MS, 3_000, seed=5), seed=5, seen=seen, wrapped=True))
    first = partfin(home, "ingest", "--table", "orders", "--source", f"debezium:{path}", "--primary-key", "id",
                    "--checkpoint-records", "50")
    assert first.returncode == 0, first.stderr
    # 30 late records each for hours 1 and 2 (final by now), spread among 3,000 on-time ones for hours 6 to 9
    tail = orders_lines(*stream_of(START_MS + 6 * HOUR_MS, START_MS + 9 * HOUR_MS, 3_000, seed=6), seed=6, seen=seen, wrapped=True)
    late = [orders_lines([START_MS + h * HOUR_MS + 60_000 * (i + 1)], None, seed=100 * h + i, seen=seen, wrapped=True)[0]
            for h in (1, 2) for i in range(30)]
    for i, line in enumerate(late):
        tail.insert(40 * i + 7, line)
    write_lines(path, tail, append=True)
    second = partfin(home, "ingest", "--table", "orders", "--source", f"debezium:{path}", "--checkpoint-records", "50")
    assert second.returncode == 0, second.stderr
    cli_late = int(second.stderr.strip().splitlines()[-1].split("late ")[1].split()[0].replace(",", ""))
    assert cli_late == 60  # what the writer counted, commit by commit, as it committed

    catalog = load_partfin_catalog(home)
    cdc = catalog.load_table("cdc.orders")
    assert writer_position(cdc.metadata, "orders-writer").checkpoint_id > 120
    retained_late = sum(int(s.summary.additional_properties.get("partfin.late-records", "0")) for s in cdc.metadata.snapshots)
    assert retained_late < 60, "expiry must have removed commits that carried late records"

    status = json.loads(partfin(home, "status", "--json").stdout)
    assert next(t for t in status["tables"] if t["name"] == "cdc.orders")["late_records"] == 60
    assert [t["name"] for t in status["tables"]] == ["cdc.orders"]  # the ledger is no table of its own in status
    (row,) = [line for line in partfin(home, "status").stdout.splitlines() if line.startswith("cdc.orders ")]
    assert " 60 " in row

    monkeypatch.setenv("PARTFIN_HOME", str(home))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.delenv("PARTFIN_CATALOG_URI", raising=False)
    monkeypatch.delenv("PARTFIN_CATALOG", raising=False)
    (tmp_path / "dagster").mkdir()
    spec = TableSpec.from_properties("orders", catalog.load_table("cdc.orders").properties)  # as the CLI declared it
    defs = build_definitions([PartfinTable(spec=spec, source=f"debezium:{path}")])
    checks = defs.resolve_job_def("checks_orders").execute_in_process(instance=DagsterInstance.ephemeral())
    late_check = {e.check_name: e for e in checks.get_asset_check_evaluations()}["late_data"]
    assert not late_check.passed and late_check.metadata["late_records"].value == 60
    hour1, hour2 = (f"{_hour_key(START_MS + h * HOUR_MS)}" for h in (1, 2))
    assert late_check.metadata["by_partition"].value == {hour1: 30, hour2: 30}


def _hour_key(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d-%H:00")


def test_one_ledger_commit_per_checkpoint_leaves_few_files_and_loses_no_row(catalog):
    """A writer that records every checkpoint on its own (a slow stream) must not leave one file per checkpoint."""
    from partfin_assets.iceberg.files import data_file_paths, data_files
    from partfin_assets.iceberg.ledger import LEDGER_MAX_SMALL_FILES

    writer = CdcWriter(catalog, ORDERS)
    writer._ledger.max_pending = 1  # as a stream with checkpoints further apart than the ledger's 5 s
    try:
        for i in range(LEDGER_MAX_SMALL_FILES + 20):
            writer.write_checkpoint(change_batch(T0_US + i * 60_000_000 + np.arange(5) * 1_000_000, offset=str(i), seq_start=10 * i))
    finally:
        writer.close()
    ledger = catalog.load_table("cdc.orders__ledger")
    assert len(data_files(ledger, ledger.current_snapshot())) < LEDGER_MAX_SMALL_FILES
    # expiry deleted the small files folded away, and only those: what is on disk is what retained snapshots name
    assert len(ledger.metadata.snapshots) < LEDGER_MAX_SMALL_FILES + 20
    on_disk = {p.as_posix() for p in Path(ledger.location().removeprefix("file://"), "data").rglob("*.parquet")}
    assert on_disk == {p.removeprefix("file://") for p in data_file_paths(ledger, ledger.metadata.snapshots)}
    rows = read_ledger(catalog, "cdc.orders")
    assert _checkpoints(rows) == {("orders-writer", i) for i in range(1, LEDGER_MAX_SMALL_FILES + 21)}
    assert rows["records"].sum() == 5 * (LEDGER_MAX_SMALL_FILES + 20)


RACERS = 3
RACER_COMMITS = 8


def _record_racing(home: str, writer_id: str, barrier, results) -> None:
    """One process recording its writer's checkpoints one commit at a time; reports how many attempts lost a race."""
    import logging

    from partfin_assets.iceberg.ledger import Checkpoint, checkpoint_rows, record_rows

    lost = []

    class CountLostRaces(logging.Handler):
        def emit(self, record):
            if "lost a race" in record.getMessage():
                lost.append(record)

    commit_log = logging.getLogger("partfin_assets.iceberg.commit")
    commit_log.setLevel(logging.DEBUG)
    commit_log.addHandler(CountLostRaces())
    catalog = load_partfin_catalog(home)
    barrier.wait()  # every process commits at the same moment
    try:
        for checkpoint_id in range(1, RACER_COMMITS + 1):
            checkpoint = Checkpoint(writer_id, writer_id, checkpoint_id, checkpoint_id, None, T0_US, None, {})
            record_rows(catalog, "cdc.orders", checkpoint_rows(checkpoint, T0_US + np.arange(3, dtype=np.int64) * 1_000_000))
        results.put(len(lost))
    except Exception as exc:  # reported to the test, which names it
        results.put(f"{type(exc).__name__}: {exc}")


def test_lost_races_on_the_ledger_commit_leave_no_file_behind(tmp_path):
    import multiprocessing

    from partfin_assets.iceberg.catalog import ensure_namespaces
    from partfin_assets.iceberg.ledger import ensure_ledger_table
    from partfin_assets.jobs.maintenance import list_table_files, referenced_files

    home = str(tmp_path / "home")
    catalog = load_partfin_catalog(home)
    ensure_namespaces(catalog, "cdc")
    ensure_ledger_table(catalog, "cdc.orders")
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(RACERS), context.Queue()
    processes = [context.Process(target=_record_racing, args=(home, f"racer-{i}", barrier, results)) for i in range(RACERS)]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=300) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    assert all(isinstance(o, int) for o in outcomes), outcomes
    assert sum(outcomes) > 0, "no commit lost a race: the test proves nothing"
    rows = read_ledger(catalog, "cdc.orders")
    assert _checkpoints(rows) == {(f"racer-{i}", c) for i in range(RACERS) for c in range(1, RACER_COMMITS + 1)}
    ledger = catalog.load_table("cdc.orders__ledger")
    on_disk = {f.path for f in list_table_files(ledger.metadata.location) if "/data/" in f.path}
    named = {p for p in referenced_files(ledger) if "/data/" in p}
    assert on_disk == named, f"{len(on_disk - named)} data file(s) no snapshot names ({sum(outcomes)} lost races)"
