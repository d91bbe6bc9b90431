"""One upsert run: plan, decode the keys, merge each key group in turn (its payloads decoded there), commit, as one UPDATE/DELETE job on base.<table>.

A run that loses a race raises `CommitConflictError` and leaves nothing behind; running it
again (the jobs layer's one retry policy, jobs/retry.py) recomputes from fresh data. The Dagster
layer runs the same steps with one step per group (defs/platform/upsert_fanout.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pyiceberg.catalog import Catalog
from pyiceberg.table.metadata import TableMetadata

from partfin_assets.iceberg.catalog import load_existing_table
from partfin_assets.iceberg.files import partition_path
from partfin_assets.iceberg.tables import ensure_base_table
from partfin_assets.jobs.job import Hook, Job
from partfin_assets.jobs.upsert.commit import commit_merge, sync_merged_tag
from partfin_assets.jobs.upsert.decode import decode_keys, unfit_in_cdc_order
from partfin_assets.jobs.upsert.merge import DEFAULT_MAX_DATA_FILES, GroupMerge, merge_group, split_by_group
from partfin_assets.jobs.upsert.plan import GroupFiles, MergePosition, merged_source_snapshot_id, plan_upsert
from partfin_assets.jobs.upsert.quarantine import quarantine_changes
from partfin_assets.model import summary_keys as K
from partfin_assets.model.summary_keys import JobKind
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.model.timeutil import iso_z
from partfin_assets.model.faults import faults

CrashHook = Callable[[str], None]  # called with "after-read", "after-files", "after-commit" (tests)


@dataclass(frozen=True)
class UpsertResult:
    table: str
    cdc_snapshot_ids_merged: list[int]  # oldest first
    cdc_snapshot_id: int | None  # the CDC snapshot the base table is now merged up to
    base_snapshot_id: int | None  # None when nothing changed
    inserted: int
    updated: int
    deleted: int
    watermark: str | None  # base watermark after this run
    hours_touched: list[str]  # hours (ISO Z) of `_event_time` of rows that appeared, changed or disappeared
    changes_read: int = 0
    stale: int = 0  # keys whose newest change in this run is older than the base row (late, superseded): ignored
    full_remerge: bool = False
    buckets_rewritten: int = 0  # buckets that got new files
    files_removed: int = 0
    files_added: int = 0
    files_scanned: int = 0  # base data files whose key columns were read
    row_groups_hit: int = 0  # row groups of those files holding a changed key
    row_groups_settled: int = 0  # of those, settled by their statistics: ordering columns not read (locate.py)
    previous_cdc_snapshot_id: int | None = None
    attempts: int = 1  # commit attempts (a commit that landed meanwhile in other buckets costs one)
    quarantined: int = 0  # changes that do not fit the declaration: in base.<table>__rejected, not merged

    @property
    def changed(self) -> bool:
        return self.base_snapshot_id is not None

    def describe(self) -> str:
        if not self.cdc_snapshot_ids_merged and self.base_snapshot_id is None:
            return (
                f"base.{self.table}: up to date with cdc.{self.table} snapshot {self.cdc_snapshot_id} "
                f"(watermark {self.watermark or '-'}); nothing merged"
            )
        ids = self.cdc_snapshot_ids_merged
        shown = ", ".join(str(i) for i in ids[:5]) + (f", ... ({len(ids)} in all)" if len(ids) > 5 else "")
        if self.previous_cdc_snapshot_id is None:
            mode = "first merge"
        elif self.full_remerge:
            mode = "full re-merge (previous position no longer available)"
        else:
            mode = "incremental"
        hours = (
            f"{self.hours_touched[0]} .. {self.hours_touched[-1]} ({len(self.hours_touched)} hour(s))"
            if self.hours_touched
            else "none"
        )
        lines = [
            f"base.{self.table}: merged {len(ids)} CDC snapshot(s) of cdc.{self.table} [{shown}], {mode}",
            f"  merged up to CDC snapshot: {self.cdc_snapshot_id} (previous: {self.previous_cdc_snapshot_id or '-'})",
            f"  changes read: {self.changes_read} (stale, ignored: {self.stale}; quarantined in "
            f"base.{self.table}__rejected: {self.quarantined})",
            f"  rows: {self.inserted} inserted, {self.updated} updated, {self.deleted} deleted",
            f"  base snapshot: {self.base_snapshot_id} "
            f"({self.buckets_rewritten} bucket(s) written: {self.files_added} file(s) in, {self.files_removed} out; "
            f"key columns of {self.files_scanned} file(s) read; ordering columns of "
            f"{self.row_groups_hit - self.row_groups_settled} of {self.row_groups_hit} row group(s) holding a changed key)",
            f"  base watermark: {self.watermark or '-'}",
            f"  hours touched: {hours}",
        ]
        return "\n".join(lines)


def run_upsert(
    catalog: Catalog,
    name: str,
    *,
    job_id: str | None = None,
    before_commit: Hook | None = None,
    crash_hook: CrashHook | None = None,
    max_data_files: int = DEFAULT_MAX_DATA_FILES,
) -> UpsertResult:
    """One incremental merge of cdc.<name> into base.<name> (see the package docstring).

    Raises CommitConflictError when base.<name> changed in a way that conflicts (docs/concurrency.md).
    """
    cdc = load_existing_table(catalog, f"cdc.{name}", "ingest into it first (partfin ingest)")
    spec = TableSpec.from_properties(name, cdc.properties)
    ensure_base_table(catalog, spec)
    with Job.start(catalog, spec.base_identifier, JobKind.UPDATE_DELETE, job_id=job_id, before_commit=before_commit) as job:
        plan = plan_upsert(catalog, spec, job.table, pin=job.pin)
        if plan is None:
            source_id = merged_source_snapshot_id(job.table.properties)
            sync_merged_tag(catalog, name)
            return UpsertResult(
                table=name, cdc_snapshot_ids_merged=[], cdc_snapshot_id=source_id, base_snapshot_id=None,
                inserted=0, updated=0, deleted=0, watermark=job.table.properties.get(K.PROP_WATERMARK), hours_touched=[],
                previous_cdc_snapshot_id=source_id,
            )
        raw, _ = plan.read_changes()
        keyed, unfit_keys = decode_keys(spec, raw)
        merges: list[GroupMerge] = []
        for group, group_rows in sorted(split_by_group(plan, keyed).items()):
            files = plan.layout.get(group, GroupFiles(group, []))
            merges.append(merge_group(
                job.table, spec, files, group_rows, job.staged,
                max_data_files=max_data_files, on_read=lambda: _crash("after-read", crash_hook),
            ))
        unfit = unfit_in_cdc_order([unfit_keys, *(m.unfit for m in merges)])
        quarantine_changes(catalog, spec, unfit, plan.cdc_snapshot.snapshot_id, plan.erasures)  # before base moves past these changes
        _crash("after-files", crash_hook)
        committed = commit_merge(job, plan.position, merges, quarantined=unfit.num_rows)
    _crash("after-commit", crash_hook)
    sync_merged_tag(catalog, name)
    return result_of(plan.position, merges, job.table.metadata, committed.snapshot_id, raw.num_rows, committed.attempts,
                     quarantined=unfit.num_rows)


def result_of(
    plan: MergePosition, merges: list[GroupMerge], metadata: TableMetadata, snapshot_id: int | None, changes_read: int, attempts: int,
    *, quarantined: int = 0,
) -> UpsertResult:
    return UpsertResult(
        table=plan.spec.name,
        cdc_snapshot_ids_merged=plan.merged_ids,
        cdc_snapshot_id=plan.cdc_snapshot_id,
        base_snapshot_id=snapshot_id,
        inserted=sum(m.inserted for m in merges),
        updated=sum(m.updated for m in merges),
        deleted=sum(m.deleted for m in merges),
        watermark=plan.watermark,
        hours_touched=[iso_z(h) for h in sorted({h for m in merges for h in m.hours_us})],
        changes_read=changes_read,
        quarantined=quarantined,
        stale=sum(m.stale for m in merges),
        full_remerge=plan.full,
        buckets_rewritten=len({partition_path(metadata, f) for m in merges for f in m.add}),
        files_removed=sum(len(m.remove) for m in merges),
        files_added=sum(len(m.add) for m in merges),
        files_scanned=sum(m.files_scanned for m in merges),
        row_groups_hit=sum(m.row_groups_hit for m in merges),
        row_groups_settled=sum(m.row_groups_settled for m in merges),
        previous_cdc_snapshot_id=plan.previous_source_id,
        attempts=attempts,
    )


def _crash(phase: str, hook: CrashHook | None) -> None:
    if hook is not None:
        hook(phase)
    faults().crash_point(f"upsert-{phase}")
