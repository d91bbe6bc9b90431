"""Reading the slot: wal2json format-version 2 rows -> partfin CDC records, exactly as far as asked.

Format-version 2 gives one JSON row per change with its LSN, the transaction's commit timestamp
and commit LSN (`include-timestamp`, `include-lsn`), the new row as typed values and the old key
("identity") of updates and deletes; numbers stay exact (parsed as Decimal). Rows are read with
`pg_logical_slot_peek_changes`, which never consumes: the slot moves only when the writer says a
position is committed (slot.py).

Records
-------
- `event_time` = the source transaction's commit timestamp (microseconds, UTC); so is
  `arrival_time` (logical decoding sees a change once its transaction committed).
- `key` = canonical key JSON of the key columns (table.py); deletes are keyed from the old-key
  identity. An update that changes the key is a delete of the old key then a `c` of the new one.
- `payload` = JSON after-image normalized as column_types.py says.
- `source_seq` = max(previous source_seq + 1, LSN of the change): strictly increasing in
  delivery (= commit) order, equal to the WAL position where changes are sparse, and
  deterministic: a replay from a committed offset numbers every change as before.
- Changes that cannot be represented (TRUNCATE, an update missing an unchanged TOAST
  column) go to the rejected records with a reason, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

import psycopg
import pyarrow as pa

from partfin_assets.model.change_columns import ChangeColumns
from partfin_assets.model.errors import PartfinError
from partfin_assets.model.records import REJECTED_RECORD_SCHEMA, ChangeBatch
from partfin_assets.model.timeutil import to_us
from partfin_assets.sources.postgres.column_types import text_value
from partfin_assets.sources.postgres.position import Position, lsn_to_int, lsn_to_text
from partfin_assets.sources.postgres.slot import ReplicationSlot
from partfin_assets.sources.postgres.table import TableInfo

log = logging.getLogger(__name__)

_FETCH_ROWS = 2_000  # rows per round trip from a peek's server-side cursor


def probe_numbers_as_text(slot: ReplicationSlot, conn: psycopg.Connection, info: TableInfo) -> tuple[bool, TableInfo]:
    """Whether the slot's wal2json has numeric-data-types-as-string (2.6+); without it, say what is at risk."""

    def probe() -> bool:
        try:
            conn.execute(
                "SELECT count(*) FROM pg_logical_slot_peek_changes(%s, '0/1'::pg_lsn, NULL, "
                "'format-version', '2', 'numeric-data-types-as-string', '1')",
                (slot.name,),
            )
            return True
        except psycopg.errors.InvalidParameterValue:
            return False

    numbers_as_text = slot.when_free(probe)
    floats = [name for name, data_type in info.types.items() if pa.types.is_floating(data_type)]
    if numbers_as_text or not floats:
        return numbers_as_text, info
    log.warning(
        "%s: this server's wal2json (before 2.6) writes float NaN and ±Infinity as null: in column(s) %s they "
        "cannot be told from NULL (a NOT NULL column rejects such changes); install wal2json 2.6 or later",
        info.qualified, ", ".join(floats),
    )
    return numbers_as_text, dataclasses.replace(info, unreadable_nulls=frozenset(floats) & info.not_null)


def _peek_options(info: TableInfo, numbers_as_text: bool) -> list[str]:
    escaped = ".".join(re.sub(r"([ ',.*\\])", r"\\\1", part) for part in (info.schema, info.name))
    options = [
        "format-version", "2",
        "include-timestamp", "1",
        "include-lsn", "1",
        "include-types", "0",
        "add-tables", escaped,
    ]  # fmt: skip
    if numbers_as_text:  # float NaN / ±Infinity as text, not null
        options += ["numeric-data-types-as-string", "1"]
    return options


def drain(
    slot: ReplicationSlot, peek_conn: psycopg.Connection, info: TableInfo, numbers_as_text: bool,
    position: Position, upto: int, max_records: int,
) -> Iterator[tuple[ChangeBatch, Position]]:
    """Batches of every change after `position` whose transaction commits before `upto`."""
    options = _peek_options(info, numbers_as_text)
    placeholders = ", ".join(["%s"] * len(options))
    window = max(4 * max_records, 1_000)
    pending = _Pending(ChangeColumns(info.key))
    reader = _TxnReader(info, position)
    while True:
        returned = 0
        delivered_before = reader.position
        rows = _peek(slot, peek_conn, placeholders, options, upto, window)
        for lsn_text, data in rows:
            returned += 1
            reader.row(lsn_text, data, pending)
            if len(pending) >= max_records:
                yield reader.batch(pending), reader.position
                pending = _Pending(ChangeColumns(info.key))
        peek_conn.commit()
        if reader.position == delivered_before and reader.in_txn is None and returned >= window:
            window *= 2  # the slot is behind what was delivered (not yet committed): look further
        if returned < window:
            break
    if len(pending) or reader.position != position:
        yield reader.batch(pending), reader.position


def _peek(
    slot: ReplicationSlot, peek_conn: psycopg.Connection, placeholders: str, options: list[str], upto: int, window: int
) -> Iterator[tuple[str, str]]:
    cursor = peek_conn.cursor(name="partfin_peek")
    slot.when_free(lambda: _execute_peek(peek_conn, cursor, placeholders, options, slot.name, lsn_to_text(upto), window))
    try:
        while True:
            rows = cursor.fetchmany(_FETCH_ROWS)
            if not rows:
                return
            yield from rows
    finally:
        cursor.close()


def _execute_peek(peek_conn, cursor, placeholders, options, slot, upto, window) -> None:
    try:
        cursor.execute(
            f"SELECT lsn::text, data FROM pg_logical_slot_peek_changes(%s, %s::pg_lsn, %s, {placeholders})",
            (slot, upto, window, *options),
        )
    except psycopg.errors.ObjectInUse:
        peek_conn.rollback()
        raise


@dataclass
class _Change:
    key_values: dict[str, Any]
    op: str
    payload: str | None


@dataclass
class _Pending:
    """Records of the batch being built."""

    changes: ChangeColumns
    rejected: list[tuple[int, str, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.changes) + len(self.rejected)


class _Reject(PartfinError, ValueError):
    pass


class _TxnReader:
    """Turns wal2json v2 rows into records, skipping what `position` already covers."""

    def __init__(self, info: TableInfo, position: Position) -> None:
        self.info = info
        self.position = position
        self.safe = position.advance_to  # end of the last wholly delivered transaction
        self.in_txn: int | None = None  # commit end LSN of the transaction being read
        self.index = 0  # changes of it seen so far
        self.skip = 0  # of them, already delivered
        self.event_time_us = 0
        self._loads = json.JSONDecoder(parse_float=Decimal).decode

    def row(self, lsn_text: str, data: str, pending: _Pending) -> None:
        head = data[:40]
        if '"action":"B"' in head:
            fields = json.loads(data)
            commit_end = lsn_to_int(fields["nextlsn"])
            self.index = 0
            if commit_end < self.position.lsn or (commit_end == self.position.lsn and self.position.n is None):
                self.in_txn, self.skip = None, 0  # delivered before
                return
            self.in_txn = commit_end
            self.skip = self.position.n if commit_end == self.position.lsn else 0
            self.event_time_us = to_us(datetime.fromisoformat(fields["timestamp"]))
            return
        if self.in_txn is None:
            return
        if '"action":"C"' in head:
            self.position = Position(self.in_txn, self.position.seq)
            self.safe = self.in_txn
            self.in_txn = None
            return
        if '"action":"M"' in head:
            return  # logical decoding messages of other tools
        self.index += 1
        if self.index <= self.skip:
            return
        seq_base = self.position.seq
        change_lsn = lsn_to_int(lsn_text)
        try:
            changes = self._changes(self._loads(data))
            reason = None
        except _Reject as exc:
            changes, reason = [], str(exc)
        if reason is not None:
            seq = max(seq_base + 1, change_lsn)
            pending.rejected.append((seq, data, reason))
        else:
            seq = seq_base
            for change in changes:
                seq = max(seq + 1, change_lsn)
                # logical decoding sees a change once its transaction committed: the commit is its arrival
                pending.changes.append(seq, change.op, change.key_values, self.event_time_us, change.payload, self.event_time_us)
        self.position = Position(self.in_txn, seq, self.index, self.safe)

    def _changes(self, change: dict[str, Any]) -> list[_Change]:
        action = change.get("action")
        info = self.info
        if action == "T":
            raise _Reject(f"TRUNCATE of {info.qualified} cannot be keyed per row (not applied to base tables)")
        if action not in ("I", "U", "D"):
            raise _Reject(f"unknown wal2json action {action!r}")
        old = self._image(change.get("identity") or [])
        if action == "D":
            return [_Change(self._key(old, "old-key identity"), "d", None)]
        new = self._image(change.get("columns") or [])
        missing = [c for c in info.types if c not in new]
        for column in missing:
            if column in old:  # REPLICA IDENTITY FULL carries unchanged TOAST values
                new[column] = old[column]
        missing = [c for c in info.types if c not in new]
        if missing:
            raise _Reject(
                f"column(s) {missing} missing from the change (unchanged TOAST values?): "
                f"ALTER TABLE {info.qualified} REPLICA IDENTITY FULL"
            )
        key = self._key(new, "new row")
        payload = json.dumps(new, separators=(",", ":"), ensure_ascii=False)
        if action == "I":
            return [_Change(key, "c", payload)]
        old_key = {c: old[c] for c in info.key if c in old}
        if len(old_key) == len(info.key) and old_key != key:
            return [_Change(old_key, "d", None), _Change(key, "c", payload)]
        return [_Change(key, "u", payload)]

    def _image(self, columns: list[dict[str, Any]]) -> dict[str, Any]:
        image = {}
        normalizers = self.info.normalizers
        for column in columns:
            name, value = column["name"], column.get("value")
            if value is None and name in self.info.unreadable_nulls:
                raise _Reject(
                    f"column {name!r} is NOT NULL but arrived as null: a float NaN or ±Infinity, which this server's "
                    "wal2json (before 2.6) cannot carry"
                )
            if value is not None:
                normalize = normalizers.get(name, text_value)
                if normalize is not None:
                    try:
                        value = normalize(value)
                    except (ValueError, TypeError, ArithmeticError) as exc:
                        raise _Reject(f"bad value in column {name!r} ({exc})") from None
            image[name] = value
        return image

    def _key(self, image: dict[str, Any], what: str) -> dict[str, Any]:
        missing = [c for c in self.info.key if image.get(c) is None]
        if missing:
            raise _Reject(f"key column(s) {missing} missing from the {what}")
        return {c: image[c] for c in self.info.key}

    def batch(self, pending: _Pending) -> ChangeBatch:
        records = pending.changes.to_records()
        rejected = pa.table(
            {
                "source_seq": [r[0] for r in pending.rejected],
                "raw": [r[1] for r in pending.rejected],
                "reason": [r[2] for r in pending.rejected],
            },
            schema=REJECTED_RECORD_SCHEMA,
        )
        return ChangeBatch(records=records, offset=self.position.to_offset(), rejected=rejected)


