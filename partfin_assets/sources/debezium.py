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
import os
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import date, timedelta
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import pyarrow as pa

from partfin_assets.model.record_keys import key_json_column
from partfin_assets.model.records import CDC_RECORD_SCHEMA, REJECTED_RECORD_SCHEMA, UTC_US, VALID_OPS, ChangeBatch
from partfin_assets.model.source_identity import SourceChanged, SourceIdentity
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
    JSON {"byte": position after the last consumed line, "line": its number,
    "crc32": of every byte before it, "tail_crc32": of the last (up to) 1 KiB before it}.
    Only newline-terminated lines are consumed, so a line still being written is
    read on a later pass. Wrapped tombstones (`"payload": null`, which Kafka emits
    after a delete) carry no change and are skipped; blank lines too.

    The file is its history: its identity is its first line, and every read checks
    that the bytes just before the position are still the ones read (SourceChanged
    otherwise: the file was truncated, rotated or rewritten), so a resume never
    starts inside a line of another file or waits silently behind a shorter one.
    A replay reads the file from its start up to a committed offset and checks the
    crc32 of all it read against the offset's.

    With follow=False the stream ends at the end of the file; with follow=True it
    polls every `poll_interval` seconds and, while nothing new arrives, yields an
    empty batch (no heartbeat: a file says nothing about completeness) every
    `idle_batch_every` seconds, so the caller regains control.
    """

    kind = "debezium-file"

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
        self._first_line_crc32: str | None = None

    def identity(self, offset: str | None) -> SourceIdentity:
        """The file's first line (crc32) is its identity: a moved file is the same history, a rotated one is not."""
        if self._first_line_crc32 is None:
            self._first_line_crc32 = self._read_first_line_crc32()
        if self._first_line_crc32 is None and offset is not None and not self.path.exists():
            raise SourceChanged(f"{self.path} does not exist; {_FilePosition.parse(offset).byte:,} bytes of it were read")
        return SourceIdentity(self.kind, f"debezium:{os.path.abspath(self.path)}", {"first_line": self._first_line_crc32})

    def _read_first_line_crc32(self) -> str | None:
        try:
            with self.path.open("rb") as file:
                line = file.readline()
        except FileNotFoundError:
            return None
        return _crc_text(zlib.crc32(line)) if line.endswith(b"\n") else None

    def history(self, until_offset: str, max_records: int) -> Iterator[pa.Table]:
        """The change records of the lines before `until_offset`, checked against the offset's crc32."""
        target = _FilePosition.parse(until_offset)
        position = _FilePosition()
        while position.byte < target.byte:
            lines = self._read_complete_lines(position, max_records, limit=target.byte)
            if not lines:
                raise SourceChanged(
                    f"{self.path} ends at byte {position.byte:,}, before the {target.byte:,} bytes the writer read: truncated"
                )
            batch = self._parse(lines, position.line, "")
            position = position.after(lines)
            yield batch.records
        if position.byte != target.byte or (target.crc32 is not None and position.crc32 != target.crc32):
            raise SourceChanged(
                f"{self.path} no longer holds the {target.byte:,} bytes the writer read (their crc32 differs): rewritten"
            )

    def column_types(self) -> dict[str, pa.DataType] | None:
        """Column types from the schema blocks read so far, else the spec's; None if neither."""
        if self._discovered_types:
            return dict(self._discovered_types)
        return dict(self._spec_columns.types) or None

    def batches(self, start_offset: str | None, max_records: int) -> Iterator[ChangeBatch]:
        if max_records < 1:
            raise ValueError(f"max_records must be at least 1, got {max_records}")
        position = self._resume(start_offset) if start_offset is not None else _FilePosition()
        idle_since = self._monotonic()
        while True:
            lines = self._read_complete_lines(position, max_records)
            if lines:
                before, position = position, position.after(lines)
                yield self._parse(lines, before.line, position.to_offset())
                idle_since = self._monotonic()
                continue
            if not self.follow:
                return
            if self._monotonic() - idle_since >= self.idle_batch_every:
                yield ChangeBatch(records=CDC_RECORD_SCHEMA.empty_table(), offset=position.to_offset())
                idle_since = self._monotonic()
            self._sleep(self.poll_interval)

    def _resume(self, offset: str) -> _FilePosition:
        """The position of a committed offset, with the bytes before it read back and checked."""
        position = _FilePosition.parse(offset)
        with self.path.open("rb") as file:
            self._check_size(file, position.byte)
            start = max(position.byte - _TAIL_BYTES, 0)
            file.seek(start)
            tail = file.read(position.byte - start)
            if position.tail_crc32 is not None and _crc_text(zlib.crc32(tail)) != position.tail_crc32:
                raise SourceChanged(self._rewritten(position.byte))
            crc32 = position.crc32
            if crc32 is None:  # an offset written before partfin kept checksums: take them once
                file.seek(0)
                crc32 = _crc_text(zlib.crc32(file.read(position.byte)))
        return _FilePosition(position.byte, position.line, crc32, tail)

    def _check_size(self, file, byte: int) -> None:
        size = os.fstat(file.fileno()).st_size
        if size < byte:
            raise SourceChanged(f"{self.path} holds {size:,} bytes, fewer than the {byte:,} already read: truncated or replaced")

    def _rewritten(self, byte: int) -> str:
        return f"the bytes of {self.path} before byte {byte:,} are not the ones read there: the file was rotated or rewritten"

    def _read_complete_lines(self, position: _FilePosition, max_lines: int, limit: int | None = None) -> list[bytes]:
        """Up to max_lines complete lines after `position` (not past byte `limit`), once the bytes before it check out."""
        lines: list[bytes] = []
        byte = position.byte
        try:
            with self.path.open("rb") as file:
                self._check_size(file, position.byte)
                file.seek(position.byte - len(position.tail))
                if file.read(len(position.tail)) != position.tail:
                    raise SourceChanged(self._rewritten(position.byte))
                while len(lines) < max_lines and (limit is None or byte < limit):
                    line = file.readline()
                    if not line.endswith(b"\n"):  # end of file, or a line still being written
                        break
                    lines.append(line)
                    byte += len(line)
        except FileNotFoundError:
            if not self.follow:
                raise
        return lines

    def _parse(self, lines: list[bytes], last_line_number: int, offset: str) -> ChangeBatch:
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
            offset=offset,
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


_TAIL_BYTES = 1024  # checked before every read: a rotated, truncated or rewritten file is seen at once


def _crc_text(value: int) -> str:
    return f"{value:08x}"


@dataclass(frozen=True)
class _FilePosition:
    """Where reading stands in the file: after `line` lines, `byte` bytes, whose crc32 is `crc32`."""

    byte: int = 0
    line: int = 0
    crc32: str | None = _crc_text(0)  # None: from an offset written before partfin kept it
    tail: bytes = b""  # the last bytes before `byte` (up to _TAIL_BYTES), as read
    tail_crc32: str | None = None  # their crc32, as an offset records it (the bytes themselves are not in it)

    def after(self, lines: list[bytes]) -> _FilePosition:
        data = b"".join(lines)
        crc32 = _crc_text(zlib.crc32(data, int(self.crc32, 16))) if self.crc32 is not None else None
        return _FilePosition(self.byte + len(data), self.line + len(lines), crc32, (self.tail + data)[-_TAIL_BYTES:])

    def to_offset(self) -> str:
        fields: dict[str, Any] = {"byte": self.byte, "line": self.line}
        if self.crc32 is not None:
            fields["crc32"] = self.crc32
        fields["tail_crc32"] = _crc_text(zlib.crc32(self.tail))
        return json.dumps(fields, separators=(",", ":"))

    @classmethod
    def parse(cls, offset: str) -> _FilePosition:
        try:
            fields = json.loads(offset)
            return cls(int(fields["byte"]), int(fields["line"]), fields.get("crc32"), b"", fields.get("tail_crc32"))
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"not a debezium-file offset: {offset!r} ({exc})") from exc
