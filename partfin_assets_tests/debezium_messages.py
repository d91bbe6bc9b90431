"""Debezium-shaped Kafka messages for tests and benchmarks (PostgreSQL connector, JsonConverter).

What Debezium publishes per row change: key = the primary key as JSON, value = the change
envelope (`before`, `after`, `source`, `op`, `ts_ms`), optionally wrapped in the
`{"schema", "payload"}` envelope (`schemas.enable=true`); a delete is followed by a tombstone
(same key, null value) so that log compaction can drop the key. Real Debezium output, for
decoding tests, is in ../shared/debezium-corpus/.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_KEY_SCHEMA = {"type": "struct", "optional": False, "name": "dbserver1.public.orders.Key",
               "fields": [{"type": "int64", "optional": False, "field": "id"}]}


@dataclass(frozen=True)
class DebeziumMessage:
    key: bytes
    value: bytes | None  # None: a tombstone
    timestamp_ms: int  # the Kafka record timestamp (Kafka Connect sets it to the source's commit time)


def _dumps(document) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode()


def order_row(order_id: int, version: int, *, note_bytes: int = 0) -> dict:
    return {"id": order_id, "customer_id": 1000 + order_id % 97, "amount": round(10.0 + version * 1.25, 2),
            "status": ("new", "paid", "shipped")[version % 3], "updated_by": f"worker-{version % 7}",
            "note": "x" * note_bytes}


def change(order_id: int, op: str, source_ts_ms: int, *, version: int = 0, schema: bool = False,
           note_bytes: int = 0, lsn: int | None = None) -> DebeziumMessage:
    """One change event of table public.orders: op "r"/"c"/"u"/"d" of row `order_id`.

    note_bytes pads each row image (an update is ~1 KB with note_bytes=250 and schema=False)."""
    before = order_row(order_id, version - 1, note_bytes=note_bytes) if op in ("u", "d") else None
    after = order_row(order_id, version, note_bytes=note_bytes) if op != "d" else None
    lsn = lsn if lsn is not None else 24_000_000 + order_id * 1000 + version
    payload = {
        "before": before, "after": after,
        "source": {"version": "2.7.0.Final", "connector": "postgresql", "name": "dbserver1",
                   "ts_ms": source_ts_ms, "snapshot": "true" if op == "r" else "false", "db": "inventory",
                   "sequence": json.dumps([None, str(lsn)]), "schema": "public", "table": "orders",
                   "txId": 700 + version, "lsn": lsn, "xmin": None},
        "op": op, "ts_ms": source_ts_ms + 40, "transaction": None,
    }
    key = {"id": order_id}
    if schema:
        key = {"schema": _KEY_SCHEMA, "payload": key}
        payload = {"schema": {"type": "struct", "name": "dbserver1.public.orders.Envelope", "optional": False},
                   "payload": payload}
    return DebeziumMessage(_dumps(key), _dumps(payload), source_ts_ms)


def tombstone(order_id: int, source_ts_ms: int, *, schema: bool = False) -> DebeziumMessage:
    """The null-value message Debezium sends after a delete (same key)."""
    return DebeziumMessage(change(order_id, "d", source_ts_ms, schema=schema).key, None, source_ts_ms)


def row_history(order_ids, start_ts_ms: int, *, updates: int = 1, delete_every: int = 0,
                note_bytes: int = 0) -> list[DebeziumMessage]:
    """For each id: a create, `updates` updates, and (every `delete_every`-th id) a delete plus tombstone,
    1 ms of source time apart, interleaved across ids like a busy table."""
    messages = []
    ts = start_ts_ms
    for version in range(updates + 2):
        for order_id in order_ids:
            if version == 0:
                messages.append(change(order_id, "c", ts, note_bytes=note_bytes))
            elif version <= updates:
                messages.append(change(order_id, "u", ts, version=version, note_bytes=note_bytes))
            elif delete_every and order_id % delete_every == 0:
                messages.append(change(order_id, "d", ts, version=version, note_bytes=note_bytes))
                messages.append(tombstone(order_id, ts))
            else:
                continue
            ts += 1
    return messages
