"""Query engines other than PyIceberg reading partfin's tables as a consumer outside partfin would: from the
table's metadata file (the one the catalog names as current), at its current snapshot or any other.

- DuckDB with its `iceberg` extension (PyPI `duckdb-extension-iceberg`, which needs `duckdb-extension-avro`
  for the manifests): the extensions are loaded from those packages' files, never downloaded;
- ClickHouse's `icebergLocal` table function in chdb (PyPI `chdb`), which reads the metadata itself.

Rows come back as plain Python values with timestamps as UTC microseconds, so rows from any reader compare
with ==.
"""

from __future__ import annotations

import importlib
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyiceberg.table import Table

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def local_path(location: str) -> str:
    return location.removeprefix("file://")


def plain_rows(data: pa.Table, columns: list[str] | None = None) -> list[tuple]:
    """The rows of `data` (its `columns`, default all) as sorted tuples; timestamps as UTC microseconds."""
    columns = columns or data.column_names
    rows = [tuple(_plain(row[c]) for c in columns) for row in data.select(columns).to_pylist()]
    return sorted(rows, key=repr)


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return (value - (EPOCH if value.tzinfo else EPOCH.replace(tzinfo=None))) // timedelta(microseconds=1)
    return value


def _duckdb_extension(name: str) -> str:
    package = importlib.import_module(f"duckdb_extension_{name}")
    return str(next(Path(package.__file__).parent.glob(f"extensions/*/{name}.duckdb_extension")))


def duckdb_connection():
    import duckdb

    con = duckdb.connect(config={"autoinstall_known_extensions": "false", "autoload_known_extensions": "false"})
    for name in ("avro", "iceberg"):  # iceberg reads manifests with avro
        con.execute(f"LOAD '{_duckdb_extension(name)}'")
    con.execute("SET TimeZone = 'UTC'")
    return con


def duckdb_read(table: Table, snapshot_id: int | None = None) -> pa.Table:
    con = duckdb_connection()
    at = f", snapshot_from_id => {int(snapshot_id)}" if snapshot_id is not None else ""
    return con.execute(f"SELECT * FROM iceberg_scan('{local_path(table.metadata_location)}'{at})").to_arrow_table()


def chdb_read(table: Table, snapshot_id: int | None = None) -> pa.Table:
    """ClickHouse reads files under its working directory only: the query runs from the table's parent."""
    import chdb

    location = Path(local_path(table.location()))
    metadata = os.path.relpath(local_path(table.metadata_location), location)
    settings = f" SETTINGS iceberg_snapshot_id = {int(snapshot_id)}" if snapshot_id is not None else ""
    cwd = os.getcwd()
    os.chdir(location.parent)
    try:
        query = (f"SELECT * FROM icebergLocal('{location.name}', SETTINGS iceberg_metadata_file_path = '{metadata}')"
                 f"{settings}")
        return chdb.query(query, "ArrowTable")
    finally:
        os.chdir(cwd)


ENGINES = {"duckdb": duckdb_read, "chdb": chdb_read}


def duckdb_read_tag(table: Table, tag: str) -> pa.Table:
    """A tag read as a DuckDB user reads it (docs/consumers.md): its snapshot id from the `refs` of the table's
    metadata file, then the table as of that snapshot."""
    con = duckdb_connection()
    metadata = local_path(table.metadata_location)
    con.execute(f"""SET VARIABLE tag_snapshot = (SELECT json_extract(content, '$.refs."{tag}"."snapshot-id"')::BIGINT
                    FROM read_text('{metadata}'))""")
    return con.execute(f"SELECT * FROM iceberg_scan('{metadata}', snapshot_from_id => getvariable('tag_snapshot'))").to_arrow_table()
