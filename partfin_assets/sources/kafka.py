"""Debezium change events from a Kafka topic, read with confluent-kafka (librdkafka).

Spec: `kafka:BOOTSTRAP#TOPIC[,option=value,...]`, e.g.
`kafka:broker1:9092,broker2:9092#dbserver1.public.orders,group=partfin-orders,security.protocol=SASL_SSL`.
BOOTSTRAP is librdkafka's `bootstrap.servers`; after `#` come the topic and options:

- `group=NAME`: the consumer group (default `partfin-<table>`). It only spreads the topic's
  partitions over the processes that read it (and tells lag monitors how far they are): where
  reading resumes is never taken from the group but from the checkpoint (below).
- `poll_timeout=0.2s`, `idle_batch_every=10s`: how long a fetch waits when nothing is fetched; how often a following
  source with nothing new yields an empty batch so its caller regains control.
- any name with a dot is a librdkafka consumer property, passed through as it is
  (`security.protocol=SASL_SSL`, `sasl.mechanism=SCRAM-SHA-512`, `sasl.username=cdc`,
  `ssl.ca.location=/etc/ssl/kafka-ca.pem`, `session.timeout.ms=10000`, ...).

Secrets never go in the spec (it is recorded in every checkpoint and shown in the UI): a property
whose name says password, passphrase, secret, credentials or private-key material (`sasl.password`,
`ssl.key.password`, `sasl.oauthbearer.client.secret`, `sasl.oauthbearer.assertion.private.key.passphrase`,
`ssl.key.pem`, ...: a rule over the name, model/redaction.py's secret words) is refused there and comes from the
environment instead: `PARTFIN_KAFKA_<NAME>` with dots as `_` (`PARTFIN_KAFKA_SASL_PASSWORD` is
`sasl.password`; `__` stands for a literal `_`). Any property may come that way; the environment
wins. Values from the environment are redacted in every error and log line.

Exactly once without trusting the group: a checkpoint holds the messages of one partition, and
the offset it commits is that partition's next offset (compact JSON `{"topic": T, "partitions":
{"3": 1200}}`), recorded in the same Iceberg commit as the records (like Flink's Iceberg sink) as
the partition's own position (iceberg/streams.py); a restarted or rebalanced reader seeks each
partition it is assigned to the offset the table recorded (the log start for a partition never
read). The group's offsets are committed after each Iceberg commit (and set to the table's
offsets when partitions are assigned, so a run after a crash between the two shows them too),
only so that lag monitors (kafka-consumer-groups, Burrow, ...) see progress; partfin never reads
them.

Scaling out: several processes (on one machine or several) read one topic in one group under one
writer id; the group spreads the partitions over them and each commits checkpoints of its own
partitions to the same table, concurrently. The compare-and-set on each partition's position
(ingest/writer.py) is what keeps every message once, whatever the group does: a commit lands only
if the table still records the offset its batch started from, so a process that lost a partition
in a rebalance (and does not know it yet) can commit it only from where the table stands, never
twice. A partition assigned to a process is read from the offset the table holds at that moment
(the writer reloads it: `resume_assigned_from`); if the table moves past it after all (such a late
commit of the previous owner), that process is fenced once and reads it again from there.

One batch holds the messages of one partition (`ChangeBatch.stream` = `<topic>-<partition>`),
so every checkpoint belongs to one partition's progress stream (iceberg/streams.py): the
watermark is the minimum over partitions, and a partition that stops producing holds it back
until it catches up or is idle by the streams' rule. Message values are decoded by the one
Debezium decoder (sources/debezium_json.py), with or without the schema envelope; `source_seq`
is the message's offset in its partition; `arrival_time` is Debezium's envelope `ts_ms`, else the
message's Kafka timestamp. Tombstones (null values) carry no change and are
consumed; Debezium heartbeat messages become heartbeat batches of their partition. A message
that is not a change event (not JSON, no `ts_ms`, an unknown `op`, nested too deep, over
PARTFIN_MAX_MESSAGE_BYTES, anything the decoder fails on) goes to `cdc.<table>__rejected` with its
topic, partition and offset, and reading goes on in every partition.

With follow=False the source reads every assigned partition up to its end as it was when
reached, then ends; with follow=True it never ends.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
from confluent_kafka import OFFSET_BEGINNING, TIMESTAMP_NOT_AVAILABLE, Consumer, KafkaError, KafkaException, TopicPartition

from partfin_assets.model.change_columns import ChangeColumns
from partfin_assets.model.errors import SourceError
from partfin_assets.model.records import (
    CDC_RECORD_SCHEMA,
    REJECTED_RECORD_SCHEMA,
    AcknowledgesCommits,
    CdcSource,
    ChangeBatch,
    DiscoversColumns,
    HoldsConnections,
    ReadsPartitions,
    implausible_event_time,
)
from partfin_assets.model.redaction import MASK, SECRET_NAME_WORDS, redact
from partfin_assets.model.settings import KAFKA_PREFIX, Settings
from partfin_assets.model.source_identity import SourceChanged, SourceIdentity
from partfin_assets.model.tablespec import TableSpec, new_table_key
from partfin_assets.model.timeutil import from_us, parse_duration
from partfin_assets.sources.debezium_json import OVERSIZED_RAW_BYTES, DebeziumJsonDecoder, DecodedHeartbeat, RejectedMessage

log = logging.getLogger(__name__)

ENV_PREFIX = KAFKA_PREFIX
# at most this many messages per fetch of what librdkafka already holds (see _fetch)
_FETCH_MESSAGES = 500
# property names whose values are secrets: only from the environment, always redacted. A rule over the name (any
# secret word, then librdkafka's key material), not a list, so that a property librdkafka adds is covered too.
_SECRET_PROPERTY = re.compile(rf"{SECRET_NAME_WORDS}|\.pem$|oauthbearer\.config|^ssl\.key\.|^ssl\.keystore\.", re.IGNORECASE)
# properties partfin sets itself: resuming from the table's offsets depends on them
_OWNED_PROPERTIES = {
    "group.id": "use the group=NAME option",
    "bootstrap.servers": "give the brokers before '#'",
    "enable.auto.commit": "partfin commits group offsets itself, after each Iceberg commit",
    "enable.auto.offset.store": "partfin commits group offsets itself, after each Iceberg commit",
    "enable.partition.eof": "partfin needs end-of-partition events",
    "auto.offset.reset": "partfin starts a partition it never read at its log start and refuses offsets retention deleted",
}
# librdkafka properties partfin sets unless the spec or the environment does: a member killed with -9 holds
# its partitions until its session expires (librdkafka's default: 45 s), so a restarted process waited that
# long (and longer on a group coordinator that waits out the session before rebalancing); 10 s, Kafka's
# default before 3.0, lets it read again within seconds. A member that stops cleanly leaves at once.
_DEFAULT_PROPERTIES = {"session.timeout.ms": 10_000}
_LIBRDKAFKA_FETCH_QUEUE_BACKOFF_MS = 1000  # librdkafka's own default


def fetch_queue_backoff_ms(poll_timeout_s: float) -> int:
    """How long librdkafka postpones a partition's next fetch while its fetch queue is over queued.min.messages or
    queued.max.messages.kbytes (unless the spec sets fetch.queue.backoff.ms).

    An empty poll of poll_timeout commits what every partition holds, so a postponed fetch must arrive well within
    it: with librdkafka's 1 s, a consumer that empties a small queue (bounded memory over many partitions) faster
    committed a checkpoint of every partition per fetch. A quarter of poll_timeout leaves room for the round trip."""
    return max(1, min(_LIBRDKAFKA_FETCH_QUEUE_BACKOFF_MS, round(poll_timeout_s * 1000 / 4)))


_OPTIONS: dict[str, Callable[[str], Any]] = {}  # filled below (after parse helpers)


def _error_text(exc: KafkaException) -> str:
    error = exc.args[0] if exc.args else None
    return error.str() if isinstance(error, KafkaError) else str(exc)


class _ClientLog:
    """librdkafka's log lines (a broker connection failing, a rebalance, ...) as INFO records of this
    module, redacted: without it librdkafka prints them onto stderr, hundreds for an unreachable
    broker, around the one-line error partfin gives. confluent-kafka calls `.log(level, fmt, *args)`."""

    def __init__(self, redact_text: Callable[[str], str]) -> None:
        self._redact = redact_text

    def log(self, level: int, fmt: str, *args: Any) -> None:
        log.info("librdkafka: %s", self._redact(fmt % args))


class KafkaSourceError(SourceError):
    """The Kafka source cannot read as configured (a missing topic, a refused property, a fatal client error)."""


@dataclass(frozen=True)
class KafkaSpec:
    bootstrap: str
    topic: str
    group: str | None = None
    properties: Mapping[str, str] = field(default_factory=dict)  # librdkafka properties from the spec (no secrets)
    poll_timeout: float = 0.2
    idle_batch_every: float = 10.0

    @property
    def display(self) -> str:
        """How the source is named in checkpoints, logs and the UI: brokers and topic, never an option value."""
        return f"kafka:{self.bootstrap}#{self.topic}"


def parse_kafka_spec(argument: str, spec_text: str) -> KafkaSpec:
    """`BOOTSTRAP#TOPIC[,option=value,...]` (what follows `kafka:`)."""
    bootstrap, hash_mark, fragment = argument.partition("#")
    items = [item.strip() for item in fragment.split(",")] if hash_mark else []
    if not bootstrap.strip() or not items or not items[0] or "=" in items[0]:
        raise SourceError(f"source {_shown(spec_text)}: expected kafka:BOOTSTRAP#TOPIC[,option=value,...], e.g. kafka:broker:9092#dbserver1.public.orders")
    options: dict[str, Any] = {}
    properties: dict[str, str] = {}
    for item in filter(None, items[1:]):
        name, equals, value = item.partition("=")
        name = name.strip()
        if not equals:
            raise SourceError(f"source {_shown(spec_text)}: option {name!r} is not name=value")
        if "." in name:
            _check_property(name, from_environment=False)
            properties[name] = value.strip()
            continue
        parse = _OPTIONS.get(name.replace("-", "_"))
        if parse is None:
            raise SourceError(
                f"source {_shown(spec_text)}: unknown kafka option {name!r}; known: {', '.join(_OPTIONS)}, "
                "or a librdkafka property (a name with a dot, e.g. security.protocol=SASL_SSL)"
            )
        try:
            options[name.replace("-", "_")] = parse(value.strip())
        except ValueError as exc:
            raise SourceError(f"source {_shown(spec_text)}: option {name}: {exc}") from None
    return KafkaSpec(bootstrap.strip(), items[0], properties=properties, **options)


def _shown(spec_text: str) -> str:
    """A spec as it may be shown in an error: option values after the topic are left out (they may be secrets)."""
    head, hash_mark, fragment = spec_text.partition("#")
    if not hash_mark:
        return repr(redact(spec_text))
    names = [item.partition("=")[0] for item in fragment.split(",")]
    return repr(redact(f"{head}#{','.join([names[0], *(f'{n}=...' for n in names[1:] if n)])}"))


def _check_property(name: str, *, from_environment: bool) -> None:
    owned = _OWNED_PROPERTIES.get(name)
    if owned is not None:
        raise SourceError(f"kafka property {name} is set by partfin ({owned})")
    if not from_environment and _SECRET_PROPERTY.search(name):
        raise SourceError(
            f"kafka property {name} is a secret: not in the source spec (it is recorded and shown), "
            f"but in the environment as {env_name(name)}"
        )


def env_name(property_name: str) -> str:
    """The environment variable that sets a librdkafka property: sasl.password -> PARTFIN_KAFKA_SASL_PASSWORD."""
    return ENV_PREFIX + property_name.replace("_", "__").replace(".", "_").upper()


def properties_from_env(environ: Mapping[str, str]) -> dict[str, str]:
    """librdkafka properties given as PARTFIN_KAFKA_<NAME> variables (`_` a dot, `__` an underscore);
    `environ` holds those variables (Settings.kafka_variables)."""
    found = {}
    for variable, value in environ.items():
        if variable.startswith(ENV_PREFIX) and len(variable) > len(ENV_PREFIX):
            name = variable[len(ENV_PREFIX):].lower().replace("__", "\0").replace("_", ".").replace("\0", "_")
            _check_property(name, from_environment=True)
            found[name] = value
    return found


def _seconds(text: str) -> float:
    return parse_duration(text).total_seconds()


_OPTIONS.update({"group": str, "poll_timeout": _seconds, "idle_batch_every": _seconds})


# --------------------------------------------------------------------------- offsets


@dataclass(frozen=True)
class KafkaOffset:
    """Where reading stands: the next offset of every partition read so far."""

    topic: str
    partitions: Mapping[int, int]

    def to_offset(self) -> str:
        return json.dumps({"topic": self.topic, "partitions": {str(p): o for p, o in sorted(self.partitions.items())}},
                          separators=(",", ":"))

    @classmethod
    def parse(cls, text: str, topic: str) -> KafkaOffset:
        try:
            fields = json.loads(text)
            parsed = cls(fields["topic"], {int(p): int(o) for p, o in fields["partitions"].items()})
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise SourceError(f"not a kafka offset: {text!r} ({exc})") from None
        if parsed.topic != topic:
            raise SourceChanged(f"the recorded offsets are of topic {parsed.topic!r}, not {topic!r}")
        return parsed


# --------------------------------------------------------------------------- the source


@dataclass
class _Pending:
    """Messages of one partition consumed but not yet yielded."""

    changes: ChangeColumns
    rejected: list[tuple[int, str, str]] = field(default_factory=list)  # offset, raw, reason
    next_offset: int | None = None  # after the last message consumed (None: nothing pending)

    def __bool__(self) -> bool:
        return self.next_offset is not None


class KafkaSource(CdcSource, AcknowledgesCommits, HoldsConnections, DiscoversColumns, ReadsPartitions):
    """Debezium change events of one table from one Kafka topic (see the module docstring)."""

    kind = "kafka"

    def __init__(
        self,
        spec: KafkaSpec,
        table: TableSpec,
        primary_key: tuple[str, ...] | None = None,
        *,
        follow: bool = False,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        key_columns = tuple(primary_key) if primary_key else table.primary_key
        if not key_columns:
            raise KafkaSourceError(f"kafka source {spec.display}: no primary key (pass --primary-key)")
        self.spec = spec
        self.table = table
        self.primary_key = key_columns
        self.follow = follow
        self.group = spec.group or f"partfin-{table.name}"
        env_properties = properties_from_env(Settings.from_env(environ).kafka_variables)
        self._secret_values = sorted({v for v in env_properties.values() if len(v) >= 3}, key=len, reverse=True)
        self.config: dict[str, Any] = {
            "client.id": f"partfin-{table.name}",
            **_DEFAULT_PROPERTIES,
            "fetch.queue.backoff.ms": fetch_queue_backoff_ms(spec.poll_timeout),
            **spec.properties,
            **env_properties,
            "bootstrap.servers": spec.bootstrap,
            "group.id": self.group,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "error",
            "error_cb": self._on_client_error,
            "logger": _ClientLog(self._redact),  # librdkafka's own lines: through logging, not raw onto stderr
        }
        self.decoder = DebeziumJsonDecoder(table.name, key_columns, table.columns or None, decimal_encodings=table.decimal_encodings)
        self._positions: dict[int, int] = {}  # next offset per partition: committed, plus what was yielded since
        self._assigned: set[int] | None = None  # None: no assignment yet
        self._at_end: set[int] = set()
        self._pending: dict[int, _Pending] = {}
        self._fatal: str | None = None
        self._committed: dict[int, int] = {}  # next offset per partition as the table holds it, for the group
        self._committed_offset: Callable[[], str | None] | None = None  # the table's offsets, read at each assignment
        self._consumer: Consumer | None = self._new_consumer()  # a bad property is one clear error before anything is created
        self._subscribed = False
        self._cluster_id: str = self._metadata().cluster_id  # an unknown topic too: before anything is created

    # ---- identity

    def identity(self, offset: str | None) -> SourceIdentity:
        """The cluster (its id, whichever brokers reach it) and the topic; a topic is not read again for replays."""
        return SourceIdentity(
            self.kind,
            self.spec.display,
            {"cluster_id": self._cluster_id, "topic": self.spec.topic},
            cannot_replay="partfin does not read a Kafka topic again (retention may already have dropped what was read)",
        )

    def column_types(self) -> dict[str, pa.DataType] | None:
        return self.decoder.column_types()

    def decimal_encodings(self) -> dict[str, str]:
        return self.decoder.decimal_encodings()

    def _metadata(self):
        if self._consumer is None:
            raise KafkaSourceError(f"kafka source {self.spec.display} is closed")
        try:
            metadata = self._consumer.list_topics(self.spec.topic, timeout=30)
        except KafkaException as exc:
            raise KafkaSourceError(f"kafka source {self.spec.display}: {self._redact(_error_text(exc))}") from None
        topic = metadata.topics.get(self.spec.topic)
        if topic is None or topic.error is not None or not topic.partitions:
            why = self._redact(topic.error.str()) if topic is not None and topic.error is not None else "no partitions"
            raise KafkaSourceError(f"kafka source {self.spec.display}: topic {self.spec.topic!r} cannot be read: {why}")
        return metadata

    # ---- reading

    def batches(self, start_offset: str | None, max_records: int) -> Iterator[ChangeBatch]:
        if max_records < 1:
            raise SourceError(f"max_records must be at least 1, got {max_records}")
        consumer = self._open()
        self._restart_from(start_offset)
        idle_since = time.monotonic()
        unsettled = False  # whether a batch went out since the source last waited in vain
        while True:
            self._raise_fatal()
            messages = self._fetch(consumer, min(max_records, _FETCH_MESSAGES))
            yielded = False
            for message in messages:
                for batch in self._take(message, max_records):
                    yielded = True
                    yield batch
            settled = False
            if not messages:  # nothing within poll_timeout: what is pending goes now
                for partition in sorted(self._pending):
                    if self._pending[partition]:
                        yielded = True
                        yield self._flush(partition)
                settled = yielded or unsettled
                if settled:  # then an empty batch: the writer commits the checkpoints it holds
                    yield ChangeBatch(CDC_RECORD_SCHEMA.empty_table(), self._offset())
            if not self.follow and self._assigned is not None and self._at_end >= self._assigned:
                return  # every assigned partition read to its end: no further fetch waits out poll_timeout
            if yielded or settled:
                idle_since, unsettled = time.monotonic(), not settled
                continue
            if self.follow and time.monotonic() - idle_since >= self.spec.idle_batch_every:
                yield ChangeBatch(CDC_RECORD_SCHEMA.empty_table(), self._offset())
                idle_since = time.monotonic()

    def _fetch(self, consumer: Consumer, count: int) -> list:
        """What librdkafka already holds (up to count), without waiting; else the next message within poll_timeout.

        consume(count, timeout) waits out the whole timeout unless count messages arrive, so the last fetch of
        a partition's backlog (and of every run) used to wait poll_timeout for messages that were not coming."""
        messages = consumer.consume(count, 0)
        if messages:
            return messages
        message = consumer.poll(self.spec.poll_timeout)
        return [] if message is None else [message]

    def _take(self, message, max_records: int) -> Iterator[ChangeBatch]:
        error = message.error()
        partition = message.partition()
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                self._at_end.add(partition)
                if self._pending.get(partition):
                    yield self._flush(partition)  # caught up: what it holds goes now
                return
            if error.code() == KafkaError._AUTO_OFFSET_RESET:
                raise SourceChanged(
                    f"topic {self.spec.topic} partition {partition}: the offset the table recorded "
                    f"({self._positions.get(partition)}) is no longer in the log (retention deleted messages partfin "
                    f"had not read): {self._redact(error.str())}"
                )
            if error.fatal():
                raise KafkaSourceError(f"kafka source {self.spec.display}: {self._redact(error.str())}")
            log.warning("kafka source %s: %s", self.spec.display, self._redact(error.str()))
            return
        if self._assigned is not None and partition not in self._assigned:
            return  # fetched before a rebalance took the partition away
        self._at_end.discard(partition)
        pending = self._pending.get(partition)
        if pending is None:
            pending = self._pending[partition] = _Pending(ChangeColumns(self.primary_key))
        offset = message.offset()
        value = message.value()
        try:
            decoded = self.decoder.decode(value)
        except RejectedMessage as reason:
            kept = value[:OVERSIZED_RAW_BYTES] if len(value) > self.decoder.max_message_bytes else value  # its head, as evidence
            raw = kept.decode("utf-8", errors="replace")
            pending.rejected.append((offset, raw, str(reason)))
            pending.next_offset = offset + 1
            return
        if isinstance(decoded, DecodedHeartbeat):  # a batch of its own, after what came before it
            if pending:
                yield self._flush(partition)
            self._positions[partition] = offset + 1
            yield ChangeBatch(CDC_RECORD_SCHEMA.empty_table(), self._offset_of(partition), heartbeat=from_us(decoded.time_us),
                              stream=self.stream_of(partition))
            return
        if decoded is not None:
            if decoded.arrival_us is None:  # no envelope ts_ms: the message's timestamp is the arrival
                kind, timestamp_ms = message.timestamp()
                if kind != TIMESTAMP_NOT_AVAILABLE and implausible_event_time(timestamp_ms * 1000) is None:
                    decoded = replace(decoded, arrival_us=timestamp_ms * 1000)
            pending.changes.append(offset, decoded.op, decoded.key_values, decoded.event_time_us, decoded.payload, decoded.arrival_us)
        pending.next_offset = offset + 1  # a tombstone is consumed too
        if len(pending.changes) + len(pending.rejected) >= max_records:
            yield self._flush(partition)

    def _flush(self, partition: int) -> ChangeBatch:
        pending = self._pending.pop(partition)
        assert pending.next_offset is not None
        self._positions[partition] = pending.next_offset
        offsets = pa.array([offset for offset, _, _ in pending.rejected], pa.int64())
        rejected = pa.table(
            {
                "source_seq": offsets,
                "raw": pa.array([raw for _, raw, _ in pending.rejected], pa.string()),
                "reason": pa.array([reason for _, _, reason in pending.rejected], pa.string()),
            },
            schema=REJECTED_RECORD_SCHEMA,
        )
        return ChangeBatch(pending.changes.to_records(), self._offset_of(partition), rejected=rejected,
                           stream=self.stream_of(partition))

    def assigned_streams(self) -> list[str]:
        """The partitions this source reads now (its share of the group), as `<topic>-<partition>`."""
        return [self.stream_of(p) for p in sorted(self._assigned or ())]

    def stream_of(self, partition: int) -> str:
        """The partition's name, as Kafka tools write it: `<topic>-<partition>`."""
        return f"{self.spec.topic}-{partition}"

    def _offset(self) -> str:
        return KafkaOffset(self.spec.topic, dict(self._positions)).to_offset()

    def _offset_of(self, partition: int) -> str:
        """A batch's offset: its partition's next one (the position of its partition's progress stream)."""
        return KafkaOffset(self.spec.topic, {partition: self._positions[partition]}).to_offset()

    def joined_offset(self, offsets: list[str]) -> str:
        joined: dict[int, int] = {}
        for offset in offsets:
            joined.update(KafkaOffset.parse(offset, self.spec.topic).partitions)
        return KafkaOffset(self.spec.topic, joined).to_offset()

    def _restart_from(self, start_offset: str | None) -> None:
        """Read again from a committed offset: forget what is pending, seek every assigned partition back."""
        self._positions = dict(KafkaOffset.parse(start_offset, self.spec.topic).partitions) if start_offset else {}
        self._committed = dict(self._positions)  # the table's positions: what the group shows once partitions are assigned
        self._pending.clear()
        self._at_end.clear()
        if self._assigned:  # assigned again at the restart positions (seek refuses partitions not fetching yet)
            self._consumer.assign([self._at_position(p) for p in sorted(self._assigned)])

    def _at_position(self, partition: int):
        return TopicPartition(self.spec.topic, partition, self._positions.get(partition, OFFSET_BEGINNING))

    # ---- the consumer group

    def _new_consumer(self) -> Consumer:
        try:
            return Consumer(self.config)
        except KafkaException as exc:
            raise KafkaSourceError(f"kafka source {self.spec.display}: {self._redact(_error_text(exc))}") from None

    def _open(self) -> Consumer:
        if self._consumer is None:
            raise KafkaSourceError(f"kafka source {self.spec.display} is closed")
        if not self._subscribed:
            self._consumer.subscribe([self.spec.topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_revoke)
            self._subscribed = True
        return self._consumer

    def resume_assigned_from(self, committed_offset: Callable[[], str | None]) -> None:
        self._committed_offset = committed_offset

    def _on_assign(self, consumer, partitions) -> None:
        self._assigned = {tp.partition for tp in partitions}
        fresh = self._committed_offset() if self._committed_offset is not None else None
        if fresh:  # another member may have committed these partitions since this one last read them
            table_positions = KafkaOffset.parse(fresh, self.spec.topic).partitions
            for partition in self._assigned & table_positions.keys():
                self._positions[partition] = self._committed[partition] = table_positions[partition]
        consumer.assign([self._at_position(p) for p in sorted(self._assigned)])  # where the table says, never the group
        self._at_end &= self._assigned
        log.info("kafka source %s: assigned partitions %s", self.spec.display, sorted(self._assigned))
        if self._committed:  # a run that commits nothing new still shows lag monitors the table's positions
            self._commit_group_offsets(asynchronous=True)

    def _on_revoke(self, consumer, partitions) -> None:
        revoked = {tp.partition for tp in partitions}
        for partition in revoked:
            self._pending.pop(partition, None)  # never yielded: the partition's next reader reads them
        self._at_end -= revoked
        # every partition taken (a rebalance): None until the group assigns again, so that a reader that ends at the
        # end of its partitions does not end in between with the partitions read by no one
        self._assigned = ((self._assigned or set()) - revoked) or None
        consumer.unassign()

    def on_committed(self, offset: str) -> None:
        """After the Iceberg commit: the group's offsets follow, for lag monitors only (never read back)."""
        self._committed.update(KafkaOffset.parse(offset, self.spec.topic).partitions)
        self._commit_group_offsets(asynchronous=True)

    def _commit_group_offsets(self, *, asynchronous: bool) -> None:
        if self._consumer is None or not self._assigned:
            return
        positions = self._committed
        offsets = [TopicPartition(self.spec.topic, p, positions[p]) for p in sorted(self._assigned) if p in positions]
        if not offsets:
            return
        try:
            self._consumer.commit(offsets=offsets, asynchronous=asynchronous)
        except KafkaException as exc:  # refused during a rebalance: the next commit catches up
            log.info("kafka source %s: group offsets not committed (%s)", self.spec.display, self._redact(_error_text(exc)))

    def close(self) -> None:
        """Leave the group at once (its partitions go to the other members now, not after a session
        timeout), with the group's offsets at the last Iceberg commit."""
        if self._committed:
            self._commit_group_offsets(asynchronous=False)
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            consumer.close()

    # ---- errors

    def _on_client_error(self, error) -> None:
        if error.fatal():
            self._fatal = error.str()
        else:
            log.info("kafka source %s: %s", self.spec.display, self._redact(error.str()))

    def _raise_fatal(self) -> None:
        if self._fatal is not None:
            raise KafkaSourceError(f"kafka source {self.spec.display}: {self._redact(self._fatal)}")

    def _redact(self, text: str) -> str:
        """Every value from the environment masked, then whatever model/redaction.py masks."""
        for secret in self._secret_values:
            text = text.replace(secret, MASK)
        return redact(text)


# ---- the registry entry's functions (sources/registry.py SOURCE_KINDS)


def open_kafka(argument: str, text: str, table: TableSpec, key_columns, complete: bool, options: dict[str, Any]) -> CdcSource:
    return KafkaSource(parse_kafka_spec(argument, text), table, key_columns, **options)


def declare_kafka(argument: str, text: str, table_name: str, key_columns, complete: bool) -> TableSpec:
    parse_kafka_spec(argument, text)  # column types come from the messages' schema blocks as they are read
    return TableSpec(table_name, new_table_key(table_name, key_columns))
