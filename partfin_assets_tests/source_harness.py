"""One harness per registered source kind, for the source conformance suite (test_source_conformance.py).

A harness knows how to feed its kind as a user's system would: change events (and which rows they must become),
a poisoned message (or that the kind has no malformed input), heartbeats (or that the kind has none), and the
spec of a *different* source of the same kind (a table keeps one change log). The suite runs `partfin ingest`
against `spec()` with `ingest_args()` and never looks inside a source.

Adding a source kind = its package + one registry line + one harness here (HARNESSES).
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from partfin_assets.model.record_keys import canonical_key
from partfin_assets.model.timeutil import parse_iso, to_us
from partfin_assets.sources.registry import make_source
from partfin_assets.sources.synthetic import ORDERS_SPEC
from partfin_assets_tests import debezium_messages as dbz
from partfin_assets_tests.debezium_lines import heartbeat_line

T0_MS = 1_793_491_200_000  # 2026-11-01T00:00:00Z
MINUTE_MS = 60_000
HOUR_MS = 3_600_000


def events_of(rows: pa.Table, columns=("key", "op", "event_time")) -> Counter:
    """The change events `rows` (cdc.<table> rows) hold, one entry per row: duplicates show as counts above 1."""
    values = [pc.cast(rows.column(c), pa.int64()) if c == "event_time" else rows.column(c) for c in columns]
    return Counter(zip(*(v.to_pylist() for v in values)))


@dataclass
class Heartbeats:
    """What a harness's heartbeats promise: every event happened before `after_us`, and the source's clock
    (its heartbeat) reaches at least `after_us` once they are read."""

    after_us: int


class SourceHarness:
    """The contract every harness meets; one instance per test (its own source)."""

    kind: str
    replayable: bool  # `partfin replay` reads the history again (else it is refused in one line)
    refusal: str = ""  # what a refused replay's line names (the kind's reason)
    grows: bool = True  # events can be added between runs (a generator's stream is fixed by its spec)

    def spec(self) -> str:
        raise NotImplementedError

    def ingest_args(self) -> tuple[str, ...]:
        return ("--primary-key", "id")

    def add_events(self, count: int) -> None:
        """About `count` new change events (creates, updates, deletes of new keys), as the system behind the source makes them."""
        raise NotImplementedError

    def expected(self) -> Counter:
        """Every event added so far, as events_of(cdc rows) must count it: each exactly once."""
        raise NotImplementedError

    def events_of(self, rows: pa.Table) -> Counter:
        return events_of(rows)

    def add_poison(self) -> str | None:
        """A message the source cannot turn into a change; returns what its reject's reason names (None: the kind has none)."""
        raise NotImplementedError

    def add_heartbeats(self) -> Heartbeats | None:
        """Heartbeats after every event so far (None: the kind has none)."""
        raise NotImplementedError

    def other_spec(self) -> str:
        """A spec of the same kind reading another change history (with events of its own)."""
        raise NotImplementedError


class _DebeziumChanges:
    """Debezium change events of `orders` rows (PostgreSQL connector, JsonConverter), one minute of source time apart:
    for each new key a create; every second key an update; every fourth a delete and its tombstone."""

    def __init__(self, first_key: int = 1) -> None:
        self.next_key = first_key
        self.next_ms = T0_MS
        self.events: Counter = Counter()

    def take(self, count: int) -> list[dbz.DebeziumMessage]:
        keys = range(self.next_key, self.next_key + max(count * 4 // 7, 1))
        self.next_key = keys[-1] + 1
        messages = []
        for key in keys:
            messages.append(self._change(key, "c", 0))
        for key in keys[::2]:
            messages.append(self._change(key, "u", 1))
        for key in keys[::4]:
            messages.append(self._change(key, "d", 2))
            messages.append(dbz.tombstone(key, self.next_ms))  # no change: read past
        return messages

    def _change(self, key: int, op: str, version: int) -> dbz.DebeziumMessage:
        self.next_ms += MINUTE_MS
        self.events[(canonical_key({"id": key}), op, self.next_ms * 1000)] += 1
        return dbz.change(key, op, self.next_ms, version=version)


@dataclass
class DebeziumFileHarness(SourceHarness):
    """`debezium:PATH`: Debezium's JSON lines in a file (a tombstone is an empty line)."""

    folder: Path
    kind = "debezium"
    replayable = True
    changes: _DebeziumChanges = field(default_factory=_DebeziumChanges)

    def __post_init__(self) -> None:
        self.path = self.folder / "orders.jsonl"
        self.path.touch()

    def spec(self) -> str:
        return f"debezium:{self.path}"

    def _append(self, path: Path, values: list[bytes | None]) -> None:
        with path.open("ab") as file:
            file.write(b"".join((value or b"") + b"\n" for value in values))

    def add_events(self, count: int) -> None:
        self._append(self.path, [m.value for m in self.changes.take(count)])

    def expected(self) -> Counter:
        return self.changes.events

    def add_poison(self) -> str:
        self._append(self.path, [b"not json at all"])
        return "invalid JSON"

    def add_heartbeats(self) -> Heartbeats:
        hours = [self.changes.next_ms + h * HOUR_MS for h in (2, 4, 6)]  # with and without the schema envelope
        self._append(self.path, [heartbeat_line(ms, wrapped=i % 2 == 0).encode() for i, ms in enumerate(hours)])
        return Heartbeats(hours[-1] * 1000)

    def other_spec(self) -> str:
        other = self.folder / "other.jsonl"
        self._append(other, [m.value for m in _DebeziumChanges(first_key=1000).take(7)])  # another first line: another file
        return f"debezium:{other}"


@dataclass
class KafkaHarness(SourceHarness):
    """`kafka:BOOTSTRAP#TOPIC`: Debezium messages on a 3-partition topic of librdkafka's mock cluster. The first events
    go to partitions 0 and 1 only: partition 2's, when they come, are read from its log start (a partition the table
    never read, as after adding one to the topic)."""

    cluster: object
    kind = "kafka"
    replayable = False
    refusal = "Kafka topic"
    topic: str = "dbserver1.public.orders"
    changes: _DebeziumChanges = field(default_factory=_DebeziumChanges)

    def __post_init__(self) -> None:
        self.cluster.create_topic(self.topic, 3)
        self.rounds = 0

    def _spec(self, topic: str) -> str:
        from partfin_assets_tests.kafka_cluster import FAST_GROUP_SETTINGS

        return f"kafka:{self.cluster.bootstrap_servers}#{topic}," + ",".join(f"{k}={v}" for k, v in FAST_GROUP_SETTINGS.items())

    def spec(self) -> str:
        return self._spec(self.topic)

    def _produce(self, messages, partitions=None, topic: str | None = None) -> None:
        from partfin_assets_tests.test_kafka_cluster import produce

        produce(self.cluster, topic or self.topic, messages, partitions=partitions)

    def add_events(self, count: int) -> None:
        messages = self.changes.take(count)
        first = self.rounds == 0
        self.rounds += 1
        # a key stays in its partition (a delete's tombstone follows it there)
        self._produce(messages, [json.loads(m.key)["id"] % (2 if first else 3) for m in messages])

    def expected(self) -> Counter:
        return self.changes.events

    def add_poison(self) -> str:
        self._produce([dbz.DebeziumMessage(b'{"id":1}', b"not json at all", self.changes.next_ms)], [1])
        return "invalid JSON"

    def add_heartbeats(self) -> Heartbeats:
        after_ms = self.changes.next_ms + 6 * HOUR_MS
        for partition in range(3):  # Debezium's heartbeat topic messages, one per partition (each has its own stream)
            beats = [dbz.DebeziumMessage(b'{"serverName":"dbserver1"}', heartbeat_line(ms, wrapped=i % 2 == 0).encode(), ms)
                     for i, ms in enumerate((after_ms - 4 * HOUR_MS, after_ms - 2 * HOUR_MS, after_ms))]
            self._produce(beats, [partition] * len(beats))
        return Heartbeats(after_ms * 1000)

    def other_spec(self) -> str:
        other = "dbserver1.public.other"
        self.cluster.create_topic(other, 1)
        self._produce(_DebeziumChanges(first_key=1000).take(7), topic=other)
        return self._spec(other)


@dataclass
class PostgresHarness(SourceHarness):
    """`postgres:DSN`: logical decoding (wal2json) of public.orders in a database of its own. A change's event time is
    its commit time, so events are compared by key and op (each key gets each op at most once)."""

    cluster: object
    kind = "postgres"
    replayable = False
    refusal = "replication slot"

    def __post_init__(self) -> None:
        import psycopg

        self.database = f"pf_{uuid.uuid4().hex[:10]}"
        self.cluster.create_database(self.database)
        self.conn = psycopg.connect(self.cluster.dsn(self.database), autocommit=True)
        self.conn.execute("CREATE TABLE orders (id bigint PRIMARY KEY, user_id bigint, amount float8, status text)")
        self.conn.execute("CREATE TABLE other (id bigint PRIMARY KEY, note text)")
        # the slot partfin reads, created before the first change (what a first `partfin ingest` does)
        self.conn.execute("SELECT pg_create_logical_replication_slot('partfin_orders', 'wal2json')")
        self.next_key = 1
        self.events: Counter = Counter()

    def spec(self) -> str:
        return f"postgres:{self.cluster.dsn(self.database)}"

    def ingest_args(self) -> tuple[str, ...]:
        return ()  # the key comes from the database

    def add_events(self, count: int) -> None:
        keys = range(self.next_key, self.next_key + max(count * 4 // 7, 1))
        self.next_key = keys[-1] + 1
        for key in keys:
            self.conn.execute("INSERT INTO orders VALUES (%s, %s, %s, 'new')", (key, key % 7, key * 1.5))
        with self.conn.transaction():  # one transaction of several changes
            for key in keys[::2]:
                self.conn.execute("UPDATE orders SET status = 'paid' WHERE id = %s", (key,))
            for key in keys[::4]:
                self.conn.execute("DELETE FROM orders WHERE id = %s", (key,))
        for key in keys:
            self.events[(canonical_key({"id": key}), "c")] += 1
        self.events.update({(canonical_key({"id": key}), "u"): 1 for key in keys[::2]})
        self.events.update({(canonical_key({"id": key}), "d"): 1 for key in keys[::4]})

    def expected(self) -> Counter:
        return self.events

    def events_of(self, rows: pa.Table) -> Counter:
        return events_of(rows, ("key", "op"))

    def add_poison(self) -> str:
        self.conn.execute("TRUNCATE orders")  # wal2json's TRUNCATE names no rows: it cannot be keyed
        return "TRUNCATE"

    def add_heartbeats(self) -> Heartbeats:
        # the database stays idle for 6 hours (its server's clock steps on): the source's heartbeat at the end of a
        # run is the database clock, after every commit
        self.cluster.step_clock(hours=6)
        (now,) = self.conn.execute("SELECT clock_timestamp()").fetchone()
        return Heartbeats(to_us(now))

    def other_spec(self) -> str:
        self.conn.execute("INSERT INTO other VALUES (1, 'x')")
        return f"postgres:{self.cluster.dsn(self.database)}#public.other"

    def close(self) -> None:
        self.conn.close()
        import psycopg

        with psycopg.connect(self.cluster.dsn(), autocommit=True) as conn:
            for (slot,) in conn.execute("SELECT slot_name FROM pg_replication_slots WHERE database = %s", (self.database,)).fetchall():
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))


class SyntheticHarness(SourceHarness):
    """`synthetic:...`: the generator's stream is fixed by its spec (seed, start, end): 3 hours of events, then an idle
    hour whose 20-minute cells each end in a heartbeat. It has no malformed input."""

    kind = "synthetic"
    replayable = True
    grows = False
    START = "2026-11-01T00:00:00Z"
    OPTIONS = "start=2026-11-01T00:00:00Z,end=2026-11-01T04:00:00Z,rate=0.02,late_fraction=0,idle_every=4h,idle_for=1h,heartbeat_every=20m"

    def __init__(self, seed: int = 11) -> None:
        self.seed = seed

    def spec(self) -> str:
        return f"synthetic:seed={self.seed},{self.OPTIONS}"

    def ingest_args(self) -> tuple[str, ...]:
        return ()

    def add_events(self, count: int) -> None:
        pass  # the spec holds them all

    def expected(self) -> Counter:
        expected = Counter()
        for batch in make_source(self.spec(), ORDERS_SPEC).batches(None, 10_000):
            expected += events_of(batch.records)
        return expected

    def add_poison(self) -> None:
        return None

    def add_heartbeats(self) -> Heartbeats:
        return Heartbeats(to_us(parse_iso(self.START)) + 3 * HOUR_MS * 1000 + 20 * MINUTE_MS * 1000)  # the idle hour's first cell

    def other_spec(self) -> str:
        return SyntheticHarness(seed=self.seed + 1).spec()


STARTS_BEHIND_HOURS = -24


class SteppedClockCluster:
    """A throwaway PostgreSQL cluster whose server clock can be stepped forward (libfaketime reads the offset file on
    every clock call): hours of an idle database pass at once. It starts a day behind, so that the stepped clock stays
    in the past (partfin trusts no source clock ahead of its own)."""

    def __init__(self, cluster, clock_file: Path) -> None:
        self.cluster, self.clock_file, self.offset_hours = cluster, clock_file, STARTS_BEHIND_HOURS

    def __getattr__(self, name):
        return getattr(self.cluster, name)

    def step_clock(self, hours: int) -> None:
        self.offset_hours += hours
        assert self.offset_hours <= 0, "a server clock ahead of partfin's is not trusted"
        self.clock_file.write_text(f"{self.offset_hours:+d}h\n")


@contextmanager
def postgres_with_a_clock() -> Iterator[SteppedClockCluster]:
    import shutil
    import tempfile

    from partfin_assets_tests.postgres_cluster import throwaway_cluster

    folder = Path(tempfile.mkdtemp(prefix="partfin-clock-"))  # the server (user postgres) must read it
    folder.chmod(0o755)
    clock = folder / "faketime"
    clock.write_text(f"{STARTS_BEHIND_HOURS:+d}h\n")
    clock.chmod(0o644)
    try:
        with throwaway_cluster(clock_file=clock) as cluster:
            yield SteppedClockCluster(cluster, clock)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def _synthetic(tmp_path: Path, request) -> Iterator[SourceHarness]:
    yield SyntheticHarness()


@contextmanager
def _debezium(tmp_path: Path, request) -> Iterator[SourceHarness]:
    yield DebeziumFileHarness(tmp_path)


@contextmanager
def _kafka(tmp_path: Path, request) -> Iterator[SourceHarness]:
    from partfin_assets_tests.kafka_cluster import mock_kafka_cluster

    with mock_kafka_cluster(brokers=3) as cluster:  # a cluster of its own per test
        yield KafkaHarness(cluster)


@contextmanager
def _postgres(tmp_path: Path, request) -> Iterator[SourceHarness]:
    harness = PostgresHarness(request.getfixturevalue("postgres_with_a_clock"))  # the module's cluster, a database per test
    try:
        yield harness
    finally:
        harness.close()


# One entry per source kind of the registry: how a test opens that kind's harness (with pytest's `request`).
HARNESSES = {"synthetic": _synthetic, "debezium": _debezium, "kafka": _kafka, "postgres": _postgres}


def open_harness(kind: str, tmp_path: Path, request):
    """The harness of `kind` for one test, as a context manager."""
    if kind not in HARNESSES:
        raise LookupError(f"no conformance harness for source kind {kind!r}: add one to source_harness.py")
    return HARNESSES[kind](tmp_path, request)

