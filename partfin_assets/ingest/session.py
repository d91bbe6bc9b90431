"""One ingest session, as `partfin ingest`, the `sync_<table>` job and `ingest_<table>_fanout` all run it.

1. the table's declaration: the one stored with cdc.<table> (a declared watermark policy replaces
   its policy), else the source's own or the given primary key (`resolve_spec`);
2. the CDC writer on it: a declared policy that differs from the table's takes effect as a recorded
   policy change (CdcWriter -> watermark/registry.py `declare_policy`); the session's `spec` is
   what is in force;
3. the source is read from the writer's committed position (`run`, or `read_checkpoints` for the fan-out);
4. at the end, even on Ctrl-C: the writer closes (pending checkpoints reach the ledger), the column
   types the source discovered complete a declaration that named only the key, and the source
   closes (e.g. a Kafka consumer leaves its group at once).
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator

from pyiceberg.catalog import Catalog

from partfin_assets.iceberg.commit import set_table_properties
from partfin_assets.ingest.writer import DEFAULT_COMMIT_INTERVAL_S, CdcWriter, CheckpointResult, PreparedCheckpoint
from partfin_assets.model import summary_keys as K
from partfin_assets.model.records import CdcSource, DiscoversColumns, HoldsConnections
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.sources.registry import source_kind, source_table_spec
from partfin_assets.watermark.registry import parse_policy


def check_declaration(source_text: str, watermark_policy: str | None) -> None:
    """Refuse an unknown source kind or a bad policy before any catalog is touched."""
    source_kind(source_text)
    if watermark_policy is not None:
        parse_policy(watermark_policy)


def resolve_spec(catalog: Catalog | None, table: str, source_text: str, *, primary_key: str | None = None,
                 watermark_policy: str | None = None, complete: bool = True) -> TableSpec:
    """The table's declaration: the one stored with cdc.<table>, else (no such table, or no catalog yet: None) the
    source's own or `primary_key`; a given `watermark_policy` is declared on it (the writer makes it the one in force)."""
    check_declaration(source_text, watermark_policy)
    identifier = f"cdc.{table}"
    if catalog is not None and catalog.table_exists(identifier):
        spec = TableSpec.from_properties(table, catalog.load_table(identifier).properties)
    else:
        spec = source_table_spec(source_text, table, primary_key, complete=complete)
    return spec if watermark_policy is None else dataclasses.replace(spec, watermark_policy=watermark_policy)


def record_discovered_columns(catalog: Catalog, spec: TableSpec, source: CdcSource) -> None:
    """Column types found in a Debezium envelope complete a declaration that named only the key."""
    columns = source.column_types() if isinstance(source, DiscoversColumns) else None
    if spec.columns or not columns:
        return
    discovered = dataclasses.replace(spec, columns=columns, decimal_encodings=source.decimal_encodings())
    declared = {K.PROP_COLUMNS: discovered.to_properties()[K.PROP_COLUMNS]}
    set_table_properties(catalog, spec.cdc_identifier, declared)  # another writer may be committing right now


def close_source(source: CdcSource) -> None:
    if isinstance(source, HoldsConnections):  # e.g. a Kafka consumer leaves its group at once
        source.close()


class IngestSession:
    """A CDC writer on `spec` reading `source` (opened by the caller, closed by the session). Use as a context manager."""

    def __init__(self, catalog: Catalog, spec: TableSpec, source: CdcSource, **writer_options) -> None:
        self.catalog = catalog
        self.source = source
        try:
            self.writer = CdcWriter(catalog, spec, **writer_options)
        except BaseException:
            close_source(source)
            raise

    @property
    def spec(self) -> TableSpec:
        """The declaration in force (its watermark policy: the table's)."""
        return self.writer.spec

    def run(self, *, max_records: int, max_checkpoints: int | None = None,
            commit_interval_s: float = DEFAULT_COMMIT_INTERVAL_S) -> Iterator[CheckpointResult]:
        return self.writer.run(self.source, max_records=max_records, max_checkpoints=max_checkpoints,
                               commit_interval_s=commit_interval_s)

    def read_checkpoints(self, *, max_records: int, max_checkpoints: int) -> list[PreparedCheckpoint]:
        """Batches for other processes to write and a committer to commit (the fan-out)."""
        return self.writer.read_checkpoints(self.source, max_records=max_records, max_checkpoints=max_checkpoints)

    def __enter__(self) -> IngestSession:
        # What the process holds once the writer is up (modules, catalog, table metadata: ~170,000 objects) lives as
        # long as the session, yet the cyclic collector walked all of it on every full collection (four Kafka members
        # on two cores: 1.6 s of collection each per run, 1.0 s frozen). Frozen, a collection walks only what came
        # after; thawed at the end, so a process that runs sessions one after another collects as before.
        gc.freeze()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        gc.unfreeze()
        try:
            self.writer.close()  # records the pending checkpoints in the ledger
            if exc_type is None or issubclass(exc_type, KeyboardInterrupt):  # --follow ends with Ctrl-C: the columns are kept
                record_discovered_columns(self.catalog, self.spec, self.source)
        finally:
            close_source(self.source)
