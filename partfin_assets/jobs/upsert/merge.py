"""Upsert step 3, merge one key group, merge-on-read: the winning changes against the old versions of their keys.

For a group (the buckets `bucket mod G == g`): decode its changes' payloads (jobs/upsert/decode.py;
the ones that do not fit are returned for the quarantine), keep the latest per key and change log,
locate the live old version of every changed key (jobs/upsert/locate.py: key and ordering columns
only, key-range-pruned files), rank each key's
changes (one per change log) from where their log stood in the base row, and decide last-writer-wins
per key (jobs/upsert/decode.py `ORDER_KEY`, `newer_than_base`), then

- append the new versions (deletes become tombstones, `_tombstone`, so an older update arriving
  later cannot resurrect the row) as one data file per bucket, sorted by key;
- delete the old versions by position: per bucket one position-delete file holding the bucket's
  earlier positions and the new ones, replacing the earlier file;
- when a bucket would hold more than `max_data_files` data files (default 2), fold the small ones
  (every file but the largest, with their deletes applied) and the new versions into one: reads
  open at most two files per bucket between compactions, and the cost stays with the changes
  since the last compaction.

The result lists the files to add and remove; commit.py commits all groups at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import polars as pl
import pyarrow as pa
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table
from pyiceberg.transforms import BucketTransform

from partfin_assets.iceberg.files import read_files
from partfin_assets.iceberg.position_deletes import positions_by_file, read_positions
from partfin_assets.iceberg.tables import DELETED, EVENT_TIME, META_COLUMNS, ORDER_TIME, SOURCE_LOG, SOURCE_SEQ, base_columns
from partfin_assets.jobs.job import StagedFiles
from partfin_assets.jobs.upsert.decode import ORDER_KEY, KeyedRows, decode_payloads, latest_per_log, newer_than_base
from partfin_assets.jobs.upsert.locate import FILE, POS, candidate_files, change_floors, old_versions
from partfin_assets.jobs.upsert.plan import GroupFiles, PartitionFiles, UpsertPlan
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.model.timeutil import US_PER_HOUR

_CHG = "__chg"
GROUP = "__group"
DEFAULT_MAX_DATA_FILES = 2  # per bucket after a run: its largest file and one file of everything newer


@dataclass
class GroupMerge:
    """What merging one key group produced (not committed)."""

    group: int
    unfit: pa.Table  # the group's changes that do not fit (decode.py): for the quarantine
    add: list[DataFile] = field(default_factory=list)  # new versions and the replacing delete files
    remove: list[DataFile] = field(default_factory=list)  # replaced delete files, folded data files
    targets: list[str] = field(default_factory=list)  # partitions read or written: the job's conflict targets
    decoded: int = 0  # the group's changes that decoded (every one, before the latest per key and log is kept)
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    stale: int = 0
    hours_us: list[int] = field(default_factory=list)  # hours whose visible rows changed
    files_scanned: int = 0
    row_groups_hit: int = 0  # row groups of those files holding a changed key
    row_groups_settled: int = 0  # of those, settled by their statistics (ordering columns not read)
    rows_folded: int = 0

    @property
    def changed(self) -> bool:
        return bool(self.add or self.remove)


def group_ids(table: Table, spec: TableSpec, groups: int, changes: pl.DataFrame) -> pl.Series:
    """The key group of each change: bucket(N, key) of base's current spec, mod G."""
    buckets = _buckets_of(table, changes.to_arrow()) if groups > 1 else None
    if buckets is None:
        return pl.Series(GROUP, [0] * changes.height, dtype=pl.Int64)
    return (pl.Series(GROUP, buckets).cast(pl.Int64) % groups).alias(GROUP)


def split_by_group(plan: UpsertPlan, keyed: KeyedRows) -> dict[int, KeyedRows]:
    """The keyed CDC rows (decode.py `decode_keys`) of each key group that has any."""
    groups = group_ids(plan.base, plan.spec, plan.groups, keyed.keys)
    return {int(g): keyed.filter(groups == g) for g in groups.unique().sort().to_list()}


def merge_group(
    table: Table,
    spec: TableSpec,
    files: GroupFiles,
    keyed: KeyedRows,
    staged: StagedFiles,
    *,
    max_data_files: int = DEFAULT_MAX_DATA_FILES,
    on_read: Callable[[], None] | None = None,
) -> GroupMerge:
    """Decode and merge the changes of one group (its keyed CDC rows) into its files (as of the job's start snapshot)."""
    decoded, unfit = decode_payloads(spec, keyed)
    result = GroupMerge(files.group, unfit=unfit, decoded=decoded.height)
    if decoded.height == 0:  # every change of the group quarantined: nothing read, nothing to conflict with
        return result
    result.targets = list(files.paths)
    changes = latest_per_log(spec, decoded)
    pk = list(spec.primary_key)
    columns = base_columns(spec)
    data = [f for p in files.partitions for f in p.data]
    deleted = positions_by_file(read_positions(table.io, [d for p in files.partitions for d in p.deletes]))
    floors = change_floors(changes, pk)
    candidates = candidate_files(table, data, floors.select(pk), _bucket_column(table, pk))
    result.files_scanned = len(candidates)
    found = old_versions(table, candidates, deleted, floors, [*pk, EVENT_TIME, *ORDER_KEY, DELETED])
    result.row_groups_hit, result.row_groups_settled = found.row_groups_hit, found.row_groups_settled
    # null: a row written before partfin kept it, or one whose row group's statistics settled it (locate.py)
    old = found.rows.with_columns(pl.col(ORDER_TIME).fill_null(pl.col(EVENT_TIME)))
    if on_read is not None:
        on_read()

    # Several live versions of one key (an outside append) all go; the newest decides.
    newest = old.sort(list(ORDER_KEY), nulls_last=False).unique(subset=pk, keep="last")
    value_columns = [c for c in columns if c not in pk] + list(META_COLUMNS)
    change_side = changes.select([*pk, *value_columns]).rename({c: c + _CHG for c in value_columns})
    change_side = change_side.cast({c: newest.schema[c] for c in pk}) if newest.height else change_side
    joined = change_side.join(newest.select([*pk, EVENT_TIME, *ORDER_KEY, DELETED]), on=pk, how="left")
    # A change of the base row's log is older than it by position alone (a re-delivery), and a newer one goes on
    # from where that log stood: never ranked before the base row's order time.
    same_log = (pl.col(SOURCE_LOG + _CHG) == pl.col(SOURCE_LOG)).fill_null(False)
    joined = joined.with_columns(
        pl.when(same_log).then(pl.max_horizontal(ORDER_TIME + _CHG, ORDER_TIME)).otherwise(pl.col(ORDER_TIME + _CHG)).alias(ORDER_TIME + _CHG),
        ~(same_log & (pl.col(SOURCE_SEQ + _CHG) <= pl.col(SOURCE_SEQ))).alias("__after_base_in_its_log"),
    )
    # The key's newest change (one per log so far), those behind the base row in its own log ranked last; then it against the base row.
    joined = joined.sort(["__after_base_in_its_log", *[c + _CHG for c in ORDER_KEY]], nulls_last=False).unique(subset=pk, keep="last")
    in_base = pl.col(EVENT_TIME).is_not_null()
    base_live = in_base & ~pl.col(DELETED).fill_null(True)
    change_delete = pl.col(DELETED + _CHG)
    take = pl.col("__after_base_in_its_log") & (~in_base | newer_than_base(_CHG).fill_null(False))
    joined = joined.with_columns(take.alias("__take"), base_live.alias("__base_live"), change_delete.alias("__change_delete"))
    counts = joined.select(
        (pl.col("__take") & ~pl.col("__change_delete") & ~pl.col("__base_live")).sum().alias("inserted"),
        (pl.col("__take") & ~pl.col("__change_delete") & pl.col("__base_live")).sum().alias("updated"),
        (pl.col("__take") & pl.col("__change_delete") & pl.col("__base_live")).sum().alias("deleted"),
        (~pl.col("__take")).sum().alias("stale"),
    ).row(0, named=True)
    result.inserted, result.updated, result.deleted, result.stale = (int(counts[k]) for k in ("inserted", "updated", "deleted", "stale"))
    taken = joined.filter(pl.col("__take"))
    if taken.height == 0:
        return result

    # Hours whose visible rows changed: where rows appeared/changed (new) and where they left (old).
    new_hours = taken.filter(~pl.col("__change_delete")).get_column(EVENT_TIME + _CHG)
    old_hours = taken.filter(pl.col("__base_live")).get_column(EVENT_TIME)
    hour_us = pl.concat([new_hours, old_hours.cast(new_hours.dtype)]).dt.epoch("us") // US_PER_HOUR * US_PER_HOUR
    result.hours_us = sorted(int(h) for h in hour_us.unique().to_list())

    schema = table.schema().as_arrow()
    new_rows = taken.select([*pk, *[pl.col(c + _CHG).alias(c) for c in value_columns]]).sort(pk)
    replaced = old.join(taken.select(pk), on=pk, how="semi").select(FILE, POS)
    _write_files(table, files, deleted, replaced, new_rows.select(schema.names).to_arrow().cast(schema), staged, result, max_data_files)
    return result


def _bucket_column(table: Table, pk: list[str]) -> str:
    partition = table.spec()
    if partition.fields:
        return table.schema().find_field(partition.fields[0].source_id).name
    return pk[0]


def _write_files(
    table: Table,
    files: GroupFiles,
    deleted: dict[str, np.ndarray],
    replaced: pl.DataFrame,
    new_rows: pa.Table,
    staged: StagedFiles,
    result: GroupMerge,
    max_data_files: int,
) -> None:
    """Per partition: the new versions, folded with the small files when due, and one delete file for what remains.

    A partition that would hold more than `max_data_files` data files gets every file but its
    largest (deletes applied) and its new versions written as one sorted file: with the default
    of 2 a bucket is its largest file plus one file of everything newer, so readers open at most
    two files per bucket between compactions, and the upsert rewrites only the changes since the
    last compaction, never the table.
    """
    new_positions = {path: np.unique(frame.get_column(POS).to_numpy()) for (path,), frame in replaced.partition_by(FILE, as_dict=True).items()}
    new_bucket = _buckets_of(table, new_rows)
    folded_in = np.zeros(new_rows.num_rows, dtype=bool)  # new versions written with a fold
    for part in files.partitions:
        incoming = _rows_of_partition(table, part, new_bucket, new_rows.num_rows)
        has_new = incoming is not None and bool(incoming.any())
        if not has_new and not any(f.file_path in new_positions for f in part.data):
            continue
        positions = {f.file_path: _union(deleted.get(f.file_path), new_positions.get(f.file_path)) for f in part.data}
        live = list(part.data)
        folded = sorted(part.data, key=lambda f: f.file_size_in_bytes)[:-1]  # all but the largest
        if folded and len(part.data) + has_new > max_data_files:
            rows = read_files(table, folded, deletes=[])
            keep = np.ones(rows.num_rows, dtype=bool)
            offset = 0
            for f in folded:
                gone = positions.get(f.file_path)
                if gone is not None and gone.size:
                    keep[offset + gone] = False
                offset += f.record_count
            survivors = rows.filter(pa.array(keep))
            result.rows_folded += survivors.num_rows
            if has_new:
                assert incoming is not None
                survivors = pa.concat_tables([survivors, new_rows.filter(pa.array(incoming))], promote_options="permissive")
                folded_in |= incoming
            result.add += staged.write(_sorted(survivors, table))
            result.remove += folded
            live = [f for f in part.data if f not in folded]
        remaining = [(path, positions[path]) for path in (f.file_path for f in live) if positions[path] is not None and positions[path].size]
        result.remove += part.deletes
        if remaining:
            rows = pa.table(
                {
                    "file_path": pa.array([p for p, pos in remaining for _ in range(pos.size)], pa.string()),
                    "pos": pa.array(np.concatenate([pos for _, pos in remaining]), pa.int64()),
                }
            )
            result.add.append(staged.write_deletes(part.spec_id, part.partition, rows))
    result.add += staged.write(new_rows.filter(pa.array(~folded_in)) if folded_in.any() else new_rows)


def _buckets_of(table: Table, rows: pa.Table) -> np.ndarray | None:
    """The bucket (partition value under base's current spec) of each row; None if the table is unpartitioned."""
    partition = table.spec()
    if not partition.fields:
        return None
    field_ = partition.fields[0]
    assert isinstance(field_.transform, BucketTransform)
    column = table.schema().find_field(field_.source_id)
    values = rows.column(column.name)
    if pa.types.is_large_string(values.type):
        values = values.cast(pa.string())
    return np.asarray(field_.transform.pyarrow_transform(column.field_type)(values).to_numpy(zero_copy_only=False))


def _rows_of_partition(table: Table, part: PartitionFiles, new_bucket: np.ndarray | None, count: int) -> np.ndarray | None:
    """Which of the `count` new versions land in `part` (a mask); None when the partition is of an older spec (none can)."""
    if part.spec_id != table.metadata.default_spec_id:
        return None
    if new_bucket is None:  # unpartitioned: one partition holds everything
        return np.ones(count, dtype=bool)
    return new_bucket == part.partition[0]


def _union(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    if a is None:
        return b
    if b is None:
        return a
    return np.union1d(a, b)


def _sorted(rows: pa.Table, table: Table) -> pa.Table:
    partition = table.spec()
    if not partition.fields or rows.num_rows == 0:
        return rows
    key = table.schema().find_field(partition.fields[0].source_id).name
    return rows.sort_by(key)
