"""Reading the snapshot lineage of a table: the only place partfin walks history."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Snapshot, ancestors_of

from partfin_assets.core import summary_keys as K
from partfin_assets.core.stats import EventTimeStats
from partfin_assets.core.timeutil import parse_iso, to_us


def lineage(metadata: TableMetadata) -> Iterator[Snapshot]:
    """Snapshots of the main branch, newest first.

    Expiry removes snapshots from the middle of the chain while keeping older ones the
    policy or a writer's resume position needs, and PyIceberg then clears the parent link
    of the oldest survivor. So where the chain ends, the walk goes on with the retained
    snapshots of lower sequence number (partfin commits only to main, so those were
    main's ancestors).
    """
    last = None
    for snapshot in ancestors_of(metadata.current_snapshot(), metadata):
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
class CommitStats:
    """A stats-bearing commit as the watermark policy sees it."""

    snapshot_id: int | None
    low_us: int  # its min event time, or its heartbeat time when it carried no records
    stats: EventTimeStats  # empty for heartbeat-only commits


def commit_stats(summary: dict[str, str], snapshot_id: int | None = None, *, with_digest: bool = False) -> CommitStats | None:
    """None for commits without event-time stats (compaction, deletes, overwrites, stat-less appends)."""
    stats = EventTimeStats.from_summary(summary, with_digest=with_digest)
    if stats is None:
        return None
    if not stats.is_empty:
        return CommitStats(snapshot_id, stats.min_us, stats)
    heartbeat = summary.get(K.EVENT_TIME_HEARTBEAT)
    if heartbeat is None:
        return None
    return CommitStats(snapshot_id, to_us(parse_iso(heartbeat)), stats)


def recent_commit_stats(metadata: TableMetadata, limit: int, *, with_digest: bool = False) -> list[CommitStats]:
    """The last `limit` stats-bearing commits of the main branch, newest first."""
    found: list[CommitStats] = []
    if limit <= 0:
        return found
    for snapshot in lineage(metadata):
        entry = commit_stats(summary_of(snapshot), snapshot.snapshot_id, with_digest=with_digest)
        if entry is not None:
            found.append(entry)
            if len(found) == limit:
                break
    return found


@dataclass(frozen=True)
class WriterPosition:
    checkpoint_id: int
    source_offset: str | None
    snapshot_id: int


def last_writer_position(metadata: TableMetadata, writer_id: str) -> WriterPosition | None:
    """The newest checkpoint this writer committed (expiry always keeps it)."""
    for snapshot in lineage(metadata):
        summary = summary_of(snapshot)
        if summary.get(K.WRITER_ID) == writer_id and K.CHECKPOINT_ID in summary:
            return WriterPosition(int(summary[K.CHECKPOINT_ID]), summary.get(K.SOURCE_OFFSET), snapshot.snapshot_id)
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
