"""The Kafka source against librdkafka's mock cluster, through real `partfin ingest` processes.

The mock cluster (kafka_cluster.py) speaks the Kafka protocol on loopback: the ingest processes use
confluent-kafka exactly as against a real cluster. Waits are liveness bounds, never performance
thresholds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from datetime import timedelta

import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka import Consumer, TopicPartition

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.expiry import TABLE_WINDOW_SNAPSHOTS, Retention
from partfin_assets.iceberg.streams import positions_of, set_idle_timeout, streams_of
from partfin_assets.iceberg.tables import DELETED
from partfin_assets.model import summary_keys as K
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.model.timeutil import parse_iso, to_us
from partfin_assets.sources.kafka import fetch_queue_backoff_ms
from partfin_assets_tests import debezium_messages as dbz
from partfin_assets_tests.kafka_cluster import FAST_GROUP_SETTINGS
from partfin_assets_tests.test_kafka_cluster import produce, producer_for

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


def recorded_partitions(table) -> dict[str, int]:
    """Partition -> the next offset the table recorded as committed (each partition's own position entry)."""
    found: dict[str, int] = {}
    for position in positions_of(table.metadata, "orders-writer").values():
        if position.source_offset:
            found.update(json.loads(position.source_offset)["partitions"])
    return found


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


HOUR_MS = 3_600_000


def per_minute(partition_ids, start_min: int, end_min: int, *, version0: int = 1) -> list:
    """One update per minute of source time in [start_min, end_min), cycling over the partition's ids."""
    return [dbz.change(partition_ids[m % len(partition_ids)], "u", T0_MS + m * 60_000, version=version0 + m)
            for m in range(start_min, end_min)]


def produce_to(cluster, partition: int, messages) -> None:
    produce(cluster, TOPIC, messages, partitions=[partition] * len(messages))


def watermark_hour(home) -> int | None:
    """The watermark of cdc.orders in hours after T0 (None: none yet)."""
    text = load_partfin_catalog(home).load_table("cdc.orders").properties.get(K.PROP_WATERMARK)
    return None if text is None else (to_us(parse_iso(text)) // 1000 - T0_MS) // HOUR_MS


def partfin_cli(home, *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "partfin_assets.cli", *args], env={**os.environ, "PARTFIN_HOME": str(home)},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_a_stalled_partition_holds_the_watermark_until_it_catches_up_or_is_idle(tmp_path, kafka_cluster):
    """Partitions 0 and 1 carry ten hours of changes, partition 2 stops after 30 minutes (a stalled
    connector task): the watermark stays at partition 2's hour; it moves once partition 2 catches
    up, and past a partition that stays silent once that one is idle (the streams' idle timeout)."""
    kafka_cluster.create_topic(TOPIC, 3)
    spec = kafka_spec(kafka_cluster)
    home = tmp_path / "home"
    ids = {0: list(range(0, 10)), 1: list(range(10, 20)), 2: list(range(20, 30))}
    produce_to(kafka_cluster, 0, per_minute(ids[0], 0, 600))
    produce_to(kafka_cluster, 1, per_minute(ids[1], 0, 600))
    produce_to(kafka_cluster, 2, per_minute(ids[2], 0, 30))
    run_ingest(home, spec, "--checkpoint-records", "50", "--watermark-policy", "min-of-last:3")  # one commit is one step
    assert watermark_hour(home) in (None, 0)  # partition 2 has only hour 0; the others would allow hour 7

    # the progress streams `partfin streams list` shows (test_progress_streams.py runs the command itself)
    streams = streams_of(load_partfin_catalog(home).load_table("cdc.orders").properties)
    partitions = {f"orders-writer/{TOPIC}-{p}" for p in range(3)}
    assert partitions <= set(streams) and streams["orders-writer"].retired
    assert not any(streams[s].retired for s in partitions)
    assert (streams[f"orders-writer/{TOPIC}-2"].progress_us // 1000 - T0_MS) // HOUR_MS == 0
    assert (streams[f"orders-writer/{TOPIC}-0"].progress_us // 1000 - T0_MS) // HOUR_MS >= 7

    produce_to(kafka_cluster, 2, per_minute(ids[2], 30, 600))  # partition 2 catches up
    run_ingest(home, spec, "--checkpoint-records", "50")
    assert watermark_hour(home) == 7

    # partitions 0 and 1 go on to hour 20; partition 2 stays silent past the idle timeout
    produce_to(kafka_cluster, 0, per_minute(ids[0], 600, 1200))
    produce_to(kafka_cluster, 1, per_minute(ids[1], 600, 1200))
    set_idle_timeout(load_partfin_catalog(home), "cdc.orders", timedelta(seconds=1))  # `partfin streams idle-timeout`
    time.sleep(2)
    run_ingest(home, spec, "--checkpoint-records", "50")
    assert watermark_hour(home) == 17
    streams = {row["stream"]: row for row in json.loads(partfin_cli(home, "streams", "list", "--table", "orders", "--json"))["streams"]}
    assert streams[f"orders-writer/{TOPIC}-2"]["state"] == "idle"

    # the late-data ledger: each checkpoint under its partition's stream, every message once
    from partfin_assets.iceberg.ledger import read_ledger

    ledger = read_ledger(load_partfin_catalog(home), "cdc.orders")
    records = {s: 0 for s in partitions}
    for stream, count in zip(ledger["stream"].to_list(), ledger["records"].to_list()):
        records[stream] += count
    produced = {0: len(per_minute(ids[0], 0, 1200)), 1: len(per_minute(ids[1], 0, 1200)), 2: len(per_minute(ids[2], 0, 600))}
    assert records == {f"orders-writer/{TOPIC}-{p}": n for p, n in produced.items()}
    assert set(ledger["writer_id"].to_list()) == {"orders-writer"}


def group_offsets(cluster, group: str, partitions: int = 3) -> dict[int, int]:
    """The group's committed offsets, as a lag monitor reads them."""
    monitor = Consumer(cluster.client_config(**{"group.id": group}))
    try:
        return {tp.partition: tp.offset for tp in monitor.committed([TopicPartition(TOPIC, p) for p in range(partitions)], timeout=30)}
    finally:
        monitor.close()


def set_group_offsets(cluster, group: str, offsets: dict[int, int]) -> None:
    """Another member of the group commits these offsets (the mock refuses commits from non-members of
    a group that had members; Kafka takes them when the group is empty: kafka-consumer-groups --reset-offsets)."""
    other = Consumer(cluster.client_config(**{"group.id": group, "enable.auto.commit": False, **FAST_GROUP_SETTINGS}))
    try:
        other.subscribe([TOPIC])
        deadline = time.monotonic() + 60
        while not other.assignment():
            assert time.monotonic() < deadline, "no assignment for the outside member"
            other.poll(0.1)
        other.commit(offsets=[TopicPartition(TOPIC, p, o) for p, o in offsets.items()], asynchronous=False)
    finally:
        other.close()
    assert group_offsets(cluster, group, len(offsets)) == offsets


def test_bad_messages_at_the_same_offsets_of_every_partition_are_each_rejected_once(tmp_path, kafka_cluster):
    """Bad messages at the same offsets of three partitions are three change logs' rejects: each lands once in
    cdc.orders__rejected, placed in its partition. The group's offsets are never where reading starts: set to the
    end before the first run and back to 0 before the second, they change nothing, and each run sets them to the
    table's. (Rejects, tombstones and heartbeats as every source has them: test_source_conformance.py.)"""
    kafka_cluster.create_topic(TOPIC, 3)
    spec = kafka_spec(kafka_cluster)
    home = tmp_path / "home"
    bad = {
        b"not json at all": "invalid JSON",
        json.dumps({"op": "u", "after": {"id": 1}, "source": {}}).encode(): "ts_ms",
        json.dumps({"op": "x", "after": {"id": 1}, "source": {"ts_ms": T0_MS}, "ts_ms": T0_MS}).encode(): "op",
    }
    for partition in range(3):
        ids = list(range(partition * 10, partition * 10 + 10))
        history = [dbz.change(i, "c", T0_MS + n * 60_000, version=0) for n, i in enumerate(ids)]
        history += [dbz.change(ids[0], "d", T0_MS + 2 * 3_600_000), dbz.tombstone(ids[0], T0_MS + 2 * 3_600_000)]
        history += [dbz.DebeziumMessage(b'{"id":1}', value, T0_MS) for value in bad]
        history += [dbz.change(ids[1], "u", T0_MS + 2 * 3_600_000 + 60_000, version=1, schema=True)]
        produce_to(kafka_cluster, partition, history)
    set_group_offsets(kafka_cluster, "partfin-orders", {0: 16, 1: 16, 2: 16})  # as if all were read
    stderr = run_ingest(home, spec, "--checkpoint-records", "4")
    assert "rejected 9" in stderr.splitlines()[-1]

    catalog = load_partfin_catalog(home)
    rejected = catalog.load_table("cdc.orders__rejected").scan().to_arrow().sort_by([("source_log", "ascending"), ("source_seq", "ascending")])
    assert rejected.num_rows == 9  # each exactly once, though every partition has them at the same offsets
    assert rejected.column("source_log").to_pylist() == [f"orders-writer/{TOPIC}-{p}" for p in (0, 0, 0, 1, 1, 1, 2, 2, 2)]
    assert rejected.column("source_seq").to_pylist() == [12, 13, 14] * 3  # the message's offset in its partition
    for raw, reason in zip(rejected.column("raw").to_pylist(), rejected.column("reason").to_pylist()):
        assert bad[raw.encode()] in reason
    cdc = cdc_rows(home)
    assert sorted(Counter(cdc.column("op").to_pylist()).items()) == [("c", 30), ("d", 3), ("u", 3)]
    assert group_offsets(kafka_cluster, "partfin-orders") == {0: 16, 1: 16, 2: 16}  # past the tombstones: what lag monitors read

    # a second run finds nothing new and rejects nothing twice, whatever the group says
    set_group_offsets(kafka_cluster, "partfin-orders", {0: 0, 1: 0, 2: 0})
    run_ingest(home, spec, "--checkpoint-records", "4")
    assert catalog.load_table("cdc.orders__rejected").scan().to_arrow().num_rows == 9
    assert cdc_rows(home).num_rows == 36
    assert group_offsets(kafka_cluster, "partfin-orders") == {0: 16, 1: 16, 2: 16}  # lag monitors see the table's


def test_a_run_ends_when_its_partitions_are_read_without_waiting_out_the_poll_timeout(tmp_path, kafka_cluster):
    """A run that is not --follow ends as soon as every partition it was assigned is read to its end. Before, its
    fetches asked for 500 messages and waited out poll_timeout for the ones that were not coming: with an hour's
    timeout the run never ended (and every run of the default 0.2 s spent ~0.4 s so)."""
    kafka_cluster.create_topic(TOPIC, 2)
    for partition in range(2):
        produce_to(kafka_cluster, partition, per_minute([partition * 10 + i for i in range(3)], 0, 30))
    home = tmp_path / "home"
    process = ingest(home, kafka_spec(kafka_cluster, extra="poll_timeout=1h"))
    try:
        _, stderr = process.communicate(timeout=90)  # a liveness bound: the run needs a second or two
    finally:
        process.kill()
    assert process.returncode == 0, stderr.decode()
    assert recorded_partitions(load_partfin_catalog(home).load_table("cdc.orders")) == {"0": 30, "1": 30}
    assert cdc_rows(home).num_rows == 60


def test_a_consumer_with_a_small_fetch_queue_commits_each_partition_once_not_a_checkpoint_per_fetch(tmp_path, kafka_cluster):
    """A consumer whose fetch queue is small (queued.max.messages.kbytes, to bound memory over many partitions) empties
    it faster than librdkafka fetches again: once the queue is over its bound, the next fetch waits
    fetch.queue.backoff.ms (librdkafka's default 1 s), longer than poll_timeout (0.2 s), and an empty poll commits what
    every partition holds. Each fetch became a checkpoint of each partition (the scale-out benchmark with a 4 MB
    queue: 12 to 13 checkpoints per partition, a quarter to a sixth of the throughput). partfin now postpones such
    fetches by a quarter of poll_timeout unless the spec sets fetch.queue.backoff.ms."""
    partitions, per_partition = 4, 40
    kafka_cluster.create_topic(TOPIC, partitions)
    producer = producer_for(kafka_cluster)
    for partition in range(partitions):
        for n, message in enumerate(per_minute([partition * 10 + i for i in range(3)], 0, per_partition)):
            producer.produce(TOPIC, key=message.key, value=message.value, timestamp=message.timestamp_ms, partition=partition)
            if n % 2:
                assert producer.flush(60) == 0  # record batches of 2 messages: a fetch returns whole batches
    home = tmp_path / "home"
    small_queue = "queued.min.messages=1,queued.max.messages.kbytes=1,max.partition.fetch.bytes=1024"  # ~2 messages a fetch
    run_ingest(home, kafka_spec(kafka_cluster, extra=small_queue))
    table = load_partfin_catalog(home).load_table("cdc.orders")
    assert recorded_partitions(table) == {str(p): per_partition for p in range(partitions)}
    assert cdc_rows(home).num_rows == partitions * per_partition
    checkpoints = {stream: position.checkpoint_id for stream, position in positions_of(table.metadata, "orders-writer").items()
                   if position.source_offset}
    assert len(checkpoints) == partitions and max(checkpoints.values()) <= 2, checkpoints  # one each at its end (2: a slow fetch)


def test_the_fetch_queue_backoff_is_a_quarter_of_poll_timeout_within_librdkafkas_default():
    assert fetch_queue_backoff_ms(0.2) == 50
    assert fetch_queue_backoff_ms(3600) == 1000  # poll_timeout=1h: never longer than librdkafka's own 1 s
    assert fetch_queue_backoff_ms(0.001) == 1


def test_a_topic_of_many_partitions_keeps_a_bounded_number_of_snapshots(tmp_path, kafka_cluster):
    """Each partition is a progress stream, and expiry used to keep up to 20 commits of each stream's window: a
    64-partition table kept 1,280 snapshots and every commit rewrote metadata that large (14x a fresh table's
    commit). All streams' windows now share one bound (each keeps at least its newest commit)."""
    partitions, per_partition = 16, 32
    kafka_cluster.create_topic(TOPIC, partitions)
    for partition in range(partitions):
        produce_to(kafka_cluster, partition, per_minute([partition * 10 + i for i in range(3)], 0, per_partition))
    home = tmp_path / "home"
    run_ingest(home, kafka_spec(kafka_cluster), "--checkpoint-records", "4")
    table = load_partfin_catalog(home).load_table("cdc.orders")
    assert recorded_partitions(table) == {str(p): per_partition for p in range(partitions)}
    assert cdc_rows(home).num_rows == partitions * per_partition  # 128 checkpoints
    retention = Retention()
    bound = retention.keep_last + retention.slack + max(TABLE_WINDOW_SNAPSHOTS, partitions + 1) + 1
    assert len(table.metadata.snapshots) <= bound, len(table.metadata.snapshots)


def test_the_checkpoints_of_many_partitions_land_together_one_snapshot_each(tmp_path, kafka_cluster):
    """A consumer reading many partitions used to make one Iceberg commit per partition's checkpoint: each costs about
    what writing a few thousand records costs, and the members of a group committing at once lost races to each
    other (the scale-out benchmark: a third of the run with a core idle). The checkpoints of different partitions
    that are ready within the commit interval now land in one commit, one snapshot each, so every checkpoint keeps
    its own position, statistics and watermark; with --commit-interval 0 each commits alone, as before."""
    partitions, per_partition = 16, 24
    kafka_cluster.create_topic(TOPIC, partitions)
    for partition in range(partitions):
        produce_to(kafka_cluster, partition, per_minute([partition * 10 + i for i in range(3)], 0, per_partition))
    for interval in ("1", "0"):
        home = tmp_path / f"interval-{interval}"
        lines = run_ingest(home, kafka_spec(kafka_cluster), "--commit-interval", interval).strip().splitlines()
        table = load_partfin_catalog(home).load_table("cdc.orders")
        assert recorded_partitions(table) == {str(p): per_partition for p in range(partitions)}
        assert cdc_rows(home).num_rows == partitions * per_partition
        assert len(lines) == partitions  # a progress line per checkpoint: one per partition, at its end
        checkpoints = [s for s in table.metadata.snapshots if s.summary.get(K.STREAM)]
        assert sorted(s.summary[K.STREAM] for s in checkpoints) == sorted(f"orders-writer/{TOPIC}-{p}" for p in range(partitions))
        assert all(int(s.summary[K.EVENT_TIME_COUNT]) == per_partition for s in checkpoints)  # each its own statistics
        commits = {s.summary[K.COMMIT_ID] for s in checkpoints}
        if interval == "0":
            assert len(commits) == partitions and "commits" not in lines[-1]
        else:
            assert len(commits) <= partitions // 4, lines
            assert f"  commits {len(commits)}" in lines[-1]


def wait_for(condition, what: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


DBZ_ORDERS = TableSpec("orders", ("id",), {"id": pa.int64(), "customer_id": pa.int64(), "amount": pa.float64(),
                                            "status": pa.string(), "updated_by": pa.string(), "note": pa.string()})


def test_dagster_sync_reads_partfin_source_kafka_and_the_group_sees_its_progress(tmp_path, kafka_cluster, monkeypatch):
    """PARTFIN_SOURCE=kafka:... for the Dagster sync job: cdc and base are written; the group's
    offsets (what lag monitors read) equal the offsets the Iceberg checkpoint recorded."""
    kafka_cluster.create_topic(TOPIC, 3)
    messages = dbz.row_history(range(40), T0_MS, updates=2, delete_every=4)
    produce(kafka_cluster, TOPIC, messages)
    spec = kafka_spec(kafka_cluster, extra="group=orders-sync")
    monkeypatch.setenv("PARTFIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PARTFIN_SOURCE", spec)
    monkeypatch.setenv("PARTFIN_PARTITIONS_START", "2026-11-01-00:00")
    monkeypatch.setenv("PARTFIN_MAX_RECORDS", "25")
    from dagster import DagsterInstance

    from partfin_assets.defs import build_definitions
    from partfin_assets.defs.tables import PartfinTable

    defs = build_definitions([PartfinTable(spec=DBZ_ORDERS, source="kafka:unused:9092#unused")])
    with DagsterInstance.ephemeral() as instance:
        assert defs.resolve_job_def("sync_orders").execute_in_process(instance=instance).success

    catalog = load_partfin_catalog(tmp_path / "home")
    assert cdc_rows(tmp_path / "home").num_rows == sum(m.value is not None for m in messages)
    base = catalog.load_table("base.orders").scan().to_arrow().filter(pc.invert(pc.field(DELETED)))
    assert sorted(base.column("id").to_pylist()) == [i for i in range(40) if i % 4]
    recorded = recorded_partitions(catalog.load_table("cdc.orders"))
    assert {str(p): o for p, o in group_offsets(kafka_cluster, "orders-sync").items()} == recorded


def test_a_source_that_cannot_be_read_is_one_line_and_creates_nothing(tmp_path, kafka_cluster):
    """Each case a real `partfin ingest` (run side by side): one line on stderr, exit 2, no table.
    librdkafka properties come from PARTFIN_KAFKA_* variables: a bad value names the property, never
    the value; a secret in the spec is refused; an unknown topic and brokers nobody answers on are
    named (librdkafka's own lines about failing connections go to the log, not onto stderr)."""
    kafka_cluster.create_topic(TOPIC, 1)
    secret = "hunter2-do-not-print"
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections to it are refused
    try:
        cases = {
            "bad-value": (kafka_spec(kafka_cluster), {"PARTFIN_KAFKA_SESSION_TIMEOUT_MS": secret},
                          'Invalid value for configuration property "session.timeout.ms"'),
            "in-spec": (kafka_spec(kafka_cluster, extra=f"sasl.password={secret}"), {}, "PARTFIN_KAFKA_SASL_PASSWORD"),
            "unknown-topic": (kafka_spec(kafka_cluster, topic="dbserver1.public.nope"), {},
                              "topic 'dbserver1.public.nope' cannot be read: Broker: Unknown topic or partition"),
            "no-broker": (f"kafka:127.0.0.1:{closed.getsockname()[1]}#{TOPIC}", {"PARTFIN_KAFKA_SASL_USERNAME": secret},
                          "Failed to get metadata: Local: Broker transport failure"),
        }
        processes = {name: ingest(tmp_path / name, spec, env=env) for name, (spec, env, _) in cases.items()}
        outcomes = {name: finish(process, 120) for name, process in processes.items()}
    finally:
        closed.close()
    for name, (_, _, named) in cases.items():
        code, lines = outcomes[name]
        assert code == 2 and len(lines) == 1, (name, lines)
        assert named in lines[0] and secret not in lines[0], (name, lines)
        home = tmp_path / name
        assert not (home / "catalog.db").exists() or not load_partfin_catalog(home).table_exists("cdc.orders")


def test_offsets_retention_deleted_stop_ingest_with_one_line(tmp_path, kafka_cluster):
    """Messages deleted (retention) before partfin read them: one line naming the partition and the
    recorded offset, exit 2, nothing skipped silently."""
    kafka_cluster.create_topic(TOPIC, 1)
    spec = kafka_spec(kafka_cluster)
    home = tmp_path / "home"
    produce(kafka_cluster, TOPIC, dbz.row_history(range(10), T0_MS, updates=1))
    run_ingest(home, spec)
    produce(kafka_cluster, TOPIC, dbz.row_history(range(10, 20), T0_MS + 3_600_000, updates=1))
    kafka_cluster.delete_records(TOPIC, 0, 30)  # offsets 20..29 are gone before partfin read them
    process = ingest(home, spec)
    _, stderr = process.communicate(timeout=120)
    lines = stderr.decode().strip().splitlines()
    assert process.returncode == 2 and len(lines) == 1, lines
    assert "partition 0" in lines[0] and "(20)" in lines[0] and "retention" in lines[0]
    assert cdc_rows(home).num_rows == 20


def start_cli(home, *args: str, env: dict | None = None) -> subprocess.Popen:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PARTFIN_")}
    environment.update({"PARTFIN_HOME": str(home), **(env or {})})
    return subprocess.Popen([sys.executable, "-m", "partfin_assets.cli", *args], env=environment,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def finish(process: subprocess.Popen, timeout_s: float = 300) -> tuple[int, list[str]]:
    """Exit code and stderr lines of a started `partfin` process."""
    _, stderr = process.communicate(timeout=timeout_s)
    return process.returncode, stderr.decode().strip().splitlines()


def bare_payload(line: bytes) -> bytes:
    """A JsonConverter line with `schemas.enable=false`: the payload after the schema block, byte for byte."""
    cut = line.index(b',"payload":')
    payload = line[cut + len(b',"payload":'):-1]
    assert json.loads(payload) == json.loads(line)["payload"]
    return payload


def cdc_of(home, table: str) -> pa.Table:
    return load_partfin_catalog(home).load_table(f"cdc.{table}").scan().to_arrow().sort_by("source_seq")


def test_real_debezium_output_decodes_the_same_from_kafka_as_from_a_file(tmp_path, kafka_cluster):
    """Real Debezium messages (../shared/debezium-corpus), one per Kafka message, a tombstone as Kafka's
    null value: `partfin ingest --source kafka:...` writes the same CDC records and declares the same
    columns as `--source debezium:FILE` of the same values, with the schema envelope (~78 column
    types) and without it (r, c, d, a tombstone, u): one decoder; and base.<table> holds the rows the
    corpus expects."""
    from partfin_assets_tests.test_debezium_corpus import CORPUS, base_differences, corpus_key

    assert CORPUS is not None, "../shared/debezium-corpus is missing"
    tombstone = b'{"schema":null,"payload":null}'
    lines = {name: (CORPUS / f"{name}.jsonl").read_bytes().splitlines() for name in ("mysql_all_types", "mysql_products")}
    assert tombstone in lines["mysql_products"]
    runs = {  # (home, table) -> message values (None: a tombstone)
        ("envelope", "mysql_all_types"): [None if x == tombstone else x for x in lines["mysql_all_types"]],
        ("bare", "mysql_products"): [None if x == tombstone else bare_payload(x) for x in lines["mysql_products"]],
    }
    processes = {}
    for (variant, table), values in runs.items():
        topic = f"dbserver1.{variant}.{table}"
        kafka_cluster.create_topic(topic, 1)
        produce(kafka_cluster, topic, [dbz.DebeziumMessage(b"{}", value, T0_MS) for value in values])
        key = ",".join(corpus_key(table))
        processes[variant, table, "kafka"] = start_cli(tmp_path / f"kafka-{variant}", "ingest", "--table", table, "--source",
                                                       kafka_spec(kafka_cluster, topic), "--primary-key", key)
        path = tmp_path / f"{variant}-{table}.jsonl"  # the same values as a Debezium file (a tombstone: an empty line)
        path.write_bytes(b"".join((value or b"") + b"\n" for value in values))
        processes[variant, table, "file"] = start_cli(tmp_path / f"file-{variant}", "ingest", "--table", table, "--source",
                                                      f"debezium:{path}", "--primary-key", key)
    for name, process in processes.items():
        code, stderr_lines = finish(process)
        assert code == 0, (name, stderr_lines)

    for (variant, table), values in runs.items():
        from_kafka = cdc_of(tmp_path / f"kafka-{variant}", table)
        assert from_kafka.num_rows == sum(value is not None for value in values) > 0
        from_file = cdc_of(tmp_path / f"file-{variant}", table)
        for column in ("key", "op", "event_time", "payload", "arrival_time"):
            assert from_kafka.column(column).to_pylist() == from_file.column(column).to_pylist(), (variant, table, column)
        # a file's source_seq is its line number, a Kafka message's its offset: one message per line
        assert from_kafka.column("source_seq").to_pylist() == [seq - 1 for seq in from_file.column("source_seq").to_pylist()]
        declared = [load_partfin_catalog(tmp_path / f"{kind}-{variant}").load_table(f"cdc.{table}").properties.get(K.PROP_COLUMNS)
                    for kind in ("kafka", "file")]
        assert declared[0] == declared[1], (variant, table)
        assert bool(json.loads(declared[0] or "{}")) == (variant == "envelope")  # column types come from the schema blocks
    # with the schema envelope, through `partfin upsert`: the rows the corpus expects, value by value
    differences = base_differences(tmp_path / "kafka-envelope", "mysql_all_types")
    assert not differences, "\n".join(differences)


def test_a_topic_declares_the_decimal_encoding_it_sent_and_reads_schemaless_messages_in_it(tmp_path, kafka_cluster):
    """The first run on a topic whose Connect Decimal comes as a JSON number (decimal.format=NUMERIC) records the
    column as `numeric`; after the connector drops its schemas (schemas.enable=false), "1234" is 1234.00 and base64
    bytes are rejected with their reason, never read as another number."""
    from partfin_assets_tests.test_debezium_json import AMOUNT, TS_MS, schemaless_line
    from partfin_assets_tests.debezium_lines import change_line

    kafka_cluster.create_topic(TOPIC, 1)
    spec = kafka_spec(kafka_cluster)
    home = tmp_path / "home"
    first = change_line({"id": 1, "amount": "123.45"}, TS_MS, fields=AMOUNT).replace('"123.45"', "123.45")
    produce(kafka_cluster, TOPIC, [dbz.DebeziumMessage(b"{}", first.encode(), TS_MS)])
    run_ingest(home, spec)
    catalog = load_partfin_catalog(home)
    assert json.loads(catalog.load_table("cdc.orders").properties[K.PROP_COLUMNS])["amount"] == "decimal128(12, 2) numeric"
    later = [schemaless_line(2, '"1234"'), schemaless_line(3, "7.5"), schemaless_line(4, '"MDk="')]
    produce(kafka_cluster, TOPIC, [dbz.DebeziumMessage(b"{}", line.encode(), TS_MS) for line in later])
    run_ingest(home, spec)
    amounts = {json.loads(p)["id"]: json.loads(p)["amount"] for p in cdc_rows(home).column("payload").to_pylist()}
    assert amounts == {1: "123.45", 2: "1234.00", 3: "7.50"}
    rejected = load_partfin_catalog(home).load_table("cdc.orders__rejected").scan().to_arrow().to_pylist()
    assert [(r["source_seq"], "'MDk=' is not decimal text" in r["reason"]) for r in rejected] == [(3, True)], rejected
