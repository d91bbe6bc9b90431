"""The one small interface every CDC source implements.

A source yields ChangeBatch objects: CDC records as Arrow, records it could not
parse (to the rejected-records table, never dropped), an opaque resumable offset
and an optional heartbeat time. The writer commits one checkpoint per batch and
stores the batch's offset in that same commit, so a restarted source resumes
from exactly what was committed. Every source also names the history it reads
(`identity`, model/source_identity.py), recorded with the offset; a source whose
history can be read again (a generator, a file) reads it for replays (`history`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol, runtime_checkable

import polars as pl
import pyarrow as pa

from partfin_assets.model.source_identity import IdentifiedSource

UTC_US = pa.timestamp("us", tz="UTC")
ARRIVAL_TIME = "arrival_time"  # the source's processing time of a record (nullable column; null: the commit clock)

# Every CDC record, whatever the source. `key` is the canonical JSON object of the
# primary-key columns (sorted keys, no spaces), so routing, dedupe and the upsert
# see one stable identity per row. `payload` is the JSON after-image (null for deletes).
# `source_seq` orders changes within the source's change log (file line, LSN + position in its
# transaction, Kafka offset in its partition, generator index): it decides last-writer-wins between
# two changes of one log (see SOURCE_LOG below). `arrival_time` is the source's processing time of
# the change (Debezium's envelope `ts_ms`, a PostgreSQL transaction's commit time, the synthetic
# source's simulated arrival); null when the source has none: the checkpoint's commit clock is then
# the arrival (what the late-data ledger measures lateness against, iceberg/ledger.py).
CDC_RECORD_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=False),
        pa.field("op", pa.string(), nullable=False),
        pa.field("event_time", UTC_US, nullable=False),
        pa.field("source_seq", pa.int64(), nullable=False),
        pa.field("payload", pa.string(), nullable=True),
        pa.field("arrival_time", UTC_US, nullable=True),
    ]
)
# the record schema before `arrival_time`: a source that knows no arrival time may still yield it
CDC_RECORD_SCHEMA_WITHOUT_ARRIVAL = CDC_RECORD_SCHEMA.remove(CDC_RECORD_SCHEMA.get_field_index(ARRIVAL_TIME))


def cdc_records(records: pa.Table) -> pa.Table:
    """Records in CDC_RECORD_SCHEMA: a batch without `arrival_time` gets it as nulls (arrival = commit clock).

    Any other schema is a source bug: ValueError naming both schemas.
    """
    if records.schema.equals(CDC_RECORD_SCHEMA):
        return records
    if records.schema.equals(CDC_RECORD_SCHEMA_WITHOUT_ARRIVAL):
        return records.append_column(CDC_RECORD_SCHEMA.field(ARRIVAL_TIME), pa.nulls(records.num_rows, UTC_US))
    raise ValueError(f"source batch schema {records.schema} is not the CDC record schema {CDC_RECORD_SCHEMA}")


# A row of cdc.<table> is a record plus the change log its `source_seq` is a position in: the progress
# stream of the writer that read it (its writer id, or `<writer id>/<topic>-<partition>` for a Kafka
# partition), which keeps one source history (model/source_identity.py). Within one log `source_seq` is
# the log's own order, so last-writer-wins compares the positions of two changes of a log, never their
# event times (jobs/upsert/decode.py). Null: not known (written before partfin recorded it).
SOURCE_LOG = "source_log"


def with_source_log(records: pa.Table, log: str | None) -> pa.Table:
    """The records as cdc.<table> rows of change log `log` (None: unknown); a `source_log` they carry is kept."""
    if SOURCE_LOG in records.schema.names:
        return records
    return records.append_column(pa.field(SOURCE_LOG, pa.string(), nullable=True), pa.array([log] * records.num_rows, pa.string()))


# A record's identity: its change log and its position in that log (with its key). Positions of two logs
# are unrelated (line 7 of one file is not line 7 of another), so two records are the same record only
# when their logs and positions are; every comparison of records (a replay's added / removed, what the
# ledger and the late-data count record for it) uses this. A row whose log is unknown (null: written
# before partfin kept it) is matched by position and key alone.
RECORD_POSITION = ("key", "source_seq")
RECORD_IDENTITY = (SOURCE_LOG, *RECORD_POSITION)
UNKNOWN_LOG = "unknown"  # how a report names the log of such a row


def records_not_in(rows: pl.DataFrame, other: pl.DataFrame) -> pl.DataFrame:
    """The rows of `rows` (holding RECORD_IDENTITY) that are no record of `other` (see RECORD_IDENTITY)."""
    log = pl.col(SOURCE_LOG).is_null()
    position = list(RECORD_POSITION)
    known = rows.filter(~log).join(other.filter(~log).select(RECORD_IDENTITY), on=list(RECORD_IDENTITY), how="anti")
    known = known.join(other.filter(log).select(position), on=position, how="anti")
    unknown = rows.filter(log).join(other.select(position), on=position, how="anti")
    return pl.concat([known, unknown])


def records_by_log(rows: pl.DataFrame) -> dict[str, int]:
    """How many of `rows` each change log holds (UNKNOWN_LOG: rows without one)."""
    counts = rows.group_by(SOURCE_LOG).len()
    return {(log if log is not None else UNKNOWN_LOG): int(n) for log, n in counts.iter_rows()}

REJECTED_RECORD_SCHEMA = pa.schema(
    [
        pa.field("source_seq", pa.int64(), nullable=False),
        pa.field("raw", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
    ]
)

VALID_OPS = frozenset({"c", "u", "d", "r"})

# Event times (and heartbeat times) a source may report: [1970-01-01, 2100-01-01) UTC. Anything
# else is a broken clock or a unit error (microseconds sent as milliseconds lands in year ~58000):
# the change goes to the rejected records with the reason, and never moves a watermark.
PLAUSIBLE_EVENT_TIME_US = (0, 4_102_444_800_000_000)


def implausible_event_time(us: int) -> str | None:
    """Why an event time (epoch microseconds) is not plausible, or None if it is."""
    low, high = PLAUSIBLE_EVENT_TIME_US
    if low <= us < high:
        return None
    hint = ""
    if low <= us // 1000 < high:
        hint = " (microseconds sent as milliseconds?)"
    elif low <= us // 1_000_000 < high:
        hint = " (nanoseconds sent as milliseconds?)"
    return f"outside the plausible range 1970-01-01T00:00:00Z .. 2100-01-01T00:00:00Z{hint}"


@dataclass(frozen=True)
class ChangeBatch:
    records: pa.Table  # CDC_RECORD_SCHEMA (or it without arrival_time: see cdc_records)
    offset: str  # opaque position after this batch; passed back to resume
    # REJECTED_RECORD_SCHEMA (their change log: the batch's progress stream, as for its records)
    rejected: pa.Table = field(default_factory=REJECTED_RECORD_SCHEMA.empty_table)
    heartbeat: datetime | None = None  # the source is complete up to this time
    # the source partition this batch came from (Kafka: `<topic>-<partition>`): the checkpoint belongs to
    # that partition's progress stream (iceberg/streams.py); None: the writer's own stream
    stream: str | None = None


class CdcSource(IdentifiedSource, Protocol):
    def batches(self, start_offset: str | None, max_records: int) -> Iterator[ChangeBatch]:
        """Yield batches of at most max_records records after start_offset (None: from the start).

        Ends when the source is exhausted; a following source never ends. A source that no longer
        holds what was read before start_offset (a file truncated or rotated) raises SourceChanged.
        """
        ...


@runtime_checkable
class ReplayableSource(CdcSource, Protocol):
    def history(self, until_offset: str, max_records: int) -> Iterator[pa.Table]:
        """The records from the start of the history up to `until_offset` (what a writer committed
        when it stood there), in batches of at most max_records; SourceChanged if the source no
        longer holds exactly that history."""
        ...


# Optional capabilities: a source declares each one it has by naming the protocol among its bases
# (`class PostgresSource(CdcSource, AcknowledgesCommits, HoldsConnections, DiscoversColumns)`); the writer,
# the ingest session and the fan-out ask `isinstance(source, <capability>)`, never for a method by name.


@runtime_checkable
class AcknowledgesCommits(Protocol):
    def on_committed(self, offset: str) -> None:
        """Everything up to `offset` is committed in the table (a replication slot may move there, a consumer
        group's offsets follow). Called after each landed checkpoint, by `CdcWriter.run` and the fan-out's committer."""
        ...


@runtime_checkable
class HoldsConnections(Protocol):
    def close(self) -> None:
        """Release connections now (a Kafka consumer leaves its group at once); the ingest session calls it at the end."""
        ...


@runtime_checkable
class DiscoversColumns(Protocol):
    def column_types(self) -> dict[str, pa.DataType] | None:
        """Column types learned from what was read (a Debezium schema block), or None: they complete a declaration
        that named only the key."""
        ...

    def decimal_encodings(self) -> dict[str, str]:
        """How those decimal columns are written in JSON without a schema block, where not the default
        (model/tablespec.py DECIMAL_ENCODINGS), as the first change read showed them."""
        ...


@runtime_checkable
class ReadsPartitions(Protocol):
    def assigned_streams(self) -> list[str]:
        """The source partitions read now (Kafka: `<topic>-<partition>`), each a progress stream of the table."""
        ...

    def resume_assigned_from(self, committed_offset: Callable[[], str | None]) -> None:
        """Where partitions assigned from now on are read from: `committed_offset()`, called at each assignment (the
        table's offsets then: another reader of the group may have committed a partition since this one read it)."""
        ...

    def joined_offset(self, offsets: list[str]) -> str:
        """One offset to read from that resumes every partition where the last of `offsets` naming it says (each
        partition's checkpoints record an offset of their partition; a writer's older entry may hold several)."""
        ...
