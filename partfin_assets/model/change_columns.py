"""CDC records built column by column, as every source gathers its changes before a batch."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from partfin_assets.model.record_keys import key_json_column
from partfin_assets.model.records import CDC_RECORD_SCHEMA, UTC_US


class ChangeColumns:
    """A source's changes gathered column by column until they become CDC records (`to_records`), each with its
    source_seq (a file's line number, a Kafka offset, a WAL position).

    A Kafka source holds every partition's changes until that partition's batch is full or read to its end:
    on a topic of many partitions, hundreds of thousands per process. Kept as (seq, change) pairs, each was
    objects the cyclic garbage collector walks on every full collection (7x the time of these columns, which
    hold only numbers and strings)."""

    __slots__ = ("primary_key", "seqs", "ops", "keys", "event_times", "arrivals", "payloads")

    def __init__(self, primary_key: tuple[str, ...]) -> None:
        self.primary_key = primary_key
        self.seqs: list[int] = []
        self.ops: list[str] = []
        self.keys: dict[str, list[Any]] = {name: [] for name in primary_key}
        self.event_times: list[int] = []
        self.arrivals: list[int | None] = []
        self.payloads: list[str | None] = []

    def append(self, seq: int, op: str, key_values: dict[str, Any], event_time_us: int, payload: str | None,
               arrival_us: int | None) -> None:
        self.seqs.append(seq)
        self.ops.append(op)
        for name, column in self.keys.items():
            column.append(key_values[name])
        self.event_times.append(event_time_us)
        self.payloads.append(payload)
        self.arrivals.append(arrival_us)

    def __len__(self) -> int:
        return len(self.seqs)

    def to_records(self) -> pa.Table:
        return pa.table(
            {
                "key": key_json_column(self.keys) if self.seqs else pa.array([], pa.string()),
                "op": pa.array(self.ops, pa.string()),
                "event_time": pa.array(self.event_times, pa.int64()).cast(UTC_US),
                "source_seq": pa.array(self.seqs, pa.int64()),
                "payload": pa.array(self.payloads, pa.string()),
                "arrival_time": pa.array(self.arrivals, pa.int64()).cast(UTC_US),
            },
            schema=CDC_RECORD_SCHEMA,
        )
