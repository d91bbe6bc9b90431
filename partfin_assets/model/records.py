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

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

import pyarrow as pa

from partfin_assets.model.source_identity import IdentifiedSource

UTC_US = pa.timestamp("us", tz="UTC")

# Every CDC record, whatever the source. `key` is the canonical JSON object of the
# primary-key columns (sorted keys, no spaces), so routing, dedupe and the upsert
# see one stable identity per row. `payload` is the JSON after-image (null for deletes).
# `source_seq` orders changes within the source (file line, LSN, generator index) and
# breaks event-time ties in last-writer-wins.
CDC_RECORD_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=False),
        pa.field("op", pa.string(), nullable=False),
        pa.field("event_time", UTC_US, nullable=False),
        pa.field("source_seq", pa.int64(), nullable=False),
        pa.field("payload", pa.string(), nullable=True),
    ]
)

REJECTED_RECORD_SCHEMA = pa.schema(
    [
        pa.field("source_seq", pa.int64(), nullable=False),
        pa.field("raw", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
    ]
)

VALID_OPS = frozenset({"c", "u", "d", "r"})


@dataclass(frozen=True)
class ChangeBatch:
    records: pa.Table  # CDC_RECORD_SCHEMA
    offset: str  # opaque position after this batch; passed back to resume
    rejected: pa.Table = field(default_factory=REJECTED_RECORD_SCHEMA.empty_table)
    heartbeat: datetime | None = None  # the source is complete up to this time


class CdcSource(IdentifiedSource, Protocol):
    def batches(self, start_offset: str | None, max_records: int) -> Iterator[ChangeBatch]:
        """Yield batches of at most max_records records after start_offset (None: from the start).

        Ends when the source is exhausted; a following source never ends. A source that no longer
        holds what was read before start_offset (a file truncated or rotated) raises SourceChanged.
        """
        ...


class ReplayableSource(CdcSource, Protocol):
    def history(self, until_offset: str, max_records: int) -> Iterator[pa.Table]:
        """The records from the start of the history up to `until_offset` (what a writer committed
        when it stood there), in batches of at most max_records; SourceChanged if the source no
        longer holds exactly that history."""
        ...
