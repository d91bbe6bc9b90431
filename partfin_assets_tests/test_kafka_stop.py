"""Stopping `partfin ingest` from Kafka as a service manager does (SIGTERM), against librdkafka's mock cluster.

A process killed where it stands stays in its consumer group until its session expires: a restarted
process (or the other members) waited that long for its partitions (librdkafka's default session is
45 s). On SIGTERM partfin stops as on Ctrl-C: it closes the source, whose consumer leaves the group
(a LeaveGroup request the brokers receive), and exits 143. How long a restart takes after each kind
of stop is measured by bench/bench_kafka_restart.py (never timed here).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets_tests import debezium_messages as dbz
from partfin_assets_tests.kafka_cluster import API_KEYS
from partfin_assets_tests.test_kafka_cluster import produce

TOPIC = "dbserver1.public.orders"
T0_MS = 1_793_491_200_000  # 2026-11-01T00:00:00Z
PROGRESS = re.compile(rb"checkpoint \d+\s+records ([\d,]+)")


def test_sigterm_leaves_the_group_and_exits_143_with_every_event_committed_once(tmp_path, kafka_cluster):
    cluster = kafka_cluster
    cluster.create_topic(TOPIC, 2)
    messages = [dbz.change(i, "c", T0_MS + i * 1000, version=1) for i in range(40)]
    produce(cluster, TOPIC, messages)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARTFIN_")}
    env["PARTFIN_HOME"] = str(tmp_path)
    process = subprocess.Popen(
        [sys.executable, "-m", "partfin_assets.cli", "ingest", "--table", "orders", "--primary-key", "id", "--follow",
         "--source", f"kafka:{cluster.bootstrap_servers}#{TOPIC},group=partfin-stop"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    committed = threading.Event()
    lines: list[bytes] = []

    def read() -> None:
        for line in process.stderr:
            lines.append(line)
            found = PROGRESS.search(line)
            if found and int(found.group(1).replace(b",", b"")) >= len(messages):
                committed.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert committed.wait(timeout=120), b"".join(lines).decode()
        cluster.start_request_tracking()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 128 + signal.SIGTERM, b"".join(lines).decode()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    reader.join(timeout=10)
    requests = cluster.tracked_requests()
    output = b"".join(lines).decode()
    assert "Traceback" not in output, output
    assert any(r.api_key == API_KEYS["LeaveGroup"] for r in requests), f"no LeaveGroup among {sorted({r.api_key for r in requests})}"
    rows = load_partfin_catalog(tmp_path).load_table("cdc.orders").scan(selected_fields=("source_log", "source_seq")).to_arrow()
    assert rows.num_rows == len(messages)
    assert len(set(zip(rows.column("source_log").to_pylist(), rows.column("source_seq").to_pylist()))) == len(messages)
