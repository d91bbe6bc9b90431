"""The `partfin` command as users run it: real processes, real catalog, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


DATA = Path(__file__).parent / "data"


def partfin(home, *args, env_extra=None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARTFIN_")}
    env.update({"PARTFIN_HOME": str(home), **(env_extra or {})})
    return subprocess.run([sys.executable, "-m", "partfin_assets.cli", *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_ingest_then_status_json(tmp_path):
    source = "synthetic:seed=3,start=2026-11-01T00:00:00Z,end=2026-11-01T04:00:00Z,rate=0.5"
    result = partfin(tmp_path, "ingest", "--table", "orders", "--source", source, "--checkpoint-records", "1000")
    assert result.returncode == 0, result.stderr
    assert "checkpoint" in result.stderr  # progress lines when not on a terminal
    status = json.loads(partfin(tmp_path, "status", "--json").stdout)
    (cdc,) = [t for t in status["tables"] if t["name"] == "cdc.orders"]
    assert {"name", "watermark", "policy", "checkpoint_id", "late_records"} <= set(cdc)
    assert cdc["policy"] == "late-budget:0.001:feedback" and cdc["checkpoint_id"] >= 3  # the default for new tables
    assert cdc["watermark"].endswith(":00:00Z")

    again = partfin(tmp_path, "ingest", "--table", "orders", "--source", source)
    assert again.returncode == 0, again.stderr
    assert json.loads(partfin(tmp_path, "status", "--json").stdout)["tables"][0]["checkpoint_id"] == cdc["checkpoint_id"]

    text = partfin(tmp_path, "status").stdout
    assert "cdc.orders" in text and cdc["watermark"] in text


def test_debezium_ingest_needs_a_primary_key_for_a_new_table(tmp_path):
    path = DATA / "debezium_wrapped.jsonl"
    result = partfin(tmp_path, "ingest", "--table", "customers", "--source", f"debezium:{path}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "partfin: error: cdc.customers does not exist yet: give its key with --primary-key COL[,COL]"
    ]


def test_unreachable_catalog_is_one_clear_line(tmp_path):
    result = partfin(tmp_path, "status", env_extra={"PARTFIN_CATALOG_URI": "postgresql+psycopg://u:secret@127.0.0.1:1/none"})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "cannot reach the Iceberg catalog at postgresql+psycopg://u:***@127.0.0.1:1/none" in lines[0]
    assert "PARTFIN_CATALOG_URI" in lines[0] and "secret" not in lines[0]


def test_unknown_table_and_bad_source_name_the_problem(tmp_path):
    result = partfin(tmp_path, "upsert", "--table", "nope")
    assert result.returncode == 2  # no catalog there yet: said, and none is created (test_refusals.py)
    assert len(result.stderr.strip().splitlines()) == 1 and f"no partfin catalog at {tmp_path}" in result.stderr
    from partfin_assets.iceberg.catalog import load_partfin_catalog

    load_partfin_catalog(tmp_path)  # an empty catalog
    result = partfin(tmp_path, "upsert", "--table", "nope")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "cdc.nope" in result.stderr
    result = partfin(tmp_path, "ingest", "--table", "orders", "--source", "kinesis:topic")
    assert result.returncode == 2 and "unknown source kind 'kinesis'" in result.stderr


def test_debezium_ingest_with_bad_lines_rejects_them_and_goes_on(tmp_path):
    good = (DATA / "debezium_wrapped.jsonl").read_text().splitlines()
    lines = [
        good[0],
        "{not json",
        '{"op":"c","after":{"id":9},"source":{}}',  # no source.ts_ms
        '{"op":"x","after":{"id":9},"source":{"ts_ms":1790000000000}}',
        '{"op":"u","source":{"ts_ms":1790000000000}}',  # no after
        '{"op":"c","after":{"region":"eu"},"source":{"ts_ms":1790000000000}}',  # no key
        *good[1:],
    ]
    path = tmp_path / "changes.jsonl"
    path.write_text("\n".join(lines) + "\n")
    result = partfin(tmp_path, "ingest", "--table", "shop", "--source", f"debezium:{path}", "--primary-key", "id")
    assert result.returncode == 0, result.stderr

    from partfin_assets.iceberg.catalog import load_partfin_catalog

    catalog = load_partfin_catalog(tmp_path)
    rejected = catalog.load_table("cdc.shop__rejected").scan().to_arrow().sort_by("source_seq")
    assert rejected.column("source_seq").to_pylist() == [2, 3, 4, 5, 6]
    assert rejected.column("raw").to_pylist() == lines[1:6]
    reasons = rejected.column("reason").to_pylist()
    assert all(reason.startswith(f"line {n}:") for n, reason in zip(range(2, 7), reasons))
    cdc = catalog.load_table("cdc.shop")
    # the envelope's schema block completed the declaration that named only the key
    declared = json.loads(cdc.properties["partfin.columns"])
    assert declared["id"] == "int64" and declared["price"] == "decimal128(10, 2)" and declared["order_date"] == "date32[day]"
    summaries = [s.summary.additional_properties for s in cdc.metadata.snapshots]
    assert sum(int(s.get("partfin.rejected-records", 0)) for s in summaries) == 5
    assert cdc.scan().to_arrow().num_rows == sum(1 for line in good if '"payload":null' not in line)

    again = partfin(tmp_path, "ingest", "--table", "shop", "--source", f"debezium:{path}")
    assert again.returncode == 0, again.stderr  # resumes after the last committed line: nothing twice
    assert load_partfin_catalog(tmp_path).load_table("cdc.shop__rejected").scan().to_arrow().num_rows == 5


def test_every_bad_value_a_user_gives_is_one_line_and_exit_2(tmp_path):
    synthetic = "synthetic:seed=1,start=2026-11-01T00:00:00Z,end=2026-11-01T01:00:00Z"
    cases = {
        ("ingest", "--table", "orders", "--source", synthetic, "--subtasks", "0"): "--subtasks: must be at least 1",
        ("ingest", "--table", "orders", "--source", synthetic, "--checkpoint-records", "0"): "--checkpoint-records: must be at least 1",
        # the source option named as the user wrote it (before: "rate must be positive, got -1.0")
        ("ingest", "--table", "orders", "--source", "synthetic:rate=-1"): "synthetic source option rate=-1: must be positive",
        # before: "unrecognized arguments: -5m"
        ("streams", "idle-timeout", "--table", "orders", "-5m"): "a negative duration is refused: '-5m'",
        ("maintain", "--table", "orders", "--orphan-min-age", "-1h"): "--orphan-min-age: a negative duration is refused: '-1h'",
        # before: only the ISO form was shown
        ("replay", "--table", "orders", "--hour", "bogus"): "name an hour as 2026-01-01-05:00 or 2026-01-01T05:00:00Z",
        ("ingest", "--table", "orders", "--source", "synthetic:start=yesterday"): "yesterday",
        ("streams", "idle-timeout", "--table", "orders", "soon"): "not a duration: 'soon'",
    }
    for args, expected in cases.items():
        result = partfin(tmp_path, *args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2, (args, result.stderr)
        assert len(lines) == 1 and lines[0].startswith("partfin: error: ") and expected in lines[0], (args, lines)


def test_status_names_the_home_and_catalog_it_read(tmp_path):
    """Before: `partfin status` never said which home it read; without PARTFIN_HOME it said only "no partfin tables yet"."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARTFIN_")}
    nowhere = subprocess.run([sys.executable, "-m", "partfin_assets.cli", "status"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120)
    assert nowhere.returncode == 0, nowhere.stderr
    assert f"no partfin tables yet in partfin home {tmp_path / '.partfin'} (PARTFIN_HOME unset: ./.partfin)" in nowhere.stdout
    assert f"sqlite:///{tmp_path / '.partfin' / 'catalog.db'}" in nowhere.stdout

    home = tmp_path / "home"
    source = "synthetic:seed=3,start=2026-11-01T00:00:00Z,end=2026-11-01T02:00:00Z,rate=0.5"
    assert partfin(home, "ingest", "--table", "orders", "--source", source).returncode == 0
    first = partfin(home, "status").stdout.splitlines()[0]
    assert first == f"partfin home {home} (PARTFIN_HOME), SQL catalog at sqlite:///{home / 'catalog.db'}"
    shown = json.loads(partfin(home, "status", "--json").stdout)
    assert shown["home"] == str(home) and shown["catalog"] == f"SQL catalog at sqlite:///{home / 'catalog.db'}"


def test_a_bug_is_not_dressed_up_as_a_user_error(tmp_path, monkeypatch, capsys):
    # only PartfinError is the user's to fix (one line, exit 2); any other exception, a ValueError
    # included, is a bug: its traceback and exit 1
    from partfin_assets import cli
    from partfin_assets.cli import tables
    from partfin_assets.iceberg.catalog import load_partfin_catalog

    def broken_upsert(catalog, table):
        raise ValueError("an invariant partfin broke")

    monkeypatch.setenv("PARTFIN_HOME", str(tmp_path))
    load_partfin_catalog(tmp_path)  # a catalog there (upsert creates none)
    monkeypatch.setattr(tables, "run_upsert", broken_upsert)
    assert cli.main(["upsert", "--table", "orders"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "ValueError: an invariant partfin broke" in err and "partfin: error" not in err


def test_report_writes_a_self_contained_page_and_a_png(tmp_path):
    source = "synthetic:seed=4,start=2026-11-01T00:00:00Z,end=2026-11-01T05:00:00Z,rate=0.5,late_fraction=0.02,idle_every=off"
    assert partfin(tmp_path, "ingest", "--table", "orders", "--source", source, "--checkpoint-records", "500").returncode == 0
    result = partfin(tmp_path, "report", "--table", "orders", "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    page, picture = tmp_path / "out" / "orders.html", tmp_path / "out" / "orders.png"
    assert str(page) in result.stdout and str(picture) in result.stdout
    text = page.read_text()
    status = json.loads(partfin(tmp_path, "status", "--json").stdout)["tables"][0]
    # the policy and watermark of the table, the four plots, plotly.js inlined (no network needed)
    assert status["policy"] in text and status["watermark"] in text
    for title in ("Watermark over wall time", "Finalization lag per hour", "Late records per hour", "Records per hour"):
        assert title in text
    assert "<script src=\"http" not in text and "Plotly.newPlot" in text
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the late records the page counts are those `partfin status` counts
    assert f"<th>late records</th><td>{status['late_records']}</td>" in text
    missing = partfin(tmp_path, "report", "--table", "nope")
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
