"""Column names that query engines reserve for Iceberg metadata columns: no partfin table may use one.

An engine that adds these columns to every scan refuses a table with a column of the same name
(Spark with the Iceberg runtime: "Table column names conflict with names reserved for Iceberg
metadata columns: [_deleted]"), or shadows one with the other. Sources:

- the Iceberg table spec, "Reserved Field IDs" (v1-v3), and Iceberg's `MetadataColumns.java`:
  `_file`, `_pos`, `_deleted`, `_spec_id`, `_partition` (every table), `_row_id` and
  `_last_updated_sequence_number` (row lineage, format v3), `_change_type`, `_change_ordinal`,
  `_commit_snapshot_id` (the changelog scan Spark's `create_changelog_view` exposes);
- Spark: the Iceberg runtime's metadata columns are the ones above; Spark's own hidden
  `_metadata` column (file sources) is shadowed by a data column of that name, so it is avoided too;
- Trino: its Iceberg connector's hidden columns are `$path`, `$file_modified_time` and
  `$partition`; every name starting with `$` is avoided.

Names the spec reserves inside delete files and metadata tables only (`file_path`, `pos`, `row`,
`content_offset`, `content_size_in_bytes`) never meet a data table's columns and are allowed.
"""

from __future__ import annotations

from pyiceberg.schema import Schema

ICEBERG_METADATA_COLUMNS = frozenset({
    "_file", "_pos", "_deleted", "_spec_id", "_partition",
    "_row_id", "_last_updated_sequence_number",
    "_change_type", "_change_ordinal", "_commit_snapshot_id",
})
SPARK_HIDDEN_COLUMNS = frozenset({"_metadata"})
RESERVED_COLUMN_NAMES = ICEBERG_METADATA_COLUMNS | SPARK_HIDDEN_COLUMNS
RESERVED_PREFIX = "$"  # Trino's hidden columns


def is_reserved(name: str) -> bool:
    return name in RESERVED_COLUMN_NAMES or name.startswith(RESERVED_PREFIX)


def reserved_names_in(schema: Schema) -> list[str]:
    """The top-level column names of `schema` that an engine reserves (metadata columns sit beside them, so a
    struct's fields cannot clash)."""
    return [f.name for f in schema.fields if is_reserved(f.name)]
