"""Upsert step 2, decode: CDC rows -> typed change rows, then one winning change per primary key.

Keys and payloads are decoded into the declared typed columns (jobs/upsert/payload.py). Any
change that does not fit aborts the run before anything is written.
"""

from __future__ import annotations

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from partfin_assets.iceberg.tables import DELETED, EVENT_TIME, SOURCE_SEQ, base_columns
from partfin_assets.jobs.upsert.payload import UpsertPayloadError, decode_columns
from partfin_assets.model.tablespec import TableSpec

OPS_UPSERT = ("c", "u", "r")
OP_DELETE = "d"


def decode_changes(spec: TableSpec, raw: pa.Table) -> pl.DataFrame:
    """CDC rows -> typed change rows: declared columns + _event_time, _source_seq, _deleted (not yet deduplicated)."""
    columns = base_columns(spec)
    pk = list(spec.primary_key)
    frame = pl.from_arrow(raw.select(["key", "op", "event_time", "source_seq", "payload"]))
    assert isinstance(frame, pl.DataFrame)
    bad_op = frame.filter(~pl.col("op").is_in([*OPS_UPSERT, OP_DELETE]))
    if bad_op.height:
        raise UpsertPayloadError(spec.name, bad_op["key"][0], "op", f"unknown CDC operation {bad_op['op'][0]!r}")
    keys = raw.column("key")
    key_values = pl.from_arrow(decode_columns(spec.name, keys, keys, {c: columns[c] for c in pk}, pk))
    is_delete = frame.get_column("op") == OP_DELETE
    upsert_mask = pa.array((~is_delete).to_arrow())
    upsert_keys = pc.filter(keys, upsert_mask)
    values = pl.from_arrow(decode_columns(spec.name, upsert_keys, pc.filter(raw.column("payload"), upsert_mask), columns, pk))
    assert isinstance(values, pl.DataFrame) and isinstance(key_values, pl.DataFrame)
    # The after-image must describe the row its key names.
    upsert_key_values = key_values.filter(~is_delete)
    for c in pk:
        differs = values.get_column(c).ne_missing(upsert_key_values.get_column(c))
        if differs.any():
            index = int(differs.arg_true()[0])
            raise UpsertPayloadError(
                spec.name, upsert_keys[index].as_py(), c,
                f"payload value {values.get_column(c)[index]!r} disagrees with the change key",
            )
    meta = frame.select(
        pl.col("event_time").alias(EVENT_TIME),
        pl.col("source_seq").alias(SOURCE_SEQ),
        (pl.col("op") == OP_DELETE).alias(DELETED),
        pl.col("op"),
        pl.col("payload"),
    )
    upserts = pl.concat([values, meta.filter(~is_delete)], how="horizontal")
    deletes = pl.concat([key_values.filter(is_delete), meta.filter(is_delete)], how="horizontal")
    empty = pl.DataFrame(schema={**{c: pl.from_arrow(pa.array([], t)).dtype for c, t in columns.items()}, **meta.schema})
    return pl.concat([empty, upserts, deletes], how="diagonal_relaxed")


def winners(spec: TableSpec, changes: pl.DataFrame) -> pl.DataFrame:
    """One change per primary key: the newest by (event time, source position).

    (event time, source position) identifies a change, so ties are re-deliveries of the same change;
    op and payload only make the choice deterministic should a source ever repeat a position.
    """
    ordered = changes.sort([EVENT_TIME, SOURCE_SEQ, "op", "payload"], nulls_last=False)
    return ordered.unique(subset=list(spec.primary_key), keep="last", maintain_order=False).drop(["op", "payload"])
