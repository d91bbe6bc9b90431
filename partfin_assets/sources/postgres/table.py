"""The source table as the PostgreSQL catalog describes it: key, column types, replica identity.

`key` is the primary key, else the REPLICA IDENTITY index, else the columns given
(`primary_key=`); a table whose replica identity does not log the key of deleted rows is
refused, since its deletes could not be keyed.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
import pyarrow as pa

from partfin_assets.sources.postgres.column_types import Normalize, column_type
from partfin_assets.sources.postgres.connection import PostgresSourceError


@dataclass
class TableInfo:
    schema: str
    name: str
    oid: int
    key: tuple[str, ...]
    types: dict[str, pa.DataType]
    normalizers: dict[str, Normalize | None]
    replica_identity: str  # d(efault) n(othing) f(ull) i(ndex)
    not_null: frozenset[str] = frozenset()
    # float columns whose NaN / ±Infinity the slot's wal2json writes as null (before 2.6): a null in
    # one of them that is NOT NULL can only be such a value, and is rejected rather than stored as null
    unreadable_nulls: frozenset[str] = frozenset()

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"


def read_table_info(conn: psycopg.Connection, schema: str, table: str, primary_key: tuple[str, ...] | None) -> TableInfo:
    """The table's key, column types and replica identity, checked for logical decoding."""
    qualified = f"{schema}.{table}"
    row = conn.execute(
        "SELECT c.oid, c.relreplident, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = %s",
        (schema, table),
    ).fetchone()
    database = conn.info.dbname
    if row is None:
        raise PostgresSourceError(f"table {qualified} does not exist in database {database!r}")
    oid, identity, relkind = int(row[0]), str(row[1]), str(row[2])
    if relkind not in ("r", "p"):
        raise PostgresSourceError(f"{qualified} is not a table (relkind {relkind!r}): only tables are decoded")
    columns = conn.execute(
        "SELECT a.attname, t.typname, a.atttypmod, t.typcategory = 'A' OR a.attndims > 0, a.attnotnull "
        "FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
        "WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
        (oid,),
    ).fetchall()
    types: dict[str, pa.DataType] = {}
    normalizers: dict[str, Normalize | None] = {}
    for name, typname, typmod, is_array, _ in columns:
        types[name], normalizers[name] = column_type(typname, int(typmod), bool(is_array))

    def index_columns(condition: str) -> tuple[str, ...]:
        found = conn.execute(
            "SELECT a.attname FROM pg_index i JOIN LATERAL unnest(i.indkey) WITH ORDINALITY k(attnum, ord) ON true "
            "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
            f"WHERE i.indrelid = %s AND {condition} ORDER BY k.ord",
            (oid,),
        ).fetchall()
        return tuple(r[0] for r in found)

    primary = index_columns("i.indisprimary")
    identity_index = index_columns("i.indisreplident") if identity == "i" else ()
    identity_name = {"d": "DEFAULT", "n": "NOTHING", "f": "FULL", "i": "USING INDEX"}.get(identity, identity)
    key = primary_key or primary or identity_index
    if not key:
        raise PostgresSourceError(
            f"table {qualified} has no primary key and REPLICA IDENTITY {identity_name}: deletes cannot be keyed; "
            f"add a primary key, or ALTER TABLE {qualified} REPLICA IDENTITY FULL and name the key columns "
            "(--primary-key)"
        )
    unknown = [c for c in key if c not in types]
    if unknown:
        raise PostgresSourceError(f"table {qualified} has no column(s) {unknown} (the key given)")
    logged_old = {"d": primary, "i": identity_index, "f": tuple(types), "n": ()}.get(identity, ())
    if not set(key) <= set(logged_old):
        raise PostgresSourceError(
            f"table {qualified} has REPLICA IDENTITY {identity_name}, which does not log key column(s) "
            f"{sorted(set(key) - set(logged_old))} of deleted rows: deletes cannot be keyed; "
            f"ALTER TABLE {qualified} REPLICA IDENTITY FULL (or key by the primary key)"
        )
    not_null = frozenset(name for name, *_, is_not_null in columns if is_not_null)
    return TableInfo(schema, table, oid, tuple(key), types, normalizers, identity, not_null)
