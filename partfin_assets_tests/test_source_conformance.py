"""The source conformance suite: every registered source kind meets the same contract, as users meet it.

Each test is written once and runs for every kind in SOURCE_KINDS through its harness (source_harness.py):
real `partfin ingest` / `partfin replay` processes, killed with -9 at the writer's crash points, against the
real thing (files, the synthetic generator, PostgreSQL with wal2json, librdkafka's mock Kafka cluster).
What is checked is behaviour: the rows of cdc.<table> against the events the source was given (every event
exactly once), rejected rows and their reasons, the ledger's counts, exit codes and one-line errors.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pyarrow.compute as pc
import pytest

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.history import watermark_history, watermark_of
from partfin_assets.iceberg.ledger import read_ledger
from partfin_assets.model import summary_keys as K
from partfin_assets.model.timeutil import US_PER_HOUR, floor_hour_us, iso_z, parse_iso, to_us
from partfin_assets.sources.registry import SOURCE_KINDS
from partfin_assets_tests.scenario_helpers import partfin
from partfin_assets_tests.source_harness import HARNESSES, SourceHarness, open_harness, postgres_with_a_clock

CHECKPOINT = 10  # records per checkpoint: every run below spans several
# where each run of the kill test dies: between a checkpoint's data files and its commit, right after a commit
# (the n-th of the run), or at a random moment after the run's first checkpoint
KILLS = ("after-files:1", "after-commit:2", "timed", "after-files:3")


@pytest.fixture(scope="module", name="postgres_with_a_clock")
def postgres_with_a_clock_fixture():
    with postgres_with_a_clock() as cluster:
        yield cluster


@pytest.fixture(params=sorted(SOURCE_KINDS))
def harness(request, tmp_path):
    with open_harness(request.param, tmp_path, request) as harness:
        yield harness


def test_every_registered_source_kind_has_a_harness():
    """A kind added to the registry without a harness is a kind the suite does not check."""
    assert set(SOURCE_KINDS) == set(HARNESSES)


def ingest(home, harness: SourceHarness, *extra: str, spec: str | None = None):
    return partfin(home, "ingest", "--table", "orders", "--source", spec or harness.spec(), *harness.ingest_args(),
                   "--checkpoint-records", str(CHECKPOINT), *extra)


def start_ingest(home, harness: SourceHarness, crash_at: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARTFIN_")}
    env["PARTFIN_HOME"] = str(home)
    if crash_at:
        env["PARTFIN_CRASH_AT"] = crash_at
    command = [sys.executable, "-m", "partfin_assets.cli", "ingest", "--table", "orders", "--source", harness.spec(),
               *harness.ingest_args(), "--checkpoint-records", str(CHECKPOINT)]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def one_line_error(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, result.stderr)
    return lines[0]


def table_rows(home, identifier: str = "cdc.orders"):
    catalog = load_partfin_catalog(home)
    return catalog.load_table(identifier).scan().to_arrow() if catalog.table_exists(identifier) else None


def ledger_records(home) -> int:
    return sum(read_ledger(load_partfin_catalog(home), "cdc.orders", columns=("records",))["records"].to_list())


def assert_exactly_once(home, harness: SourceHarness) -> None:
    """cdc.orders holds every event the source was given, each once; the ledger counts each once too."""
    rows = table_rows(home)
    written, expected = harness.events_of(rows), harness.expected()
    assert sum(expected.values()) > 0
    missing, doubled = expected - written, written - expected
    assert not missing and not doubled, (f"missing {sum(missing.values())}: {list(missing)[:3]}; "
                                         f"extra {sum(doubled.values())}: {list(doubled)[:3]}")
    assert ledger_records(home) == rows.num_rows


def test_exactly_once_across_kill_minus_nine_and_resume(harness, tmp_path):
    """`partfin ingest` killed with -9 at four moments while the source keeps growing: every event lands once, the
    watermark never goes back; a run to the end, then a run with nothing new, change nothing more."""
    home = tmp_path / "home"
    rng = random.Random(25)
    watermarks: list[int] = []
    harness.add_events(4 * CHECKPOINT)
    for crash_at in KILLS:
        if harness.grows:
            harness.add_events(4 * CHECKPOINT)  # enough for every run to reach its moment
        process = start_ingest(home, harness, None if crash_at == "timed" else crash_at)
        if crash_at == "timed":
            process.stderr.readline()  # its first checkpoint landed
            time.sleep(rng.uniform(0.0, 0.2))
            process.send_signal(signal.SIGKILL)
        _, stderr = process.communicate(timeout=300)
        # a fixed crash point always lands (the run has the checkpoints to reach it); a timed kill may come after the end
        assert process.returncode == -signal.SIGKILL or (crash_at == "timed" and process.returncode == 0), stderr.decode()
        catalog = load_partfin_catalog(home)
        if catalog.table_exists("cdc.orders"):
            table = catalog.load_table("cdc.orders")
            history = [w for _, w in watermark_history(table.metadata)]
            assert history == sorted(history)
            if watermark_of(table.properties) is not None:
                watermarks.append(watermark_of(table.properties))
    if harness.grows:
        harness.add_events(CHECKPOINT)
    assert ingest(home, harness).returncode == 0
    assert_exactly_once(home, harness)
    rows = table_rows(home).num_rows
    again = ingest(home, harness)  # resumes at the end: nothing new, nothing read twice
    assert again.returncode == 0, again.stderr
    assert table_rows(home).num_rows == rows
    assert_exactly_once(home, harness)
    assert watermarks == sorted(watermarks)


def test_a_poisoned_message_is_rejected_with_its_reason_once_and_the_stream_goes_on(harness, tmp_path):
    home = tmp_path / "home"
    harness.add_events(2 * CHECKPOINT)
    reason = harness.add_poison()
    if reason is None:
        pytest.skip(f"{harness.kind}: the source has no malformed input")
    harness.add_events(2 * CHECKPOINT)
    first = ingest(home, harness)
    assert first.returncode == 0, first.stderr
    again = ingest(home, harness)
    assert again.returncode == 0, again.stderr
    assert_exactly_once(home, harness)
    rejected = table_rows(home, "cdc.orders__rejected")
    assert rejected is not None and rejected.num_rows == 1, rejected  # once, across both runs
    (row,) = rejected.to_pylist()
    assert reason in row["reason"] and row["raw"], row
    assert row["source_log"], row  # placed in its change log, whatever the source


def test_heartbeats_move_an_idle_stream_on(harness, tmp_path):
    """After the last event only heartbeats come: the table's source clock reaches them and the watermark follows."""
    home = tmp_path / "home"
    harness.add_events(CHECKPOINT)
    heartbeats = harness.add_heartbeats()
    if heartbeats is None:
        pytest.skip(f"{harness.kind}: the source has no heartbeats")
    result = ingest(home, harness)
    assert result.returncode == 0, result.stderr
    table = load_partfin_catalog(home).load_table("cdc.orders")
    beats = [s.summary.get(K.EVENT_TIME_HEARTBEAT) for s in table.snapshots() if s.summary is not None]
    clocks = [to_us(parse_iso(beat)) for beat in beats if beat]  # the source clock each heartbeat-only checkpoint recorded
    assert clocks and max(clocks) >= heartbeats.after_us, (clocks, heartbeats)
    watermark = watermark_of(table.properties)
    assert watermark is not None and watermark >= floor_hour_us(heartbeats.after_us) - US_PER_HOUR, iso_z(watermark or 0)
    assert_exactly_once(home, harness)


def test_another_source_for_the_same_table_is_refused_in_one_line(harness, tmp_path):
    """cdc.orders keeps one change log: a spec reading another history of the same kind is refused, nothing written;
    the table's own source goes on."""
    home = tmp_path / "home"
    harness.add_events(2 * CHECKPOINT)
    assert ingest(home, harness).returncode == 0
    before = table_rows(home).num_rows
    line = one_line_error(ingest(home, harness, spec=harness.other_spec()))
    print(f"{harness.kind}, another source: {line}")
    assert "cdc.orders reads from" in line and harness.kind in line, line  # names the table's current source
    assert table_rows(home).num_rows == before
    harness.add_events(CHECKPOINT)
    assert ingest(home, harness).returncode == 0
    assert_exactly_once(home, harness)


def test_replay_reproduces_the_hour_or_is_refused_in_one_line(harness, tmp_path):
    """`partfin replay` of an ingested hour: a source that reads its history again gives the hour back as it was;
    one that cannot is refused in one line naming why, the hour untouched."""
    home = tmp_path / "home"
    harness.add_events(3 * CHECKPOINT)
    assert ingest(home, harness).returncode == 0
    rows = table_rows(home)
    hour = floor_hour_us(pc.min(pc.cast(rows.column("event_time"), "int64")).as_py())

    def hour_events():
        rows = table_rows(home)
        times = pc.cast(rows.column("event_time"), "int64")
        return harness.events_of(rows.filter(pc.and_(pc.greater_equal(times, hour), pc.less(times, hour + US_PER_HOUR))))

    before = hour_events()
    assert before
    result = partfin(home, "replay", "--table", "orders", "--hour", iso_z(hour))
    if harness.replayable:
        assert result.returncode == 0, result.stderr
        assert "(0 added, 0 removed" in result.stdout, result.stdout
    else:
        line = one_line_error(result)
        print(f"{harness.kind}, replay: {line}")
        assert "cannot replay" in line and harness.refusal in line, line
    assert hour_events() == before
