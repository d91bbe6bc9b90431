"""Debezium JSON message values: the one decoder every Debezium source calls (a JSON-lines file; Kafka next).

A value is what Kafka Connect's JsonConverter writes: with `schemas.enable=true` the
`{"schema", "payload"}` envelope, else the bare payload. `DebeziumJsonDecoder.decode(value)`
takes the value's bytes (or text; None is Kafka's null value) and returns

- `DecodedChange`: op, key column values, event time (`source.ts_ms`), arrival time (the
  envelope's `ts_ms`, None if absent or implausible) and the after-image as partfin's payload JSON;
- `DecodedHeartbeat`: a Debezium heartbeat message (heartbeat.interval.ms; schema name
  io.debezium.connector.common.Heartbeat, value `{"ts_ms": ...}`): the connector's clock;
- None: a tombstone (`"payload": null`, an empty value, a null value);

or raises `RejectedMessage` whose text is the reason (the caller keeps the raw value with it).

Limits: one message never stops a stream. A value longer than `max_message_bytes`
(PARTFIN_MAX_MESSAGE_BYTES, default 64 MiB) is rejected without being parsed; one nested deeper
than MAX_NESTING_DEPTH is rejected before the parser could exhaust Python's recursion; a string
that is no UTF-8 text (a lone surrogate escape such as `\\ud800`) is rejected before a library
meets it; and any other exception while decoding one message rejects that message, naming the
exception (a warning is logged the first time an exception type is met: it may be a partfin bug).
A UTF-8 byte-order mark before the JSON (a file's first line written by a Windows tool) is ignored.

JSON is parsed without going through float: JSON numbers with a fraction or exponent become
`Decimal`, so decimals sent as numbers (`decimal.format=NUMERIC`) stay exact.

Column types (`connect_column`; docs/sources.md has the same table). int8 and
int16 become int32 (Iceberg's smallest integer). Decimals keep their scale; a precision below
the scale (`numeric(5,6)`) is widened to the scale, a Decimal without precision gets 38, and
beyond 38 digits (Iceberg's limit) the column is the exact decimal text. Non-finite floats
(JsonConverter writes them as the strings "NaN", "Infinity", "-Infinity"; bare NaN tokens are
read too) are kept and written to the payload as those strings. A type partfin does not know is
kept as text (a string as it is, anything else as compact JSON) with one warning naming the column.

With a declaration (the table's typed columns), each message is checked against it: a column the
message's schema types differently is converted when that loses nothing (int32 -> int64, float ->
double, a zoneless timestamp into a timestamptz column as UTC, as older partfin declared it) and
otherwise rejected naming the column; a declared column the message's schema lacks (dropped at
the source) is null; a column the declaration lacks stays in the payload (cdc keeps it) and is
named in one warning. Messages without a schema block are typed by the declaration alone; a
decimal column's JSON is then read only in the column's declared encoding (`base64` bytes, the
default, or `numeric`: model/tablespec.py DECIMAL_ENCODINGS), never guessed from how it looks
("1234" is valid base64 and decimal text), and a table declared from schema blocks records the
encoding of a Connect Decimal's first value (`decimal_encodings`).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from decimal import Context, Decimal, Inexact, InvalidOperation
from typing import Any

import numpy as np
import pyarrow as pa

from partfin_assets.model.errors import PartfinConfigError, PartfinError, SourceError, one_line
from partfin_assets.model.records import UTC_US, VALID_OPS, implausible_event_time
from partfin_assets.model.settings import Settings
from partfin_assets.model.tablespec import DEFAULT_DECIMAL_ENCODING
from partfin_assets.model.timeutil import US_PER_SECOND, iso_z, parse_iso

log = logging.getLogger(__name__)

Normalize = Callable[[Any], Any]

ZONELESS_US = pa.timestamp("us")
MAX_DECIMAL_PRECISION = 38  # Iceberg's decimal(P, S) holds at most 38 digits
HEARTBEAT_SCHEMA_NAME = "io.debezium.connector.common.Heartbeat"
_EPOCH_DATE = date(1970, 1, 1)
_EPOCH = datetime(1970, 1, 1)
_INT_RANGES = {pa.int32(): (-(2**31), 2**31 - 1), pa.int64(): (-(2**63), 2**63 - 1)}
_NON_FINITE_TEXT = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_FLOAT32_MAX = 3.4028234663852886e38
_EXACT = Context(prec=1_000, traps=[Inexact, InvalidOperation])  # rescaling that would round raises
_DECIMAL_TEXT = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")  # what Java's BigDecimal writes, no NaN/spaces/_
_TIME_TEXT = re.compile(r"(\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?")
# A Debezium envelope is under 10 levels deep (a struct column in the after-image in the payload);
# Python's JSON parser and partfin's own recursive walks give out near 1,000 (RecursionError).
MAX_NESTING_DEPTH = 64
OVERSIZED_RAW_BYTES = 65_536  # of a message over the size limit, cdc.<table>__rejected keeps this much, as evidence
UTF8_BOM = b"\xef\xbb\xbf"  # a byte-order mark: Windows tools write one at the start of a file
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")


class RejectedMessage(PartfinError, ValueError):
    """A message that is not a usable change event; the text is the reason."""


@dataclass(frozen=True, slots=True)
class DecodedChange:
    op: str
    key_values: dict[str, Any]
    event_time_us: int
    arrival_us: int | None  # the envelope's ts_ms: when Debezium processed the change
    payload: str | None  # the after-image (None for deletes)


@dataclass(frozen=True)
class DecodedHeartbeat:
    time_us: int


# --------------------------------------------------------------------------- values


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | Decimal | float):
        raise ValueError(f"not an integer: {value!r}")
    if isinstance(value, int):
        return value
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"not an integer: {value!r}")
    return int(value)


def _ranged_integer(data_type: pa.DataType) -> Normalize:
    low, high = _INT_RANGES[data_type]

    def normalize(value: Any) -> int:
        number = _integer(value)
        if not low <= number <= high:
            raise ValueError(f"{number} is out of the {data_type} range")
        return number

    return normalize


def _float(value: Any) -> float | str:
    """A double for the payload: finite values as numbers, NaN / ±Infinity as JsonConverter's strings."""
    if isinstance(value, str):
        if value not in _NON_FINITE_TEXT:
            raise ValueError(f"not a number: {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal):
        raise ValueError(f"not a number: {value!r}")
    number = float(value)
    if math.isnan(number):
        return "NaN"
    if math.isinf(number):
        if not isinstance(value, float):  # a finite JSON number too large for a double
            raise ValueError(f"{value} is out of the double range")
        return "Infinity" if number > 0 else "-Infinity"
    return number


def _float32(value: Any) -> float | str:
    number = _float(value)
    if isinstance(number, float) and abs(number) > _FLOAT32_MAX:
        raise ValueError(f"{value} is out of the float range")
    return number


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"not a boolean: {value!r}")
    return value


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"not a string: {value!r}")
    return value


def _base64(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"not base64 text: {value!r}")
    try:
        base64.b64decode(value, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"not base64 text ({exc})") from None
    return value


def _decimal_text(value: Decimal, scale: int | None, precision: int | None) -> str:
    """Exact decimal text, at the column's scale when it has one (never rounded)."""
    if not value.is_finite():
        raise ValueError(f"{value} is not a finite decimal")
    if scale is not None and value.as_tuple().exponent != -scale:
        try:
            value = value.quantize(Decimal(1).scaleb(-scale), context=_EXACT)
        except (Inexact, InvalidOperation):
            raise ValueError(f"{value} has more than {scale} fraction digits") from None
    if precision is not None and value.adjusted() >= precision - (scale or 0):
        raise ValueError(f"{value} has more than {precision} digits")
    return format(value, "f")


def _unscaled(encoded: Any, scale: int) -> Decimal:
    """A Connect Decimal's bytes: big-endian two's-complement unscaled value, base64 in JSON."""
    if not isinstance(encoded, str):
        raise ValueError(f"not base64 text: {encoded!r}")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"{encoded!r} is not base64 ({exc})") from None
    if not raw:  # Connect writes at least one byte (BigInteger.toByteArray): an empty string is no number, not zero
        raise ValueError("empty base64 text: no bytes, no number")
    return Decimal(f"{int.from_bytes(raw, 'big', signed=True)}E-{scale}")


def _connect_decimal(scale: int, precision: int | None) -> Normalize:
    def normalize(value: Any) -> str:
        if isinstance(value, str):  # base64 bytes (decimal.format=BASE64, the default)
            return _decimal_text(_unscaled(value, scale), scale, precision)
        return _decimal_text(_as_decimal(value), scale, precision)  # decimal.format=NUMERIC

    return normalize


def _as_decimal(value: Any) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, int | Decimal | float | str):
        raise ValueError(f"not a decimal: {value!r}")
    try:
        return Decimal(value) if not isinstance(value, float) else Decimal(repr(value))
    except InvalidOperation:
        raise ValueError(f"not a decimal: {value!r}") from None


def _variable_scale_decimal(value: Any) -> str:
    if not isinstance(value, dict) or "scale" not in value or "value" not in value:
        raise ValueError(f"not a VariableScaleDecimal struct: {value!r}")
    return _decimal_text(_unscaled(value["value"], _integer(value["scale"])), None, None)


def _declared_decimal(scale: int, precision: int, encoding: str) -> Normalize:
    """Schemaless messages: a decimal in the column's declared encoding (model/tablespec.py DECIMAL_ENCODINGS), only.

    A string such as "1234" is both valid base64 and decimal text: read any other way than declared, it would be
    another number, silently. So a value is read in the declared encoding or rejected, never guessed.
    """

    def base64_bytes(value: Any) -> str:
        if not isinstance(value, str):
            raise ValueError(f"{'a JSON number (' + _json_text(value) + ')' if _is_number(value) else repr(value)} is not "
                             "base64 text, the column's declared decimal encoding (a Connect Decimal's bytes); a column "
                             "sent as numbers (decimal.format=NUMERIC) is declared numeric")
        return _decimal_text(_unscaled(value, scale), scale, precision)

    def numeric(value: Any) -> str:
        if isinstance(value, str):
            if not _DECIMAL_TEXT.fullmatch(value):
                raise ValueError(f"{value!r} is not decimal text, as the column's declared decimal encoding (numeric) "
                                 "needs; a Connect Decimal's base64 bytes are read in a column declared base64")
            return _decimal_text(Decimal(value), scale, precision)
        return _decimal_text(_as_decimal(value), scale, precision)

    return base64_bytes if encoding == "base64" else numeric


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float | Decimal) and not isinstance(value, bool)


def _date_from_days(value: Any) -> str:
    return (_EPOCH_DATE + timedelta(days=_integer(value))).isoformat()


def _date(value: Any) -> str:
    if isinstance(value, str):
        return date.fromisoformat(value).isoformat()
    return _date_from_days(value)


def _time_of_day(units_per_second: int) -> Normalize:
    def normalize(value: Any) -> str:
        micros = _integer(value) * US_PER_SECOND // units_per_second  # nanoseconds: kept to the microsecond
        if not 0 <= micros < 86_400 * US_PER_SECOND:
            raise ValueError(f"{value} is not a time of day")
        seconds, fraction = divmod(micros, US_PER_SECOND)
        text = f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
        return f"{text}.{fraction:06d}" if fraction else text

    return normalize


def _time(value: Any) -> str:
    """Schemaless messages: `HH:MM:SS[.fraction]` text or microseconds of the day."""
    if isinstance(value, str):
        match = _TIME_TEXT.fullmatch(value)
        if not match:
            raise ValueError(f"not a time HH:MM:SS[.ffffff]: {value!r}")
        hours, minutes, seconds, fraction = match.groups()
        value = ((int(hours) * 60 + int(minutes)) * 60 + int(seconds)) * US_PER_SECOND + int((fraction or "0")[:6].ljust(6, "0"))
    return _time_of_day(US_PER_SECOND)(value)


def _wall_clock(units_per_second: int) -> Normalize:
    """Timestamp/MicroTimestamp/NanoTimestamp and connect Timestamp: the source's wall clock, no zone."""

    def normalize(value: Any) -> str:
        micros = _integer(value) * US_PER_SECOND // units_per_second
        try:
            moment = _EPOCH + timedelta(microseconds=micros)
        except OverflowError:
            raise ValueError(f"{value} is out of the timestamp range") from None
        return moment.isoformat(timespec="microseconds" if moment.microsecond else "seconds")

    return normalize


def _zoneless_text(value: Any) -> str:
    if isinstance(value, str):
        moment = datetime.fromisoformat(_trim_fraction(value))
        if moment.tzinfo is not None:
            raise ValueError(f"{value!r} has a zone; the column is a zoneless timestamp")
        return moment.isoformat(timespec="microseconds" if moment.microsecond else "seconds")
    return _wall_clock(US_PER_SECOND)(value)


def _zoned(value: Any) -> str:
    """ZonedTimestamp: ISO-8601 with an offset -> UTC with Z (fractions beyond microseconds are cut)."""
    if not isinstance(value, str):
        raise ValueError(f"not an ISO-8601 timestamp: {value!r}")
    return iso_z(parse_iso(_trim_fraction(value)))


def _zoned_declared(value: Any) -> str:
    return _zoned(value) if isinstance(value, str) else iso_z(_integer(value))


def _trim_fraction(text: str) -> str:
    """`12:00:00.123456789Z` -> `12:00:00.123456Z`: Python reads at most microseconds."""
    head, dot, rest = text.partition(".")
    if not dot:
        return text
    digits = len(rest) - len(rest.lstrip("0123456789"))
    return f"{head}.{rest[:min(digits, 6)]}{rest[digits:]}"


def _as_text(value: Any) -> str:
    """How a value of an unknown type is kept: a string as it is, anything else as compact JSON."""
    return value if isinstance(value, str) else _json_text(value)


def _json_text(value: Any) -> str:
    """Compact JSON of a parsed value, numbers exactly as they were written (Decimal keeps its digits)."""
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k, ensure_ascii=False)}:{_json_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_json_text(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def _plain(value: Any) -> Any:
    """A value of a column without a type (not declared, no schema) made JSON-safe without loss."""
    if isinstance(value, Decimal):
        return str(value)  # its exact digits, as text
    if isinstance(value, float) and not math.isfinite(value):
        return _float(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _struct(children: Mapping[str, Normalize]) -> Normalize:
    def normalize(value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise ValueError(f"not a struct: {value!r}")
        return {name: (child(value[name]) if value.get(name) is not None else None) for name, child in children.items()}

    return normalize


# --------------------------------------------------------------------------- Connect schema -> column

_GEOMETRY_WKB = {"wkb": (pa.binary(), _base64), "srid": (pa.int32(), _ranged_integer(pa.int32()))}
_POINT = {"x": (pa.float64(), _float), "y": (pa.float64(), _float), **_GEOMETRY_WKB}

_PRIMITIVES: dict[str, tuple[pa.DataType, Normalize]] = {
    "int8": (pa.int32(), _ranged_integer(pa.int32())),
    "int16": (pa.int32(), _ranged_integer(pa.int32())),
    "int32": (pa.int32(), _ranged_integer(pa.int32())),
    "int64": (pa.int64(), _ranged_integer(pa.int64())),
    "float": (pa.float32(), _float32),
    "float32": (pa.float32(), _float32),
    "double": (pa.float64(), _float),
    "float64": (pa.float64(), _float),
    "boolean": (pa.bool_(), _boolean),
    "string": (pa.string(), _string),
    "bytes": (pa.binary(), _base64),
    "array": (pa.string(), _json_text),  # arrays and maps: their JSON text
    "map": (pa.string(), _json_text),
}

_LOGICAL: dict[str, tuple[pa.DataType, Normalize]] = {
    "io.debezium.time.Date": (pa.date32(), _date_from_days),
    "org.apache.kafka.connect.data.Date": (pa.date32(), _date_from_days),
    "io.debezium.time.Time": (pa.time64("us"), _time_of_day(1_000)),
    "io.debezium.time.MicroTime": (pa.time64("us"), _time_of_day(1_000_000)),
    "io.debezium.time.NanoTime": (pa.time64("us"), _time_of_day(1_000_000_000)),
    "org.apache.kafka.connect.data.Time": (pa.time64("us"), _time_of_day(1_000)),
    "io.debezium.time.Timestamp": (ZONELESS_US, _wall_clock(1_000)),
    "io.debezium.time.MicroTimestamp": (ZONELESS_US, _wall_clock(1_000_000)),
    "io.debezium.time.NanoTimestamp": (ZONELESS_US, _wall_clock(1_000_000_000)),
    "org.apache.kafka.connect.data.Timestamp": (ZONELESS_US, _wall_clock(1_000)),
    "io.debezium.time.ZonedTimestamp": (UTC_US, _zoned),
    "io.debezium.time.Year": (pa.int32(), _ranged_integer(pa.int32())),
    "io.debezium.time.MicroDuration": (pa.int64(), _ranged_integer(pa.int64())),
    "io.debezium.data.Bits": (pa.binary(), _base64),
    "io.debezium.data.VariableScaleDecimal": (pa.string(), _variable_scale_decimal),
    "io.debezium.data.geometry.Point": (pa.struct([(n, t) for n, (t, _) in _POINT.items()]), _struct({n: f for n, (_, f) in _POINT.items()})),
}
for _name in ("io.debezium.data.geometry.Geometry", "io.debezium.data.geometry.Geography"):
    _LOGICAL[_name] = (pa.struct([(n, t) for n, (t, _) in _GEOMETRY_WKB.items()]), _struct({n: f for n, (_, f) in _GEOMETRY_WKB.items()}))
for _name in (
    "io.debezium.data.Json", "io.debezium.data.Enum", "io.debezium.data.EnumSet", "io.debezium.data.Uuid",
    "io.debezium.data.Xml", "io.debezium.data.Ltree", "io.debezium.time.ZonedTime", "io.debezium.time.Interval",
):  # fmt: skip
    _LOGICAL[_name] = (pa.string(), _string)


@dataclass(frozen=True)
class Column:
    type: pa.DataType
    normalize: Normalize
    unknown: str | None = None  # the Debezium type partfin does not know (kept as text)
    connect_decimal: bool = False  # a Connect Decimal column: base64 bytes or a JSON number (decimal.format)


def connect_column(field: Mapping[str, Any]) -> Column:
    """The column type and value normalizer of one Kafka Connect field schema."""
    name = field.get("name")
    connect_type = field.get("type")
    if name == "org.apache.kafka.connect.data.Decimal":
        parameters = field.get("parameters") or {}
        scale = int(parameters.get("scale", 0))
        precision = parameters.get("connect.decimal.precision")
        precision = int(precision) if precision is not None else MAX_DECIMAL_PRECISION
        if max(precision, scale) > MAX_DECIMAL_PRECISION:
            return Column(pa.string(), _connect_decimal(scale, None))  # exact text: Iceberg stops at 38 digits
        return Column(pa.decimal128(max(precision, scale), scale), _connect_decimal(scale, max(precision, scale)), connect_decimal=True)
    if name in _LOGICAL:
        return Column(*_LOGICAL[name])
    if name is None and connect_type in _PRIMITIVES:
        return Column(*_PRIMITIVES[connect_type])
    described = f"{name} ({connect_type})" if name else str(connect_type)
    return Column(pa.string(), _as_text, unknown=described)


def declared_column(data_type: pa.DataType, decimal_encoding: str = DEFAULT_DECIMAL_ENCODING) -> Normalize:
    """How a message without a schema block is normalized for a declared column type (a decimal: in its encoding)."""
    if pa.types.is_integer(data_type):
        return _ranged_integer(pa.int64() if pa.types.is_int64(data_type) else pa.int32())
    if pa.types.is_floating(data_type):
        return _float32 if pa.types.is_float32(data_type) else _float
    if pa.types.is_boolean(data_type):
        return _boolean
    if pa.types.is_string(data_type) or pa.types.is_large_string(data_type):
        return _as_text
    if pa.types.is_binary(data_type):
        return _base64
    if pa.types.is_date(data_type):
        return _date
    if pa.types.is_time(data_type):
        return _time
    if pa.types.is_timestamp(data_type):
        return _zoned_declared if data_type.tz else _zoneless_text
    if pa.types.is_decimal(data_type):
        return _declared_decimal(data_type.scale, data_type.precision, decimal_encoding)
    if pa.types.is_struct(data_type):
        return _struct({data_type.field(i).name: declared_column(data_type.field(i).type) for i in range(data_type.num_fields)})
    raise ValueError(f"column type {data_type} has no JSON mapping")


def _conversion(found: pa.DataType, declared: pa.DataType) -> Normalize | None:
    """How a value typed `found` by a message's schema fits a column declared `declared`, if it does losslessly."""
    if found.equals(declared):
        return lambda value: value
    widening = {
        (pa.int32(), pa.int64()),
        (pa.float32(), pa.float64()),
        (ZONELESS_US, UTC_US),  # older partfin declared Debezium's zoneless timestamps as UTC
        (UTC_US, ZONELESS_US),
    }
    if (found, declared) in widening:
        if pa.types.is_timestamp(declared):
            return (lambda text: text + "Z") if declared.tz else (lambda text: text[:-1] if text.endswith("Z") else text)
        return lambda value: value
    if pa.types.is_decimal(found) and pa.types.is_decimal(declared):
        if found.scale == declared.scale and found.precision <= declared.precision:
            return lambda value: value
    if pa.types.is_decimal(found) and pa.types.is_string(declared):
        return lambda value: value
    return None


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class _Columns:
    normalizers: dict[str, Normalize]
    missing: tuple[str, ...] = ()  # declared columns the message's schema lacks: null
    conflict: str | None = None  # why messages of this schema cannot fit the declaration
    connect_decimals: tuple[str, ...] = ()  # Connect Decimal columns discovered from this schema (no declaration)

    def normalize(self, image: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for name, value in image.items():
            normalize = self.normalizers.get(name)
            if value is None or normalize is None:
                out[name] = _plain(value)
                continue
            try:
                out[name] = normalize(value)
            except (ValueError, TypeError, KeyError, OverflowError, InvalidOperation) as exc:
                raise RejectedMessage(f"column {name!r}: {exc}") from None
        for name in self.missing:
            out[name] = None
        return out


_SCHEMA_MARK = b'{"schema":'
_PAYLOAD_MARK = b',"payload":'
_HEARTBEAT = _Columns({})  # the columns of a heartbeat message: none


class DebeziumJsonDecoder:
    """Decodes the Debezium JSON message values of one table (see the module docstring).

    `primary_key`: the key columns, read from the after-image (the before-image for deletes).
    `declared`: the table's typed columns, if it has a declaration; None while it has none.
    `decimal_encodings`: how its decimal columns are written without a schema block (TableSpec.decimal_encodings).
    `max_message_bytes`: the size limit (default PARTFIN_MAX_MESSAGE_BYTES). `warn=False`: a decoder
    that only looks ahead (a new table's declaration) leaves the warnings to the one that reads.
    """

    def __init__(
        self,
        table: str,
        primary_key: tuple[str, ...],
        declared: Mapping[str, pa.DataType] | None = None,
        max_message_bytes: int | None = None,
        *,
        decimal_encodings: Mapping[str, str] | None = None,
        warn: bool = True,
    ) -> None:
        if not primary_key:
            raise SourceError(f"table {table!r}: the Debezium decoder needs the primary-key column(s)")
        self.max_message_bytes = max_message_bytes if max_message_bytes is not None else Settings.from_env().max_message_bytes
        if self.max_message_bytes < 1:
            raise PartfinConfigError(f"PARTFIN_MAX_MESSAGE_BYTES must be at least 1, got {self.max_message_bytes}")
        self.table = table
        self.primary_key = tuple(primary_key)
        self.declared = dict(declared) if declared else None
        self._by_schema: dict[str, _Columns] = {}
        self._by_prefix: dict[bytes, _Columns] = {}  # the raw schema block before ',"payload":'
        self._discovered: dict[str, pa.DataType] = {}
        self._declared_encodings = dict(decimal_encodings or {}) if self.declared else {}
        # the JSON form of each discovered Connect Decimal in the first change: how schemaless messages will encode it
        self._discovered_encodings: dict[str, str] = {}
        self._schemaless = _Columns({
            name: declared_column(t, self._declared_encodings.get(name, DEFAULT_DECIMAL_ENCODING))
            for name, t in (self.declared or {}).items()
        })
        self._warn_enabled = warn
        self._warned: set[str] = set()
        self._unexpected: set[type] = set()  # exception types already logged as a possible partfin bug
        self._loads = json.JSONDecoder(parse_float=Decimal).decode

    def column_types(self) -> dict[str, pa.DataType] | None:
        """The columns the schema blocks decoded so far declare (the declaration if given)."""
        if self.declared:
            return dict(self.declared)
        return dict(self._discovered) or None

    def decimal_encodings(self) -> dict[str, str]:
        """The decimal encodings of `column_types()`'s columns that are not the default (a Connect Decimal that is a
        JSON number in the first change decoded, decimal.format=NUMERIC, is `numeric`: schemaless messages send numbers)."""
        if self.declared:
            return dict(self._declared_encodings)
        return {name: encoding for name, encoding in self._discovered_encodings.items() if encoding != DEFAULT_DECIMAL_ENCODING}

    def decode(self, value: bytes | str | None) -> DecodedChange | DecodedHeartbeat | None:
        if value is None:
            return None  # Kafka's null value: a tombstone
        raw = value.encode("utf-8") if isinstance(value, str) else value
        if len(raw) > self.max_message_bytes:
            raise RejectedMessage(oversized(len(raw), self.max_message_bytes))
        try:
            return self._decode(raw)
        except RejectedMessage:
            raise
        except RecursionError:  # nesting the depth check let through (a walk deeper than the parser's)
            raise RejectedMessage(f"nested deeper than Python can decode (limit {MAX_NESTING_DEPTH} levels)") from None
        except Exception as exc:  # whatever one message does to a library, the stream goes on without it
            if type(exc) not in self._unexpected and self._warn_enabled:
                self._unexpected.add(type(exc))
                log.warning("cdc.%s: a message could not be decoded (%s); it is rejected. If the message is valid, "
                            "this is a partfin bug: please report it", self.table, one_line(exc), exc_info=True)
            raise RejectedMessage(f"cannot be decoded: {one_line(exc)}") from None

    def _decode(self, raw: bytes) -> DecodedChange | DecodedHeartbeat | None:
        raw = raw.removeprefix(UTF8_BOM)  # not part of the JSON text (RFC 8259 lets a parser ignore it)
        if not raw.strip():
            return None  # an empty value, or a blank line
        # Every message of a topic repeats the same schema block: once it is known, only the
        # payload after it is parsed (most of a JsonConverter message is its schema).
        cut = raw.find(_PAYLOAD_MARK) if raw.startswith(_SCHEMA_MARK) else -1
        known = self._by_prefix.get(raw[:cut]) if cut > 0 else None
        if known is not None:
            body = raw[cut + len(_PAYLOAD_MARK) :].rstrip()
            _check_depth(body)
            if body.endswith(b"}"):
                try:
                    return self._wrapped(known, self._loads(body[:-1].decode("utf-8")))
                except (ValueError, UnicodeDecodeError):
                    pass  # not that simple after all: parse the whole message below
        document = self._parse(raw)
        if "payload" in document and "schema" in document:
            schema = document["schema"]
            columns = _HEARTBEAT if isinstance(schema, dict) and schema.get("name") == HEARTBEAT_SCHEMA_NAME else self.columns_of(schema)
            if cut > 0 and len(self._by_prefix) < 64 and self._parse(raw[:cut] + b"}") == {"schema": schema}:
                self._by_prefix[raw[:cut]] = columns
            return self._wrapped(columns, document["payload"])
        if set(document) == {"ts_ms"}:  # a heartbeat value without its schema
            return DecodedHeartbeat(_time_us(document["ts_ms"], "heartbeat ts_ms"))
        return self._change(document, self._schemaless)

    def _parse(self, raw: bytes) -> dict[str, Any]:
        _check_depth(raw)
        try:
            document = self._loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise RejectedMessage(f"not UTF-8 ({exc.reason})") from None
        except json.JSONDecodeError as exc:
            raise RejectedMessage(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(document, dict):
            raise RejectedMessage(f"not a JSON object but {type(document).__name__}")
        return document

    def _wrapped(self, columns: _Columns, envelope: Any) -> DecodedChange | DecodedHeartbeat | None:
        if envelope is None:
            return None  # the tombstone Kafka emits after a delete
        if not isinstance(envelope, dict):
            raise RejectedMessage("payload is not a JSON object")
        if columns is _HEARTBEAT:
            return DecodedHeartbeat(_time_us(envelope.get("ts_ms"), "heartbeat ts_ms"))
        return self._change(envelope, columns)

    def columns_of(self, schema: Any) -> _Columns:
        """The normalizers for the before/after images an envelope schema describes (cached per schema)."""
        fields = image_fields(schema)
        if not fields:
            return self._schemaless
        signature = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        columns = self._by_schema.get(signature)
        if columns is None:
            columns = self._by_schema[signature] = self._columns(fields)
        return columns

    def _columns(self, fields: list[dict[str, Any]]) -> _Columns:
        normalizers: dict[str, Normalize] = {}
        connect_decimals: list[str] = []  # discovered (no declaration yet): their first value says their encoding
        conflicts = []
        for field in fields:
            name = field.get("field")
            if not isinstance(name, str):
                continue
            column = connect_column(field)
            if column.unknown:
                self._warn(name, f"Debezium type {column.unknown} is unknown to partfin: kept as text")
            if self.declared is None:
                self._discovered.setdefault(name, column.type)
                normalizers[name] = column.normalize
                if column.connect_decimal:
                    connect_decimals.append(name)
                continue
            declared = self.declared.get(name)
            if declared is None:
                self._warn(name, f"not declared for cdc.{self.table}: kept in its CDC payload, not in base.{self.table}")
                normalizers[name] = column.normalize
                continue
            convert = _conversion(column.type, declared)
            if convert is None:
                conflicts.append(f"column {name!r} is {column.type} in this message's schema, cdc.{self.table} declares {declared}")
                continue
            normalizers[name] = _then(column.normalize, convert)
        present = {f.get("field") for f in fields}
        missing = tuple(name for name in self.declared or {} if name not in present)
        return _Columns(normalizers, missing, "; ".join(conflicts) or None, tuple(connect_decimals))

    def _change(self, envelope: dict[str, Any], columns: _Columns) -> DecodedChange:
        op = envelope.get("op")
        if op not in VALID_OPS:
            if "op" not in envelope:
                raise RejectedMessage("missing op")
            raise RejectedMessage(f"unknown op {op!r}" + (" (a truncate cannot be applied per row)" if op == "t" else ""))
        source = envelope.get("source")
        if not isinstance(source, dict) or source.get("ts_ms") is None:
            raise RejectedMessage("missing source.ts_ms")
        event_time_us = _time_us(source["ts_ms"], "source.ts_ms")
        image_name = "before" if op == "d" else "after"
        image = envelope.get(image_name)
        if not isinstance(image, dict):
            raise RejectedMessage(f"op {op!r} without {image_name!r}")
        if columns.conflict:
            raise RejectedMessage(columns.conflict)
        try:
            normalized = columns.normalize(image)
        except RejectedMessage as exc:
            raise RejectedMessage(f"bad column value in {image_name!r}: {exc}") from None
        missing = [name for name in self.primary_key if normalized.get(name) is None]
        if missing:
            raise RejectedMessage(f"missing key column(s) {', '.join(map(repr, missing))} in {image_name!r}")
        for name in columns.connect_decimals:  # the first change decoded says the encoding (null: the default)
            value = image.get(name)
            self._discovered_encodings.setdefault(name, DEFAULT_DECIMAL_ENCODING if value is None or isinstance(value, str) else "numeric")
        key_values = {name: normalized[name] for name in self.primary_key}
        payload = None if op == "d" else json.dumps(normalized, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        for text in (payload, *key_values.values()):
            if isinstance(text, str):
                _require_utf8(text, image_name)
        return DecodedChange(
            op=op,
            key_values=key_values,
            event_time_us=event_time_us,
            arrival_us=_arrival_us(envelope.get("ts_ms")),
            payload=payload,
        )

    def _warn(self, column: str, what: str) -> None:
        if column not in self._warned and self._warn_enabled:
            self._warned.add(column)
            log.warning("cdc.%s: column %r: %s", self.table, column, what)


def oversized(size: int, limit: int) -> str:
    """The reason a message over the size limit is rejected."""
    return f"{size:,} bytes, over the limit of {limit:,} (PARTFIN_MAX_MESSAGE_BYTES): not parsed"


def _check_depth(raw: bytes) -> None:
    """RejectedMessage if the JSON text nests deeper than MAX_NESTING_DEPTH (brackets inside strings do not count)."""
    if raw.count(b"{") + raw.count(b"[") <= MAX_NESTING_DEPTH:
        return  # too few brackets to be that deep: the common case, without a scan
    brackets = np.frombuffer(_NOT_BRACKET.sub(b"", _JSON_STRING.sub(b"", raw)), np.uint8)
    depth = np.cumsum(np.where((brackets == ord("{")) | (brackets == ord("[")), 1, -1))
    deepest = int(depth.max()) if depth.size else 0
    if deepest > MAX_NESTING_DEPTH:
        raise RejectedMessage(f"nested deeper than {MAX_NESTING_DEPTH} levels ({deepest:,}): not parsed")


def _require_utf8(text: str, image_name: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end].encode("unicode_escape").decode("ascii")
        raise RejectedMessage(f"{image_name!r} holds text that is not UTF-8 ({bad}, a lone surrogate escape)") from None


def _then(first: Normalize, second: Normalize) -> Normalize:
    return lambda value: second(first(value))


def _time_us(ts_ms: Any, what: str) -> int:
    """Epoch milliseconds of a Debezium time field -> microseconds, or RejectedMessage."""
    if isinstance(ts_ms, float) and not math.isfinite(ts_ms):
        raise RejectedMessage(f"{what} is not a finite number: {json.dumps(ts_ms)}")
    try:
        ms = _integer(ts_ms)
    except ValueError:
        raise RejectedMessage(f"{what} is not an integer: {ts_ms!r}") from None
    us = ms * 1_000
    reason = implausible_event_time(us)
    if reason:
        raise RejectedMessage(f"{what} {ms} is {reason}")
    return us


def _arrival_us(ts_ms: Any) -> int | None:
    try:
        return _time_us(ts_ms, "ts_ms") if ts_ms is not None else None
    except RejectedMessage:
        return None  # arrival is pipeline metadata: without it, the commit's clock stands in


def image_fields(schema: Any) -> list[dict[str, Any]]:
    """The fields of the before/after struct of an envelope schema ([] if it has none)."""
    if not isinstance(schema, dict):
        return []
    for field in schema.get("fields") or []:
        if isinstance(field, dict) and field.get("field") in ("after", "before") and field.get("type") == "struct":
            return [f for f in field.get("fields") or [] if isinstance(f, dict)]
    return []
