"""Canonical record keys: the JSON object of the primary-key columns, sorted keys, no spaces.

Every source builds its `key` column here, so one row has one identity whatever
the source (`{"id":42}`, `{"id":7,"region":"eu"}`). The vectorized builder and
the per-record one produce byte-identical text (polars' JSON encoder and
`json.dumps(..., separators=(",", ":"), ensure_ascii=False)` agree; for floats the
vectorized builder is the one sources use).

A key a user gives (`partfin privacy-delete --key`, the `keys` of `privacy_delete_<table>`) is read
here too, against the table's key columns and their declared types (`parse_key`): it must name
exactly the key columns, each with a value that denotes exactly one value of the column's type,
written in one form per type (docs/privacy.md). Its `text` is then the canonical key the sources
wrote for that row, and `typed` the values of base.<table>'s key columns.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time
from decimal import Context, Decimal, Inexact, InvalidOperation
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from partfin_assets.model.errors import InvalidInput
from partfin_assets.model.timeutil import iso_z

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


# --------------------------------------------------------------------------- keys a user gives


@dataclass(frozen=True)
class GivenKey:
    """A key a user gave, read against the table's key columns (`parse_key`)."""

    text: str  # the canonical record key: cdc.<table>'s `key` of the row, what the erasure registry hashes
    typed: dict[str, Any]  # the key columns' values as base.<table> holds them (int, str, Decimal, date, datetime, ...)


class _Refused(ValueError):
    """Why a value is not one value of a column's type (no echo of the value: it is personal data)."""


def key_from_json(text: str, what: str) -> dict[str, Any]:
    """A key written as a JSON object, read exactly: numbers with a fraction or an exponent stay `Decimal` (never a
    rounded float), NaN / Infinity and a column named twice are refused (`json.loads` would keep the last)."""

    def no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        names = [name for name, _ in pairs]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise InvalidInput(f"{what} names column(s) {repeated} more than once")
        return dict(pairs)

    def not_a_number(name: str) -> Any:
        raise InvalidInput(f"{what} holds {name}, which is not JSON")

    try:
        key = json.loads(text, parse_float=Decimal, parse_constant=not_a_number, object_pairs_hook=no_repeats)
    except json.JSONDecodeError:
        key = None
    if not isinstance(key, dict) or not key:
        raise InvalidInput(f"{what} is not a JSON object naming the primary key, e.g. '{{\"id\": 42}}'")
    return key


def parse_key(given: Mapping[str, Any], primary_key: Sequence[str], column_types: Mapping[str, pa.DataType], what: str) -> GivenKey:
    """`given` ({column: value}) as the key of a table with these key columns and declared types, or InvalidInput
    naming `what` (e.g. "--key #2 for cdc.orders"), the column and the form its type takes; never the value."""
    if not isinstance(given, Mapping):
        raise InvalidInput(f"{what} is not an object of the primary key's columns {list(primary_key)}")
    if set(given) != set(primary_key):
        missing = [c for c in primary_key if c not in given]
        extra = sorted(c for c in given if c not in primary_key)
        wrong = "; ".join(part for part in (f"missing {missing}" if missing else "", f"not key columns: {extra}" if extra else "") if part)
        raise InvalidInput(f"{what} must name exactly the primary key {list(primary_key)} ({wrong})")
    canonical: dict[str, Any] = {}
    typed: dict[str, Any] = {}
    for column in primary_key:
        data_type = column_types.get(column)
        try:
            typed[column], canonical[column] = _key_value(given[column], data_type)
        except _Refused as exc:
            described = "has no declared type" if data_type is None else f"is {data_type}"
            raise InvalidInput(f"{what}: key column {column!r} {described}: {exc}") from None
    text = key_json_column({c: [canonical[c]] for c in primary_key}).to_pylist()[0]
    return GivenKey(text, typed)


_DATE_TEXT = re.compile(r"\d{4}-\d{2}-\d{2}")
_TIME_TEXT = re.compile(r"\d{2}:\d{2}:\d{2}(?:\.\d{1,6})?")
_DATETIME_TEXT = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d{1,6})?(?P<zone>Z|[+-]\d{2}:\d{2})?")
_DECIMAL_TEXT = re.compile(r"-?\d+(?:\.\d+)?")
_EXACT = Context(prec=1_000, traps=[Inexact, InvalidOperation])


def _kind(value: Any) -> str:
    """What a value is, in words (the refusal names this, never the value)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, Decimal | float):
        return "a number with a fraction or an exponent"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def _key_value(value: Any, data_type: pa.DataType | None) -> tuple[Any, Any]:
    """(the value as base holds it, the value as the canonical key writes it) of one key column, or _Refused."""
    kind = _kind(value)
    if data_type is None:  # undeclared (a schemaless source): its values stand as the source wrote them
        if isinstance(value, bool | int | str):
            return value, value
        raise _Refused(f"give an integer, a string or a boolean as the source wrote it, not {kind}")
    if pa.types.is_integer(data_type):
        if kind != "an integer":
            raise _Refused(f"give a JSON integer such as 42, not {kind} (9.0, \"9\" and true are not integers)")
        info = np.iinfo(data_type.to_pandas_dtype())
        if not info.min <= value <= info.max:
            raise _Refused(f"the integer is out of the {data_type} range")
        return value, value
    if pa.types.is_string(data_type) or pa.types.is_large_string(data_type):
        if kind != "a string":
            raise _Refused(f"give a JSON string, matched exactly (case included), not {kind}")
        return value, value
    if pa.types.is_boolean(data_type):
        if kind != "a boolean":
            raise _Refused(f"give true or false, not {kind}")
        return value, value
    if pa.types.is_decimal(data_type):
        number = _decimal(value, data_type.precision, data_type.scale)
        return number, format(number, "f")
    if pa.types.is_floating(data_type):
        if kind not in ("an integer", "a number with a fraction or an exponent") or not math.isfinite(value):
            raise _Refused(f"give a finite JSON number, not {kind}")
        return float(value), float(value)
    if pa.types.is_date(data_type):
        if kind != "a string" or not _DATE_TEXT.fullmatch(value):
            raise _Refused(f"give the date as text YYYY-MM-DD, not {kind}")
        day = _parsed(date.fromisoformat, value, "not a calendar date")
        return day, day.isoformat()
    if pa.types.is_time(data_type):
        if kind != "a string" or not _TIME_TEXT.fullmatch(value):
            raise _Refused(f"give the time of day as text HH:MM:SS[.ffffff], not {kind}")
        moment = _parsed(time.fromisoformat, value, "not a time of day")
        return moment, moment.isoformat(timespec="microseconds" if moment.microsecond else "seconds")
    if pa.types.is_timestamp(data_type):
        match = _DATETIME_TEXT.fullmatch(value) if kind == "a string" else None
        zoned = data_type.tz is not None
        if match is None or (match["zone"] is not None) != zoned:
            form = "ISO 8601 with its zone (Z or +hh:mm)" if zoned else "ISO 8601 without a zone (the source's wall clock)"
            raise _Refused(f"give the timestamp as text YYYY-MM-DDTHH:MM:SS[.ffffff], {form}, not {kind}"
                           + ("" if kind != "a string" else " of another form"))
        moment = _parsed(datetime.fromisoformat, value.replace("Z", "+00:00"), "not a valid time")
        if zoned:
            moment = moment.astimezone(UTC)
            return moment, iso_z(moment)
        return moment, moment.isoformat(timespec="microseconds" if moment.microsecond else "seconds")
    if pa.types.is_binary(data_type):
        if kind != "a string":
            raise _Refused(f"give the bytes as base64 text, not {kind}")
        raw = _parsed(lambda text: base64.b64decode(text, validate=True), value, "not base64 text")
        return raw, base64.b64encode(raw).decode("ascii")
    raise _Refused("a key column of this type cannot be given: erase the key through a column of a simpler type")


def _decimal(value: Any, precision: int, scale: int) -> Decimal:
    """A decimal(precision, scale) value given as a JSON number or as decimal text, exactly (never rounded)."""
    if isinstance(value, str) and _DECIMAL_TEXT.fullmatch(value):
        number = Decimal(value)
    elif isinstance(value, Decimal | int | float) and not isinstance(value, bool):
        number = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    else:
        raise _Refused(f"give a JSON number or decimal text such as 12.50, not {_kind(value)}")
    if not number.is_finite():
        raise _Refused("give a finite number")
    try:
        number = number.quantize(Decimal(1).scaleb(-scale), context=_EXACT)
    except (Inexact, InvalidOperation):
        raise _Refused(f"the number has more than {scale} fraction digits") from None
    if number.adjusted() >= precision - scale:
        raise _Refused(f"the number has more than {precision - scale} digits before the point")
    return abs(number) if number.is_zero() else number  # -0.00 is 0.00, as every source writes it


def _parsed(parse, text: str, refusal: str) -> Any:
    try:
        return parse(text)
    except (ValueError, binascii.Error):
        raise _Refused(refusal) from None
