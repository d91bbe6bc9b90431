"""`partfin replay`, `compact`, `privacy-delete` and `maintain`: the table jobs on the command line, as users run them.

Real `partfin` processes on one catalog: each command against a table a running `ingest --follow`
keeps committing to (late records into the very hours compaction, replay and the privacy delete
rewrite, snapshot expiry as the writer goes), then exactness: every line of the file once in cdc.orders except the
erased key, base.orders without it, and after a maintenance run every table partfin keeps for
orders (cdc, base, ledger, rejected) holds exactly the files its retained snapshots name.
"""

from __future__ import annotations

import json
import signal
import subprocess
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


def test_table_commands_race_a_running_writer_and_lose_nothing(tmp_path):
    """Each command is parked just before its commit (PARTFIN_PAUSE_AT) while the running writer commits what it
    races with; released, it loses (conflict, retried from a fresh snapshot) or keeps the writer's records."""
    home, path = tmp_path / "home", tmp_path / "orders.jsonl"
    rng = np.random.default_rng(5)
    events = np.sort(rng.integers(START_MS, START_MS + 4 * HOUR_MS, 1_200)).tolist()
    write_lines(path, orders_lines(events, seed=5, key_space=400, wrapped=True))
    ingest = ["ingest", "--table", "orders", "--source", f"debezium:{path}", "--primary-key", "id"]
    first = partfin(home, *ingest, "--checkpoint-records", "100", "--watermark-policy", "min-of-last:3")
    assert first.returncode == 0, first.stderr
    assert partfin(home, "upsert", "--table", "orders").returncode == 0
    erased = json.loads(path.read_text().splitlines()[0])["payload"]["after"]["id"]
    catalog = load_partfin_catalog(home)
    batches = iter(range(1000))

    gone: set[int] = set()  # the erased key, once the privacy delete ran

    def expected() -> Counter:
        """Records per event hour: every line of the file once, but the erased key's."""
        return Counter(line["source"]["ts_ms"] // HOUR_MS for line in _file_lines(path) if line["after"]["id"] not in gone)

    def append_and_wait(event_ms: list[int]) -> None:
        """Append changes (never of the erased key) and wait until the writer committed them."""
        write_lines(path, _lines_without(orders_lines(event_ms, seed=100 + next(batches), key_space=400, wrapped=True), erased),
                    append=True)
        deadline = time.monotonic() + 120
        while dict(event_hours_of_table(catalog.load_table("cdc.orders"))) != dict(expected()):
            assert time.monotonic() < deadline and writer.poll() is None, (
                "the writer did not commit the appended lines", dict(event_hours_of_table(catalog.load_table("cdc.orders"))),
                dict(expected()), writer.poll())
            time.sleep(0.2)

    def raced(*args: str, meanwhile) -> subprocess.CompletedProcess:
        """Run a command, parked before its (first) commit while `meanwhile()` runs."""
        pauses = tmp_path / f"pauses-{args[0]}"
        pauses.mkdir()
        command = subprocess.Popen(partfin_command(*args),
                                   env=partfin_env(home, PARTFIN_PAUSE_AT="job-commit", PARTFIN_PAUSE_DIR=str(pauses)),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while not (pauses / "job-commit.reached").exists():
            assert command.poll() is None and time.monotonic() < deadline, command.communicate()
            time.sleep(0.1)
        meanwhile()
        (pauses / "job-commit.go").touch()
        out, err = command.communicate(timeout=600)
        return subprocess.CompletedProcess(args, command.returncode, out, err)

    late_hours = START_MS, START_MS + 3 * HOUR_MS  # finalized: what compaction rewrites
    # the writer follows the file, one checkpoint per line (its snapshot expiry runs as it goes)
    writer = subprocess.Popen(partfin_command(*ingest, "--checkpoint-records", "1", "--follow"), env=partfin_env(home),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        append_and_wait([START_MS + 4 * HOUR_MS])
        compacted = raced("compact", "--table", "orders",
                          meanwhile=lambda: append_and_wait(rng.integers(*late_hours, 5).tolist()))
        assert compacted.returncode == 0, compacted.stderr
        assert "compaction of cdc.orders: conflict on attempt 1" in compacted.stderr, compacted.stderr
        assert "cdc.orders: compacted" in compacted.stdout and "base.orders" in compacted.stdout

        hour = START_MS + HOUR_MS

        def late_into_the_hour_and_expiry():
            for _ in range(30):  # 30 checkpoints: the writer's expiry removes the replay's start snapshot
                append_and_wait([hour + int(rng.integers(0, HOUR_MS))])

        replayed = raced("replay", "--table", "orders", "--hour", _hour_key(hour), meanwhile=late_into_the_hour_and_expiry)
        assert replayed.returncode == 0, replayed.stderr
        assert "conflict on attempt 1" in replayed.stderr and "expired" in replayed.stderr, replayed.stderr
        assert " 0 removed" in replayed.stdout, replayed.stdout

        erased_hour = json.loads(path.read_text().splitlines()[0])["payload"]["source"]["ts_ms"]
        erase = raced("privacy-delete", "--table", "orders", "--key", json.dumps({"id": erased}), "--request-id", "req-1",
                      meanwhile=lambda: append_and_wait([erased_hour]))  # another key, into the erased key's hour
        assert erase.returncode == 0, erase.stderr
        gone.add(erased)
        assert "record(s) from cdc.orders" in erase.stdout

        maintained = partfin(home, "maintain", "--table", "orders", "--keep-last", "1")  # default safety age: the writer's files stay
        assert maintained.returncode == 0, maintained.stderr
        for table in ("cdc.orders", "base.orders", "cdc.orders__ledger", "cdc.orders__rejected"):
            assert table in maintained.stdout, maintained.stdout
        append_and_wait([START_MS + 4 * HOUR_MS + 1000])  # the writer goes on
    finally:
        writer.send_signal(signal.SIGINT)
        out, err = writer.communicate(timeout=120)
    assert writer.returncode == 130, err
    assert dict(event_hours_of_table(catalog.load_table("cdc.orders"))) == dict(expected())  # every line once, the key erased

    assert partfin(home, "upsert", "--table", "orders").returncode == 0
    ids = set(read_base(catalog, "orders", selected_fields=("id",)).column("id").to_pylist())
    assert ids == {line["after"]["id"] for line in _file_lines(path)} - {erased}

    # with nothing running, maintenance leaves every table with exactly the files its snapshots name
    maintained = partfin(home, "maintain", "--table", "orders", "--keep-last", "1", "--orphan-min-age", "0s")
    assert maintained.returncode == 0, maintained.stderr
    for identifier in ("cdc.orders", "base.orders", "cdc.orders__ledger", "cdc.orders__rejected"):
        table = catalog.load_table(identifier)
        assert {f.path for f in list_table_files(table.metadata.location)} == referenced_files(table), identifier
    assert dict(event_hours_of_table(catalog.load_table("cdc.orders"))) == dict(expected())


def test_table_commands_refuse_in_one_line(tmp_path):
    home = tmp_path / "home"
    for args in (("compact", "--table", "nosuch"), ("maintain", "--table", "nosuch"),
                 ("replay", "--table", "nosuch", "--hour", "2026-01-01-05:00"),
                 ("privacy-delete", "--table", "nosuch", "--key", '{"id": 1}', "--request-id", "r")):
        assert "no partfin catalog" in _one_line_error(partfin(home, *args))  # an empty home: nothing is created
    assert not home.exists()
    path = tmp_path / "orders.jsonl"
    write_lines(path, orders_lines([START_MS + i * 60_000 for i in range(30)], seed=1, wrapped=True))
    assert partfin(home, "ingest", "--table", "orders", "--source", f"debezium:{path}", "--primary-key", "id").returncode == 0
    assert "primary key" in _one_line_error(partfin(home, "privacy-delete", "--table", "orders", "--key", '{"user_id": 1}',
                                                    "--request-id", "r"))
    assert "--key" in _one_line_error(partfin(home, "privacy-delete", "--table", "orders", "--key", "id=1", "--request-id", "r"))
    assert "on the hour" in _one_line_error(partfin(home, "replay", "--table", "orders", "--hour", "2026-01-01T05:30:00Z"))
