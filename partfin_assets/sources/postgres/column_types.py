"""PostgreSQL column types -> Arrow types, and how wal2json's values of each are written to the payload.

The payload is normalized like the Debezium reader's: timestamps ISO-8601 UTC with Z (a
`timestamp` without zone is read as UTC, like Debezium's MicroTimestamp), dates YYYY-MM-DD,
times HH:MM:SS[.ffffff], numerics as exact decimal strings, bytea as base64; NaN and ±Infinity
of floats as the strings JSON carries them in.
"""

from __future__ import annotations

import base64
import functools
import json
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pyarrow as pa

from partfin_assets.model.records import UTC_US
from partfin_assets.model.timeutil import iso_z

Normalize = Callable[[Any], Any]

_NON_FINITE = frozenset({"NaN", "Infinity", "-Infinity"})


def _as_int(value: Any) -> Any:
    return int(value) if isinstance(value, Decimal | str) else value


def _as_float(value: Any) -> Any:
    """A float8/real for the payload: a number, or NaN / ±Infinity as the strings JSON carries them in."""
    if isinstance(value, str) and value in _NON_FINITE:
        return value
    return float(value)


def _numeric_text(value: Any) -> str:
    """A numeric as exact text (NaN and ±Infinity, which PostgreSQL's numeric has, as their names)."""
    return format(value if isinstance(value, Decimal) else Decimal(str(value)), "f")


def _decimal_text(value: Any) -> str:
    text = _numeric_text(value)
    if text in ("NaN", "Infinity", "-Infinity", "sNaN"):
        raise ValueError(f"{value} does not fit a decimal column")
    return text


@functools.lru_cache(maxsize=4096)  # a transaction's now() repeats in every row it writes
def _timestamptz_text(value: Any) -> str:
    # The decoding session runs with TimeZone=UTC: "2026-11-29 12:51:14.100414+00".
    dt = datetime.fromisoformat(value)
    return iso_z(dt if dt.tzinfo else dt.replace(tzinfo=UTC))


def _time_text(value: Any) -> str:
    whole, dot, fraction = str(value).partition(".")
    if not dot or not fraction.strip("0"):
        return whole
    return f"{whole}.{fraction[:6].ljust(6, '0')}"


def _bytea_text(value: Any) -> str:
    text = str(value)
    if text.startswith("\\x"):
        text = text[2:]
    return base64.b64encode(bytes.fromhex(text)).decode("ascii")


def text_value(value: Any) -> Any:
    """A value of a column kept as text: a string as it is, a number exactly, anything else as compact JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, Decimal):
        return _numeric_text(value)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def column_type(typname: str, typmod: int, is_array: bool) -> tuple[pa.DataType, Normalize | None]:
    """Arrow type (one TableSpec supports) and value normalizer (None: as wal2json gives it) of a column type."""
    if is_array:
        return pa.string(), text_value
    if typname in ("int2", "int4"):
        return pa.int32(), _as_int
    if typname == "int8":
        return pa.int64(), _as_int
    if typname == "float4":
        return pa.float32(), _as_float
    if typname == "float8":
        return pa.float64(), _as_float
    if typname == "numeric":
        if typmod >= 4:
            precision, scale = ((typmod - 4) >> 16) & 0xFFFF, (typmod - 4) & 0xFFFF
            if 0 < precision <= 38 and 0 <= scale <= precision:
                return pa.decimal128(precision, scale), _decimal_text
        return pa.string(), _numeric_text  # no fixed scale fits every value: exact decimal text
    if typname == "bool":
        return pa.bool_(), None
    if typname == "bytea":
        return pa.binary(), _bytea_text
    if typname == "date":
        return pa.date32(), text_value
    if typname == "time":
        return pa.time64("us"), _time_text
    if typname in ("timestamptz", "timestamp"):
        return UTC_US, _timestamptz_text  # like Debezium's MicroTimestamp: a zoneless time is read as UTC
    return pa.string(), text_value
