"""Every refusal is one line and a refused command creates nothing, as `partfin` users meet it.

- names partfin's companion tables use (`t__ledger`, `t__rejected`) and names that are no identifier (`a.b`);
- a table whose current metadata file is missing: one line naming the file, every other table works on;
- options and sources refused before anything is created (no catalog.db either), `status` where nothing is;
- writer ids partfin cannot use (its own streams' `partfin.` names, a newline, a `/`) and such stream names to retire;
- a locked catalog, a full disk, a read-only warehouse: one line, exit 75 (try again), exact after a re-run;
- a Debezium file whose last line has no trailing newline: read when the run ends (the file is complete).
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest

from partfin_assets_tests.debezium_lines import change_line
from partfin_assets_tests.test_bad_input import MINUTE_MS, T0_MS, table_rows
from partfin_assets_tests.test_cli import partfin

SYNTHETIC = "synthetic:seed=5,start=2026-11-01T00:00:00Z,end=2026-11-01T02:00:00Z,rate=0.5"
MORE = SYNTHETIC.replace("T02:00:00Z", "T03:00:00Z")  # the same stream, an hour further
README = Path(__file__).parent.parent / "README.md"


PROGRESS = re.compile(r"cdc\.\w+: checkpoint \d+ ")  # ingest's progress lines, one per checkpoint committed before


def one_line_refusal(result, expected: str, code: int = 2) -> str:
    lines = [line for line in result.stderr.strip().splitlines() if not PROGRESS.match(line)]
    assert result.returncode == code, (result.returncode, result.stderr)
    assert len(lines) == 1 and lines[0].startswith("partfin: error: "), lines
    assert expected in lines[0], lines[0]
    return lines[0]


# --------------------------------------------------------------------------- names


@pytest.mark.parametrize("companion", ["t__ledger", "t__rejected"])
def test_a_companion_table_name_is_refused_and_the_table_it_belongs_to_works(tmp_path, companion):
    """Before t (the name would be t's companion table once t exists) and beside t (it is one)."""
    before = partfin(tmp_path, "ingest", "--table", companion, "--source", SYNTHETIC)
    ingest_t = partfin(tmp_path, "ingest", "--table", "t", "--source", SYNTHETIC)
    companion_columns = table_rows(tmp_path, f"cdc.{companion}").column_names
    beside = partfin(tmp_path, "ingest", "--table", companion, "--source", SYNTHETIC)
    again = partfin(tmp_path, "ingest", "--table", "t", "--source", MORE)
    status = json.loads(partfin(tmp_path, "status", "--json").stdout)
    print(f"\n{companion}: before t exit {before.returncode} {before.stderr.strip().splitlines()[-1:]}; t: exit {ingest_t.returncode} "
          f"{ingest_t.stderr.strip().splitlines()[-1:]}; beside t: exit {beside.returncode}; t again: exit {again.returncode}")

    for refused in (before, beside):
        one_line_refusal(refused, f"table name {companion!r} is taken by partfin")
    assert ingest_t.returncode == 0 and again.returncode == 0, ingest_t.stderr + again.stderr
    assert table_rows(tmp_path, f"cdc.{companion}").column_names == companion_columns  # nothing added to the companion
    (t,) = [s for s in status["tables"] if s["name"] == "cdc.t"]
    assert t["rejected"] == 0 and [s["name"] for s in status["tables"]] == ["cdc.t"]


@pytest.mark.parametrize("command", [
    ("upsert", "--table", "a.b"),
    ("streams", "list", "--table", "a.b"),
    ("ingest", "--table", "a.b", "--source", SYNTHETIC),
])
def test_a_table_name_that_is_no_identifier_is_one_line(tmp_path, command):
    one_line_refusal(partfin(tmp_path / "home", *command), "table name 'a.b' must be a plain identifier")
    assert not (tmp_path / "home").exists()


# --------------------------------------------------------------------------- broken tables


def current_metadata_file(home: Path, table: str) -> Path:
    with sqlite3.connect(home / "catalog.db") as db:
        (location,) = db.execute("select metadata_location from iceberg_tables where table_namespace = 'cdc' and table_name = ?",
                                 (table,)).fetchone()
    return Path(location.removeprefix("file://"))


def test_a_table_whose_metadata_file_is_missing_is_reported_broken_and_the_others_work(tmp_path):
    for table in ("good", "lost"):
        assert partfin(tmp_path, "ingest", "--table", table, "--source", SYNTHETIC).returncode == 0
    missing = current_metadata_file(tmp_path, "lost")
    missing.unlink()

    status = partfin(tmp_path, "status")
    status_json = partfin(tmp_path, "status", "--json")
    ingest_lost = partfin(tmp_path, "ingest", "--table", "lost", "--source", SYNTHETIC)
    ingest_good = partfin(tmp_path, "ingest", "--table", "good", "--source", MORE)
    print(f"\nstatus exit {status.returncode}: {status.stdout.strip().splitlines()[-1:]}{status.stderr.strip().splitlines()[-1:]}; "
          f"ingest lost: exit {ingest_lost.returncode}; ingest good: exit {ingest_good.returncode}")

    assert status.returncode == 0, status.stderr
    good_rows = [line for line in status.stdout.splitlines() if line.startswith("cdc.good ")]
    assert len(good_rows) == 1 and "2026-11-01T" in good_rows[0]  # the healthy table, with its watermark
    broken_lines = [line for line in status.stdout.splitlines() if str(missing) in line]
    assert broken_lines == [f"table cdc.lost is broken: its current metadata file {missing} is missing; "
                            "restore it from a backup (other tables are not affected)"]
    tables = {t["name"]: t for t in json.loads(status_json.stdout)["tables"]}
    assert tables["cdc.good"]["broken"] is None and str(missing) in tables["cdc.lost"]["broken"]
    one_line_refusal(ingest_lost, str(missing))
    assert ingest_good.returncode == 0, ingest_good.stderr


# --------------------------------------------------------------------------- refused commands create nothing


def refusals(tmp_path: Path) -> dict[tuple[str, ...], str]:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    return {
        ("ingest", "--table", "orders", "--source", SYNTHETIC, "--checkpoint-records", "0"): "--checkpoint-records: must be at least 1",
        ("ingest", "--table", "orders", "--source", SYNTHETIC, "--subtasks", "0"): "--subtasks: must be at least 1",
        ("ingest", "--table", "shop", "--source", f"debezium:{README}", "--primary-key", "id"): "does not read as Debezium JSON lines",
        ("ingest", "--table", "shop", "--source", f"debezium:{empty}", "--primary-key", "id"): "holds no change event yet",
        ("ingest", "--table", "shop", "--source", "debezium:", "--primary-key", "id"): "debezium needs a file path",
        ("ingest", "--table", "shop", "--source", "debezium:"): "debezium needs a file path",
        ("ingest", "--table", "t__rejected", "--source", SYNTHETIC): "is taken by partfin",
        ("streams", "retire", "--table", "nosuch", "--stream", "w"): "no partfin catalog",
        ("streams", "idle-timeout", "--table", "nosuch", "10m"): "no partfin catalog",
        ("upsert", "--table", "nosuch"): "no partfin catalog",
        ("late-data", "ack", "--table", "orders", "--hour", "2026-12-03-06:30", "--reason", "r"): "'2026-12-03-06:30' is not on the hour",
        ("late-data", "ack", "--table", "orders", "--hour", "bogus", "--reason", "r"): "--hour: not an hour: 'bogus'; name an hour as 2026-01-01-05:00",
        ("late-data", "ack", "--table", "orders", "--all", "--reason", "r", "--by", ""): "--by: who acknowledges may not be blank",
        # writer ids: partfin's own stream (the ledger's replays: accepted, it lost most of that writer's records), a
        # newline (it split `partfin streams list`), the partition-stream separator, nothing
        **{("ingest", "--table", "orders", "--source", SYNTHETIC, "--writer-id", writer): f"--writer-id: writer id {writer!r} is not one"
           for writer in ("partfin.replay", "Partfin.anything", "ops\nteam", "ops/orders-0", "ops team", "", "_a", "x" * 129)},
    }


def test_every_refused_command_is_one_line_and_creates_nothing(tmp_path):
    home = tmp_path / "home"
    for args, expected in refusals(tmp_path).items():
        line = one_line_refusal(partfin(home, *args), expected)
        assert "parse_hour" not in line and "Traceback" not in line
        assert not home.exists(), (args, sorted(p.name for p in home.rglob("*")))


def test_status_where_nothing_was_ingested_creates_nothing(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("PARTFIN_")}
    result = subprocess.run([__import__("sys").executable, "-m", "partfin_assets.cli", "status"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "no partfin tables yet" in result.stdout
    assert list(tmp_path.iterdir()) == []  # no ./.partfin/catalog.db


def test_refusals_on_an_existing_catalog_create_no_table(tmp_path):
    assert partfin(tmp_path, "ingest", "--table", "orders", "--source", SYNTHETIC).returncode == 0
    cases = {
        ("streams", "retire", "--table", "nosuch", "--stream", "w"): "table cdc.nosuch does not exist",
        ("streams", "idle-timeout", "--table", "nosuch", "10m"): "table cdc.nosuch does not exist",
        ("streams", "retire", "--table", "orders", "--stream", "orders-writer\n"): "stream 'orders-writer\\n' is not one partfin names",
        ("streams", "retire", "--table", "orders", "--stream", "partfin.replay"): "stream 'partfin.replay' is not one partfin names",
        ("streams", "retire", "--table", "orders", "--stream", "other/t-0"): "has no stream 'other/t-0'",
        **{args: expected for args, expected in refusals(tmp_path).items() if "no partfin catalog" not in expected},
    }
    for args, expected in cases.items():
        one_line_refusal(partfin(tmp_path, *args), expected)
    status = json.loads(partfin(tmp_path, "status", "--json").stdout)
    assert [t["name"] for t in status["tables"]] == ["cdc.orders"]


# --------------------------------------------------------------------------- locked catalog, full disk, read-only


def test_a_locked_catalog_is_one_line_and_exit_75_and_a_re_run_is_exact(tmp_path):
    args = ("ingest", "--table", "orders", "--source", SYNTHETIC)
    assert partfin(tmp_path, *args).returncode == 0
    more = ("ingest", "--table", "orders", "--source", MORE)
    lock = sqlite3.connect(tmp_path / "catalog.db", isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")  # another process holding the catalog database, longer than partfin waits for it
    try:
        started = time.monotonic()
        locked = partfin(tmp_path, *more, env_extra={"PARTFIN_CATALOG_LOCK_WAIT": "8"})
        waited = time.monotonic() - started
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    print(f"\nlocked: exit {locked.returncode} after {waited:.0f} s: {locked.stderr.strip().splitlines()[-1:]}")
    waiting, *error = locked.stderr.strip().splitlines()
    assert "the catalog database is locked by another process: waiting for it (up to 8 s" in waiting, locked.stderr
    assert waited >= 8  # it waited for the lock (the bound) before it gave up
    one_line_refusal(subprocess.CompletedProcess(locked.args, locked.returncode, "", "\n".join(error)),
                     "the catalog database is locked by another process", code=75)
    assert partfin(tmp_path, *more).returncode == 0
    assert_exact(tmp_path, MORE, tmp_path / "reference")


def assert_exact(home: Path, source: str, reference_home: Path) -> None:
    """cdc.orders holds exactly what one uninterrupted ingest of `source` writes."""
    assert partfin(reference_home, "ingest", "--table", "orders", "--source", source).returncode == 0
    got, want = (table_rows(h, "cdc.orders") for h in (home, reference_home))
    key = ["key", "op", "source_seq"]
    assert got.num_rows == want.num_rows
    assert got.select(key).sort_by([(c, "ascending") for c in key]).equals(want.select(key).sort_by([(c, "ascending") for c in key]))


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs (root only): a disk that fills up, and can be made read-only and bigger."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def remount(mount: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(mount)], check=True)


def test_a_full_disk_is_one_line_and_exit_75_and_a_re_run_is_exact(tmp_path, small_disk):
    home = small_disk / "home"
    source = SYNTHETIC.replace("end=2026-11-01T02:00:00Z", "end=2026-11-01T12:00:00Z")
    full = partfin(home, "ingest", "--table", "orders", "--source", source, "--checkpoint-records", "2000")
    print(f"\nfull disk: exit {full.returncode}: {full.stderr.strip().splitlines()[-1:]}")
    one_line_refusal(full, "the disk is full", code=75)
    remount(small_disk, "size=400m")
    again = partfin(home, "ingest", "--table", "orders", "--source", source, "--checkpoint-records", "2000")
    assert again.returncode == 0, again.stderr
    assert_exact(home, source, tmp_path / "reference")


def test_a_read_only_warehouse_is_one_line_and_exit_75_and_a_re_run_is_exact(tmp_path, small_disk):
    remount(small_disk, "size=400m")
    home = small_disk / "home"
    assert partfin(home, "ingest", "--table", "orders", "--source", SYNTHETIC).returncode == 0
    more = MORE
    remount(small_disk, "ro")
    read_only = partfin(home, "ingest", "--table", "orders", "--source", more)
    status = partfin(home, "status")  # reading works on a read-only disk
    remount(small_disk, "rw")
    print(f"\nread-only: exit {read_only.returncode}: {read_only.stderr.strip().splitlines()[-1:]}")
    one_line_refusal(read_only, "read-only", code=75)
    assert status.returncode == 0, status.stderr
    assert partfin(home, "ingest", "--table", "orders", "--source", more).returncode == 0
    assert_exact(home, more, tmp_path / "reference")


# --------------------------------------------------------------------------- the last line without a newline


def test_the_last_line_without_a_newline_is_read_when_the_run_ends_and_a_newline_written_later_ends_it(tmp_path):
    lines = [change_line({"id": i, "amount": float(i), "note": None}, T0_MS + i * MINUTE_MS) for i in range(1, 8)]
    path = tmp_path / "changes.jsonl"
    path.write_text("\n".join(lines[:5]))  # line 5 has no trailing newline: the file as a tool left it
    args = ("ingest", "--table", "shop", "--source", f"debezium:{path}", "--primary-key", "id")
    first = partfin(tmp_path, *args)
    first_rows = table_rows(tmp_path, "cdc.shop")
    with path.open("a") as file:
        file.write("\n" + "\n".join(lines[5:]) + "\n")  # later, the file goes on
    second = partfin(tmp_path, *args)
    cdc = table_rows(tmp_path, "cdc.shop")
    print(f"\nfirst run: exit {first.returncode}, {getattr(first_rows, 'num_rows', None)} of 5 lines; "
          f"second: exit {second.returncode}, {getattr(cdc, 'num_rows', None)} of 7")

    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert first_rows.num_rows == 5
    assert "no trailing newline" in first.stderr and str(path) in first.stderr  # said, not silent
    assert sorted(pc.cast(cdc.column("source_seq"), "int64").to_pylist()) == list(range(1, 8))  # each line once, numbered as the file
    assert table_rows(tmp_path, "cdc.shop__rejected").num_rows == 0


def test_a_history_read_sees_the_lines_a_complete_read_without_the_last_newline_consumed(tmp_path):
    """A replay reads a file's history up to a committed offset: after the unterminated last line was consumed
    and a newline and more lines were written, it finds the same lines, numbered as the writer numbered them."""
    from partfin_assets.sources.debezium import DebeziumFileSource

    lines = [change_line({"id": i, "amount": float(i), "note": None}, T0_MS + i * MINUTE_MS) for i in range(1, 8)]
    path = tmp_path / "changes.jsonl"
    path.write_text("\n".join(lines[:5]))
    first = list(DebeziumFileSource(path, ("id",), complete_file=True).batches(None, 100))
    offset = first[-1].offset
    with path.open("a") as file:
        file.write("\n" + "\n".join(lines[5:]) + "\n")
    source = DebeziumFileSource(path, ("id",), complete_file=True)
    (replayed,) = list(source.history(offset, 100))  # checks every byte it read against the offset's crc32
    resumed = list(source.batches(offset, 100))
    assert replayed.column("source_seq").to_pylist() == [1, 2, 3, 4, 5]
    assert [seq for b in resumed for seq in b.records.column("source_seq").to_pylist()] == [6, 7]
    assert sum(b.rejected.num_rows for b in resumed) == 0
