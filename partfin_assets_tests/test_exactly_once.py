"""Exactly-once ingestion across kill -9: every source event lands once, the watermark never goes back."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.history import watermark_history
from partfin_assets.model import summary_keys as K
from partfin_assets.model.timeutil import parse_iso, to_us
from partfin_assets.sources.registry import make_source
from partfin_assets.sources.synthetic import ORDERS_SPEC

SOURCE = "synthetic:seed=11,start=2026-11-01T00:00:00Z,end=2026-11-02T00:00:00Z,rate=1,idle_every=none"
KILLS = 20


def rows(table: pa.Table) -> Counter:
    times = pc.cast(table.column("event_time"), pa.int64()).to_pylist()
    return Counter(zip(table.column("key").to_pylist(), table.column("op").to_pylist(), times, table.column("source_seq").to_pylist()))


def ingest(home, crash_at: str | None) -> subprocess.Popen:
    env = {**os.environ, "PARTFIN_HOME": str(home)}
    env.pop("PARTFIN_CRASH_AT", None)
    if crash_at:
        env["PARTFIN_CRASH_AT"] = crash_at
    command = [sys.executable, "-m", "partfin_assets.cli", "ingest", "--table", "orders", "--source", SOURCE,
               "--checkpoint-records", "300", "--subtasks", "2"]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_kill_minus_nine_at_twenty_moments_loses_and_duplicates_nothing(tmp_path):
    home = tmp_path / "home"
    rng = random.Random(20261129)
    observed_watermarks: list[int] = []
    kills = {"after-files": 0, "after-commit": 0, "timed": 0}

    def observe() -> None:
        table = load_partfin_catalog(home).load_table("cdc.orders")
        history = [w for _, w in watermark_history(table.metadata)]
        assert history == sorted(history)
        if K.PROP_WATERMARK in table.properties:  # absent until the first checkpoint lands
            observed_watermarks.append(to_us(parse_iso(table.properties[K.PROP_WATERMARK])))

    delivered = 0
    while delivered < KILLS:
        # a third each: between writing data files and committing, right after a commit, and mid-batch
        moment = ["after-files", "after-commit", "timed"][delivered % 3]
        crash_at = f"{moment}:{rng.randint(1, 4)}" if moment != "timed" else None
        process = ingest(home, crash_at)
        if moment == "timed":
            # after a random number of this run's checkpoints, at a random point of the next one
            for _ in range(rng.randint(1, 3)):
                if not process.stderr.readline():
                    break
            time.sleep(rng.uniform(0.0, 0.2))
            process.send_signal(signal.SIGKILL)
        _, stderr = process.communicate(timeout=300)
        if process.returncode == -signal.SIGKILL:
            delivered += 1
            kills[moment] += 1
        else:
            assert process.returncode == 0, stderr.decode()
            break  # the source was exhausted before the kill landed: nothing more to interrupt
        if (home / "catalog.db").exists() and load_partfin_catalog(home).table_exists("cdc.orders"):
            observe()

    final = ingest(home, None)
    _, stderr = final.communicate(timeout=300)
    assert final.returncode == 0, stderr.decode()
    observe()
    assert delivered == KILLS, f"only {delivered} kills landed before the source ran out: {kills}"

    expected = Counter()
    for batch in make_source(SOURCE, ORDERS_SPEC).batches(None, 10_000):
        expected.update(rows(batch.records))
    written = rows(load_partfin_catalog(home).load_table("cdc.orders").scan().to_arrow())
    assert sum(expected.values()) > 10_000
    assert written == expected  # every event exactly once, compared by key, op, event time and position
    assert observed_watermarks == sorted(observed_watermarks)
