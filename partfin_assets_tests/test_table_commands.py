"""`partfin replay`, `compact`, `privacy-delete` and `maintain`: the table jobs on the command line, as users run them.

Real `partfin` processes on one catalog: each command against a table a running `ingest --follow`
keeps appending to (late records into the very hours compaction and replay rewrite, snapshot
expiry as the writer goes), then exactness: every line of the file once in cdc.orders except the
erased key, base.orders without it, and after a maintenance run every table partfin keeps for
orders (cdc, base, ledger, rejected) holds exactly the files its retained snapshots name.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.tables import read_base
from partfin_assets.jobs.maintenance import list_table_files, referenced_files
from partfin_assets_tests.cdc_files import HOUR_MS, event_hours_of_table, orders_lines, partfin, partfin_command, partfin_env, write_lines

pytestmark = pytest.mark.timeout(900)

START_MS = 1_795_000_000_000 // HOUR_MS * HOUR_MS


def _hour_key(ms: int) -> str:
    return time.strftime("%Y-%m-%d-%H:00", time.gmtime(ms / 1000))


def _file_lines(path: Path) -> list[dict]:
    return [json.loads(line)["payload"] for line in path.read_text().splitlines()]


def _lines_without(lines: list[str], key: int) -> list[str]:
    return [line for line in lines if json.loads(line)["payload"]["after"]["id"] != key]


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("partfin: error: "), result.stderr
    return lines[0]


@pytest.mark.xfail(strict=True, reason="issue 29.3: replay, compaction, privacy delete and maintenance run only under Dagster")
def test_table_commands_race_a_running_writer_and_lose_nothing(tmp_path):
    home, path = tmp_path / "home", tmp_path / "orders.jsonl"
    rng = np.random.default_rng(5)
    events = np.sort(rng.integers(START_MS, START_MS + 4 * HOUR_MS, 1_200)).tolist()
    write_lines(path, orders_lines(events, seed=5, key_space=400, wrapped=True))
    ingest = ["ingest", "--table", "orders", "--source", f"debezium:{path}", "--primary-key", "id"]
    first = partfin(home, *ingest, "--checkpoint-records", "100")
    assert first.returncode == 0, first.stderr
    assert partfin(home, "upsert", "--table", "orders").returncode == 0
    erased = json.loads(path.read_text().splitlines()[0])["payload"]["after"]["id"]

    # the writer follows the file; a feeder appends late changes into the finalized hours and new ones
    writer = subprocess.Popen(partfin_command(*ingest, "--checkpoint-records", "20", "--follow"), env=partfin_env(home),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop = threading.Event()

    def feed() -> None:
        batch = 0
        while not stop.is_set():
            late = rng.integers(START_MS, START_MS + 3 * HOUR_MS, 8).tolist() + [START_MS + 4 * HOUR_MS + batch * 1000]
            write_lines(path, _lines_without(orders_lines(late, seed=100 + batch, key_space=400, wrapped=True), erased), append=True)
            batch += 1
            time.sleep(0.2)

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        time.sleep(3)
        compacted = partfin(home, "compact", "--table", "orders")
        assert compacted.returncode == 0, compacted.stderr
        assert "cdc.orders" in compacted.stdout and "base.orders" in compacted.stdout
        replayed = partfin(home, "replay", "--table", "orders", "--hour", _hour_key(START_MS + HOUR_MS))
        assert replayed.returncode == 0, replayed.stderr
        assert " 0 removed" in replayed.stdout, replayed.stdout
        erase = partfin(home, "privacy-delete", "--table", "orders", "--key", json.dumps({"id": erased}), "--request-id", "req-1")
        assert erase.returncode == 0, erase.stderr
        maintained = partfin(home, "maintain", "--table", "orders", "--keep-last", "1")  # default safety age: the writer's files stay
        assert maintained.returncode == 0, maintained.stderr
        for table in ("cdc.orders", "base.orders", "cdc.orders__ledger", "cdc.orders__rejected"):
            assert table in maintained.stdout, maintained.stdout
    finally:
        stop.set()
        feeder.join()
    catalog = load_partfin_catalog(home)
    expected = Counter(line["source"]["ts_ms"] // HOUR_MS for line in _file_lines(path) if line["after"]["id"] != erased)
    deadline = time.monotonic() + 180
    while dict(event_hours_of_table(catalog.load_table("cdc.orders"))) != dict(expected) and time.monotonic() < deadline:
        time.sleep(1)
    writer.send_signal(signal.SIGINT)
    out, err = writer.communicate(timeout=120)
    assert writer.returncode == 130, err
    assert dict(event_hours_of_table(catalog.load_table("cdc.orders"))) == dict(expected)  # every line once, the key erased

    assert partfin(home, "upsert", "--table", "orders").returncode == 0
    ids = set(read_base(catalog, "orders", selected_fields=("id",)).column("id").to_pylist())
    assert ids == {line["after"]["id"] for line in _file_lines(path)} - {erased}

    # with nothing running, maintenance leaves every table with exactly the files its snapshots name
    maintained = partfin(home, "maintain", "--table", "orders", "--keep-last", "1", "--orphan-min-age", "0s")
    assert maintained.returncode == 0, maintained.stderr
    for identifier in ("cdc.orders", "base.orders", "cdc.orders__ledger", "cdc.orders__rejected"):
        table = catalog.load_table(identifier)
        assert {f.path for f in list_table_files(table.metadata.location)} == referenced_files(table), identifier
    assert dict(event_hours_of_table(catalog.load_table("cdc.orders"))) == dict(expected)


@pytest.mark.xfail(strict=True, reason="issue 29.3: replay, compaction, privacy delete and maintenance run only under Dagster")
def test_table_commands_refuse_in_one_line(tmp_path):
    home = tmp_path / "home"
    for args in (("compact", "--table", "nosuch"), ("maintain", "--table", "nosuch"),
                 ("replay", "--table", "nosuch", "--hour", "2026-01-01-05:00"),
                 ("privacy-delete", "--table", "nosuch", "--key", '{"id": 1}', "--request-id", "r")):
        assert "cdc.nosuch" in _one_line_error(partfin(home, *args))
    path = tmp_path / "orders.jsonl"
    write_lines(path, orders_lines([START_MS + i * 60_000 for i in range(30)], seed=1, wrapped=True))
    assert partfin(home, "ingest", "--table", "orders", "--source", f"debezium:{path}", "--primary-key", "id").returncode == 0
    assert "primary key" in _one_line_error(partfin(home, "privacy-delete", "--table", "orders", "--key", '{"user_id": 1}',
                                                    "--request-id", "r"))
    assert "--key" in _one_line_error(partfin(home, "privacy-delete", "--table", "orders", "--key", "id=1", "--request-id", "r"))
    assert "on the hour" in _one_line_error(partfin(home, "replay", "--table", "orders", "--hour", "2026-01-01T05:30:00Z"))
