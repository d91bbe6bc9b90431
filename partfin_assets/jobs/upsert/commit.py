"""Upsert step 4, commit: one UPDATE/DELETE job commit on base.<table>, then the merged-position tag.

One overwrite snapshot removes the old files of the rewritten buckets, adds the new ones, and
sets `partfin.source-table`, `partfin.source-snapshot-id` and `partfin.watermark` (the watermark
of the merged CDC snapshot) as table properties and summary entries: data, position and
completeness signal in one atomic commit.

As a `Job` the upsert follows the conflict matrix (DESIGN §6): it fails with
`CommitConflictError` when a commit after its start touched a bucket it read or rewrites, or when
another upsert moved `partfin.source-snapshot-id` meanwhile (a compare-and-set on the position);
commits to other buckets (a privacy delete, a compaction) only cost a rebuild on the fresh head.
"""

from __future__ import annotations

import logging

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.manifest import DataFile

from partfin_assets.iceberg.files import partition_path_of_values
from partfin_assets.jobs.job import Job, JobResult
from partfin_assets.jobs.upsert.merge import Merge
from partfin_assets.jobs.upsert.plan import UpsertPlan, merged_source_snapshot_id
from partfin_assets.model import summary_keys as K
from partfin_assets.model.stats import compact_json

log = logging.getLogger(__name__)


def commit_merge(job: Job, plan: UpsertPlan, merge: Merge, new_files: list[DataFile], *, quarantined: int = 0) -> JobResult:
    """Commit the merge as `job` (started on base.<table> at the plan's snapshot); conflicts raise."""
    position = {K.PROP_SOURCE_TABLE: plan.spec.cdc_identifier, K.PROP_SOURCE_SNAPSHOT_ID: str(plan.cdc_snapshot.snapshot_id)}
    summary = {
        **position,
        K.UPSERT_CDC_SNAPSHOTS: str(len(plan.merged_ids)),
        K.UPSERT_INSERTED: str(merge.inserted),
        K.UPSERT_UPDATED: str(merge.updated),
        K.UPSERT_DELETED: str(merge.deleted),
        K.UPSERT_STALE: str(merge.stale),
        K.UPSERT_HOURS: compact_json(merge.hours),
    }
    if quarantined:
        summary[K.UPSERT_QUARANTINED] = str(quarantined)
    properties = dict(position)
    if plan.watermark:
        summary[K.WATERMARK] = plan.watermark
        properties[K.PROP_WATERMARK] = plan.watermark
    previous = plan.previous_source_id
    job.expect_properties({K.PROP_SOURCE_SNAPSHOT_ID: str(previous) if previous is not None else None})
    job.target(partition_path_of_values(job.table.metadata, [bucket]) for bucket in merge.read_buckets)
    return job.commit_replace(merge.remove, new_files, summary, properties=properties)


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
        try:
            with cdc.manage_snapshots() as manage:
                manage.create_tag(target, K.MERGED_TAG)
            return target
        except CommitFailedException:
            continue  # a CDC checkpoint landed meanwhile: reload and retry
    log.warning("cdc.%s: could not move tag %s after %d attempts", name, K.MERGED_TAG, max_attempts)
    return None
