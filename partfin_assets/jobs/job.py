"""One partfin write job on one table: start snapshot, target partitions, files written, one commit.

Every write that can conflict goes through `Job` (docs/concurrency.md, the rules in jobs/conflicts.py):
it records the snapshot it read, the partitions it targets and the files it wrote, and
commits once through the commit layer. INTO and OVERWRITE are rebuilt on the fresh head
(an OVERWRITE keeps what INTO commits appended after its start); UPDATE/DELETE and MERGE
fail with `CommitConflictError` when a commit after their start touched their partitions.
A job that fails or is abandoned deletes the files it wrote. A job whose start snapshot, or a snapshot
of another table it pinned (`Job.pin`: the upsert's cdc.<table>), expired while it read it
(FileNotFoundError on its manifests) fails with `CommitConflictError` too: re-run from the current
heads like any other lost race.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table, Transaction
from pyiceberg.table.snapshots import Snapshot

from partfin_assets.iceberg.commit import CommitResult, commit_with_retry, new_transaction
from partfin_assets.iceberg.erasures import fence_of
from partfin_assets.iceberg.files import (
    WHOLE_TABLE,
    conform_rows,
    delete_files,
    live_files,
    partition_path,
    position_delete_files,
    write_data_files,
)
from partfin_assets.iceberg.history import lineage, summary_of
from partfin_assets.iceberg.position_deletes import write_position_deletes
from partfin_assets.iceberg.row_delta import swap_files
from partfin_assets.jobs.conflicts import CommitConflictError, Conflict, commits_touching, find_conflict
from partfin_assets.model import summary_keys as K
from partfin_assets.model.stats import compact_json
from partfin_assets.model.summary_keys import JobKind
from partfin_assets.model.faults import faults

log = logging.getLogger(__name__)


JOB_PARTITIONS_LIMIT = 200
FAILING_KINDS = frozenset({JobKind.UPDATE_DELETE, JobKind.MERGE})


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


@dataclass(frozen=True)
class JobStart:
    """Who a job is and what it read (picklable): a fanned-out run's commit step resumes the job from it."""

    job_id: str
    start_snapshot_id: int | None
    start_spec_id: int
    start_sequence_number: int | None


@dataclass
class StagedFiles:
    """Files written for a job and not committed yet: the job commits them or deletes them.

    A step of a fanned-out job (another process, e.g. one bucket group of an upsert) writes through
    its own StagedFiles, discards them if it fails, and hands them to the step that commits
    (`Job.adopt`), which commits them or deletes them with its own.
    """

    table: Table
    written: list[str] = field(default_factory=list)

    def write(self, rows: pa.Table, *, target_file_size_bytes: int | None = None) -> list[DataFile]:
        if rows.num_rows == 0:
            return []
        files: list[DataFile] = []
        for data_file in write_data_files(self.table, conform_rows(self.table, rows), target_file_size_bytes=target_file_size_bytes):
            files.append(data_file)
            self.written.append(data_file.file_path)  # registered at once: a failure later still cleans it up
        return files

    def write_deletes(self, spec_id: int, partition, positions: pa.Table) -> DataFile:
        delete_file = write_position_deletes(self.table, spec_id, partition, positions)
        self.written.append(delete_file.file_path)
        return delete_file

    def discard(self) -> None:
        delete_files(self.table.io, self.written)
        self.written.clear()


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
    expected_properties: dict[str, str | None] = field(default_factory=dict)  # compare-and-set on commit
    erasures_version: int | None = None  # the erasure registry version its input was filtered with (expect_erasures)
    pinned: dict[str, int] = field(default_factory=dict)  # other tables it reads -> the snapshot it reads (pin)
    written: list[str] = field(default_factory=list)
    before_commit: list[Hook] = field(default_factory=list)
    committed: JobResult | None = None
    aborted: bool = False
    _split: tuple[int | None, tuple[list[DataFile], list[DataFile]]] | None = field(default=None, repr=False)

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

    @property
    def started(self) -> JobStart:
        return JobStart(self.job_id, self.start_snapshot_id, self.start_spec_id, self.start_sequence_number)

    @classmethod
    def resume(cls, catalog: Catalog, identifier: str, kind: JobKind, start: JobStart, *, before_commit: Hook | Iterable[Hook] | None = None) -> Job:
        """The job another step of a fanned-out run started (same id, same start): it commits from here."""
        table = catalog.load_table(identifier)
        hooks = [] if before_commit is None else [before_commit] if callable(before_commit) else list(before_commit)
        return cls(
            catalog, identifier, JobKind(kind), start.job_id, table, start.start_snapshot_id, start.start_spec_id,
            start_sequence_number=start.start_sequence_number, before_commit=hooks,
        )

    def __enter__(self) -> Job:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.committed is None:
            self.abort()
        expired = self._expired_read() if isinstance(exc, FileNotFoundError) and self.committed is None else None
        if expired is not None:
            # expiry removed a snapshot the job read (its manifest list) while it ran: nothing of the job is
            # visible, so it is a conflict like any other, and a re-run reads the current heads
            head_snapshot_id, what = expired
            raise self._conflict(Conflict(
                head_snapshot_id, frozenset(self.partitions or {WHOLE_TABLE}), None, None,
                f"{what} expired while it ran ({exc.filename or exc})",
            )) from exc

    # ---- read side

    def landed_before(self) -> Snapshot | None:
        """The snapshot of an earlier run with this job id (a re-run after an unknown outcome), if any."""
        for snapshot in lineage(self.table.metadata):
            if summary_of(snapshot).get(K.JOB_ID) == self.job_id:
                return snapshot
        return None

    def pin(self, table: Table) -> Table:
        """Record that the job reads `table` (another table, e.g. the upsert's cdc.<table>) at its current snapshot:
        should expiry remove that snapshot while the job reads it, the job fails as a conflict and is re-run."""
        if table.metadata.current_snapshot_id is not None:
            self.pinned[".".join(table.name())] = table.metadata.current_snapshot_id
        return table

    def target(self, partitions: Iterable[str]) -> None:
        self.partitions.update(partitions)

    def target_files(self, files: Iterable[DataFile]) -> None:
        self.partitions.update(partition_path(self.table.metadata, f) for f in files)

    def expect_properties(self, expected: Mapping[str, str | None]) -> None:
        """Commit only while these table properties still hold these values (None: absent).

        A compare-and-set on what the job's result depends on beyond its partitions (the upsert:
        the CDC position base.<table> has merged up to); a changed value is a CommitConflictError.
        """
        self.expected_properties.update(expected)

    def expect_erasures(self, version: int) -> None:
        """Commit only while the table is fenced at no later erasure registry version than `version`, the one the job
        filtered its input with (iceberg/erasures.py): a privacy request registered since is a CommitConflictError."""
        self.erasures_version = version

    # ---- write side

    @property
    def staged(self) -> StagedFiles:
        """Where this job's files are written and registered for cleanup."""
        return StagedFiles(self.table, self.written)

    def write(self, rows: pa.Table, *, target_file_size_bytes: int | None = None) -> list[DataFile]:
        """Write rows as data files of this table (partitioned by its spec); registered for cleanup."""
        return self.staged.write(rows, target_file_size_bytes=target_file_size_bytes)

    def write_deletes(self, spec_id: int, partition, positions: pa.Table) -> DataFile:
        """Write (file_path, pos) rows as one position-delete file of `partition`; registered for cleanup."""
        return self.staged.write_deletes(spec_id, partition, positions)

    def adopt(self, files: Iterable[DataFile]) -> None:
        """Take over files another process wrote for this job (a fanned-out step): committed or deleted with it."""
        self.written.extend(f.file_path for f in files)

    def abort(self) -> None:
        """Delete everything this job wrote; it never committed, so nothing of it is visible."""
        if self.written:
            count = len(self.written)
            self.staged.discard()
            log.info("%s: %s job %s aborted; %d file(s) deleted", self.identifier, self.kind.value, self.job_id, count)
        self.aborted = True

    # ---- commit

    def summary(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        out = dict(extra or {})
        out[K.COMMIT_ID] = self.job_id
        out[K.JOB_ID] = self.job_id
        out[K.JOB_KIND] = self.kind.value
        if self.partitions and len(self.partitions) <= JOB_PARTITIONS_LIMIT:
            out[K.JOB_PARTITIONS] = compact_json(sorted(self.partitions))
        if self.kind is not JobKind.INTO and self.start_snapshot_id is not None:  # what it read / replaced
            out[K.JOB_START_SNAPSHOT] = str(self.start_snapshot_id)
        return out

    def check(self, table: Table) -> None:
        """Raise CommitConflictError if `table` (a fresh head) conflicts with this job."""
        for key, expected in self.expected_properties.items():
            found = table.properties.get(key)
            if found != expected:
                head = table.metadata.current_snapshot()
                summary = summary_of(head) if head is not None else {}
                raise CommitConflictError(
                    self.identifier, self.kind, self.job_id, sorted(self.partitions) or [WHOLE_TABLE],
                    table.metadata.current_snapshot_id, summary.get(K.JOB_ID) or summary.get(K.COMMIT_ID),
                    summary.get(K.JOB_KIND), f"table property {key} is now {found!r}; the job read {expected!r}",
                )
        if self.erasures_version is not None and fence_of(table.properties) > self.erasures_version:
            head = table.metadata.current_snapshot()
            summary = summary_of(head) if head is not None else {}
            raise CommitConflictError(
                self.identifier, self.kind, self.job_id, sorted(self.partitions) or [WHOLE_TABLE],
                table.metadata.current_snapshot_id, summary.get(K.JOB_ID) or summary.get(K.COMMIT_ID), summary.get(K.JOB_KIND),
                f"a privacy request ({summary.get(K.PRIVACY_REQUEST_ID, 'unknown')}) was registered after the job read its "
                "input; run it again to leave the erased keys out",
            )
        if self.kind not in FAILING_KINDS:
            return
        conflict = find_conflict(
            table, self.start_snapshot_id, self.partitions,
            start_spec_id=self.start_spec_id, start_sequence_number=self.start_sequence_number,
        )
        if conflict is not None:
            raise self._conflict(conflict)

    def commit(self, stage: Callable[[Table, object, dict[str, str]], object], *, summary: Mapping[str, str] | Callable[[Table], Mapping[str, str]] | None = None, max_attempts: int = 50) -> JobResult:
        """Commit once: every attempt reloads the table, checks conflicts, and calls `stage(table, tx, summary)`.

        `stage(fresh_table, transaction, snapshot_summary)` adds the job's snapshot to the transaction (it must
        pass `snapshot_summary` as snapshot properties) and returns a truthy value, or a falsy one
        to commit nothing. `summary` may be a function of the fresh table (re-derived per attempt).
        On any failure the job's files are deleted and the exception propagates.
        """
        if self.committed is not None:
            raise RuntimeError(f"job {self.job_id} already committed")
        faults().pause_point("job-commit")
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

    def commit_replace(
        self,
        remove: list[DataFile],
        add: list[DataFile],
        summary: Mapping[str, str] | Callable[[Table], Mapping[str, str]] | None = None,
        *,
        properties: Mapping[str, str] | None = None,
    ) -> JobResult:
        """UPDATE/DELETE or MERGE: replace the files read at the start snapshot, if no one touched their partitions.

        `remove` and `add` may hold data files and position-delete files (a merge-on-read row delta).
        `properties` are set in the same commit; with them the job commits even when no file changes.
        """
        if self.kind not in FAILING_KINDS:
            raise ValueError(f"commit_replace is for UPDATE/DELETE and MERGE jobs, not {self.kind.value}")
        self.target_files(remove)
        self.target_files(add)

        def stage(head, tx, snapshot_summary):
            return _stage_file_swap(tx, snapshot_summary, remove, add, properties)

        return self.commit(stage, summary=summary)

    def commit_overwrite(self, add: list[DataFile], summary: Mapping[str, str] | Callable[[Table], Mapping[str, str]] | None = None) -> JobResult:
        """OVERWRITE: replace what the target partitions hold at the head the commit lands on by `add`,
        except what INTO commits appended there after this job started (see `overwrite_split`)."""
        if self.kind != JobKind.OVERWRITE:
            raise ValueError(f"commit_overwrite is for OVERWRITE jobs, not {self.kind.value}")
        self.target_files(add)

        def stage(head, tx, snapshot_summary):
            replaced, _ = self.overwrite_split(head)
            # delete files of the replaced partitions go with them (merge-on-read tables)
            replaced += [d for d in position_delete_files(head, head.current_snapshot()) if partition_path(head.metadata, d) in self.partitions]
            return _stage_file_swap(tx, snapshot_summary, replaced, add)

        return self.commit(stage, summary=summary)

    def overwrite_split(self, head: Table) -> tuple[list[DataFile], list[DataFile]]:
        """(replaced, kept): the files of the target partitions an OVERWRITE committed on `head` replaces and keeps.

        It replaces what the partitions held when it started and keeps what was appended since (a
        writer's late records: it did not read them). If what they held was rewritten since
        (compaction, privacy delete, another overwrite), it replaces everything, unless records were
        also appended since: those can no longer be told apart at file level, CommitConflictError.
        """
        key = head.metadata.current_snapshot_id
        if self._split is not None and self._split[0] == key:  # summary and stage of one attempt ask alike
            return self._split[1]
        live = [f for files in live_files(head, None, self.partitions).values() for f in files]
        at_start = {f.file_path for files in live_files(self.table, None, self.partitions).values() for f in files}
        if at_start <= {f.file_path for f in live}:  # nothing rewritten or removed since the start: only appends
            split = ([f for f in live if f.file_path in at_start], [f for f in live if f.file_path not in at_start])
        else:
            touching = commits_touching(
                head, self.start_snapshot_id, self.partitions,
                start_spec_id=self.start_spec_id, start_sequence_number=self.start_sequence_number,
            )
            if isinstance(touching, Conflict):
                raise self._conflict(touching)
            appends = [c for c in touching if c.kind == JobKind.INTO.value]
            if appends:
                raise self._conflict(dataclasses.replace(
                    appends[0], reason="records were appended to these partitions and what they held was rewritten since "
                    "this job started: the appended records cannot be told apart",
                ))
            split = (live, [])
        self._split = (key, split)
        return split

    def _expired_read(self) -> tuple[int | None, str] | None:
        """(its table's head, what expired) if the job's start snapshot or a snapshot it pinned is no longer in its table."""
        reads = {self.identifier: self.start_snapshot_id, **self.pinned}
        for identifier, snapshot_id in reads.items():
            if snapshot_id is None:
                continue
            try:
                head = self.catalog.load_table(identifier)
            except Exception:  # noqa: BLE001 - the job's own error says more than a failed look
                return None
            if head.metadata.snapshot_by_id(snapshot_id) is None:
                what = f"its start snapshot {snapshot_id}" if identifier == self.identifier else f"snapshot {snapshot_id} of {identifier} it read"
                own = head if identifier == self.identifier else self.catalog.load_table(self.identifier)
                return own.metadata.current_snapshot_id, what
        return None

    def _conflict(self, conflict: Conflict) -> CommitConflictError:
        return CommitConflictError(
            self.identifier, self.kind, self.job_id, conflict.partitions, conflict.snapshot_id,
            conflict.job_id, conflict.kind, conflict.reason,
        )


def _stage_file_swap(
    tx: Transaction, snapshot_summary: dict[str, str], remove: list[DataFile], add: list[DataFile],
    properties: Mapping[str, str] | None = None,
) -> bool:
    """Stage one snapshot that removes and adds whole data and delete files (and sets `properties`).

    False when there is nothing to commit at all.
    """
    if not remove and not add and not properties:
        return False
    if properties:
        tx.set_properties(dict(properties))
    swap_files(tx, snapshot_summary, remove, add)
    return True
