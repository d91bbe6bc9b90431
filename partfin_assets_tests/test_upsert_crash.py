"""Crash safety: kill -9 the upsert at its phases and at random times, rerun; the end state is exact.

Exact means: base content equals the reference model of all CDC changes,
`partfin.source-snapshot-id` is the CDC head, every merged CDC position appears in
exactly one base snapshot (nothing applied twice), and the base watermark equals the
merged CDC snapshot's and never went backwards.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from partfin_assets.iceberg.history import summary_of, watermark_history
from partfin_assets.model import summary_keys as K
from partfin_assets_tests.test_upsert import Change, Harness
from partfin_assets_tests.test_upsert_properties import reference

UPSERT = (  # its own entry point: it installs the PARTFIN_*-driven fault hooks, as `partfin` does
    "import sys; from partfin_assets.iceberg.catalog import load_partfin_catalog; "
    "from partfin_assets.jobs.upsert import run_upsert; "
    "from partfin_assets.model.faults import install_faults; from partfin_assets.testing.faults import EnvFaults; "
    "install_faults(EnvFaults()); "
    "print(run_upsert(load_partfin_catalog(sys.argv[1]), 'orders').describe())"
)


def start_upsert(home: Path, crash_at: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PARTFIN_CRASH_AT"}
    if crash_at:
        env["PARTFIN_CRASH_AT"] = crash_at
    return subprocess.Popen([sys.executable, "-c", UPSERT, str(home)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def random_changes(rng: np.random.Generator, n: int, first_seq: int, keys: int, minute0: int) -> list[Change]:
    ids = rng.integers(1, keys + 1, n)
    ops = rng.choice(["c", "u", "d"], n, p=[0.3, 0.55, 0.15])
    minutes = minute0 + rng.integers(-90, 60, n)  # out of order, some of it late
    return [
        (int(i), str(op), int(m), first_seq + j, None if op == "d" else float(j % 97))
        for j, (i, op, m) in enumerate(zip(ids, ops, minutes))
    ]


def assert_exact(h: Harness, all_changes: list[Change]) -> None:
    base, cdc = h.base(), h.cdc()
    assert h.live() == reference(all_changes)
    head = cdc.current_snapshot().snapshot_id
    assert base.properties[K.PROP_SOURCE_SNAPSHOT_ID] == str(head)
    positions = [summary_of(s).get(K.PROP_SOURCE_SNAPSHOT_ID) for s in base.metadata.snapshots]
    positions = [p for p in positions if p]
    assert len(positions) == len(set(positions)), "a CDC position was merged twice"
    assert base.properties[K.PROP_WATERMARK] == summary_of(cdc.current_snapshot())[K.WATERMARK]
    history = [wm for _, wm in watermark_history(base.metadata)]
    assert history == sorted(history)


@pytest.mark.parametrize("phase", ["after-read", "after-files", "after-commit"])
def test_kill_at_phase_then_rerun(tmp_path: Path, phase: str):
    h = Harness(tmp_path)
    rng = np.random.default_rng(7)
    first = random_changes(rng, 300, 1, 80, 0)
    second = random_changes(rng, 300, 1000, 80, 120)
    h.write(first)
    h.upsert()
    h.write(second)
    before = len(h.base().metadata.snapshots)

    proc = start_upsert(tmp_path, f"upsert-{phase}:1")
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    committed = len(h.base().metadata.snapshots) - before
    assert committed == (1 if phase == "after-commit" else 0)

    rerun = h.upsert()
    if phase == "after-commit":
        assert rerun.base_snapshot_id is None  # already merged: nothing applied twice
    else:
        assert rerun.base_snapshot_id is not None
    assert_exact(h, first + second)
    # the tag the killed run could not move is repaired by the rerun
    assert h.cdc().metadata.refs[K.MERGED_TAG].snapshot_id == h.cdc().current_snapshot().snapshot_id


def test_kill_at_random_times(tmp_path: Path):
    h = Harness(tmp_path)
    rng = np.random.default_rng(11)
    chooser = random.Random(11)
    all_changes: list[Change] = []
    seq = 1
    outcomes = {"killed": 0, "finished": 0}
    for round_ in range(6):
        for _ in range(2):
            batch = random_changes(rng, 3000, seq, 2000, 60 * round_)
            seq += len(batch)
            all_changes += batch
            h.write(batch)
        for _ in range(2):  # two kill attempts at random moments, then a run to completion
            proc = start_upsert(tmp_path)
            time.sleep(chooser.uniform(0.3, 4.0))
            proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=120)
            outcomes["finished" if proc.returncode == 0 else "killed"] += 1
        finisher = start_upsert(tmp_path)
        out, err = finisher.communicate(timeout=300)
        assert finisher.returncode == 0, err.decode()
        assert_exact(h, all_changes)
    assert outcomes["killed"] > 0


def test_subprocess_result_line(tmp_path: Path):
    """The child process really runs the upsert (guards the kill tests against a broken command)."""
    h = Harness(tmp_path)
    h.write([(1, "c", 0, 1, 1.0)])
    proc = start_upsert(tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    assert "1 inserted" in out.decode()
    assert h.live() == {1: (1.0, 1)}
