"""Late-data signals that never miss: every late record leads to exactly one amendment of its hour, or
is covered by an acknowledgement that names it, whatever the order in which the ledger, base and the sensor see it.

The writer records its checkpoints in the late-data ledger a few at a time, after its CDC commits; a writer
killed in between (SIGKILL right after a commit, `PARTFIN_CRASH_AT=after-commit:1`) leaves its ledger rows
missing until the next writer start rebuilds them. Scenarios as an operator meets them: `partfin ingest`,
`partfin upsert` and `partfin late-data ack` as real processes, the finalization sensor ticking against a
real Dagster instance (its asset events recorded as the daemon records them).
"""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time

import pytest
from dagster import DagsterInstance

from partfin_assets.finalization.late_acks import acks_of, unacknowledged
from partfin_assets.finalization.late_data import late_data
from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.ledger import read_ledger
from partfin_assets.model.timeutil import parse_iso, to_us
from partfin_assets_tests.scenario_helpers import append_lines, change, ms, partfin
from partfin_assets_tests.test_downstream_reproducible import H1_KEY, HOURS, Pipeline

pytestmark = pytest.mark.timeout(600)

H1_US = to_us(parse_iso(HOURS[1]))
CRASH_AFTER_COMMIT = {"PARTFIN_CRASH_AT": "after-commit:1"}


def late_lines(first_key: int, count: int, minute: int) -> list[str]:
    return [change("c", first_key + i, ms(HOURS[1]) + (minute + i) * 60_000, status="paid", wrapped=True) for i in range(count)]


class Operator(Pipeline):
    """A table fed by `partfin ingest` from a Debezium file, merged by `partfin upsert`; the finalization sensor."""

    def __init__(self, tmp_path, instance):
        self.home = tmp_path / "home"
        path = tmp_path / "orders.jsonl"
        for n, hour in enumerate(HOURS):  # in the schema envelope: `partfin upsert` learns the column types
            append_lines(path, [change("c", 100 * n + i, ms(hour) + int(i * 2.5 * 60_000), status="paid", wrapped=True)
                                for i in range(1, 21)])
        super().__init__(path, instance)

    def ingest(self, path=None, writer: str = "orders-writer", crash: bool = False) -> None:
        done = partfin(self.home, "ingest", "--table", "orders", "--source", f"debezium:{path or self.path}", "--primary-key", "id",
                       "--writer-id", writer, "--checkpoint-records", "10", env_extra=CRASH_AFTER_COMMIT if crash else None)
        assert done.returncode == (-signal.SIGKILL if crash else 0), done.stderr

    def follow(self) -> subprocess.Popen:
        """`partfin ingest --follow` of the table's own file, running until SIGINT."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PARTFIN_")} | {"PARTFIN_HOME": str(self.home)}
        return subprocess.Popen([sys.executable, "-m", "partfin_assets.cli", "ingest", "--table", "orders", "--source",
                                 f"debezium:{self.path}", "--primary-key", "id", "--checkpoint-records", "10", "--follow"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def upsert(self) -> None:
        done = partfin(self.home, "upsert", "--table", "orders")
        assert done.returncode == 0, done.stderr

    def amendments(self, partition_key: str) -> list[dict]:
        return [e for e in self.events(partition_key) if e["amendment"]]


@pytest.fixture
def operator(tmp_path, monkeypatch):
    monkeypatch.setenv("PARTFIN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PARTFIN_SOURCE", raising=False)
    monkeypatch.setenv("PARTFIN_PARTITIONS_START", "2026-11-01-00:00")
    with DagsterInstance.ephemeral() as instance:
        op = Operator(tmp_path, instance)
        op.ingest()
        op.upsert()
        first = op.finalization_tick()
        assert H1_KEY in {r.partition_key for r in first.run_requests}  # H1 is final and was requested
        yield op


def test_late_records_merged_before_their_ledger_rows_get_one_amendment(operator):
    """Two late records for H1 are committed by a writer killed before it recorded them in the ledger; base merges
    them, the sensor ticks, then the next writer start records the ledger rows and the sensor ticks again.
    Before: no amendment at all (the first tick moved the cursor past the commit, the second no longer looked)."""
    op = operator
    append_lines(op.path, late_lines(5000, 2, minute=30))
    op.ingest(crash=True)
    catalog = load_partfin_catalog(op.home)
    assert read_ledger(catalog, "cdc.orders")["late_records"].sum() == 0  # not in the ledger yet
    op.upsert()  # base carries the late records now
    ticks = [op.finalization_tick()]
    op.ingest()  # the next writer start records the crashed run's ledger rows
    ticks += [op.finalization_tick(), op.finalization_tick()]
    amendments = op.amendments(H1_KEY)
    reruns = [r for t in ticks for r in t.run_requests if r.partition_key == H1_KEY]
    print(f"late records merged before their ledger rows: {len(amendments)} amendment(s) of H1 "
          f"({[a['late_records'] for a in amendments]} late records), {len(reruns)} re-run(s) requested")
    assert len(amendments) == 1 and amendments[0]["late_records"] == 2
    assert len(reruns) == 1


def test_an_acknowledgement_covers_exactly_the_late_records_it_was_shown(operator, tmp_path):
    """The table's writer follows its file. A second writer (backfill-1) commits 2 late records for H1 and is killed
    before its ledger rows are written; then the following writer commits 1 more and records it in the ledger.
    `partfin late-data ack` of H1 runs now; the backfill writer runs again (its ledger rows land).
    Before: the ack said 1 late record, yet covered all 3 (nothing open, 2 of them never shown)."""
    op = operator
    follower = op.follow()
    try:
        backfill = tmp_path / "backfill.jsonl"
        append_lines(backfill, late_lines(6000, 2, minute=20))
        op.ingest(backfill, writer="backfill-1", crash=True)
        append_lines(op.path, late_lines(7000, 1, minute=40))
        catalog = load_partfin_catalog(op.home)
        while read_ledger(catalog, "cdc.orders")["late_records"].sum() < 1:  # the follower recorded its late checkpoint
            assert follower.poll() is None, follower.communicate()
            time.sleep(0.5)
        ack = partfin(op.home, "late-data", "ack", "--table", "orders", "--hour", H1_KEY, "--reason", "reconciled upstream")
        assert ack.returncode == 0, ack.stderr
    finally:
        follower.send_signal(signal.SIGINT)
        follower.communicate(timeout=120)
    shown = int(ack.stdout.split(" late record(s) acknowledged")[0].rsplit(" ", 1)[1])
    op.ingest(backfill, writer="backfill-1")  # its ledger rows land now

    entry = late_data(catalog, "cdc.orders")[H1_US]
    acks = acks_of(catalog.load_table("cdc.orders").properties)
    still_open = sum(c.records for c in unacknowledged(entry, entry.commits, acks))
    print(f"ack of H1: shown {shown} late record(s); H1 holds {entry.records}, {still_open} not acknowledged")
    assert entry.records == 3
    assert entry.records - still_open == shown  # covered = shown, no more, no less


def test_late_records_acknowledged_before_the_sensor_sees_them_get_no_rerun_later_ones_one(operator):
    """Late records for H1 are merged and acknowledged before the sensor's next tick: no re-run (the owners said none is
    needed), whatever the tick order; a late record after the acknowledgement gets exactly one amendment, of itself."""
    op = operator
    append_lines(op.path, late_lines(5000, 2, minute=30))
    op.ingest()
    op.upsert()
    ack = partfin(op.home, "late-data", "ack", "--table", "orders", "--hour", H1_KEY, "--reason", "refunds, reconciled")
    assert ack.returncode == 0 and " 2 late record(s) acknowledged" in ack.stdout, ack.stdout + ack.stderr
    quiet = [r for t in (op.finalization_tick(), op.finalization_tick()) for r in t.run_requests if r.partition_key == H1_KEY]
    append_lines(op.path, late_lines(5100, 1, minute=50))
    op.ingest()
    op.upsert()
    later = [r for t in (op.finalization_tick(), op.finalization_tick()) for r in t.run_requests if r.partition_key == H1_KEY]
    amendments = op.amendments(H1_KEY)
    print(f"acknowledged before the sensor: {len(quiet)} re-run(s); a late record after it: {len(later)} re-run(s), "
          f"amendments {[a['late_records'] for a in amendments]}")
    assert not quiet
    assert len(later) == 1 and [a["late_records"] for a in amendments] == [1]


def test_status_and_the_late_data_check_name_the_same_hours_in_the_same_words(operator):
    """Late records reach H1 after it was final: `partfin status` and the late_data check both name H1 as holding late
    records neither re-run downstream nor acknowledged; once the amendment's downstream run succeeded, neither names it.
    Before: status kept listing every re-run hour as "late records not acknowledged" while the check passed."""
    from partfin_assets.finalization.table_checks import NEEDS_ATTENTION

    op = operator

    def late_check():
        run = op.defs.resolve_job_def("checks_orders").execute_in_process(instance=op.instance)
        return {e.check_name: e for e in run.get_asset_check_evaluations()}["late_data"]

    def status() -> tuple[dict, str]:
        done = partfin(op.home, "status", "--json")
        table = next(t for t in json.loads(done.stdout)["tables"] if t["name"] == "cdc.orders")
        return table["late_hours_needing_attention"], partfin(op.home, "status").stdout

    append_lines(op.path, late_lines(5000, 2, minute=30))
    op.ingest()
    op.upsert()
    check = late_check()
    attention, text = status()
    assert not check.passed and check.metadata["partitions_to_rerun"].value == [H1_KEY] == list(attention) and attention[H1_KEY] == 2
    assert NEEDS_ATTENTION in check.description and f"{NEEDS_ATTENTION} in hour(s) {H1_KEY} (2)" in text
    print(check.description)
    assert re.search(rf"{H1_KEY}: 2 record\(s\), the last \d+ (s|min( \d+ s)?) after the hour was final", check.description)  # how late

    (rerun,) = [r for r in op.finalization_tick().run_requests if r.partition_key == H1_KEY]
    op.activity(H1_KEY, tags=rerun.tags)  # the amendment's downstream run
    check = late_check()
    attention, text = status()
    assert check.passed and f"no hour holds {NEEDS_ATTENTION}" in check.description
    assert attention == {} and NEEDS_ATTENTION not in text
