"""How soon a restarted `partfin ingest` from Kafka reads again after its predecessor was killed with -9,
against a restart after a clean stop (SIGTERM: the process leaves its group at once).

    .venv/bin/python bench/bench_kafka_restart.py [--partitions 4] [--messages 2000] [--repeats 3]
                                                  [--session-timeout-ms N]

Setup (untimed): librdkafka's mock cluster (3 brokers on 127.0.0.1, the test fixture's helper process),
a topic of --partitions partitions. Each pass, for each way of stopping:
1. a `partfin ingest --follow` process (group `bench-N`) reads --messages events to the end;
2. it is stopped: `kill -9`, or SIGTERM (it closes its consumer, which leaves the group);
3. --messages more events are produced, and the same command starts again;
4. timed: from that start until the new process has committed every new event (its progress lines),
   Python's start, the catalog and the group's rebalance included.
The dead member of a kill -9 holds its partitions until its group session expires: the difference
between the two is what the session timeout costs a restart. Every table is checked to hold each event
once. --session-timeout-ms sets `session.timeout.ms` in the source spec (default: partfin's own).
Reported: seconds of each (median) and the median per-pass ratio kill -9 / clean stop.
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
from bench_kafka_ingest import TOPIC, events, produce  # noqa: E402
from _sizes import parse_sizes  # noqa: E402

PROGRESS = re.compile(r"checkpoint \d+\s+records ([\d,]+)")
WAIT_S = 300  # a restart slower than this is a failure, not a figure


class Ingest:
    """A `partfin ingest --follow` process and the records its progress lines report."""

    def __init__(self, home: Path, source: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PARTFIN_")}
        env["PARTFIN_HOME"] = str(home)
        self.started = time.perf_counter()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "partfin_assets.cli", "ingest", "--table", "orders", "--source", source,
             "--primary-key", "id", "--follow"], env=env, cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.records = 0
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stderr:
            with self._changed:
                self.lines.append(line.rstrip())
                found = PROGRESS.search(line)
                if found:
                    self.records = int(found.group(1).replace(",", ""))
                self._changed.notify_all()

    def wait_for(self, records: int) -> float:
        """Seconds from the process's start until it reported `records` committed records."""
        with self._changed:
            done = self._changed.wait_for(lambda: self.records >= records or self.process.poll() is not None, timeout=WAIT_S)
        if not done or self.records < records:
            tail = "\n".join(self.lines[-10:])
            self.stop(signal.SIGKILL)
            raise SystemExit(f"ingest reported {self.records} of {records} records (exit {self.process.poll()}):\n{tail}")
        return time.perf_counter() - self.started

    def stop(self, how: signal.Signals) -> None:
        self.process.send_signal(how)
        self.process.wait(timeout=60)


def restart_seconds(cluster, home: Path, group: str, stop: signal.Signals, messages: int, session_timeout_ms: int | None) -> float:
    source = f"kafka:{cluster.bootstrap_servers}#{TOPIC},group={group}"
    if session_timeout_ms is not None:
        source += f",session.timeout.ms={session_timeout_ms}"
    produce(cluster, events(messages))
    first = Ingest(home, source)
    first.wait_for(messages)
    first.stop(stop)
    produce(cluster, events(messages))
    second = Ingest(home, source)
    seconds = second.wait_for(messages)
    second.stop(signal.SIGTERM)
    table = load_partfin_catalog(home).load_table("cdc.orders")
    rows = table.scan(selected_fields=("source_log", "source_seq")).to_arrow()
    positions = set(zip(rows.column("source_log").to_pylist(), rows.column("source_seq").to_pylist()))
    if rows.num_rows != 2 * messages or len(positions) != rows.num_rows:
        raise SystemExit(f"{group}: {rows.num_rows} records at {len(positions)} positions, not {2 * messages} once each")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--messages", type=int, default=2000, help="events before the stop, and as many after it")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--session-timeout-ms", type=int, default=None, help="the consumer's session.timeout.ms (default: partfin's)")
    options = parse_sizes(parser, smoke=dict(messages=20, repeats=1, session_timeout_ms=3000))

    seconds: dict[str, list[float]] = {"kill -9": [], "clean stop": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(options.repeats):
            for name, how in (("kill -9", signal.SIGKILL), ("clean stop", signal.SIGTERM)):
                # a cluster of its own per run: each starts from an empty topic and table
                with mock_kafka_cluster(brokers=3) as cluster:
                    cluster.create_topic(TOPIC, options.partitions)
                    group = f"bench-{n}-{'kill' if how == signal.SIGKILL else 'clean'}"
                    seconds[name].append(restart_seconds(cluster, Path(tmp) / group, group, how, options.messages,
                                                         options.session_timeout_ms))
    ratios = [k / c for k, c in zip(seconds["kill -9"], seconds["clean stop"])]
    print(json.dumps({
        "partitions": options.partitions, "messages_after_restart": options.messages, "repeats": options.repeats,
        "session_timeout_ms": options.session_timeout_ms or "partfin's default",
        "restart_after_kill_s": round(statistics.median(seconds["kill -9"]), 2),
        "restart_after_clean_stop_s": round(statistics.median(seconds["clean stop"]), 2),
        "restart_kill_vs_clean": round(statistics.median(ratios), 2),
        "restart_after_kill_range_s": [round(min(seconds["kill -9"]), 2), round(max(seconds["kill -9"]), 2)],
        "goal": "a restart after kill -9 reads again within 15 s",
    }, indent=2))


if __name__ == "__main__":
    main()
