"""Canonical record keys: the JSON object of the primary-key columns, sorted keys, no spaces.

Every source builds its `key` column here, so one row has one identity whatever
the source (`{"id":42}`, `{"id":7,"region":"eu"}`). The vectorized builder and
the per-record one produce byte-identical text (polars' JSON encoder and
`json.dumps(..., separators=(",", ":"), ensure_ascii=False)` agree).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

KeyColumn = Sequence[Any] | np.ndarray | pa.Array | pa.ChunkedArray | pl.Series


def canonical_key(values: Mapping[str, Any]) -> str:
    """The key of one record, from its primary-key column values."""
    return json.dumps(dict(values), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def key_json_column(columns: Mapping[str, KeyColumn]) -> pa.Array:
    """The keys of a whole batch, from equal-length primary-key columns."""
    if not columns:
        raise ValueError("a key needs at least one primary-key column")
    try:
        frame = pl.DataFrame({name: _as_series(name, values) for name, values in columns.items()})
    except (TypeError, pl.exceptions.PolarsError, pa.ArrowException):
        # A column mixing value types (e.g. ints and strings from schemaless JSON)
        # has no single dtype: encode row by row, which gives the same text.
        return _key_json_per_row(columns)
    keys = frame.select(pl.struct(sorted(frame.columns)).struct.json_encode()).to_series()
    return keys.to_arrow().cast(pa.string())


def _as_series(name: str, values: KeyColumn) -> pl.Series:
    if isinstance(values, pl.Series):
        return values.alias(name)
    if isinstance(values, pa.Array | pa.ChunkedArray | np.ndarray):
        return pl.Series(name, values)
    return pl.Series(name, list(values), strict=True)


def _key_json_per_row(columns: Mapping[str, KeyColumn]) -> pa.Array:
    names = list(columns)
    value_lists = [_as_list(columns[name]) for name in names]
    rows = zip(*value_lists, strict=True)
    return pa.array([canonical_key(dict(zip(names, row, strict=True))) for row in rows], type=pa.string())


def _as_list(values: KeyColumn) -> list[Any]:
    if isinstance(values, pa.Array | pa.ChunkedArray):
        return values.to_pylist()
    if isinstance(values, np.ndarray):
        return values.tolist()
    return list(values)  # a polars Series iterates as Python values too
