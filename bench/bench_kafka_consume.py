"""confluent-kafka consumer throughput against the mock Kafka cluster vs reading the same events from a file.

    .venv/bin/python bench/bench_kafka_consume.py [--messages 12000] [--partitions 3] [--compression none] [--repeats 5]

Setup (untimed): librdkafka's mock cluster (3 brokers on 127.0.0.1, the test fixture's helper
process); --messages Debezium update events of ~1 KB (JSON, no schema envelope, keyed by id)
produced to a topic of --partitions partitions; the same values written as a JSON-lines file.
Measured, median of --repeats, each pass reading every event once:
1. file:            read the JSON-lines file, json.loads each line (the Debezium file source's floor)
2. kafka consume:   a Consumer assigned to every partition from offset 0 (no group join),
                    Consumer.consume(batches of 1000), json.loads each value
3. kafka poll:      the same with Consumer.poll() one message at a time
4. kafka raw:       consume() without json.loads (transport only)
Kafka passes are timed from the consumer's creation (connections, metadata, first fetch
included); "steady" is the consume pass from its first event to its last.
Reported: events/s of each (median) and, per Kafka mode, the median and range of its per-pass
ratio to the file pass beside it (the goal: Kafka through
`partfin ingest` >= 0.8x the same events from a file; this is the transport's share of it).

The mock keeps at most 5 MB of record batches per partition (older batches are dropped): the
bench checks that every partition still starts at offset 0 and stops otherwise (use more
partitions or --compression lz4).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition  # noqa: E402

from bench_kafka_ingest import TOPIC, events, produce  # noqa: E402
from partfin_assets_tests.kafka_cluster import mock_kafka_cluster  # noqa: E402
from _sizes import parse_sizes  # noqa: E402


def read_file(path: Path) -> int:
    n = 0
    with open(path, "rb") as lines:
        for line in lines:
            json.loads(line)
            n += 1
    return n


def _consumer(cluster, partitions: int) -> Consumer:
    consumer = Consumer(cluster.client_config(**{"group.id": "bench", "enable.auto.commit": False}))
    consumer.assign([TopicPartition(TOPIC, p, 0) for p in range(partitions)])
    return consumer


def _check(message) -> None:
    if message.error() and message.error().code() != KafkaError._PARTITION_EOF:
        raise KafkaException(message.error())


def read_kafka(cluster, partitions: int, total: int, *, mode: str) -> tuple[int, float]:
    """Events read and the seconds from the first event to the last (the steady rate, without the
    consumer's start: connections, metadata, first fetch)."""
    consumer = _consumer(cluster, partitions)
    n, first = 0, None
    decode = mode != "raw"
    try:
        while n < total:
            batch = [consumer.poll(5.0)] if mode == "poll" else consumer.consume(1000, 5.0)
            if not batch or batch[0] is None:
                raise RuntimeError(f"no event within 5 s after {n} of {total}")
            if first is None:
                first = time.perf_counter()
            for message in batch:
                _check(message)
                if decode:
                    json.loads(message.value())
            n += len(batch)
        return n, time.perf_counter() - first
    finally:
        consumer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=12000)
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--compression", default="none", choices=["none", "lz4", "zstd", "snappy", "gzip"])
    parser.add_argument("--repeats", type=int, default=5)
    options = parse_sizes(parser, smoke=dict(messages=200, repeats=1))

    messages = events(options.messages)
    mean_bytes = statistics.fmean(len(m.value) for m in messages)
    started = time.perf_counter()
    with mock_kafka_cluster(brokers=3) as cluster, tempfile.TemporaryDirectory() as tmp:
        start_s = time.perf_counter() - started
        cluster.create_topic(TOPIC, options.partitions)
        produce_started = time.perf_counter()
        produce(cluster, messages, **{"compression.type": options.compression})
        produce_s = time.perf_counter() - produce_started
        probe = _consumer(cluster, options.partitions)
        for partition in range(options.partitions):
            low, high = probe.get_watermark_offsets(TopicPartition(TOPIC, partition), timeout=30)
            if low != 0:
                raise SystemExit(f"the mock dropped the oldest batches of partition {partition} (log starts at {low}"
                                 f" of {high}): use more --partitions or --compression lz4")
        probe.close()
        path = Path(tmp) / "events.jsonl"
        path.write_bytes(b"".join(m.value + b"\n" for m in messages))

        figures: dict[str, list[float]] = {"file": [], "consume": [], "poll": [], "raw": [], "consume_steady": []}
        for _ in range(options.repeats):  # interleaved, so load on the shared machine hits all alike
            for name in ("file", "consume", "poll", "raw"):
                started = time.perf_counter()
                if name == "file":
                    n = read_file(path)
                else:
                    n, steady_s = read_kafka(cluster, options.partitions, options.messages, mode=name)
                seconds = time.perf_counter() - started
                if n != options.messages:
                    raise RuntimeError(f"{name} read {n} of {options.messages} events")
                figures[name].append(n / seconds)
                if name == "consume":
                    figures["consume_steady"].append(n / steady_s)

    rates = {name: statistics.median(values) for name, values in figures.items()}
    results = {
        "messages": options.messages, "mean_value_bytes": round(mean_bytes),
        "partitions": options.partitions, "compression": options.compression,
        "cluster_start_s": round(start_s, 3), "produce_events_per_s": round(options.messages / produce_s),
        "file_events_per_s": round(rates["file"]),
        "kafka_consume_events_per_s": round(rates["consume"]),
        "kafka_consume_steady_events_per_s": round(rates["consume_steady"]),
        "kafka_poll_events_per_s": round(rates["poll"]),
        "kafka_raw_events_per_s": round(rates["raw"]),
    }
    for name in ("consume", "poll", "raw"):  # median of the per-pass ratios: each pass's runs saw the same load
        ratios = [kafka / file for kafka, file in zip(figures[name], figures["file"])]
        results[f"kafka_{name}_vs_file"] = round(statistics.median(ratios), 3)
        results[f"kafka_{name}_vs_file_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
