"""Debezium change events from a JSON-lines file, one event per line.

Lines come with or without the Kafka Connect `{"schema": ..., "payload": ...}`
wrapper. Column types come from the envelope's schema block when present,
otherwise from the table spec; payload values are normalized to plain JSON
(timestamps ISO-8601 UTC with Z, dates YYYY-MM-DD, decimals as decimal strings).
Bad lines are rejected with a reason, never raised and never dropped.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import date, timedelta
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import pyarrow as pa

from partfin_assets.model.record_keys import key_json_column
from partfin_assets.model.records import CDC_RECORD_SCHEMA, REJECTED_RECORD_SCHEMA, UTC_US, VALID_OPS, ChangeBatch
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.model.timeutil import US_PER_SECOND, iso_z, parse_iso

Normalize = Callable[[Any], Any]

_EPOCH_DATE = date(1970, 1, 1)
_CONNECT_TYPES = {
    "int8": pa.int8(),
    "int16": pa.int16(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "boolean": pa.bool_(),
    "string": pa.string(),
    "bytes": pa.binary(),  # JSON carries them base64-encoded; kept as that text
}


class RejectedLine(ValueError):
    """A line that is not a usable change event; the message is the reason."""


def _identity(value: Any) -> Any:
    return value


def _timestamp_text(units_per_second: int) -> Normalize:
    # Arrow timestamps are microseconds (the design contract): nanoseconds are floored.
    return lambda value: iso_z(int(value) * US_PER_SECOND // units_per_second)


def _zoned_timestamp_text(value: Any) -> str:
    return iso_z(parse_iso(value))


def _date_text(days: Any) -> str:
    return (_EPOCH_DATE + timedelta(days=int(days))).isoformat()


def _time_text(units_per_second: int) -> Normalize:
    def normalize(value: Any) -> str:
        micros = int(value) * US_PER_SECOND // units_per_second
        seconds, fraction = divmod(micros, US_PER_SECOND)
        text = f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
        return f"{text}.{fraction:06d}" if fraction else text

    return normalize


def _decimal_text(value: Decimal) -> str:
    return format(value, "f")


def _unscaled_decimal(encoded: str, scale: int) -> str:
    unscaled = int.from_bytes(base64.b64decode(encoded, validate=True), "big", signed=True)
    return _decimal_text(Decimal(unscaled).scaleb(-scale))


def _fixed_scale_decimal(scale: int) -> Normalize:
    """A Connect Decimal: base64 big-endian two's-complement unscaled value (or, schemaless, a number)."""

    def normalize(value: Any) -> str:
        if isinstance(value, str):
            try:
                return _decimal_text(Decimal(value))
            except InvalidOperation:
                return _unscaled_decimal(value, scale)
        return _decimal_text(Decimal(str(value)))

    return normalize


def _variable_scale_decimal(value: Any) -> str:
    return _unscaled_decimal(value["value"], int(value["scale"]))


def _from_connect_field(field: dict[str, Any]) -> tuple[pa.DataType, Normalize] | None:
    """Arrow type and value normalizer of one Kafka Connect field schema; None if not a plain column."""
    logical = field.get("name")
    parameters = field.get("parameters") or {}
    if logical in ("io.debezium.time.Timestamp", "io.debezium.time.MicroTimestamp", "io.debezium.time.NanoTimestamp"):
        units = {"Timestamp": 1_000, "MicroTimestamp": 1_000_000, "NanoTimestamp": 1_000_000_000}
        return UTC_US, _timestamp_text(units[logical.rsplit(".", 1)[1]])
    if logical == "io.debezium.time.ZonedTimestamp":
        return UTC_US, _zoned_timestamp_text
    if logical == "io.debezium.time.Date":
        return pa.date32(), _date_text
    if logical in ("io.debezium.time.Time", "io.debezium.time.MicroTime", "io.debezium.time.NanoTime"):
        units = {"Time": 1_000, "MicroTime": 1_000_000, "NanoTime": 1_000_000_000}
        return pa.time64("us"), _time_text(units[logical.rsplit(".", 1)[1]])
    if logical == "org.apache.kafka.connect.data.Decimal":
        scale = int(parameters.get("scale", 0))
        precision = int(parameters.get("connect.decimal.precision", 38))
        return pa.decimal128(precision, scale), _fixed_scale_decimal(scale)
    if logical == "io.debezium.data.VariableScaleDecimal":
        # No fixed scale fits every value, so the exact decimal text is the column.
        return pa.string(), _variable_scale_decimal
    arrow_type = _CONNECT_TYPES.get(field.get("type", ""))
    return (arrow_type, _identity) if arrow_type is not None else None


def _from_arrow_type(arrow_type: pa.DataType) -> Normalize:
    """Normalizer for a column declared in the spec, for lines without a schema block."""
    if pa.types.is_timestamp(arrow_type):
        per_second = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}[arrow_type.unit]
        to_text = _timestamp_text(per_second)
        return lambda value: _zoned_timestamp_text(value) if isinstance(value, str) else to_text(value)
    if pa.types.is_date(arrow_type):
        return lambda value: date.fromisoformat(value).isoformat() if isinstance(value, str) else _date_text(value)
    if pa.types.is_decimal(arrow_type):
        return _fixed_scale_decimal(arrow_type.scale)
    return _identity


@dataclass(frozen=True)
class _Columns:
    types: dict[str, pa.DataType]
    normalizers: dict[str, Normalize]

    def normalize(self, image: dict[str, Any]) -> dict[str, Any]:
        return {
            name: (self.normalizers[name](value) if value is not None and name in self.normalizers else value)
            for name, value in image.items()
        }


@dataclass(frozen=True)
class _Change:
    key_values: dict[str, Any]
    op: str
    event_time_us: int
    payload: str | None


class DebeziumFileSource:
    """Change events of one table from a Debezium JSON-lines file.

    The key columns are `primary_key` if given, else the spec's. Event time is
    `source.ts_ms`; `source_seq` is the 1-based line number. The offset is compact
    JSON {"byte": position after the last consumed line, "line": its number}.
    Only newline-terminated lines are consumed, so a line still being written is
    read on a later pass. Wrapped tombstones (`"payload": null`, which Kafka emits
    after a delete) carry no change and are skipped; blank lines too.

    With follow=False the stream ends at the end of the file; with follow=True it
    polls every `poll_interval` seconds and, while nothing new arrives, yields an
    empty batch (no heartbeat: a file says nothing about completeness) every
    `idle_batch_every` seconds, so the caller regains control.
    """

    def __init__(
        self,
        path: str | Path,
        primary_key: tuple[str, ...] | None = None,
        spec: TableSpec | None = None,
        follow: bool = False,
        poll_interval: float = 0.5,
        idle_batch_every: float = 10.0,
        sleep: Callable[[float], None] = time.sleep,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        key_columns = tuple(primary_key) if primary_key else (spec.primary_key if spec is not None else ())
        if not key_columns:
            raise ValueError(f"debezium source {path}: no primary key (pass primary_key or a table spec)")
        self.path = Path(path)
        self.primary_key = key_columns
        self.follow = follow
        self.poll_interval = poll_interval
        self.idle_batch_every = idle_batch_every
        self._sleep = sleep
        self._monotonic = monotonic
        declared = dict(spec.columns) if spec is not None else {}
        self._spec_columns = _Columns(declared, {name: _from_arrow_type(t) for name, t in declared.items()})
        self._schema_columns: dict[tuple, _Columns] = {}
        self._discovered_types: dict[str, pa.DataType] = {}

    def column_types(self) -> dict[str, pa.DataType] | None:
        """Column types from the schema blocks read so far, else the spec's; None if neither."""
        if self._discovered_types:
            return dict(self._discovered_types)
        return dict(self._spec_columns.types) or None

    def batches(self, start_offset: str | None, max_records: int) -> Iterator[ChangeBatch]:
        if max_records < 1:
            raise ValueError(f"max_records must be at least 1, got {max_records}")
        byte, line_number = _parse_offset(start_offset) if start_offset is not None else (0, 0)
        idle_since = self._monotonic()
        while True:
            lines, byte_after = self._read_complete_lines(byte, max_records)
            if lines:
                yield self._parse(lines, line_number, byte_after)
                byte, line_number = byte_after, line_number + len(lines)
                idle_since = self._monotonic()
                continue
            if not self.follow:
                return
            if self._monotonic() - idle_since >= self.idle_batch_every:
                yield ChangeBatch(records=CDC_RECORD_SCHEMA.empty_table(), offset=_offset(byte, line_number))
                idle_since = self._monotonic()
            self._sleep(self.poll_interval)

    def _read_complete_lines(self, byte: int, max_lines: int) -> tuple[list[bytes], int]:
        lines: list[bytes] = []
        try:
            with self.path.open("rb") as file:
                file.seek(byte)
                while len(lines) < max_lines:
                    line = file.readline()
                    if not line.endswith(b"\n"):  # end of file, or a line still being written
                        break
                    lines.append(line)
                    byte += len(line)
        except FileNotFoundError:
            if not self.follow:
                raise
        return lines, byte

    def _parse(self, lines: list[bytes], last_line_number: int, byte_after: int) -> ChangeBatch:
        changes: list[tuple[int, _Change]] = []
        rejected: list[tuple[int, str, str]] = []
        for line_number, raw in enumerate(lines, start=last_line_number + 1):
            text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if not text.strip():
                continue
            try:
                change = self._parse_line(raw.rstrip(b"\r\n"))
            except RejectedLine as reason:
                rejected.append((line_number, text, f"line {line_number}: {reason}"))
                continue
            if change is not None:
                changes.append((line_number, change))
        return ChangeBatch(
            records=self._records(changes),
            offset=_offset(byte_after, last_line_number + len(lines)),
            rejected=pa.table(
                {
                    "source_seq": [seq for seq, _, _ in rejected],
                    "raw": [raw for _, raw, _ in rejected],
                    "reason": [reason for _, _, reason in rejected],
                },
                schema=REJECTED_RECORD_SCHEMA,
            ),
        )

    def _records(self, changes: list[tuple[int, _Change]]) -> pa.Table:
        key_columns = {name: [change.key_values[name] for _, change in changes] for name in self.primary_key}
        return pa.table(
            {
                "key": key_json_column(key_columns),
                "op": pa.array([change.op for _, change in changes], pa.string()),
                "event_time": pa.array([change.event_time_us for _, change in changes], pa.int64()).cast(UTC_US),
                "source_seq": pa.array([seq for seq, _ in changes], pa.int64()),
                "payload": pa.array([change.payload for _, change in changes], pa.string()),
            },
            schema=CDC_RECORD_SCHEMA,
        )

    def _parse_line(self, raw: bytes) -> _Change | None:
        try:
            document = json.loads(raw)
        except UnicodeDecodeError as exc:
            raise RejectedLine(f"not UTF-8 ({exc.reason})") from None
        except json.JSONDecodeError as exc:
            raise RejectedLine(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(document, dict):
            raise RejectedLine(f"not a JSON object but {type(document).__name__}")
        if "payload" in document and "schema" in document:
            if document["payload"] is None:
                return None  # tombstone
            envelope, columns = document["payload"], self._columns_from_schema(document["schema"])
            if not isinstance(envelope, dict):
                raise RejectedLine("payload is not a JSON object")
        else:
            envelope, columns = document, self._spec_columns

        op = envelope.get("op")
        if op not in VALID_OPS:
            raise RejectedLine(f"unknown op {op!r}" if "op" in envelope else "missing op")
        source = envelope.get("source")
        ts_ms = source.get("ts_ms") if isinstance(source, dict) else None
        if ts_ms is None:
            raise RejectedLine("missing source.ts_ms")
        if isinstance(ts_ms, bool) or not isinstance(ts_ms, int | float) or ts_ms != int(ts_ms):
            raise RejectedLine(f"source.ts_ms is not an integer: {ts_ms!r}")
        image_name = "before" if op == "d" else "after"
        image = envelope.get(image_name)
        if not isinstance(image, dict):
            raise RejectedLine(f"op {op!r} without {image_name!r}")
        try:
            normalized = columns.normalize(image)
        except (ValueError, TypeError, KeyError, binascii.Error, InvalidOperation) as exc:
            raise RejectedLine(f"bad column value in {image_name!r} ({exc})") from None
        missing = [name for name in self.primary_key if normalized.get(name) is None]
        if missing:
            raise RejectedLine(f"missing key column(s) {', '.join(map(repr, missing))} in {image_name!r}")
        return _Change(
            key_values={name: normalized[name] for name in self.primary_key},
            op=op,
            event_time_us=int(ts_ms) * 1_000,
            payload=None if op == "d" else json.dumps(normalized, separators=(",", ":"), ensure_ascii=False),
        )

    def _columns_from_schema(self, schema: Any) -> _Columns:
        """Columns of the before/after struct of an envelope schema (cached: every line repeats it)."""
        fields = _image_fields(schema)
        if not fields:
            return self._spec_columns
        signature = tuple(
            (f.get("field"), f.get("type"), f.get("name"), json.dumps(f.get("parameters"), sort_keys=True))
            for f in fields
        )
        columns = self._schema_columns.get(signature)
        if columns is None:
            types, normalizers = {}, {}
            for field in fields:
                typed = _from_connect_field(field)
                if typed is not None and "field" in field:
                    types[field["field"]], normalizers[field["field"]] = typed
            columns = self._schema_columns[signature] = _Columns(types, normalizers)
            self._discovered_types.update(columns.types)
        return columns


def _image_fields(schema: Any) -> list[dict[str, Any]]:
    if not isinstance(schema, dict):
        return []
    for field in schema.get("fields") or []:
        if isinstance(field, dict) and field.get("field") in ("after", "before") and field.get("type") == "struct":
            return [f for f in field.get("fields") or [] if isinstance(f, dict)]
    return []


def _offset(byte: int, line_number: int) -> str:
    return json.dumps({"byte": byte, "line": line_number}, separators=(",", ":"))


def _parse_offset(offset: str) -> tuple[int, int]:
    try:
        fields = json.loads(offset)
        return int(fields["byte"]), int(fields["line"])
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"not a debezium-file offset: {offset!r} ({exc})") from exc
