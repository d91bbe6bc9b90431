"""`partfin ingest` events/s from Kafka vs the same Debezium events from a JSON-lines file (goal: >= 0.9x).

    .venv/bin/python bench/bench_kafka_ingest.py [--messages 12000] [--partitions 3] [--checkpoint-records 10000] [--repeats 5]

Setup (untimed): librdkafka's mock cluster (3 brokers on 127.0.0.1, the test fixture's helper
process); --messages Debezium update events of ~1 KB (JSON, no schema envelope, keyed by id) produced
to a topic of --partitions partitions (Kafka Connect's murmur2 partitioner); the same values written
as a JSON-lines file.
Measured, --repeats passes, each with both runs back to back (so the shared machine's load hits both
alike), every run a fresh `partfin ingest` process into a fresh PARTFIN_HOME, timed from its start
to its exit (Python start, catalog and table creation, the source's start included):
1. file:   partfin ingest --table orders --source debezium:FILE --primary-key id
2. kafka:  partfin ingest --table orders --source "kafka:BOOTSTRAP#TOPIC,group=bench-N" --primary-key id
           (a new consumer group each pass: it joins, is assigned every partition, reads to the end)
Both with --checkpoint-records. Each run's table is checked to hold every event once.
Reported: events/s of each (median), and the median and range of the per-pass ratio kafka / file.

The mock keeps at most 5 MB of record batches per partition: the bench stops if a partition no longer
starts at offset 0 (use more --partitions).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from confluent_kafka import Consumer, Producer, TopicPartition  # noqa: E402

from partfin_assets.iceberg.catalog import load_partfin_catalog  # noqa: E402
from partfin_assets_tests import debezium_messages as dbz  # noqa: E402
from partfin_assets_tests.kafka_cluster import mock_kafka_cluster  # noqa: E402
from _sizes import parse_sizes  # noqa: E402

TOPIC = "dbserver1.public.orders"
T0_MS = 1_793_491_200_000


def events(count: int, note_bytes: int = 250) -> list[dbz.DebeziumMessage]:
    return [dbz.change(i % 5000, "u", T0_MS + i, version=1 + i // 5000, note_bytes=note_bytes) for i in range(count)]


def produce(cluster, messages, *, topic: str = TOPIC, **producer_config) -> None:
    """Every message into `topic`, delivered (murmur2: where Kafka's Java clients would put each key)."""
    producer = Producer(cluster.client_config(**{"linger.ms": 20, "partitioner": "murmur2_random", **producer_config}))
    for message in messages:
        while True:
            try:
                producer.produce(topic, key=message.key, value=message.value, timestamp=message.timestamp_ms)
                break
            except BufferError:  # local queue full: let deliveries drain
                producer.poll(0.1)
    if producer.flush(120):
        raise RuntimeError("not every message was delivered")


def check_retention(cluster, partitions: int, *, topic: str = TOPIC) -> None:
    probe = Consumer(cluster.client_config(**{"group.id": "bench-probe"}))
    try:
        for partition in range(partitions):
            low, high = probe.get_watermark_offsets(TopicPartition(topic, partition), timeout=30)
            if low != 0:
                raise SystemExit(f"the mock dropped the oldest batches of partition {partition} (log starts at {low} of {high}): "
                                 "use more --partitions")
    finally:
        probe.close()


def ingest(home: Path, source: str, checkpoint_records: int, expected: int) -> float:
    """Seconds of one `partfin ingest` process; checks that the table holds every event once."""
    env = {**os.environ, "PARTFIN_HOME": str(home)}
    for name in ("PARTFIN_CATALOG_URI", "PARTFIN_CATALOG", "PARTFIN_CRASH_AT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "partfin_assets.cli", "ingest", "--table", "orders", "--source", source,
               "--primary-key", "id", "--checkpoint-records", str(checkpoint_records)]
    started = time.perf_counter()
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{source}: {result.stderr}")
    rows = load_partfin_catalog(home).load_table("cdc.orders").scan(selected_fields=("source_seq",)).to_arrow().num_rows
    if rows != expected:
        raise RuntimeError(f"{source}: {rows} records, not {expected}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=12000)
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--checkpoint-records", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    options = parse_sizes(parser, smoke=dict(messages=200, checkpoint_records=100, repeats=1))

    messages = events(options.messages)
    with mock_kafka_cluster(brokers=3) as cluster, tempfile.TemporaryDirectory() as tmp:
        cluster.create_topic(TOPIC, options.partitions)
        produce(cluster, messages)
        check_retention(cluster, options.partitions)
        path = Path(tmp) / "events.jsonl"
        path.write_bytes(b"".join(m.value + b"\n" for m in messages))

        rates: dict[str, list[float]] = {"file": [], "kafka": []}
        for n in range(options.repeats):
            for name in ("file", "kafka"):
                source = f"debezium:{path}" if name == "file" else f"kafka:{cluster.bootstrap_servers}#{TOPIC},group=bench-{n}"
                seconds = ingest(Path(tmp) / f"{name}-{n}", source, options.checkpoint_records, options.messages)
                rates[name].append(options.messages / seconds)

    ratios = [kafka / file for kafka, file in zip(rates["kafka"], rates["file"])]
    print(json.dumps({
        "messages": options.messages, "mean_value_bytes": round(statistics.fmean(len(m.value) for m in messages)),
        "partitions": options.partitions, "checkpoint_records": options.checkpoint_records, "repeats": options.repeats,
        "file_events_per_s": round(statistics.median(rates["file"])),
        "kafka_events_per_s": round(statistics.median(rates["kafka"])),
        "kafka_vs_file": round(statistics.median(ratios), 3),
        "kafka_vs_file_range": [round(min(ratios), 3), round(max(ratios), 3)],
        "goal": ">= 0.9",
    }, indent=2))


if __name__ == "__main__":
    main()
