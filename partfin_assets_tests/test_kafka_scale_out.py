"""Ingest that scales out: several `partfin ingest` processes in one consumer group, one table.

Each process commits checkpoints of the partitions the group gives it, concurrently with the
others; a commit lands only if the table still records the offset its batch started from (per
partition). Against librdkafka's mock cluster (real Kafka protocol on loopback), with real
processes killed with -9 while a producer goes on. Waits are liveness bounds, never performance
thresholds.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from dagster import Definitions, execute_job, reconstructable

from partfin_assets.defs.platform.fanout import FORKSERVER
from partfin_assets.defs.platform.ingest_members import build_ingest_members_job
from partfin_assets.defs.resources import CdcSourceResource, IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable
from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.ledger import read_ledger
from partfin_assets.iceberg.streams import positions_of
from partfin_assets.iceberg.tables import ledger_identifier
from partfin_assets.model import summary_keys as K
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.model.timeutil import US_PER_HOUR
from partfin_assets_tests import debezium_messages as dbz
from partfin_assets_tests.test_kafka_cluster import produce
from partfin_assets_tests.test_kafka_source import (
    T0_MS, TOPIC, cdc_rows, events, expected_events, kafka_spec, recorded_partitions, run_ingest, wait_for,
)

PARTITIONS = 6
MEMBERS = 3
CHAOS_S = float(os.environ.get("PARTFIN_SCALE_OUT_CHAOS_S", "60"))  # how long members are killed and replaced
COMMITTED = re.compile(r"cdc\.orders: checkpoint \d+ .*partition (\S+)")
FENCED = re.compile(r"its batch is void")


class Members:
    """The `partfin -v ingest --follow` processes of one group, each logging to a file of its own."""

    def __init__(self, tmp_path, home, spec: str) -> None:
        self.tmp_path, self.home, self.spec = tmp_path, home, spec
        self.running: dict[str, subprocess.Popen] = {}
        self.started = 0

    def start(self) -> str:
        name = f"member-{self.started}"
        self.started += 1
        environment = {**os.environ, "PARTFIN_HOME": str(self.home)}
        environment.pop("PARTFIN_CRASH_AT", None)
        command = [sys.executable, "-m", "partfin_assets.cli", "-v", "ingest", "--table", "orders", "--source", self.spec,
                   "--primary-key", "id", "--checkpoint-records", "40", "--follow"]
        with open(self.tmp_path / f"{name}.log", "wb") as out:
            self.running[name] = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=out)
        return name

    def kill(self, name: str) -> None:
        process = self.running.pop(name)
        process.send_signal(signal.SIGKILL)
        process.wait(30)

    def stop_all(self) -> list[int]:
        for process in self.running.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        codes = []
        for process in self.running.values():
            try:
                codes.append(process.wait(60))
            except subprocess.TimeoutExpired:
                process.kill()
                codes.append(process.wait())
        self.running.clear()
        return codes

    def count(self, pattern: re.Pattern) -> int:
        return sum(len(pattern.findall(log.read_text(errors="replace"))) for log in self.tmp_path.glob("member-*.log"))

    def committed_partitions(self) -> dict[str, set[str]]:
        """Member -> the partitions it committed checkpoints of (from its progress lines)."""
        return {log.stem: {m.group(1) for m in COMMITTED.finditer(log.read_text(errors="replace"))}
                for log in sorted(self.tmp_path.glob("member-*.log"))}


def test_three_members_killed_and_replaced_for_a_minute_commit_every_event_once(tmp_path, kafka_cluster):
    """Three processes in one group share a 6-partition topic while a producer adds messages; for a minute one
    member at a time is killed with -9 and a new one started. Afterwards: every message is in cdc.orders
    once, each event hour holds the source's count in the table and in the late-data ledger, several members
    committed the same partitions in turn, and every partition's position is its log end."""
    kafka_cluster.create_topic(TOPIC, PARTITIONS)
    spec = kafka_spec(kafka_cluster)
    home = tmp_path / "home"
    messages: list = []
    delivered: list = []
    rounds = 0

    def produce_round() -> None:
        nonlocal rounds
        start = len(messages)
        # each round 20 minutes of event time later: the events span several hours
        more = dbz.row_history(range(start, start + 60), T0_MS + rounds * 20 * 60_000, updates=2, delete_every=7)
        delivered.extend(produce(kafka_cluster, TOPIC, more))
        messages.extend(more)
        rounds += 1

    def caught_up() -> bool:
        catalog_there = (home / "catalog.db").exists() and load_partfin_catalog(home).table_exists("cdc.orders")
        return catalog_there and events(cdc_rows(home)) == expected_events(messages, delivered)

    members = Members(tmp_path, home, spec)
    killed = 0
    try:
        produce_round()
        for _ in range(MEMBERS):
            members.start()
        chaos_ends = time.monotonic() + CHAOS_S
        rng = random.Random(27)
        while time.monotonic() < chaos_ends:
            time.sleep(rng.uniform(2.0, 5.0))
            produce_round()
            members.kill(rng.choice(sorted(members.running)))
            killed += 1
            members.start()
        produce_round()
        wait_for(caught_up, "the surviving members to ingest everything", timeout_s=240)
    finally:
        codes = members.stop_all()
    assert all(code == 143 for code in codes), codes  # each stopped cleanly on SIGTERM
    assert killed >= 3

    expected = expected_events(messages, delivered)
    assert events(cdc_rows(home)) == expected  # every message once, none lost

    # per event hour: the table and the ledger (recorded by whichever member committed) hold the source's count
    source_hours = Counter(time_us // US_PER_HOUR * US_PER_HOUR for (_, _, time_us, _), n in expected.items() for _ in range(n))
    rows = cdc_rows(home)
    table_hours = Counter((t // US_PER_HOUR * US_PER_HOUR for t in pc.cast(rows.column("event_time"), pa.int64()).to_pylist()))
    assert table_hours == source_hours
    catalog = load_partfin_catalog(home)
    run_ingest(home, spec)  # a last run records anything a killed member left out of the ledger (reconcile at start)
    ledger = read_ledger(catalog, "cdc.orders", columns=("hour", "records")).filter(pl.col("hour").is_not_null())
    ledger_hours = {int(h.timestamp() * 1_000_000): n for h, n in ledger.group_by("hour").agg(pl.col("records").sum()).iter_rows()}
    assert ledger_hours == dict(source_hours)

    # the members really shared the work: several committed, and some partition was committed by two of them in turn
    by_member = {m: p for m, p in members.committed_partitions().items() if p}
    assert len(by_member) >= 3, by_member
    owners = Counter(p for parts in by_member.values() for p in parts)
    assert max(owners.values()) >= 2, owners
    # members commit side by side: a batch is void (fenced) only when its partition moved to another member
    # meanwhile, not whenever another member committed (one position for all partitions fenced nearly every batch)
    committed, fenced = members.count(COMMITTED), members.count(FENCED)
    assert fenced <= max(3 * killed, committed // 10), (fenced, committed, killed)

    # each partition's position is its log end (what the next member would start from)
    ends = Counter(partition for partition, _ in delivered)
    assert recorded_partitions(catalog.load_table("cdc.orders")) == {str(p): ends[p] for p in range(PARTITIONS)}


def test_a_table_written_before_per_partition_positions_goes_on_from_its_writer_entry(tmp_path, kafka_cluster):
    """A Kafka table whose positions are one writer entry (every partition in one offset, checkpoint ids per writer,
    the ledger bounded per writer: how partfin recorded them before per-partition positions) goes on from that
    entry: nothing read twice, nothing skipped, the ledger holds every checkpoint once."""
    kafka_cluster.create_topic(TOPIC, 3)
    spec = kafka_spec(kafka_cluster)
    home = tmp_path / "home"
    messages = dbz.row_history(range(60), T0_MS, updates=2, delete_every=7)
    delivered = produce(kafka_cluster, TOPIC, messages)
    run_ingest(home, spec, "--checkpoint-records", "25")

    # the entries as the older partfin wrote them
    catalog = load_partfin_catalog(home)
    cdc = catalog.load_table("cdc.orders")
    last_checkpoint = max(p.checkpoint_id for p in positions_of(cdc.metadata, "orders-writer").values())
    combined = json.dumps({"topic": TOPIC, "partitions": recorded_partitions(cdc)}, separators=(",", ":"))
    with cdc.transaction() as tx:
        tx.remove_properties(*[k for k in cdc.properties if k.startswith(K.PROP_WRITER_PREFIX + "orders-writer/")])
        tx.set_properties({K.PROP_WRITER_PREFIX + "orders-writer": json.dumps({"checkpoint": last_checkpoint, "offset": combined})})
    ledger = catalog.load_table(ledger_identifier("cdc.orders"))
    with ledger.transaction() as tx:
        tx.remove_properties(*[k for k in ledger.properties if k.startswith(K.PROP_LEDGER_PREFIX + "orders-writer/")])
        tx.set_properties({K.PROP_LEDGER_PREFIX + "orders-writer": str(last_checkpoint)})

    more = dbz.row_history(range(60, 120), T0_MS + 2 * 3_600_000, updates=2, delete_every=7)
    delivered += produce(kafka_cluster, TOPIC, more)
    messages += more
    run_ingest(home, spec, "--checkpoint-records", "25")

    assert events(cdc_rows(home)) == expected_events(messages, delivered)
    cdc = catalog.load_table("cdc.orders")
    # the partitions' own entries go on above the writer's checkpoint ids
    assert all(p.checkpoint_id > last_checkpoint for s, p in positions_of(cdc.metadata, "orders-writer").items() if s != "orders-writer")
    rows = read_ledger(catalog, "cdc.orders", columns=("stream", "checkpoint_id", "hour", "records"))
    assert rows.filter(pl.col("hour").is_not_null())["records"].sum() == cdc_rows(home).num_rows
    assert not rows.select("stream", "checkpoint_id", "hour").is_duplicated().any()


def members_job():
    """Module level, so every step process can rebuild the job (reconstructable)."""
    job = build_ingest_members_job(PartfinTable(spec=TableSpec("orders", ("id",)), source="kafka:unused:9092#unused",
                                                partitions_start="2026-11-01-00:00"))
    return Definitions(jobs=[job], resources={"catalog": IcebergCatalogResource(), "cdc_source": CdcSourceResource()}).get_job_def(job.name)


def test_the_members_job_runs_one_group_member_per_step_and_reports_the_hours(tmp_path, kafka_cluster, instance):
    """`ingest_orders_members` with 3 members on the multiprocess executor: three steps in processes of their own, each
    a member of the group committing its partitions; every message lands once, and the report step reports the hours.
    A source without partitions is refused in one line (several members would only fence each other)."""
    kafka_cluster.create_topic(TOPIC, 6)
    messages = dbz.row_history(range(300), T0_MS, updates=2, delete_every=7)
    delivered = produce(kafka_cluster, TOPIC, messages)
    home = tmp_path / "partfin"

    def run(source: str, members: int):
        config = {
            "execution": {"config": {"max_concurrent": 3, "start_method": FORKSERVER}},
            "resources": {"catalog": {"config": {"home": str(home)}}, "cdc_source": {"config": {"source": source, "max_records": 50}}},
            "ops": {"members_orders": {"config": {"members": members}}},
        }
        with execute_job(reconstructable(members_job), instance=instance, run_config=config, raise_on_error=False) as result:
            return result.success, result.all_events

    ok, logged = run(kafka_spec(kafka_cluster, extra="group=orders-members"), 3)
    assert ok
    assert events(cdc_rows(home)) == expected_events(messages, delivered)
    consumed = {e.step_key for e in logged if e.event_type_value == "STEP_SUCCESS" and e.step_key.startswith("consume_orders")}
    assert len(consumed) == 3
    pids = {e.pid for e in logged if e.event_type_value == "STEP_START" and e.step_key.startswith("consume_orders")}
    assert len(pids) == 3  # each member in a process of its own
    committers = {e.step_key for e in logged if e.event_type_value == "ASSET_OBSERVATION" and e.step_key.startswith("consume_orders")}
    assert len(committers) >= 2  # the group spread the partitions: several members committed
    assert any(e.event_type_value == "ASSET_MATERIALIZATION" and e.step_key == "report_ingest_orders" for e in logged)

    ok, logged = run("synthetic", 2)
    assert not ok
    failure = next(e for e in logged if e.event_type_value == "STEP_FAILURE")
    assert "a synthetic source has one position" in failure.message or "one position" in str(failure.event_specific_data)
