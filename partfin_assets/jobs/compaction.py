"""Small-file compaction per partition: a MERGE job (docs/concurrency.md).

A streaming writer leaves one small file per subtask per hour per checkpoint.
Compaction reads the small files of a partition at the job's start snapshot,
rewrites them into files of about `target_file_size_bytes`, and commits one
overwrite snapshot that removes the old files and adds the new ones. As a MERGE
job it fails with CommitConflictError when any commit after its start touched
one of the partitions it rewrites; commits to other partitions do not matter.

By default only finalized hours are compacted (hour + 1h <= watermark): the CDC
writer still appends to the others, and every such append would make the
compaction lose. The commit carries no event-time stats, so the watermark
policy skips it, and rows are rewritten unchanged (same records, same values).

base.<table> (bucketed, merge-on-read) gets position-delete files from the
upsert: compaction folds them back. A bucket with delete files is rewritten
whole (its rows with the deletes applied, sorted by key) and its delete files
are removed in the same commit, so a compacted table reads like a freshly
written one. Buckets are not hours, so every bucket qualifies.

After `partfin base rebucket` (jobs/rebucket.py) a bucket of an older spec is rewritten into files
of the current spec, whatever its size: together with the current-spec buckets its keys map to
(its key group, jobs/upsert/plan.py `group_files`), their delete files folded in and removed, so
after one compaction the table is all in the new layout with one file per new bucket.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from pyiceberg.catalog import Catalog
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table
from pyiceberg.transforms import BucketTransform
from pyiceberg.transforms import HourTransform

from partfin_assets.finalization.hours import is_finalized
from partfin_assets.iceberg.files import hour_partition, live_files, partition_path, position_delete_files, read_files
from partfin_assets.iceberg.history import watermark_of
from partfin_assets.iceberg.ledger import ledger_entry, reconcile
from partfin_assets.iceberg.position_deletes import positions_by_file, read_positions
from partfin_assets.iceberg.tables import DEFAULT_TARGET_FILE_SIZE
from partfin_assets.jobs.job import Hook, Job, JobStart, StagedFiles
from partfin_assets.jobs.upsert.plan import group_files
from partfin_assets.model import summary_keys as K
from partfin_assets.model.summary_keys import JobKind
from partfin_assets.model.timeutil import to_us

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class PartitionCompaction:
    partition: str
    files_before: int  # live files of the partition at the start snapshot
    files_after: int
    files_rewritten: int
    bytes_rewritten: int
    bytes_written: int
    records: int


@dataclass
class CompactionResult:
    table: str
    job_id: str
    snapshot_id: int | None  # None: nothing to compact
    partitions: list[PartitionCompaction] = field(default_factory=list)
    skipped_not_finalized: list[str] = field(default_factory=list)

    @property
    def files_before(self) -> int:
        return sum(p.files_before for p in self.partitions)

    @property
    def files_after(self) -> int:
        return sum(p.files_after for p in self.partitions)

    def describe(self) -> str:
        if self.snapshot_id is None:
            return f"{self.table}: nothing to compact"
        return (
            f"{self.table}: compacted {len(self.partitions)} partition(s), files {self.files_before} -> {self.files_after} "
            f"(snapshot {self.snapshot_id}, job {self.job_id})"
        )


def _hour_of_partition(table, partition: str) -> int | None:
    """Start (us) of the hour a partition path names, if the table is partitioned by hour()."""
    spec = table.metadata.spec()
    if len(spec.fields) != 1 or not isinstance(spec.fields[0].transform, HourTransform):
        return None

    text = partition.split("=", 1)[1]
    return to_us(datetime.strptime(text, "%Y-%m-%d-%H").replace(tzinfo=UTC))


def key_column(table) -> str | None:
    """The key a bucketed table (base.<table>) is partitioned by: its files are written sorted by it."""
    spec = table.metadata.spec()
    if len(spec.fields) == 1 and isinstance(spec.fields[0].transform, BucketTransform):
        return table.metadata.schema().find_field(spec.fields[0].source_id).name
    return None


def plan_compaction(
    files: dict[str, list[DataFile]], target_file_size_bytes: int, min_input_files: int,
    deletes: dict[str, list[DataFile]] | None = None,
) -> dict[str, list[DataFile]]:
    """Per partition, the files worth rewriting: at least `min_input_files` files below the target size,
    or every file of a partition that has position deletes to fold."""
    out = {}
    for partition, partition_files in files.items():
        if deletes and deletes.get(partition):
            out[partition] = sorted(partition_files, key=lambda f: f.file_path)
            continue
        small = [f for f in partition_files if f.file_size_in_bytes < target_file_size_bytes * 3 // 4]
        if len(small) >= max(2, min_input_files):
            out[partition] = sorted(small, key=lambda f: f.file_path)
    return out


@dataclass(frozen=True)
class PartitionRewrite:
    """One partition's share of a compaction (picklable: a fanned-out run hands it to a step)."""

    partition: str
    files: list[DataFile]  # the data files to rewrite
    deletes: list[DataFile]  # the partition's position-delete files, folded in
    files_before: int  # live data files of the partition at the start snapshot
    paths: tuple[str, ...] = ()  # the partitions it rewrites when more than one (a key group moved into the current spec)


def old_spec_rewrites(table: Table, files: dict[str, list[DataFile]]) -> list[PartitionRewrite]:
    """One rewrite per key group holding a partition of an older spec among `files`: every data and delete file of the group.

    Rewritten under the current spec, the group's rows land in its current-spec buckets, one file each.
    """
    current = table.metadata.default_spec_id
    old = {path for path, partition_files in files.items() if any(f.spec_id != current for f in partition_files)}
    if not old:
        return []
    _, layout = group_files(table)
    out = []
    for group in layout.values():
        if old.isdisjoint(group.paths):
            continue
        data = [f for p in group.partitions for f in p.data]
        out.append(PartitionRewrite(
            " + ".join(group.paths), sorted(data, key=lambda f: f.file_path), [d for p in group.partitions for d in p.deletes], len(data),
            paths=tuple(group.paths),
        ))
    return out


@dataclass(frozen=True)
class CompactionPlan:
    """What one compaction job rewrites, as read at its start snapshot (picklable)."""

    identifier: str
    start: JobStart
    rewrites: list[PartitionRewrite]
    sort_by: str | None
    target_file_size_bytes: int
    skipped_not_finalized: list[str]


@dataclass(frozen=True)
class RewrittenPartition:
    """A partition rewritten (files written, not committed)."""

    stats: PartitionCompaction
    removed: list[DataFile]
    added: list[DataFile]


def plan_compaction_job(
    job: Job,
    *,
    partitions: Iterable[str] | None = None,
    hours: Iterable[int] | None = None,
    target_file_size_bytes: int = DEFAULT_TARGET_FILE_SIZE,
    min_input_files: int = 2,
    finalized_only: bool = True,
    sort_by: str | None = None,
) -> CompactionPlan:
    """The partitions a MERGE job (started on the table) rewrites; see `compact`."""
    table = job.table
    if any(ledger_entry(s) is not None for s in table.metadata.snapshots):  # a cdc table: its ledger first
        reconcile(job.catalog, table)
    wanted: set[str] | None = None
    if partitions is not None or hours is not None:
        wanted = set(partitions or ())
        wanted |= {hour_partition(table.metadata, h) for h in hours or ()}
    files = live_files(table, job.start_snapshot_id, wanted)
    skipped: list[str] = []
    if finalized_only:
        watermark = watermark_of(table.properties)
        for partition in list(files):
            hour = _hour_of_partition(table, partition)
            if hour is None:
                continue
            if not is_finalized(hour, watermark):
                skipped.append(partition)
                del files[partition]
    deletes: dict[str, list[DataFile]] = {}
    for delete_file in position_delete_files(table, table.current_snapshot()):
        deletes.setdefault(partition_path(table.metadata, delete_file), []).append(delete_file)
    plan = plan_compaction(files, target_file_size_bytes, min_input_files, deletes)
    moved = old_spec_rewrites(table, files)
    moved_paths = {path for rewrite in moved for path in rewrite.paths}
    rewrites = [PartitionRewrite(p, small, deletes.get(p, []), len(files[p])) for p, small in sorted(plan.items()) if p not in moved_paths]
    rewrites += moved
    return CompactionPlan(job.identifier, job.started, rewrites, sort_by or key_column(table), target_file_size_bytes, skipped)


def rewrite_partition(table: Table, rewrite: PartitionRewrite, staged: StagedFiles, sort_by: str | None, target_file_size_bytes: int) -> RewrittenPartition:
    """Rewrite one partition's files (deletes applied, sorted by `sort_by`) into files near the target size."""
    small, folded = rewrite.files, rewrite.deletes
    rows = read_files(table, small, deletes=folded)
    if sort_by is not None:
        rows = rows.sort_by(sort_by)
    # PyIceberg bin-packs by in-memory (Arrow) size: scale the target by the input's
    # Arrow-to-Parquet ratio so that the files on disk come out near the target size.
    on_disk = max(1, sum(f.file_size_in_bytes for f in small))
    write_target = max(1, int(target_file_size_bytes * rows.nbytes / on_disk))
    new_files = staged.write(rows, target_file_size_bytes=write_target)
    gone = positions_by_file(read_positions(table.io, folded))
    records_in = sum(f.record_count - len(gone.get(f.file_path, ())) for f in small)
    records_out = sum(f.record_count for f in new_files)
    if records_in != records_out or rows.num_rows != records_in:
        raise RuntimeError(f"{table.name()} {rewrite.partition}: compaction read {rows.num_rows} of {records_in} records, wrote {records_out}")
    stats = PartitionCompaction(
        rewrite.partition, rewrite.files_before, rewrite.files_before - len(small) + len(new_files), len(small),
        sum(f.file_size_in_bytes for f in small), sum(f.file_size_in_bytes for f in new_files), records_in,
    )
    return RewrittenPartition(stats, small + folded, new_files)


def commit_compaction(job: Job, plan: CompactionPlan, rewritten: list[RewrittenPartition]) -> CompactionResult:
    """One MERGE commit of every rewritten partition (CommitConflictError if a commit since the start touched one)."""
    result = CompactionResult(plan.identifier, job.job_id, None, skipped_not_finalized=list(plan.skipped_not_finalized))
    if not rewritten:
        job.abort()
        return result
    result.partitions = sorted((r.stats for r in rewritten), key=lambda p: p.partition)
    summary = {
        K.COMPACTION_FILES_BEFORE: str(sum(p.files_before for p in result.partitions)),
        K.COMPACTION_FILES_AFTER: str(sum(p.files_after for p in result.partitions)),
    }
    committed = job.commit_replace([f for r in rewritten for f in r.removed], [f for r in rewritten for f in r.added], summary)
    result.snapshot_id = committed.snapshot_id
    log.info("%s", result.describe())
    return result


def compact(
    catalog: Catalog,
    identifier: str,
    *,
    partitions: Iterable[str] | None = None,
    hours: Iterable[int] | None = None,
    target_file_size_bytes: int = DEFAULT_TARGET_FILE_SIZE,
    min_input_files: int = 2,
    finalized_only: bool = True,
    sort_by: str | None = None,
    job_id: str | None = None,
    before_commit: Hook | None = None,
) -> CompactionResult:
    """Compact small files of `identifier`, per partition, in one MERGE commit.

    `partitions` (paths like `event_time_hour=2026-11-01-00`) or `hours` (epoch us) restrict the
    partitions looked at; by default all. `finalized_only` (hour-partitioned tables with a
    watermark) keeps only hours with hour + 1h <= partfin.watermark at the start snapshot.
    Raises CommitConflictError if a commit after the start touched a rewritten partition.
    The partitions are rewritten in turn here; `compact_<table>_fanout` rewrites them as steps.
    """
    with Job.start(catalog, identifier, JobKind.MERGE, job_id=job_id, before_commit=before_commit) as job:
        plan = plan_compaction_job(
            job, partitions=partitions, hours=hours, target_file_size_bytes=target_file_size_bytes,
            min_input_files=min_input_files, finalized_only=finalized_only, sort_by=sort_by,
        )
        rewritten = [rewrite_partition(job.table, r, job.staged, plan.sort_by, target_file_size_bytes) for r in plan.rewrites]
        return commit_compaction(job, plan, rewritten)

