"""Debezium change events from a JSON-lines file, one message value per line.

Each line is decoded by `DebeziumJsonDecoder` (sources/debezium_json.py: the envelope, every
Debezium / Kafka Connect type, event times, heartbeats), the decoder a Kafka source calls with
a message's value bytes too. Bad lines are rejected with a reason, never raised and never dropped.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from partfin_assets.model.change_columns import ChangeColumns
from partfin_assets.model.errors import SourceError
from partfin_assets.model.redaction import redact
from partfin_assets.model.records import CDC_RECORD_SCHEMA, REJECTED_RECORD_SCHEMA, CdcSource, ChangeBatch, DiscoversColumns, ReplayableSource
from partfin_assets.model.source_identity import SourceChanged, SourceIdentity
from partfin_assets.model.tablespec import TableSpec, new_table_key
from partfin_assets.model.timeutil import from_us
from partfin_assets.sources.debezium_json import (
    OVERSIZED_RAW_BYTES,
    DebeziumJsonDecoder,
    DecodedChange,
    DecodedHeartbeat,
    RejectedMessage,
    oversized,
)

log = logging.getLogger(__name__)

_SCHEMA_PEEK_LINES = 1_000  # lines read to find a schema block when a table is declared


class DebeziumFileSource(ReplayableSource, DiscoversColumns):
    """Change events of one table from a Debezium JSON-lines file.

    The key columns are `primary_key` if given, else the spec's; the spec's typed columns are the
    declaration messages are checked against. Event time is `source.ts_ms`; `source_seq` is the
    1-based line number. The offset is compact JSON {"byte": position after the last consumed
    line, "line": its number, "crc32": of every byte before it, "tail_crc32": of the last (up to)
    1 KiB before it}. Only newline-terminated lines are consumed, so a line still being written is
    read on a later pass; with `complete_file` (`partfin ingest` without --follow: the file is
    complete), the last line is read at the end even without its newline, and a newline written
    after it later ends that line rather than starting one. Tombstones and blank lines carry no
    change and are skipped. A line longer than the size limit (PARTFIN_MAX_MESSAGE_BYTES) is read
    to its end in chunks and rejected with its first bytes and its place in the file.

    Heartbeat messages (Debezium's heartbeat.interval.ms, written into the same file) become
    batches of their own carrying the heartbeat time, never mixed with changes, so a heartbeat
    always speaks for everything before it. That is what keeps an idle file finalizing; without
    heartbeat lines a file says nothing about completeness.

    The file is its history: its identity is its first line, and every read checks that the
    bytes just before the position are still the ones read (SourceChanged otherwise: the file
    was truncated, rotated or rewritten), so a resume never starts inside a line of another file
    or waits silently behind a shorter one. A replay reads the file from its start up to a
    committed offset and checks the crc32 of all it read against the offset's.

    The file must exist when the source is made (SourceError otherwise: one line, nothing
    created). With follow=False the stream ends at the end of the file; with follow=True it
    polls every `poll_interval` seconds and, while nothing new arrives, yields an empty batch
    (no heartbeat) every `idle_batch_every` seconds, so the caller regains control.
    """

    kind = "debezium-file"

    def __init__(
        self,
        path: str | Path,
        primary_key: tuple[str, ...] | None = None,
        spec: TableSpec | None = None,
        follow: bool = False,
        complete_file: bool = False,
        poll_interval: float = 0.5,
        idle_batch_every: float = 10.0,
        sleep: Callable[[float], None] = time.sleep,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        key_columns = tuple(primary_key) if primary_key else (spec.primary_key if spec is not None else ())
        if not key_columns:
            raise SourceError(f"debezium source {path}: no primary key (pass primary_key or a table spec)")
        self.path = require_file(path)
        self.primary_key = key_columns
        self.follow = follow
        self.complete_file = complete_file and not follow
        self.poll_interval = poll_interval
        self.idle_batch_every = idle_batch_every
        self._sleep = sleep
        self._monotonic = monotonic
        table = spec.name if spec is not None else self.path.stem
        self.decoder = DebeziumJsonDecoder(table, key_columns, spec.columns if spec is not None else None,
                                           decimal_encodings=spec.decimal_encodings if spec is not None else None)
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
            changes = ChangeColumns(self.primary_key)
            for number, decoded, _ in self._decoded(lines, position.line):
                if isinstance(decoded, DecodedChange):
                    changes.append(number, decoded.op, decoded.key_values, decoded.event_time_us, decoded.payload, decoded.arrival_us)
            position = position.after(lines)
            yield changes.to_records()
        if position.byte != target.byte or (target.crc32 is not None and position.crc32 != target.crc32):
            raise SourceChanged(
                f"{self.path} no longer holds the {target.byte:,} bytes the writer read (their crc32 differs): rewritten"
            )

    def column_types(self) -> dict[str, pa.DataType] | None:
        """Column types from the schema blocks read so far, else the spec's; None if neither."""
        return self.decoder.column_types()

    def decimal_encodings(self) -> dict[str, str]:
        return self.decoder.decimal_encodings()

    def batches(self, start_offset: str | None, max_records: int) -> Iterator[ChangeBatch]:
        if max_records < 1:
            raise SourceError(f"max_records must be at least 1, got {max_records}")
        position = self._resume(start_offset) if start_offset is not None else _FilePosition()
        idle_since = self._monotonic()
        while True:
            batch, position = self._read_batch(position, max_records)
            if batch is not None:
                yield batch
                idle_since = self._monotonic()
                continue
            if not self.follow:
                return
            if self._monotonic() - idle_since >= self.idle_batch_every:
                yield ChangeBatch(records=CDC_RECORD_SCHEMA.empty_table(), offset=position.to_offset())
                idle_since = self._monotonic()
            self._sleep(self.poll_interval)

    def _read_batch(self, position: _FilePosition, max_lines: int) -> tuple[ChangeBatch | None, _FilePosition]:
        """The next batch after `position` (up to max_lines lines): changes, or one heartbeat, never both."""
        consumed: list[_Line] = []
        changes = ChangeColumns(self.primary_key)
        rejected: list[tuple[int, str, str]] = []
        heartbeat_us = None
        with closing(self._complete_lines(position, max_lines)) as lines:
            for line in lines:
                number = position.line + len(consumed) + 1
                decoded, reason = self._decode(line)
                if isinstance(decoded, DecodedHeartbeat) and changes:
                    break  # not consumed: it makes the next batch
                consumed.append(line)
                if reason is not None:
                    raw = line.data.decode("utf-8", errors="replace").rstrip("\r\n")
                    rejected.append((number, raw, f"line {number}: {reason}"))
                elif isinstance(decoded, DecodedHeartbeat):  # a batch of its own: each may become a checkpoint
                    heartbeat_us = decoded.time_us
                    break
                elif decoded is not None:
                    changes.append(number, decoded.op, decoded.key_values, decoded.event_time_us, decoded.payload, decoded.arrival_us)
        if not consumed:
            return None, position
        after = position.after(consumed)
        batch = ChangeBatch(
            records=changes.to_records(),
            offset=after.to_offset(),
            rejected=pa.table(
                {
                    "source_seq": [seq for seq, _, _ in rejected],
                    "raw": [raw for _, raw, _ in rejected],
                    "reason": [reason for _, _, reason in rejected],
                },
                schema=REJECTED_RECORD_SCHEMA,
            ),
            heartbeat=from_us(heartbeat_us) if heartbeat_us is not None else None,
        )
        return batch, after

    def _decode(self, line: _Line) -> tuple[DecodedChange | DecodedHeartbeat | None, str | None]:
        if line.oversized:
            return None, f"{oversized(line.size, self.decoder.max_message_bytes)}; it is bytes {line.start:,} to {line.start + line.size:,} of the file"
        try:
            return self.decoder.decode(line.data.rstrip(b"\r\n")), None
        except RejectedMessage as reason:
            return None, str(reason)

    def _decoded(self, lines: list[_Line], last_line_number: int) -> Iterator[tuple[int, Any, str | None]]:
        for number, line in enumerate(lines, start=last_line_number + 1):
            yield (number, *self._decode(line))

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
            if tail and not tail.endswith(b"\n") and file.read(1) == b"\n":
                # the last line was read without its newline (the file was taken as complete): the newline written
                # since ends that line, as a history read from the start sees it, rather than starting a blank one
                return _FilePosition(position.byte + 1, position.line, _crc_text(zlib.crc32(b"\n", int(crc32, 16))),
                                     (tail + b"\n")[-_TAIL_BYTES:])
        return _FilePosition(position.byte, position.line, crc32, tail)

    def _check_size(self, file, byte: int) -> None:
        size = os.fstat(file.fileno()).st_size
        if size < byte:
            raise SourceChanged(f"{self.path} holds {size:,} bytes, fewer than the {byte:,} already read: truncated or replaced")

    def _rewritten(self, byte: int) -> str:
        return f"the bytes of {self.path} before byte {byte:,} are not the ones read there: the file was rotated or rewritten"

    def _read_complete_lines(self, position: _FilePosition, max_lines: int, limit: int | None = None) -> list[_Line]:
        with closing(self._complete_lines(position, max_lines, limit)) as lines:
            return list(lines)

    def _complete_lines(self, position: _FilePosition, max_lines: int, limit: int | None = None) -> Iterator[_Line]:
        """Up to max_lines complete lines after `position` (not past byte `limit`), once the bytes before it check out.

        A line is complete when it ends with a newline; the file's last line without one is complete too
        when the file is (`complete_file`), or when it ends exactly at `limit` (a history read up to an
        offset that consumed it). A line longer than the size limit is read in chunks, never held whole.
        """
        byte = position.byte
        try:
            file = self.path.open("rb")
        except FileNotFoundError:
            if self.follow:
                return  # rotated away while following: the identity check names it on the next run
            raise SourceError(f"debezium source: {self.path} does not exist") from None
        with file:
            self._check_size(file, position.byte)
            file.seek(position.byte - len(position.tail))
            if file.read(len(position.tail)) != position.tail:
                raise SourceChanged(self._rewritten(position.byte))
            crc32 = int(position.crc32, 16) if position.crc32 is not None else None
            for _ in range(max_lines):
                if limit is not None and byte >= limit:
                    return
                line = self._read_line(file, byte, crc32, limit)
                if line is None:  # end of file, or a line still being written
                    return
                byte += line.size
                crc32 = line.crc32_after
                yield line

    def _read_line(self, file, start: int, crc32: int | None, limit: int | None) -> _Line | None:
        """The line at `start` (the file is positioned there), or None if it is not complete yet."""
        cap = self.decoder.max_message_bytes + 2  # the longest line kept whole: the limit, plus \r\n
        if limit is not None:
            cap = min(cap, limit - start)
        data = file.readline(cap)
        size = len(data)
        oversized = False
        tail = data
        if not data.endswith(b"\n") and size == cap and (limit is None or start + size < limit):
            oversized = True  # over the limit: read on to its end, keeping its head and last bytes
            running = zlib.crc32(data, crc32) if crc32 is not None else None
            while True:
                chunk = file.readline(_CHUNK_BYTES if limit is None else min(_CHUNK_BYTES, limit - start - size))
                if not chunk:
                    break
                size += len(chunk)
                running = zlib.crc32(chunk, running) if running is not None else None
                tail = (tail + chunk)[-_TAIL_BYTES:]
                if chunk.endswith(b"\n") or (limit is not None and start + size >= limit):
                    break
            data = data[:OVERSIZED_RAW_BYTES]
            crc_after = running
        else:
            crc_after = zlib.crc32(data, crc32) if crc32 is not None else None
        if not tail.endswith(b"\n"):
            at_limit = limit is not None and start + size == limit
            if not size or not (at_limit or (self.complete_file and file.read(1) == b"")):
                return None
            if not at_limit:
                log.warning("%s: its last line (%s) has no trailing newline: read as a complete line, this run treats the "
                            "file as complete", self.path, f"bytes {start:,} to {start + size:,}")
        return _Line(data, start, size, crc_after, tail[-_TAIL_BYTES:], oversized)

def require_file(path: str | Path) -> Path:
    """The path of a Debezium file that exists; else SourceError (one line, before anything is created)."""
    resolved = Path(path)
    if not resolved.is_file():
        what = "is not a file" if resolved.exists() else "does not exist"
        raise SourceError(f"debezium source: {resolved} {what}")
    return resolved


def debezium_table_spec(path: str | Path, name: str, primary_key: tuple[str, ...], *, complete: bool = True) -> TableSpec:
    """The declaration of cdc.<name> from the first schema block of a Debezium file (key only if none yet).

    Read before anything is committed, so a key the file does not have, or any declaration
    problem, is one clear error and nothing is created. A new table also needs a file that holds
    Debezium messages: one of its first 1,000 lines must decode (SourceError otherwise, quoting the
    first line's reason, e.g. for a README given by mistake), and an empty file is refused unless
    the run waits for lines to come (`complete=False`: --follow).
    """
    file_path = require_file(path)
    decoder = DebeziumJsonDecoder(name, primary_key, warn=False)
    first_rejected: str | None = None
    usable = False
    with file_path.open("rb") as file:
        lines = iter(lambda: file.readline(decoder.max_message_bytes + 2), b"")  # a longer line is cut: rejected
        for number, raw in zip(range(1, _SCHEMA_PEEK_LINES + 1), lines):
            try:
                usable = decoder.decode(raw.rstrip(b"\r\n")) is not None or usable
            except RejectedMessage as reason:
                first_rejected = first_rejected or f"line {number}: {reason}"
            columns = decoder.column_types()  # from the first schema block decoded
            if columns:
                missing = [c for c in primary_key if c not in columns]
                if missing:
                    raise SourceError(
                        f"primary-key column(s) {missing} are not in the Debezium schema of {file_path} "
                        f"(columns: {', '.join(columns)}); give --primary-key one of them"
                    )
                if usable:
                    spec = TableSpec(name, primary_key, columns, decimal_encodings=decoder.decimal_encodings())
                    spec.to_properties()  # every type must be declarable: fail here, not after a commit
                    return spec
    if first_rejected is not None and not usable:
        raise SourceError(
            f"{file_path} does not read as Debezium JSON lines: none of its first {_SCHEMA_PEEK_LINES:,} lines is a change "
            f"event ({first_rejected}); nothing was created"
        )
    if not usable and complete:
        raise SourceError(f"{file_path} holds no change event yet: nothing to ingest and nothing was created "
                          "(cdc.<table> is created with the file's first change; --follow waits for it)")
    return TableSpec(name, primary_key, decoder.column_types() or {}, decimal_encodings=decoder.decimal_encodings())


_TAIL_BYTES = 1024  # checked before every read: a rotated, truncated or rewritten file is seen at once


def _crc_text(value: int) -> str:
    return f"{value:08x}"


_CHUNK_BYTES = 1 << 20  # how a line over the size limit is read to its end


@dataclass(frozen=True)
class _Line:
    """A line as read: its bytes (of a line over the size limit, only the first OVERSIZED_RAW_BYTES), where it is,
    and the crc32 of the file from its start through this line (None: an offset older than partfin's checksums)."""

    data: bytes
    start: int
    size: int  # its length in the file, newline included
    crc32_after: int | None
    tail: bytes  # its last bytes (up to _TAIL_BYTES)
    oversized: bool = False


@dataclass(frozen=True)
class _FilePosition:
    """Where reading stands in the file: after `line` lines, `byte` bytes, whose crc32 is `crc32`."""

    byte: int = 0
    line: int = 0
    crc32: str | None = _crc_text(0)  # None: from an offset written before partfin kept it
    tail: bytes = b""  # the last bytes before `byte` (up to _TAIL_BYTES), as read
    tail_crc32: str | None = None  # their crc32, as an offset records it (the bytes themselves are not in it)

    def after(self, lines: list[_Line]) -> _FilePosition:
        """The position after `lines`, read from this one (each carries the crc32 of the file through it)."""
        if not lines:
            return self
        crc_after = lines[-1].crc32_after
        crc32 = _crc_text(crc_after) if self.crc32 is not None and crc_after is not None else None
        size = sum(line.size for line in lines)
        tail = (self.tail + b"".join(line.tail for line in lines[-_TAIL_BYTES:]))[-_TAIL_BYTES:]
        return _FilePosition(self.byte + size, self.line + len(lines), crc32, tail)

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
            raise SourceError(f"not a debezium-file offset: {offset!r} ({exc})") from exc


# ---- the registry entry's functions (sources/registry.py SOURCE_KINDS)


def _debezium_path(argument: str, spec_text: str) -> str:
    if not argument:
        raise SourceError(f"source {redact(spec_text)!r}: debezium needs a file path, e.g. debezium:/data/orders.jsonl")
    return argument


def open_debezium(argument: str, text: str, table: TableSpec, key_columns, complete: bool, options: dict[str, Any]) -> CdcSource:
    return DebeziumFileSource(_debezium_path(argument, text), primary_key=key_columns, spec=table, complete_file=complete,
                              **options)


def declare_debezium(argument: str, text: str, table_name: str, key_columns, complete: bool) -> TableSpec:
    path = _debezium_path(argument, text)
    return debezium_table_spec(path, table_name, new_table_key(table_name, key_columns), complete=complete)
