"""Upsert step 4, commit: one UPDATE/DELETE job commit on base.<table> for every group, then the merged-position tag.

One snapshot adds the groups' new data files and delete files, removes the delete files they
replace and the data files they folded, and sets `partfin.source-table`,
`partfin.source-snapshot-id` and `partfin.watermark` (the watermark of the merged CDC snapshot)
as table properties and summary entries: data, position and completeness signal in one atomic
commit.

As a `Job` the upsert follows the conflict matrix (docs/concurrency.md): it fails with
`CommitConflictError` when a commit after its start touched a bucket it read or writes, or when
another upsert moved `partfin.source-snapshot-id` meanwhile (a compare-and-set on the position);
commits to other buckets (a privacy delete, a compaction) only cost a rebuild on the fresh head.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException

from partfin_assets.iceberg.files import partition_path_of_values
from partfin_assets.jobs.job import Job, JobResult
from partfin_assets.jobs.upsert.merge import GroupMerge
from partfin_assets.jobs.upsert.plan import MergePosition, merged_source_snapshot_id
from partfin_assets.model import summary_keys as K
from partfin_assets.model.faults import faults
from partfin_assets.model.stats import compact_json
from partfin_assets.model.timeutil import iso_z

log = logging.getLogger(__name__)


def commit_merge(
    job: Job, plan: MergePosition, merges: Iterable[GroupMerge], *, quarantined: int = 0,
) -> JobResult:
    """Commit the groups' merges as `job` (started on base.<table> at the plan's snapshot); conflicts raise."""
    merges = list(merges)
    position = {K.PROP_SOURCE_TABLE: plan.spec.cdc_identifier, K.PROP_SOURCE_SNAPSHOT_ID: str(plan.cdc_snapshot_id)}
    hours = sorted({h for m in merges for h in m.hours_us})
    summary = {
        **position,
        K.UPSERT_CDC_SNAPSHOTS: str(len(plan.merged_ids)),
        K.UPSERT_INSERTED: str(sum(m.inserted for m in merges)),
        K.UPSERT_UPDATED: str(sum(m.updated for m in merges)),
        K.UPSERT_DELETED: str(sum(m.deleted for m in merges)),
        K.UPSERT_STALE: str(sum(m.stale for m in merges)),
        K.UPSERT_HOURS: compact_json([iso_z(h) for h in hours]),
    }
    if quarantined:
        summary[K.UPSERT_QUARANTINED] = str(quarantined)
    properties = dict(position)
    if plan.watermark:
        summary[K.WATERMARK] = plan.watermark
        properties[K.PROP_WATERMARK] = plan.watermark
    previous = plan.previous_source_id
    job.expect_properties({K.PROP_SOURCE_SNAPSHOT_ID: str(previous) if previous is not None else None})
    job.expect_erasures(plan.erasures.version)  # a privacy request registered since the plan: run again, filtering it
    for merge in merges:
        job.target(merge.targets)
    groups = {m.group for m in merges if m.decoded}  # groups with a change to merge
    if plan.buckets is not None:  # a group's buckets with no file yet: a concurrent first write there conflicts too
        job.target(
            partition_path_of_values(job.table.metadata, [bucket])
            for bucket in range(plan.buckets)
            if bucket % plan.groups in groups
        )
    remove = [f for m in merges for f in m.remove]
    add = [f for m in merges for f in m.add]
    return job.commit_replace(remove, add, summary, properties=properties)


def sync_merged_tag(catalog: Catalog, name: str, *, max_attempts: int = 10) -> int | None:
    """Point the `partfin-base-merged` tag of cdc.<name> at the snapshot base.<name> merged up to.

    Expiry never removes a tagged snapshot, so the next run can diff from it. A crash
    between the base commit and this call is repaired by the next run (it calls this too).
    """
    for _ in range(max_attempts):
        target = merged_source_snapshot_id(catalog.load_table(f"base.{name}").properties)
        cdc = catalog.load_table(f"cdc.{name}")
        ref = cdc.metadata.refs.get(K.MERGED_TAG)
        if target is None or (ref is not None and ref.snapshot_id == target):
            return target
        if cdc.metadata.snapshot_by_id(target) is None:
            log.warning("cdc.%s: merged snapshot %s already expired; not tagged", name, target)
            return None
        faults().pause_point("merged-tag-commit")
        try:
            with cdc.manage_snapshots() as manage:
                manage.create_tag(target, K.MERGED_TAG)
            return target
        except CommitFailedException:
            continue  # a CDC checkpoint landed meanwhile: reload and retry
    log.warning("cdc.%s: could not move tag %s after %d attempts", name, K.MERGED_TAG, max_attempts)
    return None
