"""`upsert_<table>_fanout`: the upsert as one Dagster run that fans out, one step per key group, then one commit step.

plan (decode the new CDC changes' keys, group them and base's files by bucket mod G) -> one
`merge_group` step per group (decode its payloads, locate old versions, write new versions and
delete files: jobs/upsert/merge.py) -> `commit` (quarantine what did not fit, then one
UPDATE/DELETE commit of every group's files: the same conflict matrix and exactly-once position
as `partfin upsert`). Only the plan and the commit are serial: the payload decode, the larger
part of decoding, runs in the groups' steps. The steps hand each other
picklable values through the run's IO manager, and group steps write their files to the table's
storage, so the same job runs on `multiprocess_executor` here (the default, `max_concurrent`
processes) and on `k8s_job_executor` / `celery_executor` with an object-store warehouse and an
object-store IO manager in production.

A lost race (CommitConflictError) fails the commit step, which deletes every group's files; the
whole run is retried from a fresh plan (`dagster/max_retries`, `dagster/retry_strategy:
ALL_STEPS`), since re-committing the same groups could only conflict again.
"""

from dataclasses import dataclass
from typing import Optional

import pyarrow as pa
from dagster import Config, DynamicOut, DynamicOutput, OpExecutionContext, Out, Output, op

from partfin_assets.defs.platform.fanout import DEFAULT_MAX_GROUPS, fanout_job
from partfin_assets.defs.resources import IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable
from partfin_assets.iceberg.catalog import load_existing_table
from partfin_assets.iceberg.tables import ensure_base_table
from partfin_assets.jobs.job import Job, JobStart, StagedFiles
from partfin_assets.jobs.upsert import sync_merged_tag
from partfin_assets.jobs.upsert.commit import commit_merge
from partfin_assets.jobs.upsert.decode import KeyedRows, decode_keys, unfit_in_cdc_order
from partfin_assets.jobs.upsert.merge import GroupMerge, merge_group, split_by_group
from partfin_assets.jobs.upsert.plan import GroupFiles, MergePosition, plan_upsert
from partfin_assets.jobs.upsert.quarantine import quarantine_changes
from partfin_assets.jobs.upsert.run import result_of
from partfin_assets.model.summary_keys import JobKind
from partfin_assets.model.tablespec import TableSpec


class FanoutConfig(Config):
    max_groups: int = DEFAULT_MAX_GROUPS  # merge steps per run at most (a group holds bucket count / groups buckets)


@dataclass(frozen=True)
class RunPlan:
    """What the commit step needs whatever the groups: the run's start on base and the CDC position it merges up to.

    A run may have no group to merge (every new change quarantined, heartbeat checkpoints only) and still
    commits base's position and watermark, as `partfin upsert` does.
    """

    start: JobStart
    plan: MergePosition
    changes_read: int
    unfit_keys: pa.Table  # the changes whose operation or key does not fit; the groups find the unfit payloads


@dataclass(frozen=True)
class GroupTask:
    """One group's share of an upsert run: its files at the start snapshot and its keyed CDC rows."""

    plan: MergePosition
    files: GroupFiles
    keyed: KeyedRows


def build_upsert_job(table: PartfinTable, *, max_concurrent: int = 2):
    name = table.name

    @op(name=f"plan_upsert_{name}", out={"run": Out(Optional[RunPlan]), "groups": DynamicOut(GroupTask)}, tags={"kind": "iceberg"})
    def plan(context: OpExecutionContext, config: FanoutConfig, catalog: IcebergCatalogResource):
        """Plan the run at one snapshot of each table, decode the changes: the run (None: nothing new), one output per key group."""
        iceberg = catalog.load()
        cdc = load_existing_table(iceberg, f"cdc.{name}", "ingest into it first (partfin ingest)")
        spec = TableSpec.from_properties(name, cdc.properties)
        ensure_base_table(iceberg, spec)
        job_ = Job.start(iceberg, spec.base_identifier, JobKind.UPDATE_DELETE, job_id=context.run_id)
        upsert_plan = plan_upsert(iceberg, spec, job_.table, max_groups=config.max_groups)
        if upsert_plan is None:
            sync_merged_tag(iceberg, name)
            context.log.info(f"base.{name} is up to date with cdc.{name}: nothing to merge")
            yield Output(None, "run")
            return
        raw, _ = upsert_plan.read_changes()
        keyed, unfit_keys = decode_keys(spec, raw)
        by_group = split_by_group(upsert_plan, keyed)
        context.log.info(f"{raw.num_rows} change(s) of {len(upsert_plan.merged_ids)} CDC snapshot(s) in {len(by_group)} group(s) of {upsert_plan.groups}")
        yield Output(RunPlan(job_.started, upsert_plan.position, raw.num_rows, unfit_keys), "run")
        for group, group_rows in sorted(by_group.items()):
            files = upsert_plan.layout.get(group, GroupFiles(group, []))
            yield DynamicOutput(GroupTask(upsert_plan.position, files, group_rows), output_name="groups", mapping_key=f"group_{group}")

    @op(name=f"merge_group_{name}", tags={"kind": "iceberg"})
    def merge(context: OpExecutionContext, catalog: IcebergCatalogResource, task: GroupTask) -> GroupMerge:
        """Decode, locate, decide and write one group's files (not committed: the commit step commits or deletes them)."""
        iceberg = catalog.load()
        base = iceberg.load_table(task.plan.spec.base_identifier)
        staged = StagedFiles(base)
        try:
            result = merge_group(base, task.plan.spec, task.files, task.keyed, staged)
        except BaseException:
            staged.discard()
            raise
        context.log.info(
            f"group {task.files.group}: {result.inserted} inserted, {result.updated} updated, {result.deleted} deleted, "
            f"{result.stale} stale, {result.unfit.num_rows} not fitting; key columns of {result.files_scanned} file(s) read; +{len(result.add)} -{len(result.remove)} files"
        )
        return result

    @op(name=f"commit_upsert_{name}", tags={"kind": "iceberg"})
    def commit(context: OpExecutionContext, catalog: IcebergCatalogResource, run: Optional[RunPlan], groups: list[GroupMerge]) -> None:
        """Quarantine what did not fit, then one commit for every group (none: base's position and watermark); on a
        conflict every group's files are deleted and the run fails (retried whole)."""
        if run is None:
            context.log.info("nothing new in the CDC table: nothing to commit")
            return
        iceberg = catalog.load()
        unfit = unfit_in_cdc_order([run.unfit_keys, *(m.unfit for m in groups)])
        job_ = Job.resume(iceberg, run.plan.spec.base_identifier, JobKind.UPDATE_DELETE, run.start)
        with job_:
            job_.adopt(f for m in groups for f in m.add)
            quarantine_changes(iceberg, run.plan.spec, unfit, run.plan.cdc_snapshot_id, run.plan.erasures)  # before base moves past these changes
            committed = commit_merge(job_, run.plan, groups, quarantined=unfit.num_rows)
        sync_merged_tag(iceberg, name)
        result = result_of(
            run.plan, groups, job_.table.metadata, committed.snapshot_id, run.changes_read, committed.attempts, quarantined=unfit.num_rows,
        )
        context.log.info(result.describe())

    @fanout_job(
        f"upsert_{name}_fanout",
        f"Upsert of cdc.{name} into base.{name}, one step per key group, then one commit: the scale-out "
        "form of the sync job's upsert (swap the executor for k8s_job_executor / celery_executor in production).",
        {"partfin/table": name},
        max_concurrent=max_concurrent,
    )
    def upsert_job():
        run, groups = plan()
        commit(run, groups.map(merge).collect())

    return upsert_job
