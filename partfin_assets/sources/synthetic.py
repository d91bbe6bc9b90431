"""A deterministic synthetic CDC source for the demo table `orders`.

The generator works in event time: events are generated one hour of event time
(a "chunk") at a time from an anchor, each chunk from its own seeded random
stream, so the stream depends only on (seed, anchor, options) and never on when
or in which pieces it is read. Each event then gets an arrival time (event time
+ a heavy-tailed lateness) and the source emits events in arrival order, as a
real change stream with out-of-order delivery would.

Batches and heartbeats are cut on a grid of `heartbeat_every` cells of arrival
time, anchored at the anchor: a batch never spans a whole cell with no arrivals
(an idle cell), and every idle cell yields one empty batch whose heartbeat is the
cell's end. That keeps heartbeats identical however the stream is split.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
import polars as pl
import pyarrow as pa

from partfin_assets.model.errors import SourceError
from partfin_assets.model.redaction import redact
from partfin_assets.model.record_keys import key_json_column
from partfin_assets.model.records import CDC_RECORD_SCHEMA, CDC_RECORD_SCHEMA_WITHOUT_ARRIVAL, CdcSource, ChangeBatch, ReplayableSource
from partfin_assets.model.source_identity import SourceIdentity
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.model.timeutil import US_PER_HOUR, US_PER_SECOND, floor_hour_us, from_us, iso_z, now_utc, parse_duration, parse_iso, to_us

ORDERS_SPEC = TableSpec(
    name="orders",
    primary_key=("id",),
    columns={"id": pa.int64(), "user_id": pa.int64(), "amount": pa.float64(), "status": pa.string()},
)
ORDER_STATUSES = ("pending", "paid", "shipped", "delivered", "cancelled")

CHUNK_US = US_PER_HOUR  # event time generated per random stream; fixed, it defines the stream
_ARRIVAL = "arrival_us"
_PENDING_SCHEMA = CDC_RECORD_SCHEMA_WITHOUT_ARRIVAL.append(pa.field(_ARRIVAL, pa.int64(), nullable=False))
_MEDIAN_LATENESS_S = 2.0
_LATENESS_SIGMA = 1.5  # log-normal body: ~99.9% of on-time events arrive within ~4 minutes
_LATE_TAIL_ALPHA = 1.5  # Pareto tail of the rare hours-late events


def accelerated_clock(wall: Callable[[], datetime], speed: float, since: datetime, event_at_since: datetime) -> Callable[[], datetime]:
    """An event clock that runs `speed` times faster than `wall` from wall time `since`, where it reads
    `event_at_since`, and never passes the wall clock (then it goes on at wall speed: events never come
    from the future). A demo's hours then end every 60/speed minutes of wall time while event time
    stays what it is: the time the change happened at the (simulated) source."""

    def clock() -> datetime:
        now = wall()
        return min(now, event_at_since + (now - since) * speed)

    return clock


def _us(duration: timedelta) -> int:
    return round(duration.total_seconds() * US_PER_SECOND)


def _seconds_text(us: int) -> str:
    """A duration as the spec writes it: `21600s`, `0.5s`."""
    return f"{us // US_PER_SECOND}s" if us % US_PER_SECOND == 0 else f"{us / US_PER_SECOND}s"


def _ceil_div(a: np.ndarray | int, b: int) -> np.ndarray | int:
    return -((-a) // b)


@dataclass(frozen=True)
class _Position:
    """Where the emitted stream stands; serialized as the opaque offset."""

    anchor_us: int  # event-time origin of the generator
    emitted: int  # events emitted so far, in arrival order
    clock_us: int  # arrival time of the last emitted event, or the last heartbeat

    def to_offset(self) -> str:
        return json.dumps(
            {"anchor_us": self.anchor_us, "next": self.emitted, "clock_us": self.clock_us}, separators=(",", ":")
        )

    @classmethod
    def from_offset(cls, offset: str) -> _Position:
        try:
            fields = json.loads(offset)
            return cls(int(fields["anchor_us"]), int(fields["next"]), int(fields["clock_us"]))
        except (ValueError, TypeError, KeyError) as exc:
            raise SourceError(f"not a synthetic-source offset: {offset!r} ({exc})") from exc


class SyntheticSource(ReplayableSource):
    """Insert/update/delete changes of `orders` rows, deterministic by seed.

    Events are generated from an anchor: `start` if given, else `hours` before the
    current hour (a replay, so a demo has finalized hours at once). With
    follow=False the stream ends at `end` (default: now); with follow=True it
    catches up to now, then keeps streaming paced by `clock`, sleeping with
    `sleep` until the next events are due.

    Each event's key is drawn uniformly from ids 1..key_space: a key that does not
    exist is inserted, an existing one is deleted with probability
    `delete_fraction` and updated otherwise, so deleted keys come back later.
    Lateness (arrival - event time) is log-normal around a couple of seconds,
    except for a fraction `late_fraction` of events that arrive hours late
    (Pareto from one hour, capped at `max_lateness`). The last `idle_for` of every
    `idle_every` of event time has no events.

    `heartbeat` is the source's arrival clock: for a batch of events, the arrival
    time of its last event; for an empty batch, the end of an idle cell of
    `heartbeat_every`. Every event arriving before it has been emitted; later
    events arrive at or after it, though their event times may be earlier (late
    data). The offset is compact JSON {"anchor_us", "next" (events emitted, in
    arrival order), "clock_us"}; resuming regenerates the same stream from the
    anchor and skips what was emitted.

    `speed` (with `speed_since`, a wall time, and optionally `speed_event`, the event time the clock
    reads then; default `start`) paces arrivals on an accelerated clock (accelerated_clock); the
    stream itself -- events, event times, arrival order -- does not depend on it.
    """

    kind = "synthetic"

    def __init__(
        self,
        seed: int = 0,
        rate: float = 10.0,
        hours: float = 24.0,
        start: datetime | None = None,
        end: datetime | None = None,
        follow: bool = False,
        key_space: int = 10_000,
        delete_fraction: float = 0.1,
        late_fraction: float = 0.001,
        max_lateness: timedelta = timedelta(hours=6),
        idle_every: timedelta | None = timedelta(hours=6),
        idle_for: timedelta = timedelta(minutes=20),
        heartbeat_every: timedelta = timedelta(minutes=1),
        clock: Callable[[], datetime] = now_utc,
        sleep: Callable[[float], None] = time.sleep,
        speed: float = 1.0,
        speed_since: datetime | None = None,
        speed_event: datetime | None = None,
    ) -> None:
        if rate <= 0:
            raise SourceError(f"synthetic source option rate={rate:g}: must be positive (events per second)")
        if key_space < 1:
            raise SourceError(f"synthetic source option key_space={key_space}: must be at least 1")
        for name, fraction in (("delete_fraction", delete_fraction), ("late_fraction", late_fraction)):
            if not 0 <= fraction <= 1:
                raise SourceError(f"synthetic source option {name}={fraction:g}: must be within [0, 1]")
        if max_lateness < timedelta(hours=1):
            raise SourceError(f"synthetic source option max_lateness={max_lateness}: must be at least one hour")
        if idle_every is not None and not timedelta(0) <= idle_for < idle_every:
            raise SourceError(f"synthetic source options idle_for={idle_for}, idle_every={idle_every}: idle_for must be shorter")
        if heartbeat_every <= timedelta(0):
            raise SourceError(f"synthetic source option heartbeat_every={heartbeat_every}: must be positive")
        if follow and end is not None:
            raise SourceError("a following source has no end")
        if speed != 1.0:
            if speed <= 0:
                raise SourceError(f"synthetic source option speed={speed:g}: must be positive")
            if start is None or speed_since is None:
                raise SourceError("speed needs start (the history) and speed_since (the wall time the faster clock starts)")
            clock = accelerated_clock(clock, speed, speed_since, speed_event or start)
        self.seed = seed
        self.rate = rate
        self.follow = follow
        self.key_space = key_space
        self.delete_fraction = delete_fraction
        self.late_fraction = late_fraction
        self.max_lateness_us = _us(max_lateness)
        self.idle_every_us = _us(idle_every) if idle_every is not None else None
        self.idle_for_us = _us(idle_for)
        self.heartbeat_every_us = _us(heartbeat_every)
        self.end_us = to_us(end) if end is not None else None
        self._clock = clock
        self._sleep = sleep
        self._explicit_start = start is not None
        if start is not None:
            self.anchor_us = to_us(start)
        else:
            self.anchor_us = floor_hour_us(to_us(clock())) - round(hours * US_PER_HOUR)

    def identity(self, offset: str | None) -> SourceIdentity:
        """Seed, event-shaping options and anchor: the stream depends on nothing else.

        A resume takes the anchor from the offset (`hours` is relative to the clock), unless `start`
        was given: then it is the anchor, and a different one is another history. The spec names the
        stream exactly, with `start=`, so a replay reads it again wherever and whenever it runs.
        """
        anchor_us = self.anchor_us
        if offset is not None and not self._explicit_start:
            anchor_us = _Position.from_offset(offset).anchor_us
        options = {
            "seed": self.seed,
            "rate": self.rate,
            "key_space": self.key_space,
            "delete_fraction": self.delete_fraction,
            "late_fraction": self.late_fraction,
            "max_lateness": _seconds_text(self.max_lateness_us),
            "idle_every": _seconds_text(self.idle_every_us) if self.idle_every_us is not None else "off",
            "idle_for": _seconds_text(self.idle_for_us),
            "start": iso_z(anchor_us),
        }
        spec = "synthetic:" + ",".join(f"{name}={value}" for name, value in options.items())
        return SourceIdentity(self.kind, spec, options)

    def history(self, until_offset: str, max_records: int) -> Iterator[pa.Table]:
        """The events emitted before `until_offset`, in arrival order: the stream is regenerated from its anchor."""
        position = _Position.from_offset(until_offset)
        yield from _ArrivalStream(self, position.anchor_us).take(position.emitted, max_records)

    def batches(self, start_offset: str | None, max_records: int) -> Iterator[ChangeBatch]:
        if max_records < 1:
            raise SourceError(f"max_records must be at least 1, got {max_records}")
        position = (
            _Position.from_offset(start_offset)
            if start_offset is not None
            else _Position(self.anchor_us, emitted=0, clock_us=self.anchor_us)
        )
        end_us = self.end_us if self.end_us is not None else to_us(self._clock())
        stream = _ArrivalStream(self, position.anchor_us)
        stream.skip(position.emitted)
        while True:
            horizon_us = to_us(self._clock()) if self.follow else end_us
            stream.generate_past(horizon_us)
            emitted = self._next_batch(stream, position, horizon_us, max_records)
            if emitted is not None:
                batch, position = emitted
                yield batch
                continue
            if not self.follow:
                return
            wake_us = min(stream.next_arrival_us(), stream.generated_until_us, self._heartbeat_due_us(position))
            self._sleep(max(wake_us - to_us(self._clock()), 0) / US_PER_SECOND)

    def _heartbeat_due_us(self, position: _Position) -> int:
        """End of the first whole cell after the clock: a heartbeat if no event arrives within it."""
        cell = _ceil_div(position.clock_us - position.anchor_us, self.heartbeat_every_us) + 1
        return position.anchor_us + cell * self.heartbeat_every_us

    def _next_batch(
        self, stream: _ArrivalStream, position: _Position, horizon_us: int, max_records: int
    ) -> tuple[ChangeBatch, _Position] | None:
        """The next batch due by horizon_us and the position after it; None if nothing is due yet."""
        heartbeat_us = self._heartbeat_due_us(position)
        if heartbeat_us <= horizon_us and stream.next_arrival_us() > heartbeat_us:
            after = _Position(position.anchor_us, position.emitted, heartbeat_us)
            empty = CDC_RECORD_SCHEMA.empty_table()
            return ChangeBatch(empty, after.to_offset(), heartbeat=from_us(heartbeat_us)), after
        arrivals = stream.arrivals_us()
        due = min(int(np.searchsorted(arrivals, horizon_us, side="right")), max_records)
        count = self._events_before_idle_cell(arrivals[:due], position)
        if count == 0:
            return None
        clock_us = int(arrivals[count - 1])
        after = _Position(position.anchor_us, position.emitted + count, clock_us)
        return ChangeBatch(stream.pop(count), after.to_offset(), heartbeat=from_us(clock_us)), after

    def _events_before_idle_cell(self, arrivals: np.ndarray, position: _Position) -> int:
        """How many of these arrivals come before the first cell with no arrival (a heartbeat goes there)."""
        cells = _ceil_div(arrivals - position.anchor_us, self.heartbeat_every_us)
        clock_cell = _ceil_div(position.clock_us - position.anchor_us, self.heartbeat_every_us)
        skipped_cell = np.flatnonzero(np.diff(cells, prepend=clock_cell) >= 2)
        return int(skipped_cell[0]) if len(skipped_cell) else len(arrivals)

    def _generate_chunk(self, chunk: int, anchor_us: int, first_seq: int, alive: np.ndarray) -> pa.Table:
        """Events of event-time chunk `chunk` (one hour from the anchor), as pending rows.

        `alive` (indexed by key id) carries which keys exist across chunks; it is updated.
        """
        rng = np.random.default_rng([self.seed, chunk])
        chunk_start_us = anchor_us + chunk * CHUNK_US
        count = rng.poisson(self.rate * CHUNK_US / US_PER_SECOND)
        event_us = chunk_start_us + np.sort(rng.integers(0, CHUNK_US, count))
        if self.idle_every_us is not None:
            phase_us = (event_us - anchor_us) % self.idle_every_us
            event_us = event_us[phase_us < self.idle_every_us - self.idle_for_us]
        count = len(event_us)
        ids = rng.integers(1, self.key_space + 1, count)
        wants_delete = rng.random(count) < self.delete_fraction
        lateness_us = self._draw_lateness_us(rng, count)
        orders = pl.DataFrame(
            {
                "id": ids,
                "user_id": rng.integers(1, max(self.key_space // 10, 1) + 1, count),
                "amount": np.round(rng.lognormal(3.5, 1.0, count), 2),
                "status": pl.Series(ORDER_STATUSES).gather(rng.integers(0, len(ORDER_STATUSES), count)),
                "op": _assign_ops(ids, wants_delete, alive),
            }
        )
        payload = orders.select(
            pl.when(pl.col("op") != "d").then(pl.struct("id", "user_id", "amount", "status").struct.json_encode())
        ).to_series()
        return pa.table(
            {
                "key": key_json_column({"id": ids}),
                "op": orders["op"].to_arrow().cast(pa.string()),
                "event_time": pa.array(event_us, pa.int64()).cast(CDC_RECORD_SCHEMA.field("event_time").type),
                "source_seq": pa.array(first_seq + np.arange(count), pa.int64()),
                "payload": payload.to_arrow().cast(pa.string()),
                _ARRIVAL: pa.array(event_us + lateness_us, pa.int64()),
            },
            schema=_PENDING_SCHEMA,
        )

    def _draw_lateness_us(self, rng: np.random.Generator, count: int) -> np.ndarray:
        on_time_s = rng.lognormal(np.log(_MEDIAN_LATENESS_S), _LATENESS_SIGMA, count)
        hours_late_s = 3600.0 * (1.0 + rng.pareto(_LATE_TAIL_ALPHA, count))
        is_late = rng.random(count) < self.late_fraction
        lateness_us = np.round(np.where(is_late, hours_late_s, on_time_s) * US_PER_SECOND).astype(np.int64)
        return np.minimum(lateness_us, self.max_lateness_us)


def _assign_ops(key_ids: np.ndarray, wants_delete: np.ndarray, alive: np.ndarray) -> np.ndarray:
    """Ops of events in generation order: insert a missing key, else delete or update it.

    Vectorized per key: sorted by key (stable, so in generation order), a key is
    alive after any non-delete event; through a run of delete-wanting events it
    toggles (delete, re-insert, delete, ...). So a "segment" starts at a key's
    first event or after a non-delete-wanting one, and an event's liveness is
    the segment's starting liveness flipped once per event before it in the segment.
    """
    count = len(key_ids)
    order = np.argsort(key_ids, kind="stable")
    keys = key_ids[order]
    wants = wants_delete[order]
    first_of_key = np.ones(count, dtype=bool)
    first_of_key[1:] = keys[1:] != keys[:-1]
    segment_start = first_of_key.copy()
    segment_start[1:] |= ~wants[:-1]
    start_index = np.flatnonzero(segment_start)
    segment = np.cumsum(segment_start) - 1
    alive_at_start = np.where(first_of_key, alive[keys], True)[start_index]
    alive_before = alive_at_start[segment] ^ ((np.arange(count) - start_index[segment]) % 2 == 1)
    sorted_ops = np.where(~alive_before, "c", np.where(wants, "d", "u"))
    last_of_key = np.ones(count, dtype=bool)
    last_of_key[:-1] = first_of_key[1:]
    alive[keys[last_of_key]] = ~(alive_before & wants)[last_of_key]
    ops = np.empty(count, dtype=sorted_ops.dtype)
    ops[order] = sorted_ops
    return ops


class _ArrivalStream:
    """Generated but not yet emitted events, in arrival order.

    Events with arrival before `generated_until_us` are all known (an event
    arrives no earlier than its event time), so that prefix is final.
    """

    def __init__(self, source: SyntheticSource, anchor_us: int) -> None:
        self._source = source
        self._anchor_us = anchor_us
        self._next_chunk = 0
        self._next_seq = 0
        self._alive = np.zeros(source.key_space + 1, dtype=bool)
        self._pending = _PENDING_SCHEMA.empty_table()

    @property
    def generated_until_us(self) -> int:
        return self._anchor_us + self._next_chunk * CHUNK_US

    def generate_past(self, time_us: int) -> None:
        while self.generated_until_us <= time_us:
            self._generate_next_chunk()

    def skip(self, count: int) -> None:
        """Drop the first `count` events in arrival order (already emitted before a resume)."""
        for _ in self.take(count, max(count, 1)):
            pass

    def take(self, count: int, max_records: int) -> Iterator[pa.Table]:
        """The first `count` events not emitted yet, in arrival order, at most max_records at a time."""
        while count > 0:
            final = int(np.searchsorted(self.arrivals_us(), self.generated_until_us, side="left"))
            if final == 0:
                self._generate_next_chunk()
                continue
            taken = min(count, final, max_records)
            yield self.pop(taken)
            count -= taken

    def arrivals_us(self) -> np.ndarray:
        return self._pending.column(_ARRIVAL).to_numpy()

    def next_arrival_us(self) -> int:
        """Arrival of the next known event; events not generated yet arrive after generated_until_us."""
        return int(self._pending[_ARRIVAL][0].as_py()) if self._pending.num_rows else self.generated_until_us

    def pop(self, count: int) -> pa.Table:
        taken = self._pending.slice(0, count)
        self._pending = self._pending.slice(count)
        arrival = taken.column(_ARRIVAL).cast(CDC_RECORD_SCHEMA.field("arrival_time").type)  # the simulated arrival
        return taken.select(CDC_RECORD_SCHEMA_WITHOUT_ARRIVAL.names).append_column(CDC_RECORD_SCHEMA.field("arrival_time"), arrival)

    def _generate_next_chunk(self) -> None:
        chunk = self._source._generate_chunk(self._next_chunk, self._anchor_us, self._next_seq, self._alive)
        self._next_chunk += 1
        self._next_seq += chunk.num_rows
        merged = pa.concat_tables([self._pending, chunk])
        self._pending = merged.combine_chunks().sort_by([(_ARRIVAL, "ascending"), ("source_seq", "ascending")])


# ---- the registry entry's functions (sources/registry.py SOURCE_KINDS)


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise SourceError(f"not a boolean: {text!r}")


def _optional_duration(text: str) -> timedelta | None:
    return None if text.strip().lower() in ("none", "off", "0") else parse_duration(text)


SYNTHETIC_OPTIONS: dict[str, Callable[[str], Any]] = {
    "seed": int,
    "rate": float,
    "hours": float,
    "start": parse_iso,
    "end": parse_iso,
    "follow": parse_bool,
    "key_space": int,
    "delete_fraction": float,
    "late_fraction": float,
    "max_lateness": parse_duration,
    "idle_every": _optional_duration,
    "idle_for": parse_duration,
    "heartbeat_every": parse_duration,
    "speed": float,
    "speed_since": parse_iso,
    "speed_event": parse_iso,
}


def check_orders_table(table: TableSpec, key_columns: tuple[str, ...] | None) -> None:
    """The synthetic source produces `orders` rows; a table declared otherwise would not match them."""
    for declared in (table.primary_key, key_columns or ORDERS_SPEC.primary_key):
        if declared != ORDERS_SPEC.primary_key:
            raise SourceError(f"the synthetic source keys rows by {ORDERS_SPEC.primary_key}, not by {declared}")
    # Names only: a declaration read back from the catalog may spell the types differently (large_string).
    if table.columns and set(table.columns) != set(ORDERS_SPEC.columns):
        raise SourceError(
            f"the synthetic source produces columns {list(ORDERS_SPEC.columns)}; table {table.name!r} declares "
            f"{list(table.columns)} (use ORDERS_SPEC's columns)"
        )


def parse_synthetic_options(text: str, spec_text: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, equals, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not equals:
            raise SourceError(f"source {redact(spec_text)!r}: option {item!r} is not name=value")
        parse = SYNTHETIC_OPTIONS.get(name)
        if parse is None:
            raise SourceError(
                f"source {redact(spec_text)!r}: unknown synthetic option {name!r}; known: {', '.join(SYNTHETIC_OPTIONS)}"
            )
        try:
            options[name] = parse(value.strip())
        except ValueError as exc:
            raise SourceError(f"source {redact(spec_text)!r}: option {name}: {redact(str(exc), spec_text)}") from None
    return options


def open_synthetic(argument: str, text: str, table: TableSpec, key_columns, complete: bool, options: dict[str, Any]) -> CdcSource:
    check_orders_table(table, key_columns)
    return SyntheticSource(**{**parse_synthetic_options(argument, text), **options})


def declare_synthetic(argument: str, text: str, table_name: str, key_columns, complete: bool) -> TableSpec:
    return TableSpec(table_name, ORDERS_SPEC.primary_key, dict(ORDERS_SPEC.columns), ORDERS_SPEC.watermark_policy)
