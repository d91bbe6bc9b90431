"""The Kafka source (issue 15) against librdkafka's mock cluster, through real `partfin ingest` processes.

The mock cluster (kafka_cluster.py) speaks the Kafka protocol on loopback: the ingest processes use
confluent-kafka exactly as against a real cluster. Waits are liveness bounds, never performance
thresholds.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.history import watermark_history
from partfin_assets.model import summary_keys as K
from partfin_assets.model.timeutil import parse_iso, to_us
from partfin_assets_tests import debezium_messages as dbz
from partfin_assets_tests.kafka_cluster import FAST_GROUP_SETTINGS
from partfin_assets_tests.test_kafka_cluster import produce

TOPIC = "dbserver1.public.orders"
T0_MS = 1_793_491_200_000  # 2026-11-01T00:00:00Z
GROUP_OPTIONS = ",".join(f"{name}={value}" for name, value in FAST_GROUP_SETTINGS.items())


def kafka_spec(cluster, topic: str = TOPIC, extra: str = "") -> str:
    return f"kafka:{cluster.bootstrap_servers}#{topic},{GROUP_OPTIONS}{',' + extra if extra else ''}"


def ingest(home, spec: str, *args: str, crash_at: str | None = None, env: dict | None = None) -> subprocess.Popen:
    environment = {**os.environ, "PARTFIN_HOME": str(home), **(env or {})}
    environment.pop("PARTFIN_CRASH_AT", None)
    if crash_at:
        environment["PARTFIN_CRASH_AT"] = crash_at
    command = [sys.executable, "-m", "partfin_assets.cli", "ingest", "--table", "orders", "--source", spec,
               "--primary-key", "id", *args]
    return subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def run_ingest(home, spec: str, *args: str, env: dict | None = None) -> str:
    process = ingest(home, spec, *args, env=env)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr.decode()
    return stderr.decode()


def cdc_rows(home) -> pa.Table:
    return load_partfin_catalog(home).load_table("cdc.orders").scan().to_arrow()


def events(table: pa.Table) -> Counter:
    """(key, op, event time, offset) of every CDC record: one message each (a key stays in its partition)."""
    times = pc.cast(table.column("event_time"), pa.int64()).to_pylist()
    return Counter(zip(table.column("key").to_pylist(), table.column("op").to_pylist(), times, table.column("source_seq").to_pylist()))


def expected_events(messages, delivered) -> Counter:
    """What the produced change messages must become: tombstones carry no change."""
    expected = Counter()
    for message, (_, offset) in zip(messages, delivered):
        if message.value is None:
            continue
        payload = json.loads(message.value)
        key = json.loads(message.key)
        expected[(json.dumps(key, separators=(",", ":")), payload["op"], payload["source"]["ts_ms"] * 1000, offset)] += 1
    return expected


def test_kill_minus_nine_at_twenty_moments_loses_and_duplicates_nothing(tmp_path, kafka_cluster):
    """Real `partfin ingest` processes killed with -9 at 20 moments (between writing files and the
    commit, right after a commit, at a random time) while a producer keeps adding messages: every
    message lands once, and the watermark never goes back."""
    kafka_cluster.create_topic(TOPIC, 3)
    spec = kafka_spec(kafka_cluster)
    home = tmp_path / "home"
    rng = random.Random(15)
    messages: list = []
    delivered: list = []

    def produce_more(rounds: int) -> None:
        start = len(messages)
        more = dbz.row_history(range(start, start + 60), T0_MS + start * 60_000, updates=rounds, delete_every=7)
        delivered.extend(produce(kafka_cluster, TOPIC, more))
        messages.extend(more)

    observed: list[int] = []

    def observe() -> None:
        if not load_partfin_catalog(home).table_exists("cdc.orders"):
            return
        table = load_partfin_catalog(home).load_table("cdc.orders")
        history = [w for _, w in watermark_history(table.metadata)]
        assert history == sorted(history)
        if K.PROP_WATERMARK in table.properties:
            observed.append(to_us(parse_iso(table.properties[K.PROP_WATERMARK])))

    produce_more(3)
    kills = Counter()
    while sum(kills.values()) < 20:
        moment = ["after-files", "after-commit", "timed"][sum(kills.values()) % 3]
        crash_at = f"{moment}:{rng.randint(1, 3)}" if moment != "timed" else None
        process = ingest(home, spec, "--checkpoint-records", "40", crash_at=crash_at)
        if moment == "timed":
            for _ in range(rng.randint(1, 2)):  # after one or two of this run's checkpoints, mid-way in the next
                if not process.stderr.readline():
                    break
            time.sleep(rng.uniform(0.0, 0.3))
            process.send_signal(signal.SIGKILL)
        _, stderr = process.communicate(timeout=300)
        if process.returncode == -signal.SIGKILL:
            kills[moment] += 1
        else:
            assert process.returncode == 0, stderr.decode()
        observe()
        if sum(kills.values()) % 4 == 0 or process.returncode == 0:
            produce_more(2)  # the topic grows between runs, as in production

    run_ingest(home, spec, "--checkpoint-records", "40")
    observe()
    assert kills == {"after-files": 7, "after-commit": 7, "timed": 6}
    written = events(cdc_rows(home))
    expected = expected_events(messages, delivered)
    assert sum(expected.values()) > 1000
    assert written == expected  # every change exactly once: by key, op, event time and offset
    assert observed == sorted(observed)
