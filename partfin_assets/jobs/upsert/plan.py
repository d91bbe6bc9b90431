"""Upsert step 1, the plan: which CDC data files this run merges, and base.<table>'s files by key group.

base.<table>'s `partfin.source-snapshot-id` is where the last run stopped; cdc.<table>'s current
snapshot is where this one stops. The CDC data files added in between (a manifest diff of the two
snapshots) are the changes to merge. If the recorded snapshot is gone (expired despite the tag, or
never merged) every live CDC file is re-merged, which is correct because the merge is idempotent.

base.<table> is partitioned `bucket(N, key)`; its live data and delete files at the job's start
snapshot are grouped by `bucket mod G`, G the smallest bucket count among the partition specs
that still have live files (bucket counts only ever double, so every file belongs to exactly one
group and a key's old versions can only be in its own group). Each group is merged on its own:
in turn in one process, or as one step each of a Dagster run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table
from pyiceberg.table.snapshots import Snapshot
from pyiceberg.partitioning import PartitionSpec
from pyiceberg.transforms import BucketTransform
from pyiceberg.typedef import Record

from partfin_assets.iceberg.erasures import load_erasures
from partfin_assets.iceberg.files import (
    added_data_files,
    data_files,
    partition_key_of,
    partition_path,
    position_delete_files,
    read_files,
)
from partfin_assets.iceberg.history import recorded_watermark, snapshots_since, watermark_of
from partfin_assets.model import summary_keys as K
from partfin_assets.model.erasure import Erasures, without_erased
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.model.timeutil import iso_z

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartitionFiles:
    """The live files of one partition (bucket) of base.<table> at the start snapshot."""

    spec_id: int
    partition: Record
    path: str  # as PyIceberg names it in summaries (`id_bucket=3`): the job's conflict target
    data: list[DataFile]
    deletes: list[DataFile]


@dataclass(frozen=True)
class GroupFiles:
    """The partitions of one key group (`bucket mod G`)."""

    group: int
    partitions: list[PartitionFiles]

    @property
    def paths(self) -> list[str]:
        return [p.path for p in self.partitions]


@dataclass(frozen=True)
class MergePosition:
    """What the commit needs from the plan; picklable, so a fanned-out run hands it from its plan step to its commit step."""

    spec: TableSpec
    cdc_snapshot_id: int  # merged up to
    previous_source_id: int | None
    merged_ids: list[int]
    full: bool
    watermark: str | None
    buckets: int | None
    groups: int
    erasures: Erasures  # what the changes were filtered with: the commit fails if a privacy request came after


@dataclass(frozen=True)
class UpsertPlan:
    spec: TableSpec
    base: Table  # base.<table> at the job's start snapshot: read from this
    cdc: Table  # cdc.<table> pinned at the snapshot this run merges up to
    previous_source_id: int | None  # the CDC snapshot base.<table> had merged up to
    merged_ids: list[int]  # CDC snapshots merged by this run, oldest first
    full: bool  # every live CDC file is re-merged (the previous position is gone)
    cdc_files: list[DataFile]  # the changes to merge
    watermark: str | None  # base watermark after this run: the merged CDC snapshot's, never moving back
    buckets: int | None  # bucket count of base's partition spec; None if unpartitioned
    groups: int = 1  # G: changes and files are grouped by bucket mod G
    layout: dict[int, GroupFiles] = field(default_factory=dict)  # base's live files by group (groups without files absent)
    erasures: Erasures | None = None  # the erasures in force when the plan was made (after the job's start)

    @property
    def cdc_snapshot(self) -> Snapshot:
        snapshot = self.cdc.current_snapshot()
        assert snapshot is not None
        return snapshot

    @property
    def position(self) -> MergePosition:
        return MergePosition(
            self.spec, self.cdc_snapshot.snapshot_id, self.previous_source_id, self.merged_ids, self.full,
            self.watermark, self.buckets, self.groups, self.erasures or Erasures(self.spec.primary_key),
        )

    def read_changes(self) -> tuple[pa.Table, int]:
        """The changes to merge, without those a privacy request erased; and how many were left out."""
        return without_erased(read_files(self.cdc, self.cdc_files), self.erasures or Erasures(self.spec.primary_key))


def merged_source_snapshot_id(properties: dict[str, str]) -> int | None:
    """The CDC snapshot a base table has merged up to (`partfin.source-snapshot-id`)."""
    value = properties.get(K.PROP_SOURCE_SNAPSHOT_ID)
    return int(value) if value else None


def plan_upsert(
    catalog: Catalog, spec: TableSpec, base: Table, *, max_groups: int | None = None, pin: Callable[[Table], Table] | None = None,
) -> UpsertPlan | None:
    """The plan of one run against `base` (as read); None when there is no new CDC snapshot.

    `pin` (the job's `Job.pin`) is told the cdc.<table> snapshot the run reads: should expiry remove it while the run
    reads it, the run is a conflict and re-runs from the then current head.
    """
    cdc = catalog.load_table(spec.cdc_identifier)
    if pin is not None:
        pin(cdc)
    current = cdc.current_snapshot()
    previous_id = merged_source_snapshot_id(base.properties)
    if current is None or current.snapshot_id == previous_id:
        return None
    metadata = cdc.metadata
    previous = metadata.snapshot_by_id(previous_id) if previous_id is not None else None
    files: list[DataFile] | None = None
    chain: list[Snapshot] | None = None
    if previous is not None and previous.sequence_number < current.sequence_number:
        # Where expiry cut the parent chain the tagged snapshot itself is kept, and on an
        # append-only table a file diff against it is still exact.
        chain = snapshots_since(metadata, previous_id, previous.sequence_number, complete=False)
        try:
            files = added_data_files(cdc, previous, current)
        except FileNotFoundError:
            log.warning("cdc.%s: manifests of snapshot %s are gone; re-merging everything", spec.name, previous_id)
    full = files is None
    if full:
        if previous_id is not None:
            log.warning(
                "cdc.%s: snapshot %s that base.%s merged up to is no longer in the lineage; full re-merge",
                spec.name, previous_id, spec.name,
            )
        chain = snapshots_since(metadata, None, complete=False)
        files = data_files(cdc, current)
    buckets = bucket_count(base.spec())
    groups, layout = group_files(base, max_groups)
    watermarks = [w for w in (watermark_of(base.properties), recorded_watermark(metadata)) if w is not None]
    return UpsertPlan(
        spec=spec,
        base=base,
        cdc=cdc,
        previous_source_id=previous_id,
        merged_ids=[s.snapshot_id for s in reversed(chain or [])],
        full=full,
        cdc_files=files,
        watermark=iso_z(max(watermarks)) if watermarks else None,
        buckets=buckets,
        groups=groups,
        layout=layout,
        erasures=load_erasures(catalog, spec),  # read after the job's start: a request fenced before it is in
    )


def bucket_count(spec: PartitionSpec) -> int | None:
    """N of a `bucket(N, key)` spec; None for any other spec."""
    if len(spec.fields) == 1 and isinstance(spec.fields[0].transform, BucketTransform):
        return spec.fields[0].transform.num_buckets
    return None


def group_files(base: Table, max_groups: int | None = None) -> tuple[int, dict[int, GroupFiles]]:
    """G and base's live files (data and deletes) by group, at the table's current (pinned) snapshot.

    `max_groups` caps G at its largest divisor not above the cap (a group then holds several buckets):
    the number of steps of a fanned-out run, each worth its start-up cost.
    """
    metadata = base.metadata
    snapshot = base.current_snapshot()
    files = data_files(base, snapshot) + position_delete_files(base, snapshot)
    specs = metadata.specs()
    counts = {bucket_count(specs[partition_key_of(metadata, f)[0]]) for f in files} | {bucket_count(metadata.spec())}
    if None in counts or any(c % min(counts) for c in counts):  # type: ignore[operator]
        groups = 1  # unpartitioned, or buckets that do not nest: one group holds everything
    else:
        groups = min(counts)  # type: ignore[type-var]
    if max_groups is not None and groups > max_groups:
        groups = max(d for d in range(1, max_groups + 1) if groups % d == 0)
    partitions: dict[tuple, PartitionFiles] = {}
    for data_file in files:
        key = partition_key_of(metadata, data_file)
        if key not in partitions:
            partitions[key] = PartitionFiles(key[0], data_file.partition, partition_path(metadata, data_file), [], [])
        (partitions[key].deletes if data_file.content else partitions[key].data).append(data_file)
    layout: dict[int, GroupFiles] = {}
    for (_, values), part in sorted(partitions.items(), key=lambda kv: (kv[0][0], kv[1].path)):
        group = values[0] % groups if groups > 1 else 0
        layout.setdefault(group, GroupFiles(group, [])).partitions.append(part)
    return groups, layout
