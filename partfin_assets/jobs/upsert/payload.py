"""Typed columns from CDC JSON: the one place the payload-to-column mapping is declared.

The mapping is derived from the table declaration (TableSpec.columns) and is the
same for every table:

| declared type           | JSON value in the payload                                   |
|-------------------------|-------------------------------------------------------------|
| bool                    | true / false                                                |
| int32, int64            | integer number (int32 range-checked)                        |
| float, double           | number, or "NaN" / "Infinity" / "-Infinity"                 |
| string                  | string                                                      |
| binary                  | base64 string                                               |
| date32[day]             | "YYYY-MM-DD"                                                |
| time64[us]              | "HH:MM:SS[.ffffff]"                                         |
| timestamp[us, tz=UTC]   | ISO-8601 string with an offset or Z ("2024-05-01T12:00:00Z") |
| timestamp[us]           | ISO-8601 string without an offset                           |
| decimal128(p, s)        | decimal string ("12.30"); more than s fraction digits is rejected |
| struct<...>             | object of its fields, each in its own type's form (geometry: {"wkb": base64, "srid": n}) |

Every declared column must be present in an after-image (JSON null is a value; a
missing key is not), primary-key columns must not be null, and no lenient
coercion happens (a number for a string column, "5" for an int column, 1.5 for
an int column are all rejected). Fields not declared are ignored.

Parsing is vectorized (Arrow's JSON reader with an explicit schema, then Arrow /
polars casts). Only when a batch fails is it split, with the same vectorized decoder,
down to the records that do not fit, so each is named with its column and reason and the
others decode.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
from partfin_assets.model.errors import PartfinError, first_line

# how JsonConverter and partfin's sources write the floats JSON has no number for
_NON_FINITE = re.compile(r'"(?:NaN|-?Infinity)"')


@dataclass(frozen=True)
class Unfit:
    """A record whose JSON does not fit the declared columns."""

    index: int  # position in the texts given
    column: str | None  # None: the record as a whole (not an object, empty...)
    reason: str


class _Unfit(PartfinError):
    def __init__(self, column: str | None, reason: str) -> None:
        super().__init__(reason)
        self.column = column
        self.reason = reason


def carrier_type(data_type: pa.DataType) -> pa.DataType:
    """The Arrow type the JSON reader decodes a declared column into (strict on JSON kinds)."""
    if pa.types.is_boolean(data_type) or pa.types.is_string(data_type):
        return data_type
    if pa.types.is_integer(data_type):
        return pa.int64()
    if pa.types.is_floating(data_type):
        return pa.float64()
    if pa.types.is_struct(data_type):
        return pa.struct([pa.field(f.name, carrier_type(f.type)) for f in data_type])
    if (
        pa.types.is_binary(data_type)
        or pa.types.is_date(data_type)
        or pa.types.is_time(data_type)
        or pa.types.is_timestamp(data_type)
        or pa.types.is_decimal(data_type)
    ):
        return pa.string()
    raise TypeError(f"no JSON mapping for column type {data_type}")


def _convert(name: str, values: pa.Array, target: pa.DataType) -> pa.Array:
    """Carrier -> declared type; raises _Unfit when any value does not fit."""
    if values.type == target:
        return values
    try:
        if pa.types.is_struct(target):
            children = [_convert(f"{name}.{f.name}", values.field(f.name), f.type) for f in target]
            return pa.StructArray.from_arrays(children, fields=list(target), mask=values.is_null())
        if pa.types.is_time(target):
            series = pl.Series(name, values).str.to_time("%H:%M:%S%.f", strict=True)
            return series.to_arrow().cast(target)
        if pa.types.is_binary(target):
            series = pl.Series(name, values).str.decode("base64", strict=True)
            return series.to_arrow().cast(target)
        return pc.cast(values, target, safe=True)
    except _Unfit:
        raise
    except (pa.ArrowException, pl.exceptions.PolarsError, ValueError) as exc:
        raise _Unfit(name, f"value does not fit {target}: {first_line(str(exc))}") from exc


def _floats_by_path(name: str, lines: pl.Series) -> pa.Array:
    """A float column read with its NaN / ±Infinity strings (the JSON reader takes numbers only)."""
    key = '"' + re.escape(name) + r'"\s*:\s*"'
    strings, non_finite = lines.str.count_matches(key), lines.str.count_matches(key + r'(?:NaN|-?Infinity)"')
    if (strings != non_finite).any():
        raise _Unfit(name, "value does not fit double: a string other than NaN / Infinity / -Infinity")
    try:
        return lines.str.json_path_match(f"$['{name}']").cast(pl.Float64, strict=True).to_arrow()
    except pl.exceptions.PolarsError as exc:
        raise _Unfit(name, f"value does not fit double: {first_line(str(exc))}") from exc


def _decode(texts: pa.Array, columns: Mapping[str, pa.DataType], required: Sequence[str]) -> pa.Table:
    """Decode JSON object texts into typed columns, or raise _Unfit (column None: not locatable yet)."""
    n = len(texts)
    names = list(columns)
    if n == 0:
        return pa.table({c: pa.array([], t) for c, t in columns.items()})
    series = pl.Series("p", texts, dtype=pl.String)
    if series.null_count():
        raise _Unfit(None, "payload is null")
    # Newlines are JSON whitespace outside strings (and invalid inside them): one record per line.
    lines = series.str.replace_all(r"[\r\n]", " ")
    if (lines.str.strip_chars() == "").any():
        raise _Unfit(None, "payload is empty")
    by_path = [c for c, t in columns.items() if pa.types.is_floating(t)] if lines.str.contains(_NON_FINITE.pattern).any() else []
    buffer = lines.str.join("\n").item().encode()
    schema = pa.schema([pa.field(c, carrier_type(t)) for c, t in columns.items() if c not in by_path])
    try:
        decoded = pj.read_json(
            io.BytesIO(buffer),
            read_options=pj.ReadOptions(use_threads=True, block_size=max(1 << 20, min(len(buffer) + 1, 1 << 28))),
            parse_options=pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"),
        )
    except (pa.ArrowException, ValueError) as exc:
        raise _Unfit(None, f"not a JSON object of the declared columns: {first_line(str(exc))}") from exc
    if decoded.num_rows != n:
        raise _Unfit(None, "not exactly one JSON object")
    out = {}
    for name in names:
        values = _floats_by_path(name, lines) if name in by_path else decoded.column(name).combine_chunks()
        out[name] = _convert(name, values, columns[name])
        nulls = values.is_null()
        if values.null_count:
            if name in required:
                raise _Unfit(name, "primary-key column is null")
            # A null value is fine; a missing key is not. Look only at the null rows.
            pattern = '"' + re.escape(name) + r'"\s*:'
            present = pl.Series("p", texts.filter(nulls), dtype=pl.String).str.contains(pattern)
            if not present.all():
                raise _Unfit(name, "column missing from the payload")
    return pa.table(out)


def decode_columns(
    texts: pa.Array | pa.ChunkedArray,
    columns: Mapping[str, pa.DataType],
    required: Sequence[str] = (),
) -> tuple[pa.Table, list[Unfit]]:
    """Typed columns of the JSON texts (one per change) that fit, and an `Unfit` for each that does not.

    The table holds the fitting records in their order; an `Unfit`'s index is into `texts`.
    """
    texts = _plain(texts)
    try:
        return _decode(texts, columns, required), []
    except _Unfit:
        pass
    unfit: list[Unfit] = []
    _find_unfit(texts, 0, len(texts), columns, required, unfit)
    bad = {u.index for u in unfit}
    fitting = pa.array([i not in bad for i in range(len(texts))])
    return _decode(texts.filter(fitting), columns, required), unfit


def _plain(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    return values.cast(pa.string())


def _find_unfit(
    texts: pa.Array, lo: int, hi: int, columns: Mapping[str, pa.DataType], required: Sequence[str], unfit: list[Unfit]
) -> None:
    """Split the failing records [lo, hi) in halves down to the ones that do not fit (error path only)."""
    if hi - lo == 1:
        column, reason = _locate(texts.slice(lo, 1), columns, required)
        unfit.append(Unfit(lo, column, reason))
        return
    mid = (lo + hi) // 2
    for start, end in ((lo, mid), (mid, hi)):
        try:
            _decode(texts.slice(start, end - start), columns, required)
        except _Unfit:
            _find_unfit(texts, start, end, columns, required, unfit)


def _locate(record: pa.Array, columns: Mapping[str, pa.DataType], required: Sequence[str]) -> tuple[str | None, str]:
    """The column (if one) and reason a single record does not fit."""
    try:
        _decode(record, {}, ())
    except _Unfit as exc:
        return None, exc.reason
    for name, data_type in columns.items():  # one declared column at a time
        try:
            _decode(record, {name: data_type}, [c for c in required if c == name])
        except _Unfit as exc:
            return name, exc.reason
    try:
        _decode(record, columns, required)
    except _Unfit as exc:
        return exc.column, exc.reason
    return None, "does not decode"
