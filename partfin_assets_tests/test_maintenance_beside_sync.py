"""`partfin upsert` and `partfin maintain` in loops beside a running `partfin ingest --follow`: the normal deployment
(the daily maintenance beside the sync), as real processes on one catalog.

Every run of both loops is parked at the point where a snapshot it read can be expired under it (PARTFIN_PAUSE_AT):
the upsert after its base commit, before it moves cdc's `partfin-base-merged` tag to the snapshot it merged; the
maintenance after loading a table's metadata for orphan removal, before it reads the retained snapshots' manifests.
The test releases it once the writer's (or the other loop's) expiry removed such a snapshot, so each run meets the
race instead of one in ten. Every process must end 0 (or with the documented one-line conflict error, exit 2), never
with a traceback (exit 1), and base.orders must be exactly last-writer-wins of cdc.orders afterwards.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow.compute as pc
import pytest
from pyiceberg.exceptions import CommitFailedException

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.commit import remove_snapshots
from partfin_assets.iceberg.tables import SOURCE_SEQ, read_base
from partfin_assets.jobs.upsert.plan import merged_source_snapshot_id
from partfin_assets_tests.cdc_files import partfin, partfin_command, partfin_env

pytestmark = pytest.mark.timeout(600)

LOOPS_S = 30.0  # long enough for several runs of each loop, each parked until the race it is there to meet
RELEASE_BOUND_S = 8.0  # a parked run is released after this even if the expiry it waits for did not come


def _iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _snapshot_ids(catalog, identifier: str) -> set[int]:
    return {s.snapshot_id for s in catalog.load_table(identifier).metadata.snapshots}


def _wait_until(condition, bound_s: float) -> bool:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


class ParkedLoop:
    """Runs one `partfin` command again and again until `until`, each run parked at `point` until `released(catalog)`
    holds for the state seen when it got there (or RELEASE_BOUND_S passed)."""

    def __init__(self, tmp_path: Path, home: Path, name: str, args: list[str], point: str, release_condition) -> None:
        self.tmp_path, self.home, self.name, self.args, self.point = tmp_path, home, name, args, point
        self.release_condition = release_condition
        self.results: list[tuple[int, str, str]] = []  # (exit code, stdout, stderr)
        self.met_race = 0  # runs released because the race they wait for happened
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self, until: float) -> None:
        self.until = until
        self.thread.start()

    def _run(self) -> None:
        catalog = load_partfin_catalog(self.home)  # this thread's own
        run = 0
        while time.monotonic() < self.until:
            run += 1
            pauses = self.tmp_path / f"pauses-{self.name}-{run}"
            pauses.mkdir()
            process = subprocess.Popen(
                partfin_command(*self.args),
                env=partfin_env(self.home, PARTFIN_PAUSE_AT=self.point, PARTFIN_PAUSE_DIR=str(pauses)),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            if _wait_until(lambda: (pauses / f"{self.point}.reached").exists() or process.poll() is not None, 120):
                if process.poll() is None:
                    released = self.release_condition(catalog)
                    self.met_race += _wait_until(released, RELEASE_BOUND_S)
            (pauses / f"{self.point}.go").touch()
            out, err = process.communicate(timeout=300)
            self.results.append((process.returncode, out, err))

    def join(self) -> None:
        self.thread.join(timeout=400)
        assert not self.thread.is_alive(), f"the {self.name} loop did not end"


def _maintenance_release(catalog):
    """The maintenance loaded cdc.orders before it got here: release it once a snapshot it saw is expired."""
    seen = _snapshot_ids(catalog, "cdc.orders")
    return lambda: bool(seen - _snapshot_ids(catalog, "cdc.orders"))


def _upsert_release(catalog):
    """The upsert committed base.orders merged up to a cdc snapshot: release it once that snapshot is expired."""
    merged = merged_source_snapshot_id(catalog.load_table("base.orders").properties)
    return lambda: merged not in _snapshot_ids(catalog, "cdc.orders")


def _last_writer_wins(catalog) -> dict[int, tuple[int, str]]:
    """key -> (source_seq, payload) of its newest change in cdc.orders (one change log), keys whose newest is a delete left out."""
    changes = catalog.load_table("cdc.orders").scan(selected_fields=("key", "op", "source_seq", "payload")).to_arrow()
    changes = changes.take(pc.sort_indices(changes, [("source_seq", "ascending")]))
    newest: dict[int, tuple[str, int, str]] = {}
    for key, op, seq, payload in zip(*(changes.column(c).to_pylist() for c in ("key", "op", "source_seq", "payload"))):
        newest[json.loads(key)["id"]] = (op, seq, payload)
    return {key: (seq, payload) for key, (op, seq, payload) in newest.items() if op != "d"}


def test_upsert_and_maintain_loops_beside_a_following_writer_end_cleanly_and_base_stays_exact(tmp_path):
    home = tmp_path / "home"
    now = datetime.now(UTC).replace(microsecond=0)
    # event time runs 60x faster than the wall clock from an hour and a half ago: a steady ~3 checkpoints a second
    # for the whole test, each an expiry candidate (the writer expires as it goes, the maintenance keeps one)
    source = (f"synthetic:seed=7,rate=0.5,key_space=300,late_fraction=0,idle_every=off,"
              f"start={_iso(now - timedelta(minutes=90))},speed=60,speed_since={_iso(now)}")
    writer = subprocess.Popen(
        partfin_command("ingest", "--table", "orders", "--source", source, "--checkpoint-records", "10",
                        "--watermark-policy", "min-of-last:3", "--follow"),
        env=partfin_env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    catalog = None
    try:
        def ingested() -> bool:
            nonlocal catalog
            if not (home / "catalog.db").exists():
                return False
            catalog = catalog or load_partfin_catalog(home)
            return catalog.table_exists("cdc.orders") and len(_snapshot_ids(catalog, "cdc.orders")) >= 2
        assert _wait_until(ingested, 120) and writer.poll() is None, writer.communicate(timeout=30)
        first = partfin(home, "upsert", "--table", "orders")  # base.orders exists before the loops start
        assert first.returncode == 0, first.stderr

        until = time.monotonic() + LOOPS_S
        upserts = ParkedLoop(tmp_path, home, "upsert", ["upsert", "--table", "orders"], "merged-tag-commit", _upsert_release)
        maintenance = ParkedLoop(tmp_path, home, "maintain", ["maintain", "--table", "orders", "--keep-last", "1"],
                                 "orphans-after-load", _maintenance_release)
        upserts.start(until)
        maintenance.start(until)
        upserts.join()
        maintenance.join()
        assert writer.poll() is None, writer.communicate(timeout=30)
    finally:
        writer.send_signal(signal.SIGINT)
        out, err = writer.communicate(timeout=120)
    assert writer.returncode == 130, err[-3000:]

    # the maintenance meets its race every run; the upsert's is rarer since expiry keeps base's merge position too
    assert len(maintenance.results) >= 2 and maintenance.met_race >= 1, (len(maintenance.results), maintenance.met_race)
    assert len(upserts.results) >= 2, len(upserts.results)
    for loop in (upserts, maintenance):
        for code, out, err in loop.results:
            assert code in (0, 2), f"partfin {loop.name} ended {code}:\n{err[-3000:]}"
            if code == 2:  # the documented outcome of a conflict whose retries ran out: one line
                lines = err.strip().splitlines()
                assert lines[-1].startswith("partfin: error: ") and "conflict" in lines[-1], err[-3000:]
                assert "Traceback" not in err, err[-3000:]

    final = partfin(home, "upsert", "--table", "orders")
    assert final.returncode == 0, final.stderr
    expected = _last_writer_wins(catalog)
    base = read_base(catalog, "orders", selected_fields=("id", SOURCE_SEQ))
    assert dict(zip(base.column("id").to_pylist(), base.column(SOURCE_SEQ).to_pylist())) == {
        key: seq for key, (seq, _) in expected.items()}
    rows = read_base(catalog, "orders", selected_fields=("id", "amount", "status", "user_id")).to_pylist()
    assert {r["id"]: (r["amount"], r["status"], r["user_id"]) for r in rows} == {
        key: (after["amount"], after["status"], after["user_id"])
        for key, (_, payload) in expected.items() for after in [json.loads(payload)]}


def test_a_commit_that_refers_to_what_a_concurrent_expiry_removed_loses_its_race(tmp_path):
    """The catalog applies a commit to the metadata current when it lands: a snapshot another process expired since
    the commit was built (a tag to point at it, an expiry of it) is a lost compare-and-set, retried, not a ValueError."""
    home = tmp_path / "home"
    ingested = partfin(home, "ingest", "--table", "orders", "--source",
                       "synthetic:seed=3,start=2026-11-01T00:00:00Z,end=2026-11-01T01:00:00Z,rate=0.05", "--checkpoint-records", "20")
    assert ingested.returncode == 0, ingested.stderr
    catalog = load_partfin_catalog(home)
    stale = catalog.load_table("cdc.orders")
    oldest = min(stale.metadata.snapshots, key=lambda s: s.sequence_number)
    assert remove_snapshots(catalog.load_table("cdc.orders"), [oldest]) == 1  # another process's expiry
    assert remove_snapshots(stale, [oldest]) == 0  # expiring it again from the older view: a lost race
    with pytest.raises(CommitFailedException, match="changed under this commit"):
        with stale.manage_snapshots() as refs:
            refs.create_tag(oldest.snapshot_id, "partfin-base-merged")
    assert "partfin-base-merged" not in catalog.load_table("cdc.orders").metadata.refs
