"""Upsert step 1, the plan: which CDC data files this run merges, read at one pinned snapshot of each table.

base.<table>'s `partfin.source-snapshot-id` is where the last run stopped; cdc.<table>'s current
snapshot is where this one stops. The CDC data files added in between (a manifest diff of the two
snapshots) are the changes to merge. If the recorded snapshot is gone (expired despite the tag, or
never merged) every live CDC file is re-merged, which is correct because the merge is idempotent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pyiceberg.catalog import Catalog
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table
from pyiceberg.table.snapshots import Snapshot
from pyiceberg.transforms import BucketTransform

from partfin_assets.iceberg.files import added_data_files, data_files
from partfin_assets.iceberg.history import recorded_watermark, snapshots_since, watermark_of
from partfin_assets.model import summary_keys as K
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.model.timeutil import iso_z

log = logging.getLogger(__name__)


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

    @property
    def cdc_snapshot(self) -> Snapshot:
        snapshot = self.cdc.current_snapshot()
        assert snapshot is not None
        return snapshot


def merged_source_snapshot_id(properties: dict[str, str]) -> int | None:
    """The CDC snapshot a base table has merged up to (`partfin.source-snapshot-id`)."""
    value = properties.get(K.PROP_SOURCE_SNAPSHOT_ID)
    return int(value) if value else None


def plan_upsert(catalog: Catalog, spec: TableSpec, base: Table) -> UpsertPlan | None:
    """The plan of one run against `base` (as read); None when there is no new CDC snapshot."""
    cdc = catalog.load_table(spec.cdc_identifier)
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
    partition = base.spec()
    buckets = None
    if partition.fields and isinstance(partition.fields[0].transform, BucketTransform):
        buckets = partition.fields[0].transform.num_buckets
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
    )
