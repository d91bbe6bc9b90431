"""Where the old versions of changed keys are: (data file, row position) plus what last-writer-wins needs.

Only the key columns and the ordering/tombstone columns of base.<table> are read, one row group
at a time, and only from the data files of the changes' key group whose key bounds (manifest
statistics) can hold one of the changed keys; the ordering/tombstone columns only of row groups
holding a changed key, and not at all when the file's statistics show them constant (`_tombstone`
of a file without tombstones). Rows already removed by a position delete are not versions any
more. Memory is bounded by the changes plus one row group; the cost is the key columns of the
group's files, never whole rows.

A row group's own statistics often settle last-writer-wins without its ordering columns: when
every changed key it holds has changes whose order time and position are all above the row
group's largest `_order_time`/`_event_time` and `_source_seq`, each of those changes is newer than
any version there, whatever its log (the common case of a stream: new changes above old rows).
Such a row group is read for its key, `_event_time` (the hours a replaced row leaves) and
`_tombstone` only; its ordering columns come back null, which the merge ranks as "older than the
change" (a null log is no common log, a null order time reads as the event time): the decision a
full read would give. Late changes, re-deliveries and several logs with unrelated positions fall
back to reading the ordering columns of the row groups they hit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from pyiceberg.conversions import from_bytes
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table
from pyiceberg.types import BooleanType, DateType, IntegerType, LongType, TimestampType, TimestamptzType

from partfin_assets.iceberg.tables import EVENT_TIME, ORDER_TIME, SOURCE_LOG, SOURCE_SEQ

FILE = "__file"
POS = "__pos"
FLOOR_TIME = "__floor_order_time"  # per changed key: the lowest order time of its changes (epoch us)
FLOOR_SEQ = "__floor_source_seq"  # per changed key: the lowest source position of its changes
_EXACT_BOUNDS = (BooleanType, IntegerType, LongType, DateType, TimestampType, TimestamptzType)


def candidate_files(table: Table, files: list[DataFile], keys: pl.DataFrame, key_column: str) -> list[DataFile]:
    """The files whose bounds on `key_column` (manifest statistics) can hold one of `keys`."""
    if keys.height == 0:
        return []
    field = table.metadata.schema().find_field(key_column)
    values = keys.get_column(key_column).sort()
    out = []
    for data_file in files:
        lower = (data_file.lower_bounds or {}).get(field.field_id)
        upper = (data_file.upper_bounds or {}).get(field.field_id)
        if lower is None or upper is None:
            out.append(data_file)
            continue
        try:
            low, high = from_bytes(field.field_type, lower), from_bytes(field.field_type, upper)
        except (ValueError, TypeError):  # a type whose bounds do not compare with the decoded keys
            out.append(data_file)
            continue
        first = values.search_sorted(low, side="left")
        if first < values.len() and values[first] <= high:
            out.append(data_file)
    return out


def _sorted_integer_keys(keys: pl.DataFrame) -> np.ndarray | None:
    """The changed keys as a sorted unique int64 array, when the key is one integer column (binary search applies)."""
    if len(keys.columns) == 1 and keys.dtypes[0].is_integer():
        return np.unique(keys.get_column(keys.columns[0]).cast(pl.Int64).to_numpy())
    return None


def _hit_positions(keys_of_rows: pa.Table, keys: pl.DataFrame, sorted_keys: np.ndarray | None) -> np.ndarray:
    """Row numbers (within `keys_of_rows`, one row group's key columns) whose key is in `keys`, ascending.

    A single integer key sorted in the file (partfin sorts every file it writes by key) is found
    by binary search: the cost is the decoding of the key column, not a join over every row.
    Anything else (composite or non-integer keys, a file written unsorted by another tool) is a
    hash semi-join.
    """
    key_columns = keys.columns
    if sorted_keys is not None and pa.types.is_integer(keys_of_rows.schema.field(key_columns[0]).type):
        column = keys_of_rows.column(key_columns[0])
        if column.null_count == 0:
            chunk = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
            values = chunk.to_numpy(zero_copy_only=False)
            if values.size < 2 or bool(np.all(values[1:] >= values[:-1])):
                first = np.searchsorted(values, sorted_keys, side="left")
                last = np.searchsorted(values, sorted_keys, side="right")
                found = last > first
                starts, stops = first[found], last[found]
                # several rows of one key in a file (an outside append): every one of them
                if np.any(stops - starts > 1):
                    return np.concatenate([np.arange(a, b) for a, b in zip(starts, stops)])
                return starts
    frame = pl.from_arrow(keys_of_rows)
    assert isinstance(frame, pl.DataFrame)
    frame = frame.with_row_index(POS)
    hits = frame.join(keys.cast({c: frame.schema[c] for c in key_columns}), on=key_columns, how="semi")
    return np.sort(hits.get_column(POS).cast(pl.Int64).to_numpy())


def _constant_columns(table: Table, data_file: DataFile, columns: list[str]) -> dict[str, object]:
    """The columns whose every value in `data_file` is one known value, from its manifest statistics.

    Only types whose bounds are exact (booleans, integers, dates, timestamps) and only when the
    column has no nulls: `_tombstone` of a file without tombstones is the common case. Such a column
    is not decoded at all.
    """
    schema = table.metadata.schema()
    out: dict[str, object] = {}
    for name in columns:
        field = schema.find_field(name)
        if not isinstance(field.field_type, _EXACT_BOUNDS):
            continue
        lower = (data_file.lower_bounds or {}).get(field.field_id)
        upper = (data_file.upper_bounds or {}).get(field.field_id)
        nulls = (data_file.null_value_counts or {}).get(field.field_id)
        if lower is not None and lower == upper and nulls == 0:
            out[name] = from_bytes(field.field_type, lower)
    return out


@dataclass(frozen=True)
class OldVersions:
    """The live old versions of the changed keys, and how much of the row groups holding them was read."""

    rows: pl.DataFrame  # the requested columns + __file + __pos
    row_groups_hit: int = 0  # row groups holding a changed key
    row_groups_settled: int = 0  # of those, settled by their statistics: ordering columns not read


def change_floors(changes: pl.DataFrame, key_columns: list[str]) -> pl.DataFrame:
    """Per changed key, the lowest order time and source position among its changes (`FLOOR_TIME`, `FLOOR_SEQ`)."""
    return changes.group_by(key_columns).agg(
        pl.col(ORDER_TIME).dt.epoch("us").min().alias(FLOOR_TIME), pl.col(SOURCE_SEQ).min().alias(FLOOR_SEQ))


def _row_group_ceiling(parquet: pq.ParquetFile, group: int, physical: Mapping[str, str]) -> tuple[int, int] | None:
    """The largest order time (`_order_time`, else `_event_time`, epoch us) and `_source_seq` of one row group,
    from its Parquet statistics; None when they do not tell (no statistics, another time unit)."""
    arrow_schema = parquet.schema_arrow
    meta = parquet.metadata.row_group(group)
    index = {parquet.metadata.schema.column(i).path: i for i in range(meta.num_columns)}
    ceilings = {}
    for column in (EVENT_TIME, ORDER_TIME, SOURCE_SEQ):
        name = physical.get(column)
        if name is None:  # `_order_time` of a file from before it existed: null, ranked at the event time
            if column == ORDER_TIME:
                continue
            return None
        field_type = arrow_schema.field(name).type
        if not (pa.types.is_int64(field_type) or (pa.types.is_timestamp(field_type) and field_type.unit == "us")):
            return None
        stats = meta.column(index[name]).statistics
        if stats is None:
            return None
        if stats.has_min_max:
            ceilings[column] = int(stats.max_raw)
        elif not (stats.has_null_count and stats.null_count == meta.num_rows):  # only an all-null column needs no max
            return None
    times = [ceilings[c] for c in (EVENT_TIME, ORDER_TIME) if c in ceilings]
    if not times or SOURCE_SEQ not in ceilings:
        return None
    return max(times), ceilings[SOURCE_SEQ]


def _settled_by_statistics(hit_keys: pa.Table, floors: pl.DataFrame, ceiling: tuple[int, int] | None) -> bool:
    """Every change of every hit key is above the row group's largest order time and position (see the module doc)."""
    if ceiling is None:
        return False
    hits = pl.from_arrow(hit_keys)
    assert isinstance(hits, pl.DataFrame)
    key_columns = hits.columns
    lowest = hits.join(floors.cast({c: hits.schema[c] for c in key_columns}), on=key_columns, how="left").select(
        pl.col(FLOOR_TIME).min(), pl.col(FLOOR_SEQ).min(), pl.col(FLOOR_TIME).null_count().alias("unknown")).row(0)
    floor_time, floor_seq, unknown = lowest
    return not unknown and floor_time is not None and floor_seq is not None and floor_time > ceiling[0] and floor_seq > ceiling[1]


def old_versions(
    table: Table,
    files: list[DataFile],
    deleted: Mapping[str, np.ndarray],
    floors: pl.DataFrame,
    columns: list[str],
) -> OldVersions:
    """Live rows of `files` whose primary key is one of `floors` (`change_floors`): `columns` + __file + __pos.

    Per row group, the key columns are read first; the other columns only when the row group
    holds a changed key, and then only the hit rows are kept; its ordering columns not at all when
    its statistics settle the hit keys (module doc). Columns the file's statistics show to be
    constant are filled in, never read.
    """
    schema = table.metadata.schema()
    arrow_schema = schema.select(*columns).as_arrow()
    key_columns = [c for c in floors.columns if c not in (FLOOR_TIME, FLOOR_SEQ)]
    keys = floors.select(key_columns)
    sorted_keys = _sorted_integer_keys(keys)
    ordering = [c for c in (ORDER_TIME, SOURCE_LOG, SOURCE_SEQ) if c in columns]
    found = []
    hit_groups = settled_groups = 0
    for data_file in files:
        constant = _constant_columns(table, data_file, [c for c in columns if c not in key_columns])
        with table.io.new_input(data_file.file_path).open() as stream:
            parquet = pq.ParquetFile(stream)
            # columns by field id: the physical names are whatever the writer used
            physical = {int(f.metadata[b"PARQUET:field_id"]): f.name for f in parquet.schema_arrow if f.metadata and b"PARQUET:field_id" in f.metadata}
            stored = {c: physical[schema.find_field(c).field_id] for c in columns if schema.find_field(c).field_id in physical}
            name_of = {c: name for c, name in stored.items() if c not in constant}
            if SOURCE_LOG in name_of:  # a few log names, repeated: read as their dictionary (a fifth of the cost), decoded for the hits only
                parquet = pq.ParquetFile(stream, metadata=parquet.metadata, read_dictionary=[name_of[SOURCE_LOG]])
            # columns added to the table after the file was written (`_source_log`, `_order_time`): null
            absent = [c for c in columns if c not in constant and c not in name_of]
            others = [c for c in columns if c not in key_columns and c in name_of]
            offset = 0
            for group in range(parquet.metadata.num_row_groups):
                # one row group at a time (files partfin writes have one per ~1M rows): bounded memory
                key_rows = parquet.read_row_group(group, columns=[name_of[c] for c in key_columns])
                key_rows = key_rows.rename_columns(list(key_columns))
                positions = _hit_positions(key_rows, keys, sorted_keys)
                if positions.size:
                    hit_groups += 1
                    take = pa.array(positions)
                    hits = {c: key_rows.column(c).take(take) for c in key_columns}
                    unread = []
                    if ordering and _settled_by_statistics(pa.table(hits), floors, _row_group_ceiling(parquet, group, stored)):
                        settled_groups += 1
                        unread = ordering
                    wanted = [c for c in others if c not in unread]
                    if wanted:
                        rest = parquet.read_row_group(group, columns=[name_of[c] for c in wanted]).rename_columns(wanted)
                        hits |= {c: rest.column(c).take(take) for c in wanted}
                    hits |= {c: pa.repeat(pa.scalar(v, arrow_schema.field(c).type), positions.size) for c, v in constant.items() if c not in unread}
                    hits |= {c: pa.nulls(positions.size, arrow_schema.field(c).type) for c in [*absent, *unread]}
                    frame = pl.from_arrow(pa.table({c: hits[c].cast(arrow_schema.field(c).type) for c in columns}))
                    assert isinstance(frame, pl.DataFrame)
                    found.append(frame.with_columns(pl.Series(POS, positions + offset, dtype=pl.Int64), pl.lit(data_file.file_path).alias(FILE)))
                offset += key_rows.num_rows
    if not found:
        empty = pl.from_arrow(arrow_schema.empty_table())
        assert isinstance(empty, pl.DataFrame)
        return OldVersions(empty.with_columns(pl.lit(None, pl.Int64).alias(POS), pl.lit(None, pl.String).alias(FILE)))
    rows = pl.concat(found, how="vertical_relaxed").with_columns(pl.col(POS).cast(pl.Int64))
    scanned = {f.file_path for f in files}
    gone = [
        pl.DataFrame({POS: positions.astype(np.int64)}).with_columns(pl.lit(path).alias(FILE))
        for path, positions in deleted.items()
        if path in scanned and positions.size
    ]
    if gone:
        rows = rows.join(pl.concat(gone), on=[FILE, POS], how="anti")
    return OldVersions(rows, hit_groups, settled_groups)

