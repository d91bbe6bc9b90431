"""A privacy delete racing an upsert in flight: every interleaving of the delete's steps with the
upsert's read and its commit.

The upsert is a real `partfin upsert` process stopped at its fault points (`PARTFIN_PAUSE_AT`): after its read
(planned, erasures loaded, CDC changes read and decoded) and after its files (quarantine committed, base files
written, before the base commit). The delete runs in the test process; its `after_step` hook, called once each
step is done (registered, then each table, then the references), starts the upsert or lets it go on, so the
upsert reads in gap `read` and commits in gap `commit` >= `read` (gap i: after the delete's step i-1; the last:
after the delete returned). Whatever the interleaving, once both are done the key is in no table, and stays out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.jobs.privacy import STEP_REFERENCES, STEP_REGISTERED, privacy_delete
from partfin_assets.jobs.upsert import run_upsert
from partfin_assets.model.records import REJECTED_RECORD_SCHEMA, ChangeBatch
from partfin_assets_tests.conftest import MINUTE_US, ORDERS, T0_US, change_batch
from partfin_assets_tests.test_privacy_erasure import ERASED, where_the_key_is

STEPS = [STEP_REGISTERED, "cdc.orders", "cdc.orders__rejected", "base.orders", "base.orders__rejected", STEP_REFERENCES]
GAPS = range(len(STEPS) + 1)  # gap i: after i steps (0: before the request); the last: after the delete returned
INTERLEAVINGS = [(read, commit) for read in GAPS for commit in GAPS if read <= commit]


class PausedUpsert:
    """`partfin upsert` as a real process, stopped after its read and again before its commit."""

    def __init__(self, home: Path, pauses: Path) -> None:
        self.home, self.pauses = home, pauses
        self.process: subprocess.Popen | None = None
        self.output = ""

    def read(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PARTFIN_")}
        env.update({"PARTFIN_HOME": str(self.home), "PARTFIN_PAUSE_DIR": str(self.pauses),
                    "PARTFIN_PAUSE_AT": "upsert-after-read,upsert-after-files"})
        self.process = subprocess.Popen([sys.executable, "-m", "partfin_assets.cli", "upsert", "--table", "orders"],
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._wait("upsert-after-read")

    def commit(self) -> None:
        if self.process is None:
            self.read()
        (self.pauses / "upsert-after-read.go").touch()
        self._wait("upsert-after-files")
        (self.pauses / "upsert-after-files.go").touch()
        self.output, _ = self.process.communicate(timeout=300)
        assert self.process.returncode == 0, self.output

    def _wait(self, point: str) -> None:
        deadline = time.monotonic() + 120
        while not (self.pauses / f"{point}.reached").exists():
            assert self.process.poll() is None, f"upsert ended before {point}: {self.process.communicate()[0]}"
            assert time.monotonic() < deadline, f"upsert never reached {point}"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def seed(home: Path, base_holds_the_key: bool) -> None:
    """base.orders merged with keys 1-5 (and the erased key, if `base_holds_the_key`); pending in cdc.orders: an
    update of key 1, a change of the erased key that merges and one that the upsert quarantines; a raw line naming
    the erased key in cdc.orders__rejected."""
    catalog = load_partfin_catalog(home)
    writer = CdcWriter(catalog, ORDERS)
    first = [1, 2, 3, 4, 5] + ([ERASED] if base_holds_the_key else [])
    bad = pa.table({"source_seq": [99], "raw": ['{"payload":{"op":"u","after":{"id":42,"amount":'], "reason": ["not JSON"]},
                   schema=REJECTED_RECORD_SCHEMA)
    batch = change_batch(T0_US + np.arange(len(first)) * MINUTE_US, offset="1", seq_start=0, keys=first)
    writer.write_checkpoint(ChangeBatch(batch.records, offset="1", rejected=bad))
    run_upsert(catalog, "orders")
    pending = change_batch(T0_US + (10 + np.arange(3)) * MINUTE_US, offset="2", seq_start=100, keys=[1, ERASED, ERASED])
    payloads = pending.records.column("payload").to_pylist()
    payloads[2] = json.dumps({"id": ERASED, "amount": "lots"})  # does not fit the declared double: quarantined
    records = pending.records.set_column(4, "payload", pa.array(payloads, pa.string()))
    writer.write_checkpoint(ChangeBatch(records, offset="2"))
    writer.close()


def run_interleaving(tmp_path: Path, read: int, commit: int, base_holds_the_key: bool) -> None:
    home, pauses = tmp_path / "home", tmp_path / "pauses"
    pauses.mkdir()
    seed(home, base_holds_the_key)
    upsert = PausedUpsert(home, pauses)
    done_steps: list[str] = []

    def at_gap(gap: int) -> None:
        if gap == read:
            upsert.read()
        if gap == commit:
            upsert.commit()

    def after_step(step: str) -> None:
        done_steps.append(step)
        if len(done_steps) < len(STEPS):
            at_gap(len(done_steps))

    try:
        at_gap(0)
        result = privacy_delete(load_partfin_catalog(home), "orders", [{"id": ERASED}], request_id="race", after_step=after_step)
        assert done_steps == STEPS
        if commit < len(STEPS):  # the upsert is done: the key must be gone the moment the delete says so
            assert where_the_key_is(home) == {}, "the delete reported done with the key still in a table"
        at_gap(len(STEPS))  # after the delete returned
    finally:
        upsert.stop()
    print(f"read in gap {read}, commit in gap {commit}: deleted {result.deleted_by_table()}; upsert: "
          + " | ".join(upsert.output.strip().splitlines()[:1]))
    assert where_the_key_is(home) == {}
    base = {r["id"]: r["amount"] for r in load_partfin_catalog(home).load_table("base.orders").scan().to_arrow().to_pylist()}
    assert base == {1: 1.5, 2: 1.5, 3: 1.5, 4: 1.5, 5: 1.5}
    again = run_upsert(load_partfin_catalog(home), "orders")
    assert again.inserted == 0 and where_the_key_is(home) == {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("read", "commit"), INTERLEAVINGS, ids=[f"read{r}-commit{c}" for r, c in INTERLEAVINGS])
def test_an_upsert_in_flight_at_any_step_of_the_delete(tmp_path, read, commit):
    """base does not hold the key yet: the upsert is what would bring it in."""
    run_interleaving(tmp_path, read, commit, base_holds_the_key=False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("commit", list(GAPS), ids=[f"commit{c}" for c in GAPS])
def test_an_upsert_that_read_before_the_request_when_base_holds_the_key(tmp_path, commit):
    run_interleaving(tmp_path, 0, commit, base_holds_the_key=True)
