"""`partfin ingest` from Kafka scaled out: a group of 1, 2 and 4 processes, one table (goal: 2 >= 1.6x 1, 4 >= 2).

    .venv/bin/python bench/bench_kafka_scale_out.py [--messages 600000] [--partitions 96] [--checkpoint-records 10000]
                                                   [--note-bytes 0] [--processes 1,2,4] [--repeats 2]
                                                   [--properties queued.max.messages.kbytes=4096,...]
                                                   [--initial-rebalance-delay-ms 3000]

Setup (untimed): librdkafka's mock cluster (3 brokers on 127.0.0.1, the test fixture's helper process) and one
topic of --partitions partitions holding --messages Debezium update events (~500 bytes; --note-bytes 250 makes
them ~1 KB), produced before any reader starts: the backlog a group is scaled out for, read in full by every run.
Each run: N `partfin -v ingest --follow` processes in a consumer group of their own, into a fresh PARTFIN_HOME.
As a Kafka broker does (group.initial.rebalance.delay.ms, 3 s by default), the mock's coordinator waits
--initial-rebalance-delay-ms for the members of a new group before its first assignment, so they start together:
with no wait, the first member read every partition alone until the others joined, finished its share ahead of
them, and the group ended with fewer processes than it has (a core idle at two).
Timed: from the moment the group is formed (every process reports its share of the partitions) until the
processes' progress lines report every event committed; what was committed before is left out of the rate. So
the figure is a running group's throughput (decoding, writing and committing in each process), without Python's
start or the group's joins, which a long-running group pays once. The processes are then stopped (SIGTERM) and
the table is checked to hold every event once. --repeats passes, each running every process count back to back
(so the shared machine's load hits them alike), each pass starting with the next count.
Reported: events/s per process count (median), the median per-pass ratio to one process and to the count before, the
CPU seconds the processes used in the timed part per 100,000 events (what more processes cost on the same cores) and
of them the kernel's (system time) and librdkafka's threads', the checkpoints committed, the catalog commits they
landed in (a member commits several partitions' checkpoints at once), the commit retries per checkpoint (commits
that lost a race to another process's commit, from the progress lines) and how much later the last member's final
commit came than the first member's (the cores a group leaves idle at its end). --properties adds librdkafka
consumer properties to every process's source spec (a smaller fetch queue, a fetch setting) to see what they change.

The mock keeps at most 5 MB of record batches per partition: the bench stops if a partition no longer starts at
offset 0 (use more --partitions).
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
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from partfin_assets.iceberg.catalog import load_partfin_catalog  # noqa: E402
from partfin_assets_tests.kafka_cluster import mock_kafka_cluster  # noqa: E402
from bench_kafka_ingest import TOPIC, check_retention, events, produce  # noqa: E402
from _sizes import parse_sizes  # noqa: E402

PROGRESS = re.compile(r"checkpoint \d+\s+records ([\d,]+).*?(?:commit retries (\d+))?$")
COMMITS = re.compile(r"  commits ([\d,]+)")  # only when fewer than the checkpoints (several partitions' in one commit)
ASSIGNED = re.compile(r"assigned partitions (\[[\d, ]*\])")
WAIT_S = 600  # a run slower than this is a failure, not a figure
GROUP = "session.timeout.ms=3000,heartbeat.interval.ms=300"  # the mock waits a session less 1 s before each rebalance


class Member:
    """One `partfin -v ingest --follow` process: its partitions and the records its progress lines report."""

    def __init__(self, command: list[str], env: dict) -> None:
        self.process = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.records = self.checkpoints = self.commits = self.retries = 0
        self.last_commit_at = 0.0
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
                    commits = COMMITS.search(line)
                    self.commits = int(commits.group(1).replace(",", "")) if commits else self.checkpoints
                    self.last_commit_at = time.perf_counter()
                assigned = ASSIGNED.search(line)
                if assigned:
                    self.assigned = json.loads(assigned.group(1))
                self.changed.notify_all()

    def cpu_seconds(self) -> Counter:
        """CPU the process has used so far (Linux /proc): user, system, and how much of both librdkafka's threads used."""
        user, system = clock_ticks(Path(f"/proc/{self.process.pid}/stat"))
        librdkafka = 0
        for task in Path(f"/proc/{self.process.pid}/task").iterdir():
            try:
                if (task / "comm").read_text().startswith("rdk:"):
                    librdkafka += sum(clock_ticks(task / "stat"))
            except FileNotFoundError:
                continue  # a thread that just ended
        tick = os.sysconf("SC_CLK_TCK")
        return Counter({"user": user / tick, "system": system / tick, "librdkafka_threads": librdkafka / tick})

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        if self.process.wait(timeout=60) not in (0, 143):
            raise RuntimeError(f"a member exited {self.process.returncode}: {''.join(self.tail)}")


def clock_ticks(stat: Path) -> tuple[int, int]:
    """(user, system) clock ticks from a /proc stat file."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def wait_for(condition, what: str, members: list[Member]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline or any(m.process.poll() is not None for m in members):
            for member in members:
                member.process.kill()
            raise SystemExit(f"gave up waiting for {what}: " + " | ".join("".join(m.tail[-3:]) for m in members))
        time.sleep(0.05)


@dataclass
class Run:
    events_per_s: float  # once the group is formed
    cpu_per_100k: Counter  # the processes' CPU seconds per 100,000 of those events: user, system, librdkafka's threads
    checkpoints: int
    commits: int  # catalog commits: one may land several partitions' checkpoints
    retries: int
    last_behind_first_s: float  # how much later the last member's final commit came than the first member's


def read_backlog(cluster, topic: str, home: Path, processes: int, options) -> Run:
    """A group of `processes` ingest processes reading the whole topic."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARTFIN_")}
    env["PARTFIN_HOME"] = str(home)
    source = f"kafka:{cluster.bootstrap_servers}#{topic},group=bench-{home.name},{GROUP}"
    if options.properties:
        source += f",{options.properties}"
    command = [sys.executable, "-m", "partfin_assets.cli", "-v", "ingest", "--table", "orders", "--source", source,
               "--primary-key", "id", "--checkpoint-records", str(options.checkpoint_records), "--follow"]
    launched = time.perf_counter()
    members = [Member(command, env) for _ in range(processes)]
    share = -(-options.partitions // processes)  # each member's share once the group is formed
    wait_for(lambda: all(m.assigned is not None and 0 < len(m.assigned) <= share for m in members)
             and sum(len(m.assigned) for m in members) == options.partitions, "the group to form", members)
    formed = time.perf_counter()
    committed_before = sum(m.records for m in members)
    cpu_before = sum((m.cpu_seconds() for m in members), Counter())
    wait_for(lambda: sum(m.records for m in members) >= options.messages, "every event committed", members)
    seconds = time.perf_counter() - formed
    finished = [m.last_commit_at for m in members if m.checkpoints]  # a member beyond the partitions commits nothing
    last_behind_first_s = max(finished) - min(finished)
    timed_events = options.messages - committed_before
    if timed_events <= 0:  # all committed before the group formed (a tiny topic): the whole run is timed instead
        seconds, timed_events, cpu_before = time.perf_counter() - launched, options.messages, Counter()
    cpu_used = sum((m.cpu_seconds() for m in members), Counter())
    cpu_used.subtract(cpu_before)
    cpu_per_100k = Counter({kind: used * 100_000 / timed_events for kind, used in cpu_used.items()})
    for member in members:
        member.stop()
    rows = load_partfin_catalog(home).load_table("cdc.orders").scan(selected_fields=("source_log", "source_seq")).to_arrow()
    once = len(set(zip(rows.column("source_log").to_pylist(), rows.column("source_seq").to_pylist())))
    if rows.num_rows != options.messages or once != options.messages:
        raise RuntimeError(f"{processes} processes: {rows.num_rows} records at {once} positions, not {options.messages} once each")
    return Run(timed_events / seconds, cpu_per_100k, sum(m.checkpoints for m in members), sum(m.commits for m in members),
               sum(m.retries for m in members), last_behind_first_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=600_000)  # ~20 s of one process here
    parser.add_argument("--partitions", type=int, default=96)  # the mock keeps 5 MB per partition
    parser.add_argument("--checkpoint-records", type=int, default=10_000)
    parser.add_argument("--note-bytes", type=int, default=0, help="bytes of text in each event's note column (250: ~1 KB events)")
    parser.add_argument("--processes", default="1,2,4", help="process counts to compare, the first is the baseline")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--properties", default="", help="librdkafka consumer properties for every process: name=value,...")
    parser.add_argument("--initial-rebalance-delay-ms", type=int, default=3000, help="how long a new group waits for its members")
    options = parse_sizes(parser, smoke=dict(messages=400, partitions=4, checkpoint_records=100, processes="1,2", repeats=1))
    counts = [int(n) for n in options.processes.split(",")]

    runs: dict[int, list[Run]] = {n: [] for n in counts}
    with mock_kafka_cluster(brokers=3, initial_rebalance_delay_ms=options.initial_rebalance_delay_ms) as cluster, \
            tempfile.TemporaryDirectory() as tmp:
        cluster.create_topic(TOPIC, options.partitions)
        produce(cluster, events(options.messages, options.note_bytes))
        check_retention(cluster, options.partitions)
        for repeat in range(options.repeats):
            for n in counts[repeat % len(counts):] + counts[:repeat % len(counts)]:  # each count first in turn: the order matters
                runs[n].append(read_backlog(cluster, TOPIC, Path(tmp) / f"{n}-{repeat}", n, options))

    def median(n: int, figure) -> float:
        return statistics.median(figure(run) for run in runs[n])

    def per_pass_ratio(n: int, m: int) -> float:
        """The median over passes of n processes' throughput over m processes' in the same pass."""
        return round(statistics.median(run.events_per_s / other.events_per_s for run, other in zip(runs[n], runs[m])), 3)

    baseline = counts[0]
    print(json.dumps({
        "messages": options.messages, "partitions": options.partitions, "checkpoint_records": options.checkpoint_records,
        "repeats": options.repeats, "cpus": os.cpu_count(), "properties": options.properties,
        "events_per_s": {str(n): round(median(n, lambda run: run.events_per_s)) for n in counts},
        "vs_one_process": {str(n): per_pass_ratio(n, baseline) for n in counts},
        "vs_previous_count": {f"{n} vs {m}": per_pass_ratio(n, m) for m, n in zip(counts, counts[1:])},  # what the goal compares
        "cpu_seconds_per_100k_events": {str(n): round(median(n, lambda run: run.cpu_per_100k["user"] + run.cpu_per_100k["system"]), 2)
                                        for n in counts},
        "of_which": {str(n): {kind: round(median(n, lambda run: run.cpu_per_100k[kind]), 2) for kind in ("system", "librdkafka_threads")}
                     for n in counts},
        "checkpoints": {str(n): round(median(n, lambda run: run.checkpoints)) for n in counts},
        "commits": {str(n): round(median(n, lambda run: run.commits)) for n in counts},
        "commit_retries_per_checkpoint": {str(n): round(median(n, lambda run: run.retries / max(run.checkpoints, 1)), 3) for n in counts},
        "last_member_behind_first_s": {str(n): round(median(n, lambda run: run.last_behind_first_s), 2) for n in counts},
        "goal": "2 processes >= 1.6x one; 4 no slower than 2",
    }, indent=2))


if __name__ == "__main__":
    main()
