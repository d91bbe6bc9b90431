"""Two writers on one table, as users start them -- every source event lands exactly once.

Real processes only: `partfin ingest` twice at once on one Debezium file with different
`--checkpoint-records` (three rounds, then one final run), and `partfin ingest` started by hand
while a `sync_orders` run (`dagster job execute`) is writing. Both use the table's default
writer id, `<table>-writer`. Afterwards `cdc.orders` must hold every source event exactly once:
the same count per event-time hour as the source, and no source position twice.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections import Counter
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from partfin_assets_tests.cdc_files import (
    HOUR_MS,
    event_hours_of_file,
    event_hours_of_table,
    hour_diff,
    orders_lines,
    partfin,
    partfin_command,
    partfin_env,
    stream_of,
    write_lines,
)

pytestmark = pytest.mark.timeout(900)

EVENTS = 60_000
BAD_LINES = 40
START_MS = int(datetime(2026, 11, 20, tzinfo=UTC).timestamp() * 1000)
HOURS = 10
ROUNDS = 3


def _catalog(home):
    from partfin_assets.iceberg.catalog import load_partfin_catalog

    return load_partfin_catalog(home)


def _positions(table) -> Counter:
    return Counter(table.scan(selected_fields=("source_seq",)).to_arrow().column("source_seq").to_pylist())


def _run_together(commands: list[list[str]], env: dict[str, str]) -> list[subprocess.CompletedProcess]:
    processes = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    results = []
    for command, process in zip(commands, processes):
        stdout, stderr = process.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(command, process.returncode, stdout, stderr))
    return results


def test_two_cli_writers_at_once_then_a_final_run_land_every_event_once(tmp_path):
    path = tmp_path / "orders.jsonl"
    events, arrivals = stream_of(START_MS, START_MS + HOURS * HOUR_MS, EVENTS, seed=10)
    lines = orders_lines(events, arrivals, seed=10)
    for n in range(BAD_LINES):  # bad lines go to cdc.orders__rejected, also exactly once
        lines.insert(n * (EVENTS // BAD_LINES) + n, f'{{"not json {n}')
    bad = [i + 1 for i, line in enumerate(lines) if line.startswith('{"not json')]
    write_lines(path, lines)
    home = tmp_path / "home"
    env = partfin_env(home)
    source = f"debezium:{path}"
    ingest = ["ingest", "--table", "orders", "--source", source, "--primary-key", "id"]

    for round_ in range(ROUNDS):
        results = _run_together(
            [partfin_command(*ingest, "--checkpoint-records", "700", "--max-checkpoints", "12"),
             partfin_command(*ingest, "--checkpoint-records", "1000", "--max-checkpoints", "9")],
            env,
        )
        for result in results:
            assert result.returncode == 0, f"round {round_}: {result.stderr[:3000]}"
    final = partfin(home, *ingest)
    assert final.returncode == 0, final.stderr[-2000:]

    table = _catalog(home).load_table("cdc.orders")
    expected = event_hours_of_file(path)
    actual = event_hours_of_table(table)
    positions = _positions(table)
    doubled = sum(n - 1 for n in positions.values() if n > 1)
    missing = EVENTS - len(positions)
    rejected = _positions(_catalog(home).load_table("cdc.orders__rejected"))
    # the "before" figure of the issue note: rows for EVENTS events, hours short / doubled
    print(f"two CLI writers: {sum(actual.values()):,} rows for {EVENTS:,} events; {doubled:,} doubled, "
          f"{missing:,} missing; hours that differ: {hour_diff(expected, actual)}; "
          f"{sum(rejected.values())} rejected rows for {BAD_LINES} bad lines")
    assert actual == expected
    assert sorted(positions) == sorted(set(range(1, len(lines) + 1)) - set(bad)) and doubled == 0
    assert rejected == Counter(bad)


def _synthetic_expected(source: str) -> tuple[Counter, int]:
    from partfin_assets.sources.registry import make_source
    from partfin_assets.sources.synthetic import ORDERS_SPEC

    hours: Counter = Counter()
    total = 0
    for batch in make_source(source, ORDERS_SPEC).batches(None, 50_000):
        times = pc.cast(batch.records.column("event_time"), pa.int64()).to_numpy()
        hours.update((times // (HOUR_MS * 1000)).tolist())
        total += batch.records.num_rows
    return hours, total


def test_cli_ingest_beside_a_dagster_sync_run_lands_every_event_once(tmp_path):
    from partfin_assets.testing import dagster_processes as devtools

    source = "synthetic:seed=12,start=2026-11-20T00:00:00Z,end=2026-11-20T10:00:00Z,rate=1.6667,idle_every=none"
    expected, total = _synthetic_expected(source)
    home, dagster_home = tmp_path / "home", tmp_path / "dagster"
    env = devtools.dagster_env(home, dagster_home, PARTFIN_SOURCE=source, PARTFIN_MAX_RECORDS="500",
                               PARTFIN_MAX_CHECKPOINTS_PER_RUN="40", PARTFIN_MAX_SECONDS_PER_RUN="600",
                               PARTFIN_PARTITIONS_START="2026-11-20-00:00")
    env.pop("PARTFIN_CATALOG_URI", None)
    env.pop("PARTFIN_CATALOG", None)
    ingest = partfin_command("ingest", "--table", "orders", "--source", source, "--checkpoint-records", "700",
                             "--max-checkpoints", "25")
    sync = [devtools.bin_path("dagster"), "job", "execute", "-m", "partfin_assets.definitions", "-j", "sync_orders"]
    for round_ in range(2):
        # the scheduled sync run is writing when the operator starts `partfin ingest` by hand
        before = _last_sequence(home)
        dagster = subprocess.Popen(sync, env=env, cwd=devtools.REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 180
        while _last_sequence(home) <= before and dagster.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        cli = subprocess.run(ingest, env=env, capture_output=True, text=True, timeout=600)
        output, _ = dagster.communicate(timeout=600)
        assert cli.returncode == 0, f"round {round_}: {cli.stderr[-2000:]}"
        assert dagster.returncode == 0, f"round {round_}: {output[-3000:]}"
    final = subprocess.run(partfin_command("ingest", "--table", "orders", "--source", source), env=env,
                           capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stderr[-2000:]

    table = _catalog(home).load_table("cdc.orders")
    actual = event_hours_of_table(table)
    positions = _positions(table)
    doubled = sum(n - 1 for n in positions.values() if n > 1)
    print(f"CLI beside sync: {sum(actual.values()):,} rows for {total:,} events; {doubled:,} doubled, "
          f"{total - len(positions):,} missing; hours that differ: {hour_diff(expected, actual)}")
    assert actual == expected
    assert len(positions) == total and doubled == 0
    shutil.rmtree(dagster_home, ignore_errors=True)


def _last_sequence(home) -> int:
    if not (home / "catalog.db").exists():
        return 0
    try:
        catalog = _catalog(home)
        if not catalog.table_exists("cdc.orders"):
            return 0
        return catalog.load_table("cdc.orders").metadata.last_sequence_number
    except Exception:  # the catalog is being created by the other process
        return 0
