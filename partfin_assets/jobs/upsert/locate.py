"""Where the old versions of changed keys are: (data file, row position) plus what last-writer-wins needs.

Only the key columns and the ordering/tombstone columns of base.<table> are read, one row group
at a time, and only from the data files of the changes' key group whose key bounds (manifest
statistics) can hold one of the changed keys. Rows already removed by a position delete are not
versions any more. Memory is bounded by the changes plus one row group; the cost is the key
columns of the group's files, never whole rows.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from pyiceberg.conversions import from_bytes
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table

FILE = "__file"
POS = "__pos"


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


def _hits(rows: pa.Table, keys: pl.DataFrame, offset: int) -> pl.DataFrame | None:
    """The rows (+ __pos, offset by `offset`) of one row group whose key is in `keys`.

    A single integer key sorted in the file (partfin sorts every file it writes by key) is found
    by binary search, and only the hit rows are taken: the cost is the decoding of the key
    column, not a join over every row. Anything else (composite or non-integer keys, a file
    written unsorted by another tool) is a hash semi-join.
    """
    key_columns = keys.columns
    if len(key_columns) == 1 and pa.types.is_integer(rows.schema.field(key_columns[0]).type):
        column = rows.column(key_columns[0])
        if column.null_count == 0:
            values = column.to_numpy().astype(np.int64, copy=False)
            if values.size < 2 or bool(np.all(values[1:] >= values[:-1])):
                wanted = np.unique(keys.get_column(key_columns[0]).cast(pl.Int64).to_numpy())
                first = np.searchsorted(values, wanted, side="left")
                last = np.searchsorted(values, wanted, side="right")
                found = last > first
                starts, stops = first[found], last[found]
                if starts.size == 0:
                    return None
                # several rows of one key in a file (an outside append): every one of them
                positions = np.concatenate([np.arange(a, b) for a, b in zip(starts, stops)]) if np.any(stops - starts > 1) else starts
                frame = pl.from_arrow(rows.take(pa.array(positions)))
                assert isinstance(frame, pl.DataFrame)
                return frame.with_columns(pl.Series(POS, positions + offset, dtype=pl.Int64))
    frame = pl.from_arrow(rows)
    assert isinstance(frame, pl.DataFrame)
    frame = frame.with_row_index(POS, offset=offset)
    return frame.join(keys.cast({c: frame.schema[c] for c in key_columns}), on=key_columns, how="semi")


def old_versions(
    table: Table,
    files: list[DataFile],
    deleted: Mapping[str, np.ndarray],
    keys: pl.DataFrame,
    columns: list[str],
) -> pl.DataFrame:
    """Live rows of `files` whose primary key is in `keys` (its columns): `columns` + __file + __pos."""
    schema = table.metadata.schema()
    ids = {schema.find_field(c).field_id: c for c in columns}
    arrow_schema = schema.select(*columns).as_arrow()
    found = []
    for data_file in files:
        with table.io.new_input(data_file.file_path).open() as stream:
            parquet = pq.ParquetFile(stream)
            # columns by field id: the physical names are whatever the writer used
            physical = {int(f.metadata[b"PARQUET:field_id"]): f.name for f in parquet.schema_arrow if f.metadata and b"PARQUET:field_id" in f.metadata}
            names = [physical[i] for i in ids if i in physical]
            renames = {physical[i]: c for i, c in ids.items() if i in physical}
            absent = [c for i, c in ids.items() if i not in physical]  # added to the table after the file was written: null
            offset = 0
            for group in range(parquet.metadata.num_row_groups):
                # one row group at a time (files partfin writes have one per ~1M rows): bounded memory
                rows = parquet.read_row_group(group, columns=names).rename_columns(renames)
                for c in absent:
                    rows = rows.append_column(c, pa.nulls(rows.num_rows, arrow_schema.field(c).type))
                rows = rows.select(columns)
                hits = _hits(rows, keys, offset)
                offset += rows.num_rows
                if hits is not None and hits.height:
                    found.append(hits.with_columns(pl.lit(data_file.file_path).alias(FILE)))
    if not found:
        empty = pl.from_arrow(schema.select(*columns).as_arrow().empty_table())
        assert isinstance(empty, pl.DataFrame)
        return empty.with_columns(pl.lit(None, pl.Int64).alias(POS), pl.lit(None, pl.String).alias(FILE))
    rows = pl.concat(found, how="vertical_relaxed").with_columns(pl.col(POS).cast(pl.Int64))
    scanned = {f.file_path for f in files}
    gone = [
        pl.DataFrame({POS: positions.astype(np.int64)}).with_columns(pl.lit(path).alias(FILE))
        for path, positions in deleted.items()
        if path in scanned and positions.size
    ]
    if gone:
        rows = rows.join(pl.concat(gone), on=[FILE, POS], how="anti")
    return rows
