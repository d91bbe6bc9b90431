"""Upsert step 2, decode: CDC rows -> typed change rows, then the latest change per primary key and change log.

Keys and payloads are decoded into the declared typed columns (jobs/upsert/payload.py) in two
steps: the keys once for the run (`decode_keys`, enough to route each change to its key group),
the payloads per key group (`decode_payloads`, in the group's own step when the upsert fans out:
the larger part of the decode runs in parallel). A change that does not fit (an unknown op, a key
or payload that does not decode, a payload whose key columns disagree with its key) is set aside
with its reason for the quarantine (jobs/upsert/quarantine.py), in CDC order whichever step found
it; the other changes merge as if it were not there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from partfin_assets.iceberg.tables import DELETED, EVENT_TIME, ORDER_TIME, SOURCE_LOG, SOURCE_SEQ, base_columns
from partfin_assets.jobs.upsert.payload import Unfit, decode_columns
from partfin_assets.model.records import SOURCE_LOG as CDC_SOURCE_LOG
from partfin_assets.model.records import with_source_log
from partfin_assets.model.tablespec import TableSpec

OPS_UPSERT = ("c", "u", "r")
OP_DELETE = "d"
CHANGE_COLUMNS = ["key", "op", "event_time", "source_seq", "payload", CDC_SOURCE_LOG]
CDC_ROW = "cdc_row"  # a change's row in what the run read: the quarantine keeps the CDC order whoever decoded it


@dataclass(frozen=True)
class KeyedRows:
    """CDC rows whose operation is known and whose key decodes: each row's typed primary key (`keys`) beside the row
    itself (`rows`: CHANGE_COLUMNS and CDC_ROW). Enough to route a change to its key group; payloads are decoded there."""

    keys: pl.DataFrame
    rows: pa.Table

    def filter(self, mask: pl.Series) -> KeyedRows:
        return KeyedRows(self.keys.filter(mask), self.rows.filter(pa.array(mask.to_numpy())))


def decode_keys(spec: TableSpec, raw: pa.Table) -> tuple[KeyedRows, pa.Table]:
    """Step 2a, CDC rows -> the rows with a known operation and a key that decodes; the others, with `column` and `reason`."""
    pk = list(spec.primary_key)
    columns = base_columns(spec)
    raw = with_source_log(raw, None).select(CHANGE_COLUMNS)  # a table written before partfin kept the log: unknown
    raw = raw.append_column(CDC_ROW, pa.array(np.arange(raw.num_rows), pa.int64()))
    unfit: dict[int, tuple[str | None, str]] = {}  # CDC row -> (column, reason)
    rows = np.arange(raw.num_rows)
    ops = raw.column("op")
    known_op = pc.is_in(ops, pa.array([*OPS_UPSERT, OP_DELETE])).to_numpy(zero_copy_only=False)
    for row in rows[~known_op]:
        unfit[int(row)] = ("op", f"unknown CDC operation {ops[int(row)].as_py()!r}")
    rows = rows[known_op]
    key_values, bad_keys = decode_columns(raw.column("key").take(rows), {c: columns[c] for c in pk}, pk)
    rows = _set_aside(rows, bad_keys, unfit, "key: ")
    keys = pl.from_arrow(key_values)
    assert isinstance(keys, pl.DataFrame)
    return KeyedRows(keys, raw.take(rows)), _unfit_rows(raw, unfit)


def decode_payloads(spec: TableSpec, keyed: KeyedRows) -> tuple[pl.DataFrame, pa.Table]:
    """Step 2b, keyed CDC rows -> typed change rows (declared columns + _event_time, _source_seq, _tombstone, _source_log,
    not yet deduplicated); the rows whose after-image does not fit, with `column` and `reason`."""
    columns = base_columns(spec)
    pk = list(spec.primary_key)
    raw = keyed.rows
    unfit: dict[int, tuple[str | None, str]] = {}  # row of `raw` -> (column, reason)
    rows = np.arange(raw.num_rows)
    is_delete = pc.equal(raw.column("op"), OP_DELETE).to_numpy(zero_copy_only=False)
    upsert_rows = rows[~is_delete]
    values, bad_payloads = decode_columns(raw.column("payload").take(upsert_rows), columns, pk)
    upsert_key_values = keyed.keys.filter(pl.Series(~is_delete))
    if bad_payloads:
        kept = np.ones(len(upsert_rows), dtype=bool)
        kept[[u.index for u in bad_payloads]] = False
        upsert_key_values = upsert_key_values.filter(pl.Series(kept))
        upsert_rows = _set_aside(upsert_rows, bad_payloads, unfit)
    values = pl.from_arrow(values)
    assert isinstance(values, pl.DataFrame)
    # The after-image must describe the row its key names.
    disagree = np.zeros(values.height, dtype=bool)
    for c in pk:
        differs = values.get_column(c).ne_missing(upsert_key_values.get_column(c)).to_numpy()
        for index in np.flatnonzero(differs & ~disagree):
            unfit[int(upsert_rows[index])] = (c, f"payload value {values.get_column(c)[int(index)]!r} disagrees with the change key")
        disagree |= differs
    values = values.filter(pl.Series(~disagree))
    upsert_rows = upsert_rows[~disagree]

    upserts = pl.concat([values, _meta(raw, upsert_rows)], how="horizontal")
    deletes = pl.concat([keyed.keys.filter(pl.Series(is_delete)), _meta(raw, rows[is_delete])], how="horizontal")
    empty = pl.DataFrame(schema={**{c: pl.from_arrow(pa.array([], t)).dtype for c, t in columns.items()}, **_meta(raw, rows[:0]).schema})
    changes = pl.concat([empty, upserts, deletes], how="diagonal_relaxed")
    return changes, _unfit_rows(raw, unfit)


def unfit_in_cdc_order(parts: list[pa.Table]) -> pa.Table:
    """The unfit rows set aside by the decode steps (keys in one place, payloads per key group), in CDC order."""
    return pa.concat_tables(parts).sort_by(CDC_ROW)


def _set_aside(rows: np.ndarray, found: list[Unfit], unfit: dict[int, tuple[str | None, str]], prefix: str = "") -> np.ndarray:
    """Record the unfit among `rows` (indexes into the decoded table) in `unfit`; the rows that remain."""
    for u in found:
        unfit[int(rows[u.index])] = (u.column, prefix + u.reason)
    return np.delete(rows, [u.index for u in found])


def _meta(raw: pa.Table, rows: np.ndarray) -> pl.DataFrame:
    frame = pl.from_arrow(raw.take(rows))
    assert isinstance(frame, pl.DataFrame)
    return frame.select(
        pl.col("event_time").alias(EVENT_TIME),
        pl.col("source_seq").alias(SOURCE_SEQ),
        (pl.col("op") == OP_DELETE).alias(DELETED),
        pl.col(CDC_SOURCE_LOG).alias(SOURCE_LOG),
        pl.col("op"),
        pl.col("payload"),
    )


def _unfit_rows(raw: pa.Table, unfit: dict[int, tuple[str | None, str]]) -> pa.Table:
    order = sorted(unfit)
    rows = raw.take(pa.array(order, pa.int64()))
    rows = rows.append_column("column", pa.array([unfit[i][0] for i in order], pa.string()))
    return rows.append_column("reason", pa.array([unfit[i][1] for i in order], pa.string()))


# Last writer wins: the order of two versions of a key (a change, or a base row beside it).
#
# Within one change log (a writer's progress stream: cdc `source_log`) the log's own order decides:
# `source_seq` (file line, LSN, Kafka offset in its partition, generator index). Event time only orders
# versions of different logs (several writer ids or Kafka partitions of one table), or of unknown ones.
# To make that one total order, each version is ranked at its *order time*: its event time, but never
# before an earlier change of its key in its log (a clock that steps back in a failover or an NTP step
# does not make a later change older). Versions are ordered by (order time, log, source_seq): within a
# log, order time never decreases along the log, so source_seq decides; between logs order time does,
# then the log id (ties between logs must not depend on which changes a run happens to see), and a
# null (unknown) log ranks lowest. The base row keeps its winner's log and order time
# (`_source_log`, `_order_time`, iceberg/tables.py), so a later run ranks the next change of that log
# from where the log stood. This needs a log to deliver its changes in its order, re-deliveries aside,
# which every partfin source does. Rows written before partfin kept the log (null `_source_log`, null
# `_order_time`: the event time) rank by event time as before.
ORDER_KEY = (ORDER_TIME, SOURCE_LOG, SOURCE_SEQ)


def latest_per_log(spec: TableSpec, changes: pl.DataFrame) -> pl.DataFrame:
    """Per primary key and change log, the latest change, ranked at its order time within what this run read.

    Every other change of a key in one log is older than that one whatever the base holds, so nothing
    the merge needs is lost. A change of an unknown (null) log is ranked at its event time, and only the
    newest of them by (event time, source position) is kept. op and payload only make the choice
    deterministic should a source ever repeat a position.
    """
    per_log = [*spec.primary_key, SOURCE_LOG]
    order_time = pl.when(pl.col(SOURCE_LOG).is_not_null()).then(pl.col(EVENT_TIME).max().over(per_log)).otherwise(pl.col(EVENT_TIME))
    ordered = changes.with_columns(order_time.alias(ORDER_TIME)).sort([*ORDER_KEY, "op", "payload"], nulls_last=False)
    return ordered.unique(subset=per_log, keep="last", maintain_order=False).drop(["op", "payload"])


def newer_than_base(change_suffix: str) -> pl.Expr:
    """True where a change (columns named `<column><change_suffix>`) is strictly newer than the base row beside it.

    A change replaces a base row only when it is strictly newer, so re-delivered or reordered
    changes give the same table; a null base side (no base row) is not newer: callers decide.
    The base's order time must be filled (null: its event time); a null log ranks lowest.
    """
    newer: pl.Expr | None = None
    equal_so_far: pl.Expr | None = None
    for column in ORDER_KEY:
        change, base = pl.col(column + change_suffix), pl.col(column)
        if column == SOURCE_LOG:
            change, base = change.fill_null(""), base.fill_null("")
        step = change > base if equal_so_far is None else equal_so_far & (change > base)
        newer = step if newer is None else newer | step
        equal_so_far = (change == base) if equal_so_far is None else equal_so_far & (change == base)
    assert newer is not None
    return newer
