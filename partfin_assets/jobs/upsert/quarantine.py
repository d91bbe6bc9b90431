"""Quarantine: CDC changes the upsert cannot decode go to base.<table>__rejected, each exactly once.

A change whose key or payload does not fit the declaration (or whose op is unknown) cannot be
merged; holding the whole table back for it would freeze every other key. The upsert sets it
aside (jobs/upsert/decode.py) and merges the rest; this module appends the set-aside changes to
base.<table>__rejected with their key, op, event time, source position, payload, the column and
reason, and the CDC snapshot the run read, before the base commit.

Exactly once: a change is identified by its change log, its position in it and its key
(model/records.py RECORD_IDENTITY; changes held before the log was kept match by position). The append
skips changes the table already holds, checked inside the commit attempt on fresh metadata, so a
run that crashed after quarantining, a re-run after a lost race, or a full re-merge that reads
the same CDC files again never adds a change twice. The table holds only bad changes, so reading
its identities is cheap. `partfin status` and the base table's `quarantined` check count them
from the snapshot summary (`total-records`), never from data files.
"""

from __future__ import annotations

import polars as pl
import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.table import Table

from partfin_assets.iceberg.commit import AttemptFiles, commit_with_retry, new_transaction, snapshot_summary_with_commit_id
from partfin_assets.iceberg.erasures import current_erasures
from partfin_assets.iceberg.tables import QUARANTINE_SCHEMA, ensure_quarantine_table
from partfin_assets.model import summary_keys as K
from partfin_assets.model.erasure import Erasures, without_erased
from partfin_assets.model.records import RECORD_IDENTITY, records_not_in
from partfin_assets.model.summary_keys import JobKind
from partfin_assets.model.tablespec import TableSpec



def quarantine_changes(catalog: Catalog, spec: TableSpec, unfit: pa.Table, cdc_snapshot_id: int, erasures: Erasures | None = None) -> int:
    """Append the changes of `unfit` (CDC rows + column, reason) not quarantined yet; how many were new.

    `erasures`: what `unfit` was filtered with; a privacy request the quarantine table is fenced at since
    (iceberg/erasures.py) is filtered here, in the commit attempt that sees it.
    """
    if unfit.num_rows == 0:
        return 0
    ensure_quarantine_table(catalog, spec)
    rows = unfit.append_column("cdc_snapshot_id", pa.array([cdc_snapshot_id] * unfit.num_rows, pa.int64()))
    rows = rows.select(QUARANTINE_SCHEMA.column_names)
    added = 0
    files = AttemptFiles()

    def build(table: Table, commit_id: str):
        nonlocal added
        fit, _ = without_erased(rows, current_erasures(catalog, spec, table, erasures or Erasures(spec.primary_key)))
        new = _not_yet_quarantined(table, fit)
        added = new.num_rows
        if not added:
            return None
        tx = new_transaction(table)
        summary = snapshot_summary_with_commit_id({K.QUARANTINED_RECORDS: str(added)}, commit_id, JobKind.INTO)
        files.append(tx, table, new, summary)
        return tx

    commit_with_retry(catalog, spec.quarantine_identifier, build, files=files)
    return added


def _not_yet_quarantined(table: Table, rows: pa.Table) -> pa.Table:
    if table.current_snapshot() is None:
        return rows
    held = pl.from_arrow(table.scan(selected_fields=RECORD_IDENTITY).to_arrow())
    new = pl.from_arrow(rows)
    assert isinstance(held, pl.DataFrame) and isinstance(new, pl.DataFrame)
    held = held.cast({c: new.schema[c] for c in RECORD_IDENTITY})
    return records_not_in(new, held).to_arrow()
