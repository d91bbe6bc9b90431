"""Helpers for user-level scenarios: the `partfin` command as a real process, and Debezium change
events as JSON lines (one event a line, as Debezium's file sinks write them).

The rows are `orders` rows (id, user_id, amount, status), the columns of ORDERS_SPEC, so a table
declared with ORDERS_SPEC's columns and a `debezium:` source upserts them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from partfin_assets.model.timeutil import parse_iso, to_us

ORDERS_COLUMNS = ("id", "user_id", "amount", "status")


# The Kafka Connect schema block Debezium's JsonConverter writes (schemas.enable=true) for an `orders` row.
_ROW_SCHEMA = [
    {"type": "int64", "optional": False, "field": "id"},
    {"type": "int64", "optional": True, "field": "user_id"},
    {"type": "double", "optional": True, "field": "amount"},
    {"type": "string", "optional": True, "field": "status"},
]
_ENVELOPE_SCHEMA = {
    "type": "struct",
    "name": "shop.public.orders.Envelope",
    "fields": [
        {"type": "struct", "optional": True, "name": "shop.public.orders.Value", "field": "before", "fields": _ROW_SCHEMA},
        {"type": "struct", "optional": True, "name": "shop.public.orders.Value", "field": "after", "fields": _ROW_SCHEMA},
        {"type": "struct", "optional": False, "field": "source", "fields": [{"type": "int64", "optional": False, "field": "ts_ms"}]},
        {"type": "string", "optional": False, "field": "op"},
        {"type": "int64", "optional": True, "field": "ts_ms"},
    ],
}


def change(
    op: str, key: int, ts_ms: int, status: str = "new", amount: float = 10.0, lsn: int | None = None, wrapped: bool = False
) -> str:
    """One Debezium event of `orders` row `key` whose source time is `ts_ms`; `wrapped`: in the schema envelope."""
    row = {"id": key, "user_id": key % 7, "amount": amount, "status": status}
    source = {"connector": "postgresql", "db": "shop", "table": "orders", "ts_ms": ts_ms}
    if lsn is not None:
        source["lsn"] = lsn
    event = {
        "op": op,
        "ts_ms": ts_ms + 250,  # when Debezium processed it
        "source": source,
        "before": row if op == "d" else None,
        "after": None if op == "d" else row,
    }
    if wrapped:
        event = {"schema": _ENVELOPE_SCHEMA, "payload": event}
    return json.dumps(event, separators=(",", ":"))


def hour_of_changes(hour_iso: str, keys: Iterable[int], *, minute_step: float = 1.0, status: str = "new") -> list[str]:
    """One insert per key, spread over the hour starting at `hour_iso` (minute_step minutes apart)."""
    start_ms = to_us(parse_iso(hour_iso)) // 1000
    return [change("c", key, start_ms + int(i * minute_step * 60_000), status=status) for i, key in enumerate(keys)]


def append_lines(path: Path, lines: Iterable[str]) -> None:
    with path.open("a", encoding="utf-8") as file:
        for line in lines:
            file.write(line + "\n")


def ms(iso: str) -> int:
    return to_us(parse_iso(iso)) // 1000


def partfin(home: Path, *args: str, env_extra: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The `partfin` command as a user runs it: a real process with its own PARTFIN_HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARTFIN_")}
    env.update({"PARTFIN_HOME": str(home), **(env_extra or {})})
    return subprocess.run(
        [sys.executable, "-m", "partfin_assets.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
