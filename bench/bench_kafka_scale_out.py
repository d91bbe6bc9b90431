"""`partfin ingest` from Kafka scaled out: 1, 2 and 4 processes in one consumer group, one table (goal: 2 >= 1.6x 1).

    .venv/bin/python bench/bench_kafka_scale_out.py [--messages 60000] [--partitions 8] [--checkpoint-records 5000]
                                                   [--processes 1,2,4] [--repeats 2]

Setup (untimed): librdkafka's mock cluster (3 brokers on 127.0.0.1, the test fixture's helper process);
--messages Debezium update events of ~1 KB (the same events as bench_kafka_ingest.py) produced to a topic
of --partitions partitions.
Measured, --repeats passes, each running every process count back to back (so the shared machine's load
hits them alike): N `partfin ingest` processes started at once in a new consumer group, into a fresh
PARTFIN_HOME, timed from their start until the last one exits (each reads the partitions the group gives it to their end;
Python's start, the table's creation and the group's join included). Each table is checked to hold every event once.
Reported: events/s per process count (median), the median per-pass ratio to one process, and the
commit retries per checkpoint (commits that lost a race to another process's commit, from the
processes' progress lines).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from partfin_assets.iceberg.catalog import load_partfin_catalog  # noqa: E402
from partfin_assets_tests.kafka_cluster import mock_kafka_cluster  # noqa: E402
from bench_kafka_ingest import TOPIC, check_retention, events, produce  # noqa: E402
from _sizes import parse_sizes  # noqa: E402

PROGRESS = re.compile(r"checkpoint \d+ .*?(?:commit retries (\d+))?$", re.MULTILINE)
GROUP = "session.timeout.ms=3000,heartbeat.interval.ms=300"  # the mock waits a session less 1 s before each rebalance


def scale_out(home: Path, source: str, processes: int, checkpoint_records: int, expected: int) -> tuple[float, int, int]:
    """Seconds until `processes` ingest processes of one group all exited; (seconds, checkpoints, commit retries)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARTFIN_")}
    env["PARTFIN_HOME"] = str(home)
    command = [sys.executable, "-m", "partfin_assets.cli", "ingest", "--table", "orders", "--source", source,
               "--primary-key", "id", "--checkpoint-records", str(checkpoint_records)]
    started = time.perf_counter()
    running = [subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
               for _ in range(processes)]
    outputs = [p.communicate() for p in running]
    seconds = time.perf_counter() - started
    checkpoints = retries = 0
    for process, (_, stderr) in zip(running, outputs):
        if process.returncode != 0:
            raise RuntimeError(f"{processes} processes: one exited {process.returncode}: {stderr[-2000:]}")
        lines = PROGRESS.findall(stderr)
        checkpoints += len(lines)
        retries += int(lines[-1] or 0) if lines else 0  # cumulative per process
    rows = load_partfin_catalog(home).load_table("cdc.orders").scan(selected_fields=("source_log", "source_seq")).to_arrow()
    once = len(set(zip(rows.column("source_log").to_pylist(), rows.column("source_seq").to_pylist())))
    if rows.num_rows != expected or once != expected:
        raise RuntimeError(f"{processes} processes: {rows.num_rows} records at {once} positions, not {expected} once each")
    return seconds, checkpoints, retries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=60_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--checkpoint-records", type=int, default=5_000)
    parser.add_argument("--processes", default="1,2,4", help="process counts to compare, the first is the baseline")
    parser.add_argument("--repeats", type=int, default=2)
    options = parse_sizes(parser, smoke=dict(messages=400, partitions=4, checkpoint_records=100, processes="1,2", repeats=1))
    counts = [int(n) for n in options.processes.split(",")]

    rates: dict[int, list[float]] = {n: [] for n in counts}
    retries: dict[int, list[float]] = {n: [] for n in counts}
    with mock_kafka_cluster(brokers=3) as cluster, tempfile.TemporaryDirectory() as tmp:
        cluster.create_topic(TOPIC, options.partitions)
        produce(cluster, events(options.messages))
        check_retention(cluster, options.partitions)
        for repeat in range(options.repeats):
            for n in counts:
                home = Path(tmp) / f"{n}-{repeat}"
                source = f"kafka:{cluster.bootstrap_servers}#{TOPIC},group=bench-{n}-{repeat},{GROUP}"
                seconds, checkpoints, lost = scale_out(home, source, n, options.checkpoint_records, options.messages)
                rates[n].append(options.messages / seconds)
                retries[n].append(lost / max(checkpoints, 1))

    baseline = counts[0]
    print(json.dumps({
        "messages": options.messages, "partitions": options.partitions, "checkpoint_records": options.checkpoint_records,
        "repeats": options.repeats, "cpus": os.cpu_count(),
        "events_per_s": {str(n): round(statistics.median(rates[n])) for n in counts},
        "vs_one_process": {str(n): round(statistics.median(r / b for r, b in zip(rates[n], rates[baseline])), 3) for n in counts},
        "commit_retries_per_checkpoint": {str(n): round(statistics.median(retries[n]), 3) for n in counts},
        "goal": "2 processes >= 1.6x one; 4 no slower than 2",
    }, indent=2))


if __name__ == "__main__":
    main()
