"""Snapshot expiry that keeps what the watermark policy and resumption need.

Commit cost in PyIceberg grows with the snapshots kept in table metadata, so a
streaming writer expires old snapshots as it goes. Never expired: the newest
`keep_last` snapshots of main, the newest commits of each progress stream's policy window (its last X
stats-bearing commits, or those of the last span of arrival; at most WINDOW_SNAPSHOTS of them, and fewer when
many streams share the table (TABLE_WINDOW_SNAPSHOTS for all, at least the newest of each), so what is kept is
bounded by count whatever the commit rate and the partitions: a policy whose window reaches further reads the
rest from the late-data ledger, ingest/watermark_processor.py), the newest checkpoint of every writer (its resume
position on tables older than the `partfin.writer.*` properties), and anything a
branch or tag points at (the upsert tags the CDC snapshot it merged, the finalization sensor each
finalized hour of base) -- and, on cdc.<table>, the snapshot base.<table> records as merged up to before the tag
has followed. A tag or branch with `max-ref-age-ms` older than that (the age of the snapshot
it points at, as Iceberg defines it) is dropped by expiry, in the same commit. Before checkpoints
expire, the late-data ledger records any it does not hold yet (iceberg/ledger.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import MAIN_BRANCH
from pyiceberg.table.snapshots import Snapshot

from partfin_assets.iceberg.catalog import load_table_if_exists
from partfin_assets.iceberg.commit import remove_snapshots
from partfin_assets.iceberg.history import commit_stream, lineage, summary_of
from partfin_assets.iceberg.ledger import ledger_entry, reconcile
from partfin_assets.iceberg.streams import stream_count
from partfin_assets.model import summary_keys as K
from partfin_assets.model.defaults import KEEP_LAST_SNAPSHOTS
from partfin_assets.model.errors import InvalidInput
from partfin_assets.model.stats import CommitWindow, commit_clock_us, commit_stats, source_clock_us

log = logging.getLogger(__name__)

# the most commits of a stream's policy window kept as snapshots: a writer checkpointing every second must not
# keep (and rewrite with every commit's metadata) the 1,800 snapshots of a 30-minute window
WINDOW_SNAPSHOTS = 20
# ... and of all the table's streams' windows together: a table fed by 64 Kafka partitions kept 20 of each (1,280
# snapshots) and a commit cost 14x a fresh table's. Each stream keeps at least its newest commit, so that the
# stream's next commit sees it before it can go (the watermark processor's history of a stream counts on that).
TABLE_WINDOW_SNAPSHOTS = 40


def window_snapshots(metadata: TableMetadata) -> int:
    """How many commits of each progress stream's policy window expiry keeps as snapshots. Streams are never
    forgotten, so this only ever falls as a table gains streams: what a commit counted on being kept stays kept."""
    return max(1, min(WINDOW_SNAPSHOTS, TABLE_WINDOW_SNAPSHOTS // max(stream_count(metadata.properties), 1)))


def window_retained(window: CommitWindow, metadata: TableMetadata) -> bool:
    """Whether expiry keeps all of `window` as snapshots (else the watermark reads the rest from the ledger)."""
    return window.commits is not None and window.commits <= window_snapshots(metadata)


@dataclass(frozen=True)
class Retention:
    keep_last: int = KEEP_LAST_SNAPSHOTS  # newest snapshots of main always kept
    slack: int = 20  # expire only once this many more piled up: one expiry commit per `slack` checkpoints
    # False: a table whose snapshot summaries nothing reads back (the rejected tables): keep only the newest
    # `keep_last` and what refs point at, not the policy windows and writers' checkpoints a cdc table keeps
    summaries: bool = True

    def __post_init__(self) -> None:
        if self.keep_last < 1 or self.slack < 0:
            raise InvalidInput(f"retention needs keep_last >= 1 and slack >= 0, got {self}")


def aged_refs(metadata: TableMetadata, now_ms: int) -> list[str]:
    """The refs (main aside) older than their `max-ref-age-ms`: the age of the snapshot each points at."""
    out = []
    for name, ref in metadata.refs.items():
        snapshot = metadata.snapshot_by_id(ref.snapshot_id)
        if name != MAIN_BRANCH and ref.max_ref_age_ms is not None and snapshot is not None \
                and now_ms - snapshot.timestamp_ms > ref.max_ref_age_ms:
            out.append(name)
    return out


def protected_snapshot_ids(metadata: TableMetadata, keep_last: int, window: CommitWindow | int, dropped_refs: tuple[str, ...] = ()) -> set[int]:
    if isinstance(window, int):
        window = CommitWindow(commits=window)
    keep: set[int] = {ref.snapshot_id for name, ref in metadata.refs.items() if name not in dropped_refs}
    kept_per_stream = min(window.commits or WINDOW_SNAPSHOTS, window_snapshots(metadata))
    stats_seen: dict[str | None, int] = {}  # per stream: its policy window
    newest_clock: dict[str | None, int] = {}
    writers_seen: set[str] = set()
    for position, snapshot in enumerate(lineage(metadata)):
        summary = summary_of(snapshot)
        if position < keep_last:
            keep.add(snapshot.snapshot_id)
        writer = summary.get(K.WRITER_ID)
        stream = commit_stream(summary)
        taken = stats_seen.get(stream, 0)
        if taken < kept_per_stream and commit_stats(summary) is not None:
            clock = source_clock_us(summary) or commit_clock_us(summary, snapshot.timestamp_ms)  # its arrival clock
            newest = newest_clock.setdefault(stream, clock)
            if window.holds(taken, clock, newest):
                stats_seen[stream] = taken + 1
                keep.add(snapshot.snapshot_id)
        if writer is not None and writer not in writers_seen:
            writers_seen.add(writer)
            keep.add(snapshot.snapshot_id)
    return keep


def expire_snapshots(table: Table, retention: Retention, window: CommitWindow | int, now_ms: int | None = None,
                     before_removal: Callable[[list[Snapshot]], None] | None = None) -> int:
    """Expire what retention allows once enough piled up; returns how many snapshots were expired.

    `table` is the caller's freshly committed view of the table; `window`: the watermark policy's
    window per progress stream (kept). Refs past their max-ref-age go in the same commit.
    `before_removal` sees the snapshots about to go before the ledger is reconciled for them (a writer
    records the ledger rows it still holds for any of them).
    """
    snapshots = table.metadata.snapshots
    if not expiry_due(table, retention):
        return 0
    aged = tuple(aged_refs(table.metadata, int(time.time() * 1000) if now_ms is None else now_ms))
    if retention.summaries:
        keep = protected_snapshot_ids(table.metadata, retention.keep_last, window, aged)
    else:
        keep = {ref.snapshot_id for name, ref in table.metadata.refs.items() if name not in aged}
        keep |= {s.snapshot_id for s in list(lineage(table.metadata))[: retention.keep_last]}
    keep |= merge_position(table)
    expired = [s for s in snapshots if s.snapshot_id not in keep]
    if len(expired) < max(retention.slack, 1) and not aged:
        return 0  # what the windows keep fills the slack: expire once `slack` more piled up, not on every commit
    if before_removal is not None:
        before_removal(expired)
    if retention.summaries and any(ledger_entry(s) is not None for s in expired):  # a cdc table's checkpoints or replays
        reconcile(table.catalog, table, expired)  # every one reaches the late-data ledger before its snapshot goes
    return remove_snapshots(table, expired, aged)


def merge_position(table: Table) -> set[int]:
    """For cdc.<name>: the snapshot base.<name> records as merged up to (`partfin.source-snapshot-id`), else nothing.

    The upsert's tag (`partfin-base-merged`) keeps it, but the tag moves only after base's commit: an expiry in
    between (the writer's, a maintenance run) would remove it, the tag could not follow, and the next upsert would
    re-merge everything.
    """
    namespace, name = table.name()[0], table.name()[-1]
    if namespace != "cdc" or table.catalog is None:
        return set()
    base = load_table_if_exists(table.catalog, f"base.{name}")
    position = base.properties.get(K.PROP_SOURCE_SNAPSHOT_ID) if base is not None else None
    return {int(position)} if position else set()


def expiry_due(table: Table, retention: Retention) -> bool:
    """Whether expire_snapshots would look for snapshots to expire on this view of the table."""
    return len(table.metadata.snapshots) > retention.keep_last + retention.slack
