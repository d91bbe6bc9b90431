"""`compact_<table>_fanout`: compaction of base.<table> as one Dagster run, one step per group of buckets, then one commit step.

plan (the buckets to rewrite at the job's start snapshot: those with delete files or enough small
files, jobs/compaction.py) -> one `rewrite_<table>` step per group of buckets (their rows, deletes
applied, sorted by key, into new files; not committed) -> `commit_compaction_<table>` (one MERGE
commit of every group's files: the conflict matrix of `compact_<table>`). Steps hand each other
picklable values through the run's IO manager and write files to the table's storage, so the job
runs on `multiprocess_executor` here and on `k8s_job_executor` / `celery_executor` with an
object-store warehouse in production, like `upsert_<table>_fanout`.

A lost race (CommitConflictError) fails the commit step, which deletes every group's files; the
run is retried whole from a fresh plan (`dagster/retry_strategy: ALL_STEPS`).
"""

from dataclasses import dataclass

from dagster import Config, DynamicOut, DynamicOutput, OpExecutionContext, op

from partfin_assets.defs.platform.fanout import DEFAULT_MAX_GROUPS, fanout_job
from partfin_assets.defs.resources import IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable
from partfin_assets.iceberg.catalog import load_table_if_exists
from partfin_assets.jobs.compaction import (
    DEFAULT_TARGET_FILE_SIZE,
    CompactionPlan,
    RewrittenPartition,
    commit_compaction,
    plan_compaction_job,
    rewrite_partition,
)
from partfin_assets.jobs.job import Job, StagedFiles
from partfin_assets.model.summary_keys import JobKind


class CompactionFanoutConfig(Config):
    max_groups: int = DEFAULT_MAX_GROUPS  # rewrite steps per run at most
    target_file_size_bytes: int = DEFAULT_TARGET_FILE_SIZE
    min_input_files: int = 2  # a bucket without delete files is rewritten when it has at least this many small files


@dataclass(frozen=True)
class RewriteTask:
    """One step's share: the plan (for the job's start and settings) and the indexes of its partitions in it."""

    plan: CompactionPlan
    indexes: list[int]


def build_compaction_fanout_job(table: PartfinTable, *, max_concurrent: int = 2):
    name = table.name
    identifier = f"base.{name}"

    @op(name=f"plan_compaction_{name}", out=DynamicOut(RewriteTask), tags={"kind": "iceberg"})
    def plan(context: OpExecutionContext, config: CompactionFanoutConfig, catalog: IcebergCatalogResource):
        """The buckets to rewrite at one snapshot, one output per group of them."""
        iceberg = catalog.load()
        if load_table_if_exists(iceberg, identifier) is None:
            context.log.info(f"{identifier} does not exist yet: nothing to compact")
            return
        job_ = Job.start(iceberg, identifier, JobKind.MERGE, job_id=f"dagster-{context.run_id}-{identifier}")
        compaction = plan_compaction_job(
            job_, target_file_size_bytes=config.target_file_size_bytes, min_input_files=config.min_input_files, finalized_only=True,
        )
        groups = min(config.max_groups, len(compaction.rewrites))
        context.log.info(f"{identifier}: {len(compaction.rewrites)} bucket(s) to rewrite in {groups} step(s)")
        for group in range(groups):
            yield DynamicOutput(RewriteTask(compaction, list(range(group, len(compaction.rewrites), groups))), mapping_key=f"group_{group}")

    @op(name=f"rewrite_{name}", tags={"kind": "iceberg"})
    def rewrite(context: OpExecutionContext, catalog: IcebergCatalogResource, task: RewriteTask) -> tuple[CompactionPlan, list[RewrittenPartition]]:
        """Rewrite this group's buckets (files written, not committed: the commit step commits or deletes them)."""
        base = catalog.load().load_table(identifier)
        staged = StagedFiles(base)
        compaction = task.plan
        try:
            out = [rewrite_partition(base, compaction.rewrites[i], staged, compaction.sort_by, compaction.target_file_size_bytes) for i in task.indexes]
        except BaseException:
            staged.discard()
            raise
        context.log.info(f"rewrote {', '.join(r.stats.partition for r in out)}: {sum(r.stats.records for r in out)} record(s)")
        return compaction, out

    @op(name=f"commit_compaction_{name}", tags={"kind": "iceberg"})
    def commit(context: OpExecutionContext, catalog: IcebergCatalogResource, groups: list[tuple[CompactionPlan, list[RewrittenPartition]]]) -> None:
        """One MERGE commit of every group's files; on a conflict they are all deleted and the run fails (retried whole)."""
        if not groups:
            context.log.info(f"{identifier}: nothing to compact")
            return
        compaction = groups[0][0]  # every group carries the same plan
        job_ = Job.resume(catalog.load(), identifier, JobKind.MERGE, compaction.start)
        rewritten = [r for _, group in groups for r in group]
        with job_:
            job_.adopt(f for r in rewritten for f in r.added)
            result = commit_compaction(job_, compaction, rewritten)
        context.log.info(result.describe())

    @fanout_job(
        f"compact_{name}_fanout",
        f"Compaction of base.{name}, one step per group of buckets, then one MERGE commit: the scale-out "
        f"form of compact_{name}'s base step (swap the executor for k8s_job_executor / celery_executor in production).",
        {"partfin/table": name, "partfin/maintenance": name},
        max_concurrent=max_concurrent,
    )
    def compaction_job():
        commit(plan().map(rewrite).collect())

    return compaction_job
