"""`partfin ingest` from Kafka scaled out: a group of 1, 2 and 4 processes, one table (goal: 2 >= 1.6x 1).

    .venv/bin/python bench/bench_kafka_scale_out.py [--messages 200000] [--partitions 64] [--checkpoint-records 5000]
                                                   [--processes 1,2,4] [--repeats 2]

Setup (untimed): librdkafka's mock cluster (3 brokers on 127.0.0.1, the test fixture's helper process); a
topic of --partitions partitions per run; N `partfin -v ingest --follow` processes in a new consumer group,
into a fresh PARTFIN_HOME, started on the empty topic and left until the group has given each its share
of the partitions (their logs say so).
Timed: --messages Debezium update events of ~1 KB (the events of bench_kafka_ingest.py) produced to the
topic at once, until the processes' progress lines report every one committed: the throughput of a running
group (decoding, writing and committing in each process), without Python's start or the group's first join,
which a long-running group pays once. The processes are then stopped (SIGTERM) and the table is checked to
hold every event once. --repeats passes, each running every process count back to back (so the shared
machine's load hits them alike), each pass starting with the next count (the first run of a pass is often slower).
Reported: events/s per process count (median), the median per-pass ratio to one process, and the commit
retries per checkpoint (commits that lost a race to another process's commit, from the progress lines).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from partfin_assets.iceberg.catalog import load_partfin_catalog  # noqa: E402
from partfin_assets_tests.kafka_cluster import mock_kafka_cluster  # noqa: E402
from bench_kafka_ingest import events, produce  # noqa: E402
from _sizes import parse_sizes  # noqa: E402

PROGRESS = re.compile(r"checkpoint \d+\s+records ([\d,]+).*?(?:commit retries (\d+))?$")
ASSIGNED = re.compile(r"assigned partitions (\[[\d, ]*\])")
WAIT_S = 600  # a run slower than this is a failure, not a figure
GROUP = "session.timeout.ms=3000,heartbeat.interval.ms=300"  # the mock waits a session less 1 s before each rebalance


class Member:
    """One `partfin -v ingest --follow` process: its partitions and the records its progress lines report."""

    def __init__(self, command: list[str], env: dict) -> None:
        self.process = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.records = self.checkpoints = self.retries = 0
        self.assigned: list[int] | None = None
        self.tail: list[str] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stderr:
            with self.changed:
                self.tail = (self.tail + [line])[-20:]
                found = PROGRESS.search(line)
                if found:
                    self.records = int(found.group(1).replace(",", ""))
                    self.retries = int(found.group(2) or 0)  # cumulative
                    self.checkpoints += 1
                assigned = ASSIGNED.search(line)
                if assigned:
                    self.assigned = json.loads(assigned.group(1))
                self.changed.notify_all()

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        if self.process.wait(timeout=60) not in (0, 143):
            raise RuntimeError(f"a member exited {self.process.returncode}: {''.join(self.tail)}")


def wait_for(condition, what: str, members: list[Member]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline or any(m.process.poll() is not None for m in members):
            for member in members:
                member.process.kill()
            raise SystemExit(f"gave up waiting for {what}: " + " | ".join("".join(m.tail[-3:]) for m in members))
        time.sleep(0.05)


def scale_out(cluster, topic: str, home: Path, processes: int, options) -> tuple[float, int, int]:
    """A group of `processes` ingest processes, formed; then --messages produced: (seconds until all are committed,
    checkpoints, commit retries)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARTFIN_")}
    env["PARTFIN_HOME"] = str(home)
    cluster.create_topic(topic, options.partitions)
    source = f"kafka:{cluster.bootstrap_servers}#{topic},group={topic},{GROUP}"
    command = [sys.executable, "-m", "partfin_assets.cli", "-v", "ingest", "--table", "orders", "--source", source,
               "--primary-key", "id", "--checkpoint-records", str(options.checkpoint_records), "--follow"]
    members = [Member(command, env) for _ in range(processes)]
    share = -(-options.partitions // processes)  # each member's share once the group is formed
    wait_for(lambda: all(m.assigned is not None and 0 < len(m.assigned) <= share for m in members)
             and sum(len(m.assigned) for m in members) == options.partitions, "the group to form", members)
    messages = events(options.messages, options.note_bytes)
    started = time.perf_counter()
    produce(cluster, messages, topic=topic)
    wait_for(lambda: sum(m.records for m in members) >= options.messages, "every event committed", members)
    seconds = time.perf_counter() - started
    for member in members:
        member.stop()
    rows = load_partfin_catalog(home).load_table("cdc.orders").scan(selected_fields=("source_log", "source_seq")).to_arrow()
    once = len(set(zip(rows.column("source_log").to_pylist(), rows.column("source_seq").to_pylist())))
    if rows.num_rows != options.messages or once != options.messages:
        raise RuntimeError(f"{processes} processes: {rows.num_rows} records at {once} positions, not {options.messages} once each")
    return seconds, sum(m.checkpoints for m in members), sum(m.retries for m in members)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--partitions", type=int, default=64)  # the mock keeps 5 MB per partition
    parser.add_argument("--checkpoint-records", type=int, default=5_000)
    parser.add_argument("--note-bytes", type=int, default=250, help="bytes of text in each event's note column (250: ~1 KB events)")
    parser.add_argument("--processes", default="1,2,4", help="process counts to compare, the first is the baseline")
    parser.add_argument("--repeats", type=int, default=2)
    options = parse_sizes(parser, smoke=dict(messages=400, partitions=4, checkpoint_records=100, processes="1,2", repeats=1))
    counts = [int(n) for n in options.processes.split(",")]

    rates: dict[int, list[float]] = {n: [] for n in counts}
    retries: dict[int, list[float]] = {n: [] for n in counts}
    with mock_kafka_cluster(brokers=3) as cluster, tempfile.TemporaryDirectory() as tmp:
        for repeat in range(options.repeats):
            for n in counts[repeat % len(counts):] + counts[:repeat % len(counts)]:  # each count first in turn: the order matters
                seconds, checkpoints, lost = scale_out(cluster, f"orders-{n}-{repeat}", Path(tmp) / f"{n}-{repeat}", n, options)
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
