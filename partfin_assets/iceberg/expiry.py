"""Snapshot expiry that keeps what the watermark policy and resumption need.

Commit cost in PyIceberg grows with the snapshots kept in table metadata, so a
streaming writer expires old snapshots as it goes. Never expired: the newest
`keep_last` snapshots of main, each writer's last `lookback` stats-bearing commits
(its stream's policy window), the newest checkpoint of every writer (its resume
position on tables older than the `partfin.writer.*` properties), and anything a
branch or tag points at (the upsert tags the CDC snapshot it merged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pyiceberg.exceptions import CommitFailedException
from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.update import AssertRefSnapshotId, RemoveSnapshotsUpdate

from partfin_assets.iceberg.commit import new_transaction
from partfin_assets.iceberg.files import delete_files
from partfin_assets.iceberg.history import lineage, summary_of
from partfin_assets.model import summary_keys as K
from partfin_assets.model.stats import commit_stats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retention:
    keep_last: int = 10  # newest snapshots of main always kept
    slack: int = 10  # expire only once this many more piled up: one expiry commit per `slack` checkpoints

    def __post_init__(self) -> None:
        if self.keep_last < 1 or self.slack < 0:
            raise ValueError(f"retention needs keep_last >= 1 and slack >= 0, got {self}")


def protected_snapshot_ids(metadata: TableMetadata, keep_last: int, lookback: int) -> set[int]:
    keep: set[int] = {ref.snapshot_id for ref in metadata.refs.values()}
    stats_seen: dict[str | None, int] = {}  # per writer: its stream's policy window
    writers_seen: set[str] = set()
    for position, snapshot in enumerate(lineage(metadata)):
        summary = summary_of(snapshot)
        if position < keep_last:
            keep.add(snapshot.snapshot_id)
        writer = summary.get(K.WRITER_ID)
        if stats_seen.get(writer, 0) < lookback and commit_stats(summary) is not None:
            stats_seen[writer] = stats_seen.get(writer, 0) + 1
            keep.add(snapshot.snapshot_id)
        if writer is not None and writer not in writers_seen:
            writers_seen.add(writer)
            keep.add(snapshot.snapshot_id)
    return keep


def expire_snapshots(table: Table, retention: Retention, lookback: int) -> int:
    """Expire what retention allows once enough piled up; returns how many snapshots were expired.

    `table` is the caller's freshly committed view of the table.
    """
    snapshots = table.metadata.snapshots
    if len(snapshots) <= retention.keep_last + retention.slack:
        return 0
    keep = protected_snapshot_ids(table.metadata, retention.keep_last, lookback)
    expired = [s for s in snapshots if s.snapshot_id not in keep]
    if not expired:
        return 0
    # The catalog applies the removal to whatever metadata is current when it commits: a
    # concurrent expiry may have removed some of these snapshots already (PyIceberg then fails
    # the whole update), and a tag moved meanwhile (the upsert's) would be dropped with its
    # snapshot. So the removal is a compare-and-set on every ref as this view saw it; a lost
    # race just leaves expiry to the next checkpoint.
    unchanged = tuple(AssertRefSnapshotId(ref=name, snapshot_id=ref.snapshot_id) for name, ref in table.metadata.refs.items())
    try:
        new_transaction(table)._apply((RemoveSnapshotsUpdate(snapshot_ids=[s.snapshot_id for s in expired]),), unchanged).commit_transaction()
    except CommitFailedException:
        log.info("snapshot expiry on %s lost a race with a concurrent commit; retried next time", table.name())
        return 0
    # A manifest list belongs to exactly one snapshot: gone with it.
    delete_files(table.io, [s.manifest_list for s in expired])
    return len(expired)
