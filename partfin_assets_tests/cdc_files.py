"""Debezium JSON-lines files of `orders` changes for CLI-level tests, and what they should land as.

Lines are unwrapped Debezium envelopes: `source.ts_ms` is the event time (the source database's
commit clock), the envelope's `ts_ms` the time the connector saw the change (arrival). Ids get
`c` on their first change and `u` afterwards, so the upsert accepts every line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

HOUR_MS = 3_600_000
STATUSES = ("pending", "paid", "shipped", "delivered", "cancelled")


ORDERS_IMAGE_SCHEMA = {
    "type": "struct",
    "optional": True,
    "fields": [
        {"type": "int64", "optional": False, "field": "id"},
        {"type": "int64", "optional": True, "field": "user_id"},
        {"type": "float64", "optional": True, "field": "amount"},
        {"type": "string", "optional": True, "field": "status"},
    ],
}
ORDERS_ENVELOPE_SCHEMA = {
    "type": "struct",
    "name": "shop.public.orders.Envelope",
    "fields": [
        {**ORDERS_IMAGE_SCHEMA, "field": "before"},
        {**ORDERS_IMAGE_SCHEMA, "field": "after"},
        {"type": "string", "optional": False, "field": "op"},
        {"type": "int64", "optional": True, "field": "ts_ms"},
    ],
}


def orders_lines(event_ms: Sequence[int], arrival_ms: Sequence[int] | None = None, *, seed: int = 0,
                 key_space: int = 20_000, seen: set[int] | None = None, wrapped: bool = False) -> list[str]:
    """One Debezium line per event, in the given order; `seen` carries which ids exist across calls.

    `wrapped`: in the Kafka Connect `{"schema", "payload"}` envelope, so that `partfin ingest`
    learns the column types (the upsert needs them).
    """
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, key_space + 1, len(event_ms))
    seen = set() if seen is None else seen
    arrivals = list(arrival_ms) if arrival_ms is not None else list(event_ms)
    lines = []
    for event, arrival, key in zip(event_ms, arrivals, ids):
        key = int(key)
        op = "u" if key in seen else "c"
        seen.add(key)
        after = {"id": key, "user_id": key % 997, "amount": round(1 + (key % 500) / 7, 2), "status": STATUSES[key % 5]}
        envelope = {"op": op, "before": None, "after": after, "source": {"ts_ms": int(event)}, "ts_ms": int(arrival)}
        if wrapped:
            envelope = {"schema": ORDERS_ENVELOPE_SCHEMA, "payload": envelope}
        lines.append(json.dumps(envelope, separators=(",", ":")))
    return lines


def stream_of(start_ms: int, end_ms: int, count: int, *, seed: int = 0, median_lateness_s: float = 2.0) -> tuple[list[int], list[int]]:
    """`count` events with event times spread over [start, end), in arrival order (lognormal lateness)."""
    rng = np.random.default_rng(seed)
    events = np.sort(rng.integers(start_ms, end_ms, count))
    arrivals = events + np.round(rng.lognormal(np.log(median_lateness_s * 1000), 1.0, count)).astype(np.int64)
    order = np.argsort(arrivals, kind="stable")
    return events[order].tolist(), arrivals[order].tolist()


def write_lines(path: Path, lines: Iterable[str], *, append: bool = False) -> None:
    with path.open("a" if append else "w") as file:
        for line in lines:
            file.write(line + "\n")


def event_hours_of_file(path: Path) -> Counter:
    """Changes per event-time hour (epoch hour number) in a Debezium file (lines that are not JSON skipped)."""
    counts: Counter = Counter()
    for line in path.read_text().splitlines():
        try:
            document = json.loads(line)
        except json.JSONDecodeError:
            continue
        envelope = document["payload"] if "schema" in document else document
        counts[envelope["source"]["ts_ms"] // HOUR_MS] += 1
    return counts


def event_hours_of_table(table) -> Counter:
    """Records per event-time hour (epoch hour number) in cdc.<table>."""
    import pyarrow as pa
    import pyarrow.compute as pc

    times = pc.cast(table.scan(selected_fields=("event_time",)).to_arrow().column("event_time"), pa.int64()).to_numpy()
    return Counter((times // (HOUR_MS * 1000)).tolist())


def partfin_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARTFIN_")}
    env.update({"PARTFIN_HOME": str(home), **extra})
    return env


def partfin_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "partfin_assets.cli", *args]


def partfin(home: Path, *args: str, timeout: float = 600, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(partfin_command(*args), env=partfin_env(home, **extra), capture_output=True, text=True, timeout=timeout)


def hour_diff(expected: Counter, actual: Counter) -> dict[int, tuple[int, int]]:
    """Hours whose counts differ: hour -> (expected, actual)."""
    return {h: (expected.get(h, 0), actual.get(h, 0)) for h in sorted(set(expected) | set(actual)) if expected.get(h, 0) != actual.get(h, 0)}
