"""A table's source identity: a Debezium file that changed under its offset, and a table switched
to another source kind, are refused with one clear line, as `partfin ingest` users meet them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets_tests.scenario_helpers import append_lines, hour_of_changes, partfin


def ingest(home, path, *extra):
    return partfin(home, "ingest", "--table", "orders", "--source", f"debezium:{path}", "--primary-key", "id",
                   "--checkpoint-records", "10", *extra)


def table_counts(home) -> tuple[int, int]:
    """(records in cdc.orders, records in cdc.orders__rejected)."""
    catalog = load_partfin_catalog(home)
    return (catalog.load_table("cdc.orders").scan().to_arrow().num_rows,
            catalog.load_table("cdc.orders__rejected").scan().to_arrow().num_rows)


def assert_refused(result, *needles: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_rotated_file_is_refused_not_resumed_mid_line(tmp_path):
    """Debezium's file was rotated (moved aside, a new one started at the path, already longer than the old
    offset). Before: ingest resumed at the old byte offset inside a line of the new file: the cut line went to
    the rejected table and the rest were taken with wrong line numbers."""
    path, home = tmp_path / "orders.jsonl", tmp_path / "home"
    append_lines(path, hour_of_changes("2026-11-01T00:00:00Z", range(1, 41)))
    assert ingest(home, path).returncode == 0
    before = table_counts(home)
    path.rename(tmp_path / "orders.jsonl.1")
    append_lines(path, hour_of_changes("2026-11-01T01:00:00Z", range(1000, 1070), status="rotated-file"))
    result = ingest(home, path)
    after = table_counts(home)
    print(f"rotated file: exit {result.returncode}, records/rejected {before} -> {after}; stderr: {result.stderr.strip()[-300:]}")
    line = assert_refused(result, str(path), "cdc.orders")
    assert "rotated" in line or "replaced" in line or "changed" in line
    assert after == before


def test_truncated_file_is_refused_not_a_silent_stall(tmp_path):
    """The file was truncated in place (copytruncate) and new events written, fewer bytes than the offset.
    Before: ingest read nothing, exited 0 and said nothing: the stream stalled silently."""
    path, home = tmp_path / "orders.jsonl", tmp_path / "home"
    append_lines(path, hour_of_changes("2026-11-01T00:00:00Z", range(1, 41)))
    assert ingest(home, path).returncode == 0
    before = table_counts(home)
    path.write_text("")
    append_lines(path, hour_of_changes("2026-11-01T01:00:00Z", range(1000, 1010)))
    result = ingest(home, path)
    after = table_counts(home)
    print(f"truncated file: exit {result.returncode}, records/rejected {before} -> {after}; stderr: {result.stderr.strip()[-300:]}")
    line = assert_refused(result, str(path), "cdc.orders")
    assert "truncated" in line or "changed" in line
    assert after == before


def test_switching_source_kind_names_the_current_source(tmp_path):
    """cdc.orders was fed by the synthetic source; someone points it at a Debezium file. Before: `partfin: error:
    not a debezium-file offset: '{"anchor_us":...}'`. Wanted: one line naming the table's current source."""
    home, path = tmp_path / "home", tmp_path / "orders.jsonl"
    synthetic = "synthetic:seed=3,start=2026-11-01T00:00:00Z,end=2026-11-01T02:00:00Z,rate=0.2"
    assert partfin(home, "ingest", "--table", "orders", "--source", synthetic).returncode == 0
    append_lines(path, hour_of_changes("2026-11-01T03:00:00Z", range(1, 11)))
    records_before = load_partfin_catalog(home).load_table("cdc.orders").scan().to_arrow().num_rows
    result = ingest(home, path)
    print(f"switching synthetic -> debezium: exit {result.returncode}; stderr: {result.stderr.strip()}")
    line = assert_refused(result, "cdc.orders", "synthetic", "seed=3", "debezium")
    assert "not a debezium-file offset" not in line
    assert load_partfin_catalog(home).load_table("cdc.orders").scan().to_arrow().num_rows == records_before


def test_file_changed_before_the_offset_with_its_first_line_kept_is_refused(tmp_path):
    """Same first line, but the file was cut short (logrotate copytruncate of part of it), or a line before the
    committed offset was rewritten in place: the bytes just before the offset are checked on every resume."""
    path, home = tmp_path / "orders.jsonl", tmp_path / "home"
    lines = hour_of_changes("2026-11-01T00:00:00Z", range(1, 41))
    append_lines(path, lines)
    assert ingest(home, path).returncode == 0
    before = table_counts(home)
    path.write_text("")
    append_lines(path, lines[:10])
    assert_refused(ingest(home, path), str(path), "cdc.orders", "fewer than", "truncated")
    path.write_text("")
    append_lines(path, lines[:-1] + [lines[-1].replace('"new"', '"old"')])  # same length, other bytes
    assert_refused(ingest(home, path), str(path), "cdc.orders", "rewritten")
    assert table_counts(home) == before


def test_file_truncated_while_following_stops_with_one_line(tmp_path):
    """`ingest --follow` is reading when logrotate's copytruncate empties the file and new events follow. It must
    stop with one line (exit 2), not wait silently behind the shorter file or resume inside one of its lines."""
    path, home = tmp_path / "orders.jsonl", tmp_path / "home"
    append_lines(path, hour_of_changes("2026-11-01T00:00:00Z", range(1, 41)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARTFIN_")}
    command = [sys.executable, "-m", "partfin_assets.cli", "ingest", "--table", "orders", "--source", f"debezium:{path}",
               "--primary-key", "id", "--checkpoint-records", "10", "--follow"]
    process = subprocess.Popen(command, env={**env, "PARTFIN_HOME": str(home)}, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and process.poll() is None:
            catalog = load_partfin_catalog(home)
            if catalog.table_exists("cdc.orders") and catalog.load_table("cdc.orders").scan().to_arrow().num_rows == 40:
                break
            time.sleep(0.5)
        assert process.poll() is None, process.stderr.read()
        path.write_text("")
        append_lines(path, hour_of_changes("2026-11-01T01:00:00Z", range(1000, 1010)))
        returncode = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    stderr = process.stderr.read()
    errors = [line for line in stderr.splitlines() if not line.startswith("cdc.orders: checkpoint")]
    print(f"truncated while following: exit {returncode}; {errors}")
    assert returncode == 2 and len(errors) == 1, stderr
    assert str(path) in errors[0] and "truncated" in errors[0]
    assert table_counts(home) == (40, 0)
