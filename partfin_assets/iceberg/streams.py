"""Who writes a cdc table and where each writer stands: writer positions and progress streams.

Two kinds of entries, each one table property of cdc.<table> holding compact JSON, changed
only inside a commit that PyIceberg validates against the head it was built on:

- `partfin.writer.<writer id>` = {"checkpoint": n, "offset": "..."}: the writer's committed
  source position, set in the same commit as its checkpoint. A checkpoint commits only if the
  position it started from is still the one on the fresh metadata (compare-and-set): two
  processes with one writer id can never both commit from the same position.
- `partfin.stream.<stream id>` = {"writer", "progress", "seen", "state"}: a *progress stream*,
  something whose uncommitted data the watermark must not pass. Today one stream per writer
  (stream id = writer id); a source with partitions (Kafka) adds one per partition
  (`<writer id>/<partition>`), which is more entries, not another mechanism. `progress` is the
  stream's own watermark candidate (hour aligned; null until its first stats-bearing commit),
  `seen` the commit clock of its last checkpoint (or its registration), `state` active or
  retired.

The table's watermark candidate is the minimum of `progress` over the *active* streams: not
retired, and seen within the idle timeout (`partfin.streams.idle-timeout`, default 15m) of the
committing checkpoint's clock. A stream registers when its writer starts, is retired explicitly
(`partfin streams retire`), and counts as idle -- no longer holding the watermark -- once it has
committed nothing (no data, no heartbeat) for the idle timeout; its next checkpoint makes it
active again (its data may then be late, and is counted as such).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta

from pyiceberg.catalog import Catalog
from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata

from partfin_assets.iceberg.commit import commit_with_retry, new_transaction, set_table_properties
from partfin_assets.iceberg.history import last_writer_position
from partfin_assets.model import summary_keys as K
from partfin_assets.model.errors import InvalidInput, PartfinError
from partfin_assets.model.stats import compact_json
from partfin_assets.model.timeutil import US_PER_SECOND, iso_z, parse_duration, parse_iso, to_us

DEFAULT_IDLE_TIMEOUT = timedelta(minutes=15)
ACTIVE, RETIRED = "active", "retired"


class UnknownStream(PartfinError):
    pass


@dataclass(frozen=True)
class CommittedPosition:
    """The source position a writer committed last: checkpoint id and the offset after it."""

    checkpoint_id: int  # 0: nothing committed yet
    source_offset: str | None

    def encode(self) -> str:
        return compact_json({"checkpoint": self.checkpoint_id, "offset": self.source_offset})


NO_POSITION = CommittedPosition(0, None)


def writer_position(metadata: TableMetadata, writer_id: str) -> CommittedPosition:
    """The writer's committed position on this metadata (from its entry; older tables: from the history)."""
    text = metadata.properties.get(K.PROP_WRITER_PREFIX + writer_id)
    if text:
        entry = json.loads(text)
        return CommittedPosition(int(entry["checkpoint"]), entry.get("offset"))
    legacy = last_writer_position(metadata, writer_id)  # written before positions were properties
    return CommittedPosition(legacy.checkpoint_id, legacy.source_offset) if legacy else NO_POSITION


@dataclass(frozen=True)
class Stream:
    stream_id: str
    writer_id: str
    progress_us: int | None  # the stream's watermark candidate; None: it claims nothing yet
    seen_us: int  # commit clock of its last checkpoint, or of its registration
    retired: bool = False

    def encode(self) -> str:
        return compact_json({
            "writer": self.writer_id,
            "progress": iso_z(self.progress_us) if self.progress_us is not None else None,
            "seen": iso_z(self.seen_us),
            "state": RETIRED if self.retired else ACTIVE,
        })

    @classmethod
    def decode(cls, stream_id: str, text: str) -> Stream:
        entry = json.loads(text)
        progress = entry.get("progress")
        return cls(
            stream_id,
            entry.get("writer", stream_id),
            to_us(parse_iso(progress)) if progress else None,
            to_us(parse_iso(entry["seen"])),
            entry.get("state") == RETIRED,
        )

    def idle(self, clock_us: int, idle_timeout_us: int) -> bool:
        return clock_us - self.seen_us > idle_timeout_us


def streams_of(properties: Mapping[str, str]) -> dict[str, Stream]:
    prefix = K.PROP_STREAM_PREFIX
    return {key[len(prefix):]: Stream.decode(key[len(prefix):], value) for key, value in properties.items() if key.startswith(prefix)}


def idle_timeout_us(properties: Mapping[str, str]) -> int:
    text = properties.get(K.PROP_STREAMS_IDLE_TIMEOUT)
    timeout = parse_duration(text) if text else DEFAULT_IDLE_TIMEOUT
    return int(timeout.total_seconds() * US_PER_SECOND)


def active_streams(properties: Mapping[str, str], clock_us: int) -> dict[str, Stream]:
    """The streams that hold the watermark at `clock_us`: not retired, and not idle."""
    timeout = idle_timeout_us(properties)
    return {sid: s for sid, s in streams_of(properties).items() if not s.retired and not s.idle(clock_us, timeout)}


def progress_floor(streams: Mapping[str, Stream]) -> int | None:
    """The minimum progress over `streams`; None when one of them claims nothing yet (or there are none)."""
    values = [s.progress_us for s in streams.values()]
    if not values or any(v is None for v in values):
        return None
    return min(values)


def stream_property(stream: Stream) -> dict[str, str]:
    return {K.PROP_STREAM_PREFIX + stream.stream_id: stream.encode()}


# --------------------------------------------------------------------------- registration and retirement


def register_stream(catalog: Catalog, identifier: str, stream_id: str, writer_id: str, clock_us: int) -> Table:
    """Make the stream active (a writer starting): a new one claims nothing until its first checkpoint.

    An active stream is left as it is (its `seen` moves with its checkpoints only, so that a
    writer started again and again without committing still goes idle); a retired one becomes
    active again with the progress it had.
    """

    def build(table: Table, commit_id: str):
        current = streams_of(table.properties).get(stream_id)
        if current is not None and not current.retired:
            return None
        stream = Stream(stream_id, writer_id, None, clock_us) if current is None else replace(current, retired=False, seen_us=clock_us)
        tx = new_transaction(table)
        tx.set_properties(stream_property(stream))
        return tx

    return commit_with_retry(catalog, identifier, build).table


def retire_stream(catalog: Catalog, identifier: str, stream_id: str) -> Stream:
    """Stop counting a stream (and, for a writer's own stream, its partition streams) in the watermark.

    Takes effect at the next checkpoint of any writer. A writer that starts again registers again.
    """
    retired: list[Stream] = []

    def build(table: Table, commit_id: str):
        streams = streams_of(table.properties)
        if stream_id not in streams:
            known = ", ".join(sorted(streams)) or "none"
            raise UnknownStream(f"{identifier} has no stream {stream_id!r} (streams: {known})")
        targets = [s for sid, s in streams.items() if sid == stream_id or (s.writer_id == stream_id and sid.startswith(stream_id + "/"))]
        retired[:] = [replace(s, retired=True) for s in targets]
        tx = new_transaction(table)
        tx.set_properties({k: v for s in retired for k, v in stream_property(s).items()})
        return tx

    commit_with_retry(catalog, identifier, build)
    return next(s for s in retired if s.stream_id == stream_id)


def set_idle_timeout(catalog: Catalog, identifier: str, timeout: timedelta) -> None:
    if timeout <= timedelta(0):
        raise InvalidInput(f"the idle timeout must be positive, got {timeout}")
    set_table_properties(catalog, identifier, {K.PROP_STREAMS_IDLE_TIMEOUT: f"{timeout.total_seconds():g}s"})
