"""No partfin table uses a column name engines reserve for Iceberg metadata.

Spark with the Iceberg runtime refused to read base.<table> at all while its tombstone column was
named `_deleted`. Base tables created before the rename are migrated in place by the next
`partfin upsert`: an Iceberg column rename (metadata only, the field id stays).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow as pa

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.reserved_names import RESERVED_COLUMN_NAMES, is_reserved, reserved_names_in
from partfin_assets.iceberg.tables import (
    DELETED,
    ensure_base_table,
    ensure_cdc_tables,
    ensure_quarantine_table,
    ledger_identifier,
    read_base,
)
from partfin_assets.model.tablespec import TableSpec
from partfin_assets_tests.scenario_helpers import append_lines, change, ms, partfin

T = ms("2026-11-01T10:00:00Z")
LEGACY_NAME = "_deleted"  # the tombstone column's name in tables created before (main at aef2540)

# `partfin upsert` as the code before the rename ran it: the same code path with the tombstone column's old name.
OLD_UPSERT = f"""
import sys
import partfin_assets.iceberg.tables as tables
tables.META_COLUMNS = tuple({LEGACY_NAME!r} if c == tables.DELETED else c for c in tables.META_COLUMNS)
tables.DELETED = {LEGACY_NAME!r}
from partfin_assets.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_reserved_list_holds_the_iceberg_metadata_columns():
    assert {"_file", "_pos", "_deleted", "_spec_id", "_partition", "_row_id", "_last_updated_sequence_number"} <= RESERVED_COLUMN_NAMES
    assert is_reserved("$path") and not is_reserved("_event_time")


def test_no_table_partfin_creates_uses_a_reserved_name(tmp_path):
    catalog = load_partfin_catalog(tmp_path)
    spec = TableSpec(name="orders", primary_key=("id",), columns={"id": pa.int64(), "status": pa.string()})
    tables = {
        "cdc": ensure_cdc_tables(catalog, spec),
        "rejected": catalog.load_table(spec.rejected_identifier),
        "ledger": catalog.load_table(ledger_identifier(spec.cdc_identifier)),
        "base": ensure_base_table(catalog, spec),
        "quarantine": ensure_quarantine_table(catalog, spec),
    }
    assert {kind: reserved_names_in(table.schema()) for kind, table in tables.items()} == {kind: [] for kind in tables}


def test_upsert_migrates_a_base_table_created_with_the_reserved_name(tmp_path):
    """A base table made by the code before (tombstone column `_deleted`, rows and a tombstone in it) is
    read as it is, then the next `partfin upsert` renames the column in place (same field id, a new schema
    version in the metadata) and merges; old snapshots stay readable under the new name."""
    path, home = tmp_path / "orders.jsonl", tmp_path / "home"
    append_lines(path, [change("c", k, T + k * 1000, wrapped=True) for k in (1, 2, 3)] + [change("d", 1, T + 5000, wrapped=True)])
    assert partfin(home, "ingest", "--table", "orders", "--source", f"debezium:{path}", "--primary-key", "id").returncode == 0
    old = subprocess.run([sys.executable, "-c", OLD_UPSERT, "upsert", "--table", "orders"],
                         env={**os.environ, "PARTFIN_HOME": str(home)}, capture_output=True, text=True, timeout=300)
    assert old.returncode == 0, old.stderr
    catalog = load_partfin_catalog(home)
    before = catalog.load_table("base.orders")
    assert LEGACY_NAME in {f.name for f in before.schema().fields}  # what the code before made
    field_id = before.schema().find_field(LEGACY_NAME).field_id
    old_snapshot = before.current_snapshot().snapshot_id
    # readers accept the old name: a table not migrated yet reads as any other
    assert {r["id"]: r[DELETED] for r in read_base(catalog, "orders", include_deleted=True).to_pylist()} == {1: True, 2: False, 3: False}
    assert sorted(read_base(catalog, "orders").column("id").to_pylist()) == [2, 3]

    append_lines(path, [change("d", 2, T + 6000, wrapped=True), change("u", 3, T + 7000, status="paid", wrapped=True)])
    assert partfin(home, "ingest", "--table", "orders", "--source", f"debezium:{path}").returncode == 0
    upsert = partfin(home, "upsert", "--table", "orders")
    assert upsert.returncode == 0, upsert.stderr

    after = catalog.load_table("base.orders")
    assert reserved_names_in(after.schema()) == []
    assert after.schema().find_field(DELETED).field_id == field_id  # renamed in place: the same column
    assert after.schema().schema_id > before.schema().schema_id  # recorded as a schema change
    rows = {r["id"]: (r[DELETED], r["status"]) for r in read_base(catalog, "orders", include_deleted=True).to_pylist()}
    assert rows == {1: (True, None), 2: (True, None), 3: (False, "paid")}
    at_old = read_base(catalog, "orders", include_deleted=True, snapshot_id=old_snapshot)
    assert {r["id"]: r[DELETED] for r in at_old.to_pylist()} == {1: True, 2: False, 3: False}
    assert partfin(home, "upsert", "--table", "orders").returncode == 0  # nothing left to migrate: a no-op
    assert catalog.load_table("base.orders").schema().schema_id == after.schema().schema_id
