"""The base-table upsert: merge new CDC snapshots into base.<table>, last writer wins.

One run:

1. **Plan** (read side, pinned): load base.<table> and cdc.<table>; the base
   table's `partfin.source-snapshot-id` is where the last run stopped, the CDC
   table's current snapshot is where this one stops. The CDC data files added
   in between (a manifest diff of the two snapshots) are the changes to merge;
   if the recorded snapshot is gone (expired despite the tag, or never merged)
   every live CDC file is re-merged, which is correct because the merge is
   idempotent.
2. **Decode**: keys and payloads are decoded into the declared typed columns
   (jobs/upsert/payload.py). Any change that does not fit aborts the run before
   anything is written.
3. **Merge** (polars, vectorized): the changes are reduced to one winner per
   primary key by (event time, source position), then joined with the rows of
   the base buckets they touch; a change replaces a base row only when it is
   strictly newer. Deletes become tombstones (`_deleted`), so an older update
   arriving later cannot resurrect the row.
4. **Write** the rewritten buckets as new data files.
5. **Commit** one overwrite snapshot on base.<table>: remove the old files of
   the rewritten buckets, add the new ones, and set `partfin.source-table`,
   `partfin.source-snapshot-id` and `partfin.watermark` (the watermark of the
   merged CDC snapshot) as table properties and summary entries: data,
   position and completeness signal in one atomic commit.
6. **Tag** the merged CDC snapshot (`partfin-base-merged`) so snapshot expiry
   keeps the next run's starting point.

The upsert is an UPDATE/DELETE job: if base.<table> changed after step 1, the
commit is not retried on top of the newer table; the whole run is recomputed
from fresh data (a lost compare-and-set is detected in `build`). The plan keeps
the start snapshot and the buckets read, which is what a per-partition conflict
check (DESIGN §6) needs.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.expressions import AlwaysTrue
from pyiceberg.io.pyarrow import ArrowScan, _dataframe_to_data_files
from pyiceberg.manifest import DataFile, ManifestContent
from pyiceberg.table import FileScanTask, Table
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Snapshot, ancestors_of
from pyiceberg.transforms import BucketTransform

from partfin_assets.iceberg.catalog import load_existing_table
from partfin_assets.iceberg.commit import commit_with_retry, new_transaction, snapshot_summary_with_commit_id
from partfin_assets.iceberg.files import delete_files, partition_path, partition_path_of_values
from partfin_assets.iceberg.history import summary_of
from partfin_assets.iceberg.tables import DELETED, EVENT_TIME, META_COLUMNS, SOURCE_SEQ, base_columns, ensure_base_table
from partfin_assets.jobs.conflicts import find_conflict
from partfin_assets.jobs.upsert.payload import UpsertPayloadError, decode_columns
from partfin_assets.model import summary_keys as K
from partfin_assets.model.stats import compact_json
from partfin_assets.model.summary_keys import JobKind
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.model.timeutil import US_PER_HOUR, iso_z, parse_iso, to_us
from partfin_assets.testing.faults import crash_point

log = logging.getLogger(__name__)


__all__ = [
    "UpsertPayloadError",
    "UpsertResult",
    "UpsertConflict",
    "run_upsert",
]


MERGED_TAG = "partfin-base-merged"  # on cdc.<table>: the snapshot base.<table> merged up to


# Snapshot-summary entries of an upsert commit (beyond DESIGN §4; documented in the README).
SUMMARY_CDC_SNAPSHOTS = "partfin.upsert.cdc-snapshots"
SUMMARY_INSERTED = "partfin.upsert.inserted"
SUMMARY_UPDATED = "partfin.upsert.updated"
SUMMARY_DELETED = "partfin.upsert.deleted"
SUMMARY_STALE = "partfin.upsert.stale"
SUMMARY_HOURS = "partfin.upsert.hours-touched"

_OPS_UPSERT = ("c", "u", "r")
_OP_DELETE = "d"
_IN_BASE = "__in_base"
_IN_CHANGE = "__in_change"
_CHG = "__chg"

CrashHook = Callable[[str], None]


class UpsertConflict(RuntimeError):
    """base.<table> kept changing under the upsert; every recomputed attempt lost the race."""


class _BaseMoved(Exception):
    """base.<table> changed after the plan read it: recompute from fresh data."""


# --------------------------------------------------------------------------- result


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
    buckets_rewritten: int = 0
    files_removed: int = 0
    files_added: int = 0
    previous_cdc_snapshot_id: int | None = None
    attempts: int = 1

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
            f"  changes read: {self.changes_read} (stale, ignored: {self.stale})",
            f"  rows: {self.inserted} inserted, {self.updated} updated, {self.deleted} deleted",
            f"  base snapshot: {self.base_snapshot_id} "
            f"({self.buckets_rewritten} bucket(s) rewritten: {self.files_removed} file(s) out, {self.files_added} in)",
            f"  base watermark: {self.watermark or '-'}",
            f"  hours touched: {hours}",
        ]
        return "\n".join(lines)


@dataclass
class _Plan:
    spec: TableSpec
    base: Table  # as read
    base_snapshot_id: int | None  # the start snapshot: the commit requires main to still be here
    previous_source_id: int | None
    cdc_metadata: TableMetadata
    cdc_snapshot: Snapshot
    merged_ids: list[int]  # oldest first
    full: bool
    cdc_files: list[DataFile]
    watermark: str | None  # new base watermark
    buckets: int | None  # bucket count of the base partition spec, None if unpartitioned
    read_buckets: set[int] = field(default_factory=set)  # filled by the merge: for a per-partition conflict check


def _source_snapshot_id(properties: dict[str, str]) -> int | None:
    value = properties.get(K.PROP_SOURCE_SNAPSHOT_ID)
    return int(value) if value else None


def _cdc_watermark(metadata: TableMetadata, snapshot: Snapshot) -> str | None:
    """The watermark recorded by the merged CDC snapshot (or its nearest ancestor that recorded one)."""
    for ancestor in ancestors_of(snapshot, metadata):
        value = summary_of(ancestor).get(K.WATERMARK)
        if value:
            return value
    return None


def _max_watermark(a: str | None, b: str | None) -> str | None:
    values = [v for v in (a, b) if v]
    if not values:
        return None
    return iso_z(max(to_us(parse_iso(v)) for v in values))


def _live_data_files(snapshot: Snapshot, io, skip_manifests: set[str] = frozenset()) -> dict[str, DataFile]:
    files: dict[str, DataFile] = {}
    for manifest in snapshot.manifests(io):
        if manifest.manifest_path in skip_manifests:
            continue
        if manifest.content != ManifestContent.DATA:
            raise NotImplementedError(f"{manifest.manifest_path}: delete files in a CDC table are not supported")
        for entry in manifest.fetch_manifest_entry(io, discard_deleted=True):
            files[entry.data_file.file_path] = entry.data_file
    return files


def _new_cdc_files(cdc: Table, previous: Snapshot, current: Snapshot) -> list[DataFile]:
    """Data files live at `current` but not at `previous` (manifests shared by both are skipped)."""
    prev_manifests = {m.manifest_path for m in previous.manifests(cdc.io)}
    cur_manifests = {m.manifest_path for m in current.manifests(cdc.io)}
    added = _live_data_files(current, cdc.io, prev_manifests & cur_manifests)
    if added:
        gone = _live_data_files(previous, cdc.io, prev_manifests & cur_manifests)
        for path in gone:
            added.pop(path, None)
    return list(added.values())


def _plan(catalog: Catalog, spec: TableSpec) -> _Plan | None:
    base = catalog.load_table(spec.base_identifier)
    cdc = catalog.load_table(spec.cdc_identifier)
    current = cdc.current_snapshot()
    previous_id = _source_snapshot_id(base.properties)
    if current is None or current.snapshot_id == previous_id:
        return None
    metadata = cdc.metadata
    chain: list[Snapshot] = []
    reached = False
    for snapshot in ancestors_of(current, metadata):
        if snapshot.snapshot_id == previous_id:
            reached = True
            break
        chain.append(snapshot)
    previous = metadata.snapshot_by_id(previous_id) if previous_id is not None else None
    if not reached and previous is not None and previous.sequence_number < current.sequence_number:
        # Expiry cut the parent chain between the tagged snapshot and now; the tagged snapshot
        # itself is kept, and on an append-only table a file diff against it is still exact.
        reached = True
        chain = [s for s in chain if s.sequence_number > previous.sequence_number]
    chain.reverse()
    files: list[DataFile] | None = None
    if reached and previous is not None:
        try:
            files = _new_cdc_files(cdc, previous, current)
        except FileNotFoundError:
            log.warning("cdc.%s: manifests of snapshot %s are gone; re-merging everything", spec.name, previous_id)
    full = files is None
    if full:
        if previous_id is not None:
            log.warning(
                "cdc.%s: snapshot %s that base.%s merged up to is no longer in the lineage; full re-merge",
                spec.name, previous_id, spec.name,
            )
        files = list(_live_data_files(current, cdc.io).values())
    partition = base.spec()
    buckets = None
    if partition.fields and isinstance(partition.fields[0].transform, BucketTransform):
        buckets = partition.fields[0].transform.num_buckets
    return _Plan(
        spec=spec,
        base=base,
        base_snapshot_id=base.metadata.current_snapshot_id,
        previous_source_id=previous_id,
        cdc_metadata=metadata,
        cdc_snapshot=current,
        merged_ids=[s.snapshot_id for s in chain],
        full=full,
        cdc_files=files,
        watermark=_max_watermark(base.properties.get(K.PROP_WATERMARK), _cdc_watermark(metadata, current)),
        buckets=buckets,
    )


# --------------------------------------------------------------------------- decode


def _read_files(metadata: TableMetadata, io, files: Iterable[DataFile]) -> pa.Table:
    tasks = [FileScanTask(f) for f in files]
    return ArrowScan(metadata, io, metadata.schema(), AlwaysTrue()).to_table(tasks)


def _decode_changes(spec: TableSpec, raw: pa.Table) -> pl.DataFrame:
    """CDC rows -> typed change rows: declared columns + _event_time, _source_seq, _deleted (not yet deduplicated)."""
    columns = base_columns(spec)
    pk = list(spec.primary_key)
    frame = pl.from_arrow(raw.select(["key", "op", "event_time", "source_seq", "payload"]))
    assert isinstance(frame, pl.DataFrame)
    bad_op = frame.filter(~pl.col("op").is_in([*_OPS_UPSERT, _OP_DELETE]))
    if bad_op.height:
        raise UpsertPayloadError(spec.name, bad_op["key"][0], "op", f"unknown CDC operation {bad_op['op'][0]!r}")
    keys = raw.column("key")
    key_values = pl.from_arrow(decode_columns(spec.name, keys, keys, {c: columns[c] for c in pk}, pk))
    is_delete = frame.get_column("op") == _OP_DELETE
    upsert_mask = pa.array((~is_delete).to_arrow())
    upsert_keys = pc.filter(keys, upsert_mask)
    values = pl.from_arrow(decode_columns(spec.name, upsert_keys, pc.filter(raw.column("payload"), upsert_mask), columns, pk))
    assert isinstance(values, pl.DataFrame) and isinstance(key_values, pl.DataFrame)
    # The after-image must describe the row its key names.
    upsert_key_values = key_values.filter(~is_delete)
    for c in pk:
        differs = values.get_column(c).ne_missing(upsert_key_values.get_column(c))
        if differs.any():
            index = int(differs.arg_true()[0])
            raise UpsertPayloadError(
                spec.name, upsert_keys[index].as_py(), c,
                f"payload value {values.get_column(c)[index]!r} disagrees with the change key",
            )
    meta = frame.select(
        pl.col("event_time").alias(EVENT_TIME),
        pl.col("source_seq").alias(SOURCE_SEQ),
        (pl.col("op") == _OP_DELETE).alias(DELETED),
        pl.col("op"),
        pl.col("payload"),
    )
    upserts = pl.concat([values, meta.filter(~is_delete)], how="horizontal")
    deletes = pl.concat([key_values.filter(is_delete), meta.filter(is_delete)], how="horizontal")
    empty = pl.DataFrame(schema={**{c: pl.from_arrow(pa.array([], t)).dtype for c, t in columns.items()}, **meta.schema})
    return pl.concat([empty, upserts, deletes], how="diagonal_relaxed")


def _winners(spec: TableSpec, changes: pl.DataFrame) -> pl.DataFrame:
    """One change per primary key: the newest by (event time, source position).

    (event time, source position) identifies a change, so ties are re-deliveries of the same change;
    op and payload only make the choice deterministic should a source ever repeat a position.
    """
    ordered = changes.sort([EVENT_TIME, SOURCE_SEQ, "op", "payload"], nulls_last=False)
    return ordered.unique(subset=list(spec.primary_key), keep="last", maintain_order=False).drop(["op", "payload"])


# --------------------------------------------------------------------------- merge


@dataclass
class _Merge:
    rows: pa.Table | None  # the rewritten buckets (None: no change)
    remove: list[DataFile]
    inserted: int
    updated: int
    deleted: int
    stale: int
    hours: list[str]
    buckets_rewritten: int


def _bucket_ids(plan: _Plan, values: pl.Series) -> pl.Series:
    assert plan.buckets is not None
    field_ = plan.base.spec().fields[0]
    source_type = plan.base.schema().find_field(field_.source_id).field_type
    bucket = BucketTransform(plan.buckets).pyarrow_transform(source_type)
    arrow = values.to_arrow()
    if pa.types.is_large_string(arrow.type):
        arrow = arrow.cast(pa.string())
    return pl.Series("bucket", bucket(arrow)).cast(pl.Int64)


def _base_files(plan: _Plan) -> list[tuple[DataFile, int | None]]:
    snapshot = plan.base.current_snapshot()
    if snapshot is None:
        return []
    spec_id = plan.base.spec().spec_id
    out = []
    for manifest in snapshot.manifests(plan.base.io):
        if manifest.content != ManifestContent.DATA:
            raise NotImplementedError(f"{plan.spec.base_identifier}: delete files are not supported")
        for entry in manifest.fetch_manifest_entry(plan.base.io, discard_deleted=True):
            data_file = entry.data_file
            bucket = data_file.partition[0] if plan.buckets is not None and data_file.spec_id == spec_id else None
            out.append((data_file, bucket))
    return out


def _merge(plan: _Plan, winners: pl.DataFrame) -> _Merge:
    spec = plan.spec
    pk = list(spec.primary_key)
    columns = base_columns(spec)
    first_pk = pk[0] if plan.buckets is not None else None
    base_partition_field = plan.base.spec().fields[0] if plan.buckets is not None else None
    if base_partition_field is not None:
        first_pk = plan.base.schema().find_field(base_partition_field.source_id).name

    files = _base_files(plan)
    if first_pk is not None:
        winners = winners.with_columns(_bucket_ids(plan, winners.get_column(first_pk)).alias("__bucket"))
        touched = set(winners.get_column("__bucket").unique().to_list())
        # A file of another spec (None) is always read: its rows may belong anywhere.
        read = [(f, b) for f, b in files if b is None or b in touched]
    else:
        touched = set()
        read = files
    plan.read_buckets = touched

    base_rows = _read_files(plan.base.metadata, plan.base.io, [f for f, _ in read])
    base_frame = pl.from_arrow(base_rows) if base_rows.num_rows else None
    if base_frame is None:
        base_frame = pl.DataFrame(schema=pl.from_arrow(plan.base.schema().as_arrow().empty_table()).schema)
    assert isinstance(base_frame, pl.DataFrame)
    value_columns = [c for c in columns if c not in pk] + list(META_COLUMNS)

    change_side = winners.select([*pk, *value_columns]).with_columns(pl.lit(True).alias(_IN_CHANGE))
    base_side = base_frame.select([*pk, *value_columns]).with_columns(pl.lit(True).alias(_IN_BASE))
    # Align key dtypes (e.g. base decimal vs decoded decimal) before joining.
    change_side = change_side.cast({c: base_side.schema[c] for c in pk})
    joined = base_side.join(change_side, on=pk, how="full", coalesce=True, suffix=_CHG)
    in_base = pl.col(_IN_BASE).fill_null(False)
    in_change = pl.col(_IN_CHANGE).fill_null(False)
    newer = (pl.col(EVENT_TIME + _CHG) > pl.col(EVENT_TIME)) | (
        (pl.col(EVENT_TIME + _CHG) == pl.col(EVENT_TIME)) & (pl.col(SOURCE_SEQ + _CHG) > pl.col(SOURCE_SEQ))
    )
    take = in_change & (~in_base | newer.fill_null(False))
    base_live = in_base & ~pl.col(DELETED).fill_null(True)
    change_delete = pl.col(DELETED + _CHG).fill_null(False)
    joined = joined.with_columns(
        take.alias("__take"),
        base_live.alias("__base_live"),
        change_delete.alias("__change_delete"),
        in_change.alias("__in_change"),
    )
    counts = joined.select(
        (pl.col("__take") & ~pl.col("__change_delete") & ~pl.col("__base_live")).sum().alias("inserted"),
        (pl.col("__take") & ~pl.col("__change_delete") & pl.col("__base_live")).sum().alias("updated"),
        (pl.col("__take") & pl.col("__change_delete") & pl.col("__base_live")).sum().alias("deleted"),
        (pl.col("__in_change") & ~pl.col("__take")).sum().alias("stale"),
        pl.col("__take").sum().alias("taken"),
    ).row(0, named=True)
    if counts["taken"] == 0:
        return _Merge(None, [], 0, 0, 0, counts["stale"], [], 0)

    # Hours whose visible rows changed: where rows appeared/changed (new) and where they left (old).
    new_hours = joined.filter(pl.col("__take") & ~pl.col("__change_delete")).get_column(EVENT_TIME + _CHG)
    old_hours = joined.filter(pl.col("__take") & pl.col("__base_live")).get_column(EVENT_TIME)
    hour_us = pl.concat([new_hours, old_hours]).dt.epoch("us") // US_PER_HOUR * US_PER_HOUR
    hours = [iso_z(int(h)) for h in hour_us.unique().sort().to_list()]

    merged = joined.select(
        *pk,
        *[pl.when(pl.col("__take")).then(pl.col(c + _CHG)).otherwise(pl.col(c)).alias(c) for c in value_columns],
        pl.col("__take"),
    )
    remove = [f for f, _ in read]
    if first_pk is not None:
        merged = merged.with_columns(_bucket_ids(plan, merged.get_column(first_pk)).alias("__bucket"))
        rewrite = set(merged.filter(pl.col("__take")).get_column("__bucket").unique().to_list())
        merged = merged.filter(pl.col("__bucket").is_in(list(rewrite)))
        remove = [f for f, b in read if b is None or b in rewrite]
        buckets_rewritten = len(rewrite)
    else:
        buckets_rewritten = 1
    schema = plan.base.schema().as_arrow()
    rows = merged.select(schema.names).to_arrow().cast(schema)
    return _Merge(rows, remove, counts["inserted"], counts["updated"], counts["deleted"], counts["stale"], hours, buckets_rewritten)


# --------------------------------------------------------------------------- run


def _crash(phase: str, hook: CrashHook | None) -> None:
    if hook is not None:
        hook(phase)
    crash_point(f"upsert-{phase}")


def run_upsert(catalog: Catalog, name: str, *, crash_hook: CrashHook | None = None, max_attempts: int = 10) -> UpsertResult:
    """One incremental merge of cdc.<name> into base.<name>; see the module docstring."""
    cdc = load_existing_table(catalog, f"cdc.{name}", "ingest into it first (partfin ingest)")
    spec = TableSpec.from_properties(name, cdc.properties)
    ensure_base_table(catalog, spec)
    for attempt in range(1, max_attempts + 1):
        try:
            return _run_once(catalog, spec, crash_hook, attempt)
        except _BaseMoved:
            log.info("base.%s changed while the upsert ran (attempt %d); recomputing from fresh data", name, attempt)
    raise UpsertConflict(f"base.{name}: changed under the upsert {max_attempts} times in a row; giving up")


def _target_partitions(plan: _Plan, merge: _Merge, data_files: list[DataFile]) -> set[str]:
    """The base partitions this run read or rewrites (the per-partition conflict check's targets)."""
    metadata = plan.base.metadata
    out = {partition_path(metadata, f) for f in [*merge.remove, *data_files]}
    out |= {partition_path_of_values(metadata, [b]) for b in plan.read_buckets}
    return out


def _run_once(catalog: Catalog, spec: TableSpec, crash_hook: CrashHook | None, attempt: int) -> UpsertResult:
    plan = _plan(catalog, spec)
    if plan is None:
        base = catalog.load_table(spec.base_identifier)
        source_id = _source_snapshot_id(base.properties)
        sync_merged_tag(catalog, spec.name)
        return UpsertResult(
            table=spec.name, cdc_snapshot_ids_merged=[], cdc_snapshot_id=source_id, base_snapshot_id=None,
            inserted=0, updated=0, deleted=0, watermark=base.properties.get(K.PROP_WATERMARK), hours_touched=[],
            previous_cdc_snapshot_id=source_id, attempts=attempt,
        )
    cdc_table = catalog.load_table(spec.cdc_identifier)
    raw = _read_files(plan.cdc_metadata, cdc_table.io, plan.cdc_files)
    changes = _decode_changes(spec, raw)
    merge = _merge(plan, _winners(spec, changes))
    _crash("after-read", crash_hook)

    summary = {
        K.PROP_SOURCE_TABLE: spec.cdc_identifier,
        K.PROP_SOURCE_SNAPSHOT_ID: str(plan.cdc_snapshot.snapshot_id),
        SUMMARY_CDC_SNAPSHOTS: str(len(plan.merged_ids)),
        SUMMARY_INSERTED: str(merge.inserted),
        SUMMARY_UPDATED: str(merge.updated),
        SUMMARY_DELETED: str(merge.deleted),
        SUMMARY_STALE: str(merge.stale),
        SUMMARY_HOURS: compact_json(merge.hours),
    }
    properties = {K.PROP_SOURCE_TABLE: spec.cdc_identifier, K.PROP_SOURCE_SNAPSHOT_ID: str(plan.cdc_snapshot.snapshot_id)}
    if plan.watermark:
        summary[K.WATERMARK] = plan.watermark
        properties[K.PROP_WATERMARK] = plan.watermark

    def build(table: Table, commit_id: str):
        # UPDATE/DELETE: never re-apply a merge computed on older data (DESIGN §6). Another upsert
        # moved the source position; any other commit since the plan (a privacy delete, a
        # compaction) conflicts only if it touched the buckets this merge read or rewrites.
        if _source_snapshot_id(table.properties) != plan.previous_source_id:
            raise _BaseMoved()
        if table.metadata.current_snapshot_id != plan.base_snapshot_id and find_conflict(
            table, plan.base_snapshot_id, _target_partitions(plan, merge, data_files), start_spec_id=plan.base.metadata.default_spec_id
        ):
            raise _BaseMoved()
        tx = new_transaction(table)
        tx.set_properties(properties)
        with tx.update_snapshot(
            snapshot_properties=snapshot_summary_with_commit_id(summary, commit_id, JobKind.UPDATE_DELETE)
        ).overwrite() as overwrite:
            for data_file in merge.remove:
                overwrite.delete_data_file(data_file)
            for data_file in data_files:
                overwrite.append_data_file(data_file)
        return tx

    data_files: list[DataFile] = []
    try:
        if merge.rows is not None and merge.rows.num_rows:
            for data_file in _dataframe_to_data_files(
                plan.base.metadata, merge.rows, plan.base.io, write_uuid=uuid.uuid4(), counter=itertools.count()
            ):
                data_files.append(data_file)
        _crash("after-files", crash_hook)
        result = commit_with_retry(catalog, spec.base_identifier, build)
    except BaseException:
        # Nothing landed (an unknown outcome that did land is returned by commit_with_retry):
        # a failed job leaves no files behind. Only a hard kill leaves orphans.
        delete_files(plan.base.io, [f.file_path for f in data_files])
        raise
    _crash("after-commit", crash_hook)
    sync_merged_tag(catalog, spec.name)
    return UpsertResult(
        table=spec.name,
        cdc_snapshot_ids_merged=plan.merged_ids,
        cdc_snapshot_id=plan.cdc_snapshot.snapshot_id,
        base_snapshot_id=result.snapshot.snapshot_id if result.snapshot else None,
        inserted=merge.inserted,
        updated=merge.updated,
        deleted=merge.deleted,
        watermark=plan.watermark,
        hours_touched=merge.hours,
        changes_read=changes.height,
        stale=merge.stale,
        full_remerge=plan.full,
        buckets_rewritten=merge.buckets_rewritten,
        files_removed=len(merge.remove),
        files_added=len(data_files),
        previous_cdc_snapshot_id=plan.previous_source_id,
        attempts=attempt,
    )


def sync_merged_tag(catalog: Catalog, name: str, *, max_attempts: int = 10) -> int | None:
    """Point the `partfin-base-merged` tag of cdc.<name> at the snapshot base.<name> merged up to.

    Expiry never removes a tagged snapshot, so the next run can diff from it. A crash
    between the base commit and this call is repaired by the next run (it calls this too).
    """
    for _ in range(max_attempts):
        base = catalog.load_table(f"base.{name}")
        target = _source_snapshot_id(base.properties)
        cdc = catalog.load_table(f"cdc.{name}")
        ref = cdc.metadata.refs.get(MERGED_TAG)
        if target is None or (ref is not None and ref.snapshot_id == target):
            return target
        if cdc.metadata.snapshot_by_id(target) is None:
            log.warning("cdc.%s: merged snapshot %s already expired; not tagged", name, target)
            return None
        try:
            with cdc.manage_snapshots() as manage:
                manage.create_tag(target, MERGED_TAG)
            return target
        except CommitFailedException:
            continue  # a CDC checkpoint landed meanwhile: reload and retry
    log.warning("cdc.%s: could not move tag %s after %d attempts", name, MERGED_TAG, max_attempts)
    return None
