"""The conflict matrix of DESIGN §6 at partition granularity: one job object every partfin write goes through.

Job kinds and what happens when another commit lands between a job's start (the
snapshot it read) and its commit ("first to finish wins"):

- INTO (append) and OVERWRITE (replace partitions) never fail for concurrency:
  every attempt is rebuilt on the fresh head. An INTO appends on top of it; an
  OVERWRITE re-derives, at that head, the files that are in its partitions and
  replaces them.
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

import itertools
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.io.pyarrow import ArrowScan, _dataframe_to_data_files
from pyiceberg.expressions import AlwaysTrue
from pyiceberg.manifest import DataFile, ManifestEntryStatus
from pyiceberg.table import FileScanTask, Table, Transaction
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Snapshot

from partfin_assets.core import summary_keys as K
from partfin_assets.core.commit import CommitResult, JobKind, commit_with_retry, delete_files, new_transaction
from partfin_assets.core.history import lineage, summary_of
from partfin_assets.core.stats import compact_json

log = logging.getLogger(__name__)

WHOLE_TABLE = "*"  # the target / touched "partition" of an unpartitioned table, or "unknown: assume all"
PARTITION_SUMMARY_PREFIX = "partitions."
PARTITION_SUMMARIES_INCLUDED = "partition-summaries-included"
CHANGED_PARTITION_COUNT = "changed-partition-count"
_FILE_CHANGE_KEYS = (
    "added-data-files", "deleted-data-files", "added-delete-files", "removed-delete-files",
    "added-position-delete-files", "removed-position-delete-files",
    "added-equality-delete-files", "removed-equality-delete-files",
)
JOB_PARTITIONS_LIMIT = 200
FAILING_KINDS = frozenset({JobKind.UPDATE_DELETE, JobKind.MERGE})


class CommitConflictError(RuntimeError):
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


# --------------------------------------------------------------------------- partitions


def partition_path(metadata: TableMetadata, data_file: DataFile) -> str:
    """The partition of a data file as PyIceberg names it in snapshot summaries (`event_time_hour=2026-11-01-00`)."""
    try:
        spec_id = data_file.spec_id
    except AttributeError:  # a file just written (not read from a manifest) belongs to the default spec
        spec_id = metadata.default_spec_id
    spec = metadata.specs().get(spec_id, metadata.spec())
    if spec.is_unpartitioned() or len(data_file.partition) == 0:
        return WHOLE_TABLE
    return spec.partition_to_path(data_file.partition, metadata.schema())


def partition_path_of_values(metadata: TableMetadata, values: Iterable) -> str:
    """The partition path of the current spec for already-transformed partition values."""
    from pyiceberg.typedef import Record

    spec = metadata.spec()
    if spec.is_unpartitioned():
        return WHOLE_TABLE
    return spec.partition_to_path(Record(*values), metadata.schema())


def hour_partition(metadata: TableMetadata, hour_us: int) -> str:
    """The partition path of the hour starting at `hour_us` in an hour(event time)-partitioned table."""
    from pyiceberg.transforms import HourTransform

    spec = metadata.spec()
    hour_fields = [f for f in spec.fields if isinstance(f.transform, HourTransform)]
    if len(spec.fields) != 1 or not hour_fields:
        raise ValueError(f"table at {metadata.location} is not partitioned by one hour() field: {spec}")
    return partition_path_of_values(metadata, [hour_us // 3_600_000_000])


def live_files(table: Table, snapshot_id: int | None = None, partitions: Iterable[str] | None = None) -> dict[str, list[DataFile]]:
    """Live data files of a snapshot (default: the current one) grouped by partition path (manifests only)."""
    metadata = table.metadata
    snapshot = metadata.snapshot_by_id(snapshot_id) if snapshot_id is not None else metadata.current_snapshot()
    wanted = set(partitions) if partitions is not None else None
    out: dict[str, list[DataFile]] = {}
    if snapshot is None:
        return out
    for manifest in snapshot.manifests(table.io):
        for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
            data_file = entry.data_file
            path = partition_path(metadata, data_file)
            if wanted is not None and path not in wanted and WHOLE_TABLE not in wanted:
                continue
            out.setdefault(path, []).append(data_file)
    return out


def read_files(table: Table, files: Iterable[DataFile]) -> pa.Table:
    """The rows of some data files (no delete files: partfin writes copy-on-write)."""
    metadata = table.metadata
    tasks = [FileScanTask(f) for f in files]
    if not tasks:
        return metadata.schema().as_arrow().empty_table()
    return ArrowScan(metadata, table.io, metadata.schema(), AlwaysTrue()).to_table(tasks)


# --------------------------------------------------------------------------- what changed since a snapshot


@dataclass(frozen=True)
class Touched:
    snapshot: Snapshot
    partitions: frozenset[str]  # WHOLE_TABLE in it: the whole table (or unknown)
    from_manifests: bool  # the summary did not say; the snapshot's own manifests were read


def snapshots_since(
    metadata: TableMetadata, start_snapshot_id: int | None, start_sequence_number: int | None = None
) -> list[Snapshot] | None:
    """Snapshots of main after `start_snapshot_id` up to the head, newest first.

    Follows parent links. Where expiry broke the chain (the start snapshot itself, or snapshots
    in between, expired), the sequence number the job recorded at its start still decides: each
    commit on main takes the next sequence number, so the retained snapshots numbered after it
    are all of them exactly when their numbers have no gap up to the head. Otherwise None: what
    changed can no longer be known, and callers must assume everything did.
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
    if start_sequence_number is not None and head is not None and head.sequence_number:
        after = sorted((s for s in metadata.snapshots if s.sequence_number > start_sequence_number),
                       key=lambda s: s.sequence_number, reverse=True)
        if [s.sequence_number for s in after] == list(range(head.sequence_number, start_sequence_number, -1)):
            return after
    return None


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


def find_conflict(
    table: Table,
    start_snapshot_id: int | None,
    targets: Iterable[str],
    *,
    start_spec_id: int | None = None,
    start_sequence_number: int | None = None,
) -> Conflict | None:
    """The oldest commit after `start_snapshot_id` that touched one of `targets` (the one that won), or None."""
    metadata = table.metadata
    targets = frozenset(targets)
    if not targets:
        return None
    if start_spec_id is not None and metadata.default_spec_id != start_spec_id:
        return Conflict(metadata.current_snapshot_id, targets, None, None, "the partition spec changed since the job started")
    chain = snapshots_since(metadata, start_snapshot_id, start_sequence_number)
    if chain is None:
        return Conflict(
            metadata.current_snapshot_id, targets, None, None,
            f"snapshots between the start snapshot {start_snapshot_id} and the head expired; changes cannot be ruled out",
        )
    for snapshot in reversed(chain):  # oldest first: name the commit that won the race
        touched = touched_partitions(snapshot, metadata, table.io)
        hit = overlaps(targets, touched.partitions)
        if hit:
            summary = summary_of(snapshot)
            return Conflict(snapshot.snapshot_id, frozenset(hit), summary.get(K.JOB_ID) or summary.get(K.COMMIT_ID), summary.get(K.JOB_KIND))
    return None


# --------------------------------------------------------------------------- the job


@dataclass
class JobResult:
    job_id: str
    kind: JobKind
    table: str
    snapshot_id: int | None  # None: nothing committed
    attempts: int
    partitions: list[str]
    result: CommitResult | None = None
    already_committed: bool = False  # a job with this id had already landed (re-run after an unknown outcome)


Hook = Callable[["Job"], None]


@dataclass
class Job:
    """One partfin write job on one table: start snapshot, target partitions, files written, one commit.

    Typical use::

        with Job.start(catalog, "cdc.orders", JobKind.MERGE) as job:
            files = live_files(job.table, job.start_snapshot_id, ...)      # read at the start snapshot
            job.target(paths)
            new = job.write(rows)                                          # registered for cleanup
            job.commit_replace(remove=files, add=new, summary={...})       # conflict-checked per attempt

    Leaving the `with` block without a commit (exception, abandon) deletes the files written.
    `before_commit` hooks run once between the read/write phase and the first commit attempt
    (tests use them as a barrier to make races deterministic).
    """

    catalog: Catalog
    identifier: str
    kind: JobKind
    job_id: str
    table: Table  # as of the start snapshot: read from this
    start_snapshot_id: int | None
    start_spec_id: int
    start_sequence_number: int | None = None  # decides what came after the start should expiry cut the chain
    partitions: set[str] = field(default_factory=set)
    written: list[str] = field(default_factory=list)
    before_commit: list[Hook] = field(default_factory=list)
    committed: JobResult | None = None
    aborted: bool = False

    @classmethod
    def start(
        cls,
        catalog: Catalog,
        identifier: str,
        kind: JobKind,
        *,
        job_id: str | None = None,
        before_commit: Hook | Iterable[Hook] | None = None,
    ) -> Job:
        table = catalog.load_table(identifier)
        hooks = [] if before_commit is None else [before_commit] if callable(before_commit) else list(before_commit)
        head = table.metadata.current_snapshot()
        return cls(
            catalog, identifier, JobKind(kind), job_id or uuid.uuid4().hex, table,
            table.metadata.current_snapshot_id, table.metadata.default_spec_id,
            start_sequence_number=head.sequence_number if head is not None else None, before_commit=hooks,
        )

    def __enter__(self) -> Job:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.committed is None:
            self.abort()

    # ---- read side

    def landed_before(self) -> Snapshot | None:
        """The snapshot of an earlier run with this job id (a re-run after an unknown outcome), if any."""
        for snapshot in lineage(self.table.metadata):
            if summary_of(snapshot).get(K.JOB_ID) == self.job_id:
                return snapshot
        return None

    def target(self, partitions: Iterable[str]) -> None:
        self.partitions.update(partitions)

    def target_files(self, files: Iterable[DataFile]) -> None:
        self.partitions.update(partition_path(self.table.metadata, f) for f in files)

    # ---- write side

    def write(self, rows: pa.Table, *, target_file_size_bytes: int | None = None) -> list[DataFile]:
        """Write rows as data files of this table (partitioned by its spec); registered for cleanup."""
        if rows.num_rows == 0:
            return []
        metadata = self.table.metadata
        if target_file_size_bytes is not None:
            metadata = metadata.model_copy(
                update={"properties": {**metadata.properties, "write.target-file-size-bytes": str(target_file_size_bytes)}}
            )
        rows = rows.cast(self.table.schema().as_arrow())
        files: list[DataFile] = []
        try:
            for data_file in _dataframe_to_data_files(metadata, rows, self.table.io, write_uuid=uuid.uuid4(), counter=itertools.count()):
                files.append(data_file)
                self.written.append(data_file.file_path)
        except BaseException:
            # files written before the failure are registered already; the caller's exit aborts
            raise
        return files

    def abort(self) -> None:
        """Delete everything this job wrote; it never committed, so nothing of it is visible."""
        if self.written:
            delete_files(self.table.io, self.written)
            log.info("%s: %s job %s aborted; %d file(s) deleted", self.identifier, self.kind.value, self.job_id, len(self.written))
            self.written = []
        self.aborted = True

    # ---- commit

    def summary(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        out = dict(extra or {})
        out[K.COMMIT_ID] = self.job_id
        out[K.JOB_ID] = self.job_id
        out[K.JOB_KIND] = self.kind.value
        if self.partitions and len(self.partitions) <= JOB_PARTITIONS_LIMIT:
            out[K.JOB_PARTITIONS] = compact_json(sorted(self.partitions))
        if self.kind in FAILING_KINDS and self.start_snapshot_id is not None:
            out[K.JOB_START_SNAPSHOT] = str(self.start_snapshot_id)
        return out

    def check(self, table: Table) -> None:
        """Raise CommitConflictError if `table` (a fresh head) conflicts with this job."""
        if self.kind not in FAILING_KINDS:
            return
        conflict = find_conflict(
            table, self.start_snapshot_id, self.partitions,
            start_spec_id=self.start_spec_id, start_sequence_number=self.start_sequence_number,
        )
        if conflict is not None:
            raise CommitConflictError(
                self.identifier, self.kind, self.job_id, conflict.partitions, conflict.snapshot_id,
                conflict.job_id, conflict.kind, conflict.reason,
            )

    def commit(self, stage: Callable[[Table, object, dict[str, str]], object], *, summary: Mapping[str, str] | Callable[[Table], Mapping[str, str]] | None = None, max_attempts: int = 50) -> JobResult:
        """Commit once: every attempt reloads the table, checks conflicts, and calls `stage(table, tx, summary)`.

        `stage(fresh_table, transaction, snapshot_summary)` adds the job's snapshot to the transaction (it must
        pass `snapshot_summary` as snapshot properties) and returns a truthy value, or a falsy one
        to commit nothing. `summary` may be a function of the fresh table (re-derived per attempt).
        On any failure the job's files are deleted and the exception propagates.
        """
        if self.committed is not None:
            raise RuntimeError(f"job {self.job_id} already committed")
        for hook in self.before_commit:
            hook(self)

        def build(table: Table, commit_id: str):
            self.check(table)
            extra = summary(table) if callable(summary) else summary
            tx = new_transaction(table)
            if not stage(table, tx, self.summary(extra)):
                return None
            return tx

        try:
            result = commit_with_retry(self.catalog, self.identifier, build, commit_id=self.job_id, max_attempts=max_attempts)
        except BaseException:
            self.abort()
            raise
        snapshot_id = result.snapshot.snapshot_id if result.snapshot is not None else None
        if snapshot_id is None:
            self.abort()  # nothing committed: whatever was written is garbage
        self.committed = JobResult(self.job_id, self.kind, self.identifier, snapshot_id, result.attempts, sorted(self.partitions), result)
        self.written = []
        return self.committed

    # ---- the kinds

    def commit_append(self, add: list[DataFile], summary: Mapping[str, str] | Callable[[Table], Mapping[str, str]] | None = None) -> JobResult:
        """INTO: append `add` on top of whatever the head is."""

        def stage(head, tx, snapshot_summary):
            if not add:
                return False
            with tx.update_snapshot(snapshot_properties=snapshot_summary).fast_append() as append:
                for data_file in add:
                    append.append_data_file(data_file)
            return True

        return self.commit(stage, summary=summary)

    def commit_replace(self, remove: list[DataFile], add: list[DataFile], summary: Mapping[str, str] | Callable[[Table], Mapping[str, str]] | None = None) -> JobResult:
        """UPDATE/DELETE or MERGE: replace the files read at the start snapshot, if no one touched their partitions."""
        if self.kind not in FAILING_KINDS:
            raise ValueError(f"commit_replace is for UPDATE/DELETE and MERGE jobs, not {self.kind.value}")
        self.target_files(remove)
        self.target_files(add)

        def stage(head, tx, snapshot_summary):
            return _stage_file_swap(tx, snapshot_summary, remove, add)

        return self.commit(stage, summary=summary)

    def commit_overwrite(self, add: list[DataFile], summary: Mapping[str, str] | Callable[[Table], Mapping[str, str]] | None = None) -> JobResult:
        """OVERWRITE: replace everything in the target partitions *at the head the commit lands on* by `add`."""
        if self.kind != JobKind.OVERWRITE:
            raise ValueError(f"commit_overwrite is for OVERWRITE jobs, not {self.kind.value}")
        self.target_files(add)
        targets = set(self.partitions)

        def stage(head, tx, snapshot_summary):
            replaced = [f for files in live_files(head, None, targets).values() for f in files]
            return _stage_file_swap(tx, snapshot_summary, replaced, add)

        return self.commit(stage, summary=summary)


def retry_on_conflict(run: Callable[[], object], *, max_attempts: int = 5, on_conflict: Callable[[CommitConflictError, int], None] | None = None):
    """Run a job function again from a fresh snapshot while it fails with CommitConflictError (bounded)."""
    for attempt in range(1, max_attempts + 1):
        try:
            return run()
        except CommitConflictError as exc:
            if attempt == max_attempts:
                raise
            log.info("%s (attempt %d of %d); re-running from a fresh snapshot", exc, attempt, max_attempts)
            if on_conflict is not None:
                on_conflict(exc, attempt)
    raise AssertionError("unreachable")


def _stage_file_swap(tx: Transaction, snapshot_summary: dict[str, str], remove: list[DataFile], add: list[DataFile]) -> bool:
    """Stage one overwrite snapshot that removes and adds whole data files; False when there is nothing to swap."""
    if not remove and not add:
        return False
    with tx.update_snapshot(snapshot_properties=snapshot_summary).overwrite() as overwrite:
        for data_file in remove:
            overwrite.delete_data_file(data_file)
        for data_file in add:
            overwrite.append_data_file(data_file)
    return True
