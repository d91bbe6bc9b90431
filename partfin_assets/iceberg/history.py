"""Reading the snapshot lineage of a table (a snapshot and its ancestors): the only place partfin walks it."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Snapshot, ancestors_of

from partfin_assets.model import summary_keys as K
from partfin_assets.model.source_identity import SourceIdentity
from partfin_assets.model.stats import CommitStats, CommitWindow, commit_clock_us, commit_stats
from partfin_assets.model.timeutil import parse_iso, to_us


def lineage(metadata: TableMetadata, start: Snapshot | None = None) -> Iterator[Snapshot]:
    """Snapshots of the main branch, newest first (from `start` and its ancestors, when given).

    Expiry removes snapshots from the middle of the chain while keeping older ones the
    policy or a writer's resume position needs, and PyIceberg then clears the parent link
    of the oldest survivor. So where the chain ends, the walk goes on with the retained
    snapshots of lower sequence number (partfin commits only to main, so those were
    main's ancestors).
    """
    last = None
    for snapshot in ancestors_of(start if start is not None else metadata.current_snapshot(), metadata):
        last = snapshot
        yield snapshot
    if last is None:
        return
    older = [s for s in metadata.snapshots if s.sequence_number < last.sequence_number]
    yield from sorted(older, key=lambda s: s.sequence_number, reverse=True)


def watermark_of(mapping: Mapping[str, str]) -> int | None:
    """partfin.watermark of a snapshot summary or of table properties (same key), in us."""
    value = mapping.get(K.WATERMARK)
    return to_us(parse_iso(value)) if value else None


def summary_of(snapshot: Snapshot) -> dict[str, str]:
    return snapshot.summary.additional_properties if snapshot.summary else {}


@dataclass(frozen=True)
class StreamWindow:
    commits: list[CommitStats]  # in the window, newest first
    boundary: CommitStats | None  # the stream's next older stats-bearing commit, outside the window (None: none retained)


def stream_window(
    metadata: TableMetadata,
    window: CommitWindow,
    *,
    taken: int = 0,
    newest_arrival_us: int | None = None,
    with_digest: bool = False,
    writer_id: str | None = None,
    stream_id: str | None = None,
) -> StreamWindow:
    """The retained stats-bearing commits of main in `window`, newest first (of one writer / progress stream, if given).

    `taken`: commits already in the window (the one being committed); `newest_arrival_us`: the
    arrival clock a span window reaches back from (default: the newest commit's). A span window
    holds the commits whose arrival clock (`CommitStats.arrival_clock_us`) lies within it.
    """
    found: list[CommitStats] = []
    for snapshot in lineage(metadata):
        summary = summary_of(snapshot)
        if writer_id is not None and summary.get(K.WRITER_ID) != writer_id:
            continue
        if stream_id is not None and commit_stream(summary) != stream_id:
            continue
        entry = snapshot_commit_stats(snapshot, with_digest)
        if entry is None:
            continue
        if newest_arrival_us is None:
            newest_arrival_us = entry.arrival_clock_us
        if not window.holds(taken + len(found), entry.arrival_clock_us, newest_arrival_us):
            return StreamWindow(found, entry)
        found.append(entry)
    return StreamWindow(found, None)


_PARSED: OrderedDict[tuple[int, bool], tuple[Snapshot, CommitStats | None]] = OrderedDict()
_PARSED_MAX = 512  # a few tables' retained windows
_PARSED_LOCK = threading.Lock()


def snapshot_commit_stats(snapshot: Snapshot, with_digest: bool = False) -> CommitStats | None:
    """`commit_stats` of a snapshot, parsed once: each commit reads its stream's window from the retained snapshots
    again, and the same Snapshot objects go from one metadata version to the next (the catalog keeps them)."""
    key = (id(snapshot), with_digest)
    with _PARSED_LOCK:
        cached = _PARSED.get(key)
        if cached is not None and cached[0] is snapshot:  # kept alive with its entry, so the id is still this snapshot's
            _PARSED.move_to_end(key)
            return cached[1]
    summary = summary_of(snapshot)
    entry = commit_stats(summary, snapshot.snapshot_id, with_digest=with_digest, clock_us=commit_clock_us(summary, snapshot.timestamp_ms))
    with _PARSED_LOCK:
        _PARSED[key] = (snapshot, entry)
        if len(_PARSED) > _PARSED_MAX:
            _PARSED.popitem(last=False)
    return entry


def recent_commit_stats(metadata: TableMetadata, limit: int, *, with_digest: bool = False, writer_id: str | None = None,
                        stream_id: str | None = None) -> list[CommitStats]:
    """The last `limit` stats-bearing commits of main (of one writer / progress stream, if given), newest first."""
    if limit <= 0:
        return []
    return stream_window(metadata, CommitWindow(commits=limit), with_digest=with_digest, writer_id=writer_id,
                         stream_id=stream_id).commits


def commit_stream(summary: Mapping[str, str]) -> str | None:
    """The progress stream a checkpoint belongs to: its partition's (Kafka), else its writer's."""
    return summary.get(K.STREAM) or summary.get(K.WRITER_ID)


@dataclass(frozen=True)
class WriterPosition:
    checkpoint_id: int
    source_offset: str | None
    snapshot_id: int
    source: SourceIdentity | None = None  # the history that offset is a position in (None: recorded before partfin kept it)
    writer_id: str | None = None


def _position(snapshot: Snapshot, summary: Mapping[str, str]) -> WriterPosition:
    identity = summary.get(K.SOURCE)
    return WriterPosition(
        int(summary[K.CHECKPOINT_ID]), summary.get(K.SOURCE_OFFSET), snapshot.snapshot_id,
        SourceIdentity.from_json(identity) if identity else None, summary.get(K.WRITER_ID),
    )


def last_writer_position(metadata: TableMetadata, writer_id: str, stream_id: str | None = None) -> WriterPosition | None:
    """The newest checkpoint this writer committed (expiry always keeps it); with `stream_id`, of that progress stream."""
    for snapshot in lineage(metadata):
        summary = summary_of(snapshot)
        if summary.get(K.WRITER_ID) == writer_id and K.CHECKPOINT_ID in summary and stream_id in (None, commit_stream(summary)):
            return _position(snapshot, summary)
    return None


def writer_positions(metadata: TableMetadata) -> list[WriterPosition]:
    """The newest checkpoint of every writer of the table, newest first."""
    found: dict[str, WriterPosition] = {}
    for snapshot in lineage(metadata):
        summary = summary_of(snapshot)
        writer = summary.get(K.WRITER_ID)
        if writer is not None and writer not in found and K.CHECKPOINT_ID in summary:
            found[writer] = _position(snapshot, summary)
    return list(found.values())


def recorded_source(metadata: TableMetadata, writer_id: str | None = None) -> SourceIdentity | None:
    """The table's current source: the identity its newest checkpoint recorded (None: none recorded yet).

    With `writer_id`: the one that writer's newest checkpoint recorded. Each writer id of a table is a
    progress stream of its own (iceberg/streams.py) with its own source and positions in it.
    """
    if writer_id is not None:
        position = last_writer_position(metadata, writer_id)
        return position.source if position is not None else None
    for position in writer_positions(metadata):
        if position.source is not None:
            return position.source
    return None


def find_commit(table: Table, commit_id: str, stop_at_snapshot_id: int | None) -> Snapshot | None:
    """The snapshot carrying `commit_id`, searching back from head to `stop_at_snapshot_id`."""
    for snapshot in lineage(table.metadata):
        if snapshot.snapshot_id == stop_at_snapshot_id:
            return None
        if summary_of(snapshot).get(K.COMMIT_ID) == commit_id:
            return snapshot
    return None


def watermark_history(metadata: TableMetadata) -> list[tuple[int, int]]:
    """(snapshot id, watermark in us) of every retained commit that recorded one, oldest first."""
    out = []
    for snapshot in lineage(metadata):
        watermark = watermark_of(summary_of(snapshot))
        if watermark is not None:
            out.append((snapshot.snapshot_id, watermark))
    out.reverse()
    return out


def snapshots_since(
    metadata: TableMetadata,
    start_snapshot_id: int | None,
    start_sequence_number: int | None = None,
    *,
    complete: bool = True,
) -> list[Snapshot] | None:
    """Snapshots of main after `start_snapshot_id` (None: since the table began) up to the head, newest first.

    Follows parent links. Where expiry broke the chain (the start snapshot itself, or snapshots
    in between, expired), the sequence number recorded with the start still decides: each
    commit on main takes the next sequence number, so the retained snapshots numbered after it
    are all of them exactly when their numbers have no gap up to the head. Otherwise None: what
    changed can no longer be known, and callers must assume everything did. With
    `complete=False` the caller takes what is retained: the retained snapshots numbered after
    the start (or, without a start number, those the parent links reach).
    """
    by_id = {s.snapshot_id: s for s in metadata.snapshots}
    out: list[Snapshot] = []
    head = current = metadata.current_snapshot()
    while current is not None:
        if current.snapshot_id == start_snapshot_id:
            return out
        out.append(current)
        parent = current.parent_snapshot_id
        if parent is not None and parent == start_snapshot_id:
            return out
        if parent is None:
            if start_snapshot_id is None:
                return out
            break
        current = by_id.get(parent)
    if start_snapshot_id is None and head is None:
        return out
    if start_sequence_number is None:
        return None if complete else out
    after = sorted((s for s in metadata.snapshots if s.sequence_number > start_sequence_number),
                   key=lambda s: s.sequence_number, reverse=True)
    if not complete:
        return after
    if head is not None and head.sequence_number and [s.sequence_number for s in after] == list(
        range(head.sequence_number, start_sequence_number, -1)
    ):
        return after
    return None


def recorded_value(metadata: TableMetadata, key: str, snapshot: Snapshot | None = None) -> str | None:
    """Summary entry `key` as of `snapshot` (default: the head): the newest one recorded at or before it.

    Commits that do not carry it (a compaction, a privacy delete) leave the one before in force.
    """
    for entry in lineage(metadata, snapshot):
        value = summary_of(entry).get(key)
        if value is not None:
            return value
    return None


def recorded_watermark(metadata: TableMetadata, snapshot: Snapshot | None = None) -> int | None:
    """The watermark recorded as of `snapshot` (default: the head): what a reader of that snapshot saw."""
    return watermark_of({K.WATERMARK: recorded_value(metadata, K.WATERMARK, snapshot) or ""})


def applied_policy(metadata: TableMetadata) -> str | None:
    """The watermark policy the newest checkpoint recorded it ran (None: none recorded one yet)."""
    return recorded_value(metadata, K.WATERMARK_POLICY_APPLIED)


def late_records_total(metadata: TableMetadata) -> int:
    """Running total carried by the newest commit that recorded one (survives snapshot expiry)."""
    for snapshot in lineage(metadata):
        total = summary_of(snapshot).get(K.LATE_RECORDS_TOTAL)
        if total is not None:
            return int(total)
    return 0


def total_records(table: Table) -> int:
    """Records a table holds, from its current snapshot's summary (no data file read)."""
    snapshot = table.current_snapshot()
    summary = summary_of(snapshot) if snapshot is not None else {}
    return int(summary.get("total-records", 0))
