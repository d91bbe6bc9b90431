"""Debezium JSON lines as Kafka Connect's JsonConverter writes them (schemas.enable=true), for tests."""

from __future__ import annotations

import json
from typing import Any

CONNECT_FIELDS = {
    "id": {"type": "int64", "optional": False},
    "amount": {"type": "double", "optional": True},
    "note": {"type": "string", "optional": True},
}

HEARTBEAT_SCHEMA = {
    "type": "struct",
    "fields": [{"type": "int64", "optional": False, "field": "ts_ms"}],
    "optional": False,
    "name": "io.debezium.connector.common.Heartbeat",
    "version": 1,
}


def envelope_schema(fields: dict[str, dict]) -> dict:
    image = [{**spec, "field": name} for name, spec in fields.items()]
    source = [
        {"type": "string", "optional": False, "field": "connector"},
        {"type": "int64", "optional": False, "field": "ts_ms"},
        {"type": "string", "optional": False, "field": "db"},
    ]
    return {
        "type": "struct",
        "fields": [
            {"type": "struct", "fields": image, "optional": True, "name": "shop.public.t.Value", "field": "before"},
            {"type": "struct", "fields": image, "optional": True, "name": "shop.public.t.Value", "field": "after"},
            {"type": "struct", "fields": source, "optional": False, "name": "io.debezium.connector.postgresql.Source", "field": "source"},
            {"type": "string", "optional": False, "field": "op"},
            {"type": "int64", "optional": True, "field": "ts_ms"},
        ],
        "optional": False,
        "name": "shop.public.t.Envelope",
    }


def change_line(
    row: dict[str, Any], ts_ms: Any, op: str = "c", fields: dict[str, dict] | None = None, arrival_ms: Any = None
) -> str:
    """One wrapped change event; `ts_ms` is written verbatim (a float NaN becomes the bare token NaN)."""
    payload = {
        "before": row if op == "d" else None,
        "after": None if op == "d" else row,
        "source": {"connector": "postgresql", "ts_ms": ts_ms, "db": "shop"},
        "op": op,
        "ts_ms": arrival_ms if arrival_ms is not None else ts_ms,
    }
    return json.dumps({"schema": envelope_schema(fields or CONNECT_FIELDS), "payload": payload}, separators=(",", ":"))


def heartbeat_line(ts_ms: int, wrapped: bool = True) -> str:
    """A Debezium heartbeat message value (heartbeat.interval.ms): `{"ts_ms": ...}`, with or without its schema."""
    payload = {"ts_ms": ts_ms}
    document = {"schema": HEARTBEAT_SCHEMA, "payload": payload} if wrapped else payload
    return json.dumps(document, separators=(",", ":"))
