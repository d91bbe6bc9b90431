"""The conflict matrix (docs/concurrency.md) at partition granularity: one job object every partfin write goes through.

Job kinds and what happens when another commit lands between a job's start (the
snapshot it read) and its commit ("first to finish wins"):

- INTO (append) never fails for concurrency: every attempt appends on the fresh head.
- OVERWRITE (a replay) replaces what its partitions held when it started, re-derived on
  the fresh head, and never what INTO commits appended to them after its start (it did
  not read those records: a writer's late records stay). A rewrite of its partitions
  after its start (compaction, privacy delete, another overwrite) is replaced too; only
  when the same partitions were both appended to and rewritten since its start can the
  appended records no longer be told apart, and the OVERWRITE fails with
  `CommitConflictError` (re-run from a fresh snapshot) rather than drop them.
- UPDATE/DELETE and MERGE (compaction) fail with `CommitConflictError` when any
  commit after their start snapshot touched one of their target partitions (or
  the table, when it is unpartitioned). Commits to other partitions only cost a
  rebuild on the fresh head.

The check reads metadata only: the parent chain from the fresh head back to the
start snapshot, and per snapshot the partitions it changed, from PyIceberg's
`partitions.<path>` summary entries (partfin tables set
`write.summary.partition-limit`). Only a snapshot whose summary lacks them
(truncated past the limit, written by another engine) costs a read of the
manifests that snapshot wrote, never of data files. So the cost is linear in the
snapshots between start and head and independent of the table's size.

A job that fails or is abandoned deletes the data files it wrote (nothing of it
is visible: it never committed). A commit whose outcome is unknown (the catalog
call raised something else than CommitFailedException) is resolved by looking
for the job's commit id in the history (commit_with_retry), never by guessing.
PyIceberg's own rebase is never used: partfin tables set
`commit.retry.num-retries=0`, and each attempt is a fresh transaction whose
snapshot requirement makes it a compare-and-set.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pyiceberg.manifest import ManifestEntryStatus
from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Snapshot

from partfin_assets.iceberg.files import WHOLE_TABLE, partition_path
from partfin_assets.iceberg.history import snapshots_since, summary_of
from partfin_assets.model import summary_keys as K
from partfin_assets.model.errors import PartfinError
from partfin_assets.model.summary_keys import JobKind

PARTITION_SUMMARY_PREFIX = "partitions."
PARTITION_SUMMARIES_INCLUDED = "partition-summaries-included"
CHANGED_PARTITION_COUNT = "changed-partition-count"
_FILE_CHANGE_KEYS = (
    "added-data-files", "deleted-data-files", "added-delete-files", "removed-delete-files",
    "added-position-delete-files", "removed-position-delete-files",
    "added-equality-delete-files", "removed-equality-delete-files",
)


class CommitConflictError(PartfinError, RuntimeError):
    """An UPDATE/DELETE or MERGE job lost: a commit made after it started reading changed its partitions.

    Nothing of the job is visible and its files are deleted. Retrying means re-running the job from
    a fresh snapshot (the Dagster layer retries on this class).
    """

    def __init__(
        self,
        table: str,
        kind: JobKind,
        job_id: str,
        partitions: Iterable[str],
        conflicting_snapshot_id: int | None,
        conflicting_job_id: str | None = None,
        conflicting_kind: str | None = None,
        reason: str | None = None,
    ) -> None:
        self.table = table
        self.kind = kind
        self.job_id = job_id
        self.partitions = sorted(partitions)
        self.conflicting_snapshot_id = conflicting_snapshot_id
        self.conflicting_job_id = conflicting_job_id
        self.conflicting_kind = conflicting_kind
        self.reason = reason
        shown = ", ".join(self.partitions[:5]) + (f", ... ({len(self.partitions)} in all)" if len(self.partitions) > 5 else "")
        by = f"snapshot {conflicting_snapshot_id}"
        if conflicting_job_id or conflicting_kind:
            by += f" ({conflicting_kind or 'unknown kind'} job {conflicting_job_id or 'unknown'})"
        super().__init__(
            f"{table}: {kind.value} job {job_id} conflicts with {by} on partition(s) [{shown}]"
            + (f": {reason}" if reason else "")
            + "; nothing was committed, re-run the job from a fresh snapshot"
        )


@dataclass(frozen=True)
class Touched:
    snapshot: Snapshot
    partitions: frozenset[str]  # WHOLE_TABLE in it: the whole table (or unknown)
    from_manifests: bool  # the summary did not say; the snapshot's own manifests were read


def touched_partitions(snapshot: Snapshot, metadata: TableMetadata, io) -> Touched:
    """The partitions one snapshot added or removed files in: from its summary, else its own manifests."""
    summary = summary_of(snapshot)
    if summary.get(PARTITION_SUMMARIES_INCLUDED) == "true":
        parts = frozenset(k[len(PARTITION_SUMMARY_PREFIX) :] for k in summary if k.startswith(PARTITION_SUMMARY_PREFIX))
        return Touched(snapshot, parts, False)
    if snapshot.summary is not None and CHANGED_PARTITION_COUNT not in summary:
        changed_files = any(int(summary.get(k, "0") or 0) > 0 for k in _FILE_CHANGE_KEYS)
        if not changed_files:
            return Touched(snapshot, frozenset(), False)  # e.g. a heartbeat checkpoint: no files at all
        if metadata.spec().is_unpartitioned():
            return Touched(snapshot, frozenset({WHOLE_TABLE}), False)
    # Partition summaries missing or truncated: read the manifests this snapshot wrote.
    parts: set[str] = set()
    for manifest in snapshot.manifests(io):
        if manifest.added_snapshot_id != snapshot.snapshot_id:
            continue
        for entry in manifest.fetch_manifest_entry(io, discard_deleted=False):
            if entry.status == ManifestEntryStatus.EXISTING or entry.snapshot_id != snapshot.snapshot_id:
                continue
            parts.add(partition_path(metadata, entry.data_file))
    return Touched(snapshot, frozenset(parts), True)


def overlaps(targets: frozenset[str] | set[str], touched: frozenset[str]) -> set[str]:
    if not touched or not targets:
        return set()
    if WHOLE_TABLE in touched:
        return set(targets)
    if WHOLE_TABLE in targets:
        return set(touched)
    return set(targets) & set(touched)


@dataclass(frozen=True)
class Conflict:
    snapshot_id: int | None
    partitions: frozenset[str]
    job_id: str | None
    kind: str | None
    reason: str | None = None


def commits_touching(
    table: Table,
    start_snapshot_id: int | None,
    targets: Iterable[str],
    *,
    start_spec_id: int | None = None,
    start_sequence_number: int | None = None,
) -> list[Conflict] | Conflict:
    """Every commit after `start_snapshot_id` that touched one of `targets`, oldest first.

    A single Conflict with a reason instead when what happened can no longer be known (the
    partition spec changed, or expiry removed snapshots between the start and the head).
    """
    metadata = table.metadata
    targets = frozenset(targets)
    # A spec change (partfin base rebucket) moves every partition: it conflicts whatever the job targets,
    # even a job that targets none yet (a rebucket racing another).
    if start_spec_id is not None and metadata.default_spec_id != start_spec_id:
        return Conflict(metadata.current_snapshot_id, targets or frozenset({WHOLE_TABLE}), None, None,
                        "the partition spec changed since the job started")
    if not targets:
        return []
    chain = snapshots_since(metadata, start_snapshot_id, start_sequence_number)
    if chain is None:
        return Conflict(
            metadata.current_snapshot_id, targets, None, None,
            f"snapshots between the start snapshot {start_snapshot_id} and the head expired; changes cannot be ruled out",
        )
    found = []
    for snapshot in reversed(chain):  # oldest first
        hit = overlaps(targets, touched_partitions(snapshot, metadata, table.io).partitions)
        if hit:
            summary = summary_of(snapshot)
            found.append(Conflict(snapshot.snapshot_id, frozenset(hit), summary.get(K.JOB_ID) or summary.get(K.COMMIT_ID), summary.get(K.JOB_KIND)))
    return found


def find_conflict(
    table: Table,
    start_snapshot_id: int | None,
    targets: Iterable[str],
    *,
    start_spec_id: int | None = None,
    start_sequence_number: int | None = None,
) -> Conflict | None:
    """The oldest commit after `start_snapshot_id` that touched one of `targets` (the one that won), or None."""
    touching = commits_touching(
        table, start_snapshot_id, targets, start_spec_id=start_spec_id, start_sequence_number=start_sequence_number
    )
    if isinstance(touching, Conflict):
        return touching
    return touching[0] if touching else None
