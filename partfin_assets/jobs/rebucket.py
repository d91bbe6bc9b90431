"""Growing base.<table>'s bucket count: partition evolution from bucket(M, key) to bucket(N, key).

`partfin base rebucket --table T --buckets N` changes the partition spec (PyIceberg's
`update_spec`) and `partfin.base.buckets` in one commit and rewrites no data: files of the old
spec stay where they are and every reader keeps reading them (Iceberg plans each manifest with
its own spec). The upsert keeps finding old versions there and deletes them by position in their
old partitions, while new versions go to the new spec (jobs/upsert/merge.py); the next
compaction moves the old-spec files into the new layout (jobs/compaction.py).

N must be a multiple of M greater than M: Iceberg's bucket hash gives bucket(N) mod M ==
bucket(M) then, so the keys of one old bucket stay in one key group (`bucket mod M`,
jobs/upsert/plan.py `group_files`) and a group's old and new files are merged together.

Job kind (docs/concurrency.md): a MERGE of the table's layout. It reads no data, so data commits that land
between its start and its commit do not make it fail; it fails with CommitConflictError when the
partition spec (or `partfin.base.buckets`) changed since it started (another rebucket finished
first). Every UPDATE/DELETE or MERGE job that started before it and finishes after it fails
(its start spec is no longer the head's, jobs/conflicts.py) and is re-run by the one retry policy.
Its commit is a snapshot without files that carries the job id, so an unknown outcome is
resolved from the history like any other partfin commit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pyiceberg.catalog import Catalog
from pyiceberg.table import Table
from pyiceberg.transforms import BucketTransform

from partfin_assets.iceberg.catalog import load_existing_table
from partfin_assets.iceberg.row_delta import swap_files
from partfin_assets.jobs.job import Hook, Job
from partfin_assets.jobs.upsert.plan import bucket_count
from partfin_assets.model import summary_keys as K
from partfin_assets.model.errors import InvalidInput
from partfin_assets.model.summary_keys import JobKind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebucketResult:
    table: str
    buckets_before: int
    buckets_after: int
    spec_id: int
    snapshot_id: int | None
    job_id: str

    def describe(self) -> str:
        name = self.table.split(".", 1)[1]
        return (
            f"{self.table}: buckets {self.buckets_before} -> {self.buckets_after} (partition spec {self.spec_id}, "
            f"snapshot {self.snapshot_id}, job {self.job_id}); files of the old spec are read as they are and moved "
            f"into the new one by the next compaction (compact_{name})"
        )


def current_buckets(identifier: str, table: Table) -> int:
    """M of a partfin base table's `bucket(M, key)` spec; InvalidInput for any other table."""
    buckets = bucket_count(table.spec())
    if K.PROP_BASE_BUCKETS not in table.properties or buckets is None:
        raise InvalidInput(
            f"{identifier} is not a partfin base table partitioned bucket(N, key) "
            f"(no {K.PROP_BASE_BUCKETS} property, or another partitioning): nothing to rebucket"
        )
    return buckets


def check_bucket_growth(identifier: str, before: int, after: int) -> None:
    if after <= before or after % before:
        raise InvalidInput(
            f"{identifier}: --buckets {after} must be a multiple of {before} (the current count) greater than {before}, "
            f"e.g. {2 * before}: the keys of one old bucket must stay in one key group, and only for a multiple N of {before} "
            f"is bucket(N) mod {before} == bucket({before}), so that a key's old- and new-spec files are merged together"
        )


def rebucket(catalog: Catalog, name: str, buckets: int, *, job_id: str | None = None, before_commit: Hook | None = None) -> RebucketResult:
    """Evolve base.<name> from bucket(M, key) to bucket(`buckets`, key) in one commit (see the module docstring)."""
    identifier = f"base.{name}"
    table = load_existing_table(catalog, identifier, f"run `partfin upsert --table {name}` first")
    before = current_buckets(identifier, table)
    check_bucket_growth(identifier, before, buckets)
    field = table.spec().fields[0]
    key = table.schema().find_field(field.source_id).name
    with Job.start(catalog, identifier, JobKind.MERGE, job_id=job_id, before_commit=before_commit) as job:
        job.expect_properties({K.PROP_BASE_BUCKETS: table.properties[K.PROP_BASE_BUCKETS]})

        def stage(head: Table, tx, snapshot_summary: dict[str, str]) -> bool:
            with tx.update_spec() as update:  # asserts the default spec it replaces: a compare-and-set
                update.remove_field(field.name)
                update.add_field(key, BucketTransform(buckets), f"{key}_bucket_{buckets}")
            tx.set_properties({K.PROP_BASE_BUCKETS: str(buckets)})
            swap_files(tx, snapshot_summary, [], [])  # no files: the snapshot records the job in the history
            return True

        committed = job.commit(stage, summary={K.REBUCKET_FROM: str(before), K.REBUCKET_TO: str(buckets)})
    spec_id = catalog.load_table(identifier).metadata.default_spec_id
    result = RebucketResult(identifier, before, buckets, spec_id, committed.snapshot_id, job.job_id)
    log.info("%s", result.describe())
    return result
