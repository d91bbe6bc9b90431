"""Who writes a cdc table and where each writer stands: writer positions and progress streams.

Two kinds of entries, each one table property of cdc.<table> holding compact JSON, changed
only inside a commit that PyIceberg validates against the head it was built on:

- `partfin.writer.<stream id>` = {"checkpoint": n, "offset": "..."}: the committed source position
  of a progress stream (below), set in the same commit as its checkpoint. A checkpoint commits only
  if the position it started from is still the one on the fresh metadata (compare-and-set): two
  processes can never both commit from the same position. A writer without partitions has one
  (stream id = writer id); a source with partitions (Kafka) has one per partition, so processes
  that share a writer id (one consumer group) each commit the partitions they read, concurrently,
  and a process that lost a partition can commit it only from where the table stands. Checkpoint
  ids count up per stream. A table written before per-partition positions keeps its writer's entry
  (all partitions in one offset): partitions without an entry of their own resume from it, and
  their checkpoint ids go on from its checkpoint id.
- `partfin.stream.<stream id>` = {"writer", "progress", "seen", "state", "since", "steady"}: a *progress
  stream*, something whose uncommitted data the watermark must not pass. One stream per writer
  (stream id = writer id); a source with partitions (Kafka) has one per partition instead
  (`<writer id>/<partition>`; the writer's own stream is then retired and never holds the
  watermark), which is more entries, not another mechanism. `progress` is the stream's own
  watermark candidate (hour aligned; null until its first stats-bearing commit), `seen` the
  commit clock of its last checkpoint (or its registration), `state` active or retired, `since`
  per writer that writer's stream clock (below) at its first commit that found this checkpoint
  (for the stream's own writer: the checkpoint's commit), `steady` its writer's host monotonic
  clock (and boot) when that commit recorded its own.
- `partfin.writer-clock.<writer id>` = {"ahead-of", "ahead-by-s", "found"}: the writer's clock was
  found ahead of another writer's by at least that much (see below); absent while they agree.

The table's watermark candidate is the minimum of `progress` over the *active* streams: not
retired, and not silent for the idle timeout (`partfin.streams.idle-timeout`, default 15m). A
stream registers when its writer starts, is retired explicitly (`partfin streams retire`), and
counts as idle -- no longer holding the watermark -- once it has committed nothing (no data, no
heartbeat) for the idle timeout; its next checkpoint makes it active again (its data may then be
late, and is counted as such).

Clocks. Writers run on hosts whose clocks may disagree, and a host's clock may step, back or
forward, while its writer runs. So a stream's silence is never a difference of two writers'
clocks, nor of two readings across a step: the committing writer measures it on its own *stream
clock* (`StreamClock`: the host's monotonic clock, carried from run to run on one boot, never
behind a time the writer recorded in `since`), from its own first commit that found the stream's
current checkpoint (`since`). Commits are serialized by the catalog, so that first commit
came after the checkpoint, and the silence measured is never longer than the real one. The same
first sight checks the clocks against each other: the checkpoint's `seen` lies before the commit
that finds it, so `seen` beyond the finder's clock by more than the tolerance means the writer
that recorded it runs ahead by at least that much (`partfin.writer-clock.<writer>`); a later
first sight by that writer of the finder's checkpoint within the tolerance clears it. A writer
found ahead judges event times with its clock less that lead (`trusted_clock_us`).

Names. A writer id names a stream, the table properties above and the ledger's rows, and begins
its partition streams' ids (`<writer id>/<partition>`), so one a user gives is checked
(`check_writer_id`, model/stream_names.py): 1-128 ASCII letters, digits, `.`, `_`, `-`, starting with a letter or digit
(no `/`, which begins a partition's stream; no space or control character, which would split the
lines of `partfin streams`), and outside `partfin.`, the prefix of partfin's own streams
(`REPLAY_STREAM`: the ledger's record of each replay of an hour).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import cache
from pathlib import Path

from pyiceberg.catalog import Catalog
from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata

from partfin_assets.iceberg.commit import commit_with_retry, new_transaction, set_table_properties
from partfin_assets.iceberg.history import last_writer_position
from partfin_assets.model import summary_keys as K
from partfin_assets.model.table_options import STREAMS_IDLE_TIMEOUT
from partfin_assets.model.errors import InvalidInput, PartfinError
from partfin_assets.model.stats import compact_json
from partfin_assets.model.stream_names import PARTITION_SEPARATOR, RESERVED_STREAM_PREFIX, check_stream_id, check_writer_id
from partfin_assets.model.timeutil import US_PER_SECOND, iso_z, parse_iso, to_us

DEFAULT_IDLE_TIMEOUT = timedelta(microseconds=STREAMS_IDLE_TIMEOUT.default_value)
ACTIVE, RETIRED = "active", "retired"

REPLAY_STREAM = RESERVED_STREAM_PREFIX + "replay"  # the ledger's stream of replays of an hour (checkpoint id: sequence number)


class UnknownStream(PartfinError):
    pass


@dataclass(frozen=True)
class CommittedPosition:
    """The source position a writer committed last: checkpoint id and the offset after it."""

    checkpoint_id: int  # 0: nothing committed yet
    source_offset: str | None

    def encode(self) -> str:
        return compact_json({"checkpoint": self.checkpoint_id, "offset": self.source_offset})


NO_POSITION = CommittedPosition(0, None)


def writer_position(metadata: TableMetadata, writer_id: str) -> CommittedPosition:
    """The writer's own committed position on this metadata (from its entry; older tables: from the history)."""
    text = metadata.properties.get(K.PROP_WRITER_PREFIX + writer_id)
    if text:
        return _decode_position(text)
    # written before positions were properties (a partition's checkpoint is not the writer's own)
    legacy = last_writer_position(metadata, writer_id, writer_id)
    return CommittedPosition(legacy.checkpoint_id, legacy.source_offset) if legacy else NO_POSITION


def stream_position(metadata: TableMetadata, writer_id: str, stream_id: str) -> CommittedPosition:
    """The committed position of a progress stream of `writer_id` on this metadata (see `position_in`)."""
    return position_in(positions_of(metadata, writer_id), writer_id, stream_id)


def position_in(positions: Mapping[str, CommittedPosition], writer_id: str, stream_id: str) -> CommittedPosition:
    """A stream's position among a writer's `positions` (`positions_of`): its entry; a partition stream without one
    starts where its writer's entry left off (its checkpoint id; the offset is the writer's, joined by the source)."""
    known = positions.get(stream_id)
    return known if known is not None else CommittedPosition(positions[writer_id].checkpoint_id, None)


def positions_of(metadata: TableMetadata, writer_id: str) -> dict[str, CommittedPosition]:
    """Stream id -> committed position, for the writer's own stream and every partition stream with an entry."""
    prefix = K.PROP_WRITER_PREFIX + writer_id + "/"
    found = {key[len(K.PROP_WRITER_PREFIX):]: _decode_position(value)
             for key, value in metadata.properties.items() if key.startswith(prefix)}
    return {writer_id: writer_position(metadata, writer_id), **found}


def _decode_position(text: str) -> CommittedPosition:
    entry = json.loads(text)
    return CommittedPosition(int(entry["checkpoint"]), entry.get("offset"))


@dataclass(frozen=True)
class Stream:
    stream_id: str
    writer_id: str
    progress_us: int | None  # the stream's watermark candidate; None: it claims nothing yet
    seen_us: int  # commit clock of its last checkpoint, or of its registration (its writer's clock)
    retired: bool = False
    # writer id -> that writer's stream clock at its first commit that found this checkpoint (its own: the checkpoint)
    since: Mapping[str, int] = field(default_factory=dict)
    # its writer's host monotonic clock when its own `since` entry was recorded (None: not recorded, no boot known)
    steady: SteadyReading | None = None

    def encode(self) -> str:
        entry = {
            "writer": self.writer_id,
            "progress": iso_z(self.progress_us) if self.progress_us is not None else None,
            "seen": iso_z(self.seen_us),
            "state": RETIRED if self.retired else ACTIVE,
        }
        if self.since:
            entry["since"] = {writer: iso_z(us) for writer, us in sorted(self.since.items())}
        if self.steady is not None:
            entry["steady"] = {"boot": self.steady.boot, "us": self.steady.us}
        return compact_json(entry)

    @classmethod
    def decode(cls, stream_id: str, text: str) -> Stream:
        entry = json.loads(text)
        progress = entry.get("progress")
        return cls(
            stream_id,
            entry.get("writer", stream_id),
            to_us(parse_iso(progress)) if progress else None,
            to_us(parse_iso(entry["seen"])),
            entry.get("state") == RETIRED,
            {writer: to_us(parse_iso(at)) for writer, at in entry.get("since", {}).items()},
            SteadyReading(entry["steady"]["boot"], int(entry["steady"]["us"])) if "steady" in entry else None,
        )

    def silence_us(self, writer_id: str | None, clock_us: int) -> int:
        """How long the stream has committed nothing, as writer `writer_id` measures it at `clock_us` on its stream clock.

        From the writer's first commit that found this checkpoint (0 before it has one: this is it).
        None: a reader that commits nothing, from `seen` on its wall clock `clock_us`.
        """
        if writer_id is None:
            return clock_us - self.seen_us
        found = self.since.get(writer_id)
        return 0 if found is None else clock_us - found

    def idle(self, writer_id: str | None, clock_us: int, idle_timeout_us: int) -> bool:
        return self.silence_us(writer_id, clock_us) > idle_timeout_us

    def checkpointed(self, progress_us: int | None, clock_us: int, reading: StreamClockReading) -> Stream:
        """The stream after a checkpoint of its own at commit clock `clock_us` (its writer's stream clock `reading`):
        active, seen now, found by its own writer only."""
        return replace(self, progress_us=progress_us, seen_us=clock_us, retired=False, since={self.writer_id: reading.us},
                       steady=reading.steady)


def streams_of(properties: Mapping[str, str]) -> dict[str, Stream]:
    prefix = K.PROP_STREAM_PREFIX
    return {key[len(prefix):]: Stream.decode(key[len(prefix):], value) for key, value in properties.items() if key.startswith(prefix)}


def stream_count(properties: Mapping[str, str]) -> int:
    """How many progress streams the table knows (retired ones included: a stream is never forgotten)."""
    return sum(1 for key in properties if key.startswith(K.PROP_STREAM_PREFIX))


def idle_timeout_us(properties: Mapping[str, str]) -> int:
    return STREAMS_IDLE_TIMEOUT.read(properties)


def active_streams(streams: Mapping[str, Stream], writer_id: str | None, clock_us: int, idle_timeout: int) -> dict[str, Stream]:
    """The streams that hold the watermark as writer `writer_id` judges them at `clock_us` (its stream clock; a
    reader: its wall clock): not retired, not idle."""
    return {sid: s for sid, s in streams.items() if not s.retired and not s.idle(writer_id, clock_us, idle_timeout)}


def progress_floor(streams: Mapping[str, Stream]) -> int | None:
    """The minimum progress over `streams`; None when one of them claims nothing yet (or there are none)."""
    values = [s.progress_us for s in streams.values()]
    if not values or any(v is None for v in values):
        return None
    return min(values)


def stream_property(stream: Stream) -> dict[str, str]:
    return {K.PROP_STREAM_PREFIX + stream.stream_id: stream.encode()}


def first_sights(streams: Mapping[str, Stream], writer_id: str, stream_clock_us: int) -> dict[str, Stream]:
    """Active streams whose current checkpoint this commit of `writer_id` is the first of its writer to find
    (another writer's; one of its own recorded before `since` held its checkpoint), with this writer's
    stream clock recorded in `since` (its measure of their silence starts here)."""
    return {sid: replace(s, since={**s.since, writer_id: stream_clock_us}) for sid, s in streams.items()
            if not s.retired and writer_id not in s.since}


# --------------------------------------------------------------------------- the clock that measures silence


@dataclass(frozen=True)
class SteadyReading:
    """A reading of a host's monotonic clock (CLOCK_MONOTONIC, µs since its boot), which no step of the wall clock
    moves; `boot` names the boot it counts from (None: unknown, so never compared with another process's)."""

    boot: str | None
    us: int


@cache
def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def steady_now() -> SteadyReading:
    return SteadyReading(_boot_id(), time.monotonic_ns() // 1000)


@dataclass(frozen=True)
class StreamClockReading:
    us: int  # the stream clock
    steady: SteadyReading  # the host's monotonic clock at the same moment


def recorded_by(streams: Mapping[str, Stream], writer_id: str) -> int | None:
    """The latest stream clock `writer_id` recorded in the streams (`since`); None: none."""
    return max((s.since[writer_id] for s in streams.values() if writer_id in s.since), default=None)


class StreamClock:
    """The clock writer `writer_id` measures progress streams' silence on: one that no step of its host's clock lengthens.

    It runs on the host's monotonic clock, which the kernel never steps (a step of the wall clock,
    back or forward, leaves it alone), from where the writer's stream clock stood: at a process's
    first reading, the stream clock the writer recorded last on this boot (its own streams'
    `since`, with the monotonic clock then, `steady`) moved on by the monotonic clock since,
    though never beyond the wall clock (a process of another clock, libfaketime's, may share the
    boot); without such a record, the wall clock. And never earlier than the latest time the writer
    recorded in the table (`recorded_by`): a process started after a step back starts where the
    writer's clock stood. So neither a step during a run nor one between runs on one boot lengthens
    a silence, and where the monotonic clock steps too (libfaketime), a step back and forward again
    does not either.
    """

    def __init__(self, writer_id: str, wall_us: Callable[[], int], steady: Callable[[], SteadyReading] = steady_now) -> None:
        self.writer_id = writer_id
        self._wall_us, self._steady = wall_us, steady
        self._anchor: tuple[int, int] | None = None  # (stream clock, monotonic clock) at the first reading

    def read(self, streams: Mapping[str, Stream]) -> StreamClockReading:
        """The stream clock now, for a commit on `streams` (the table's, as the commit finds them)."""
        steady = self._steady()
        floor = recorded_by(streams, self.writer_id)
        if self._anchor is None:
            start = min((self._wall_us(), *self._resumed(streams, steady)))
            self._anchor = (start if floor is None else max(start, floor), steady.us)
        at, steady_at = self._anchor
        now = at + steady.us - steady_at
        return StreamClockReading(now if floor is None else max(now, floor), steady)

    def _resumed(self, streams: Mapping[str, Stream], steady: SteadyReading) -> list[int]:
        """The writer's last recorded stream clock on this boot moved on by the monotonic clock since (none or one)."""
        moved = [s.since[self.writer_id] + steady.us - s.steady.us for s in streams.values()
                 if s.writer_id == self.writer_id and self.writer_id in s.since and s.steady is not None and steady.boot is not None
                 and s.steady.boot == steady.boot and s.steady.us <= steady.us]
        return [max(moved)] if moved else []


# --------------------------------------------------------------------------- writers' clocks checked against each other


@dataclass(frozen=True)
class WriterClock:
    """A writer's clock found ahead of another writer's by at least `ahead_by_us`, when that one's commit found it."""

    writer_id: str
    ahead_of: str
    ahead_by_us: int
    found_us: int  # the finding writer's clock

    def encode(self) -> str:
        return compact_json({"ahead-of": self.ahead_of, "ahead-by-s": self.ahead_by_us // US_PER_SECOND, "found": iso_z(self.found_us)})

    @classmethod
    def decode(cls, writer_id: str, text: str) -> WriterClock:
        entry = json.loads(text)
        return cls(writer_id, entry["ahead-of"], int(entry["ahead-by-s"]) * US_PER_SECOND, to_us(parse_iso(entry["found"])))

    def as_dict(self) -> dict:
        return {"writer": self.writer_id, "ahead_of": self.ahead_of, "ahead_by_seconds": self.ahead_by_us // US_PER_SECOND,
                "found": iso_z(self.found_us), "description": self.describe()}

    def describe(self) -> str:
        seconds = self.ahead_by_us // US_PER_SECOND
        return (f"clock of writer {self.writer_id} is at least {seconds}s ({seconds / 60:.0f} min) ahead of writer {self.ahead_of}'s "
                f"(found at {iso_z(self.found_us)} on {self.ahead_of}'s clock): the watermark caps {self.writer_id}'s event times "
                f"by the slower clock; set the hosts' clocks right (NTP)")


def writer_clocks(properties: Mapping[str, str]) -> dict[str, WriterClock]:
    """Writer id -> its clock's disagreement with another writer's, for every writer found ahead."""
    prefix = K.PROP_WRITER_CLOCK_PREFIX
    return {key[len(prefix):]: WriterClock.decode(key[len(prefix):], value) for key, value in properties.items() if key.startswith(prefix)}


@dataclass(frozen=True)
class ClockFindings:
    """What one commit's first sights say about the writers' clocks: entries to set and to remove."""

    found: dict[str, WriterClock]
    cleared: list[str]

    def properties(self) -> dict[str, str]:
        return {K.PROP_WRITER_CLOCK_PREFIX + w: c.encode() for w, c in self.found.items()}

    def removals(self) -> list[str]:
        return [K.PROP_WRITER_CLOCK_PREFIX + w for w in self.cleared]

    def apply(self, clocks: Mapping[str, WriterClock]) -> dict[str, WriterClock]:
        return {w: c for w, c in {**clocks, **self.found}.items() if w not in self.cleared}


def check_clocks(sighted: Mapping[str, Stream], clocks: Mapping[str, WriterClock], writer_id: str, clock_us: int,
                 tolerance_us: int) -> ClockFindings:
    """Check this writer's clock against the checkpoints it finds first (`first_sights`, before this commit).

    Each was recorded (`seen`) before this commit: `seen - clock` is a lower bound of how far its
    writer's clock runs ahead of this one's, and `clock - seen` an upper bound of how far this one
    runs ahead of it. A lower bound beyond the tolerance is a finding; an upper bound within it
    clears a finding that this writer runs ahead of that one.
    """
    found: dict[str, WriterClock] = {}
    cleared: list[str] = []
    for stream in sighted.values():
        other = stream.writer_id
        if other == writer_id:
            continue  # a stream of its own, recorded before `since` held its checkpoint
        lead = stream.seen_us - clock_us
        known = found.get(other) or clocks.get(other)
        if lead > tolerance_us and (known is None or known.ahead_of == writer_id or lead > known.ahead_by_us):
            found[other] = WriterClock(other, writer_id, lead, clock_us)
        own = clocks.get(writer_id)
        if own is not None and own.ahead_of == other and -lead <= tolerance_us and writer_id not in cleared:
            cleared.append(writer_id)
    return ClockFindings(found, cleared)


def trusted_clock_us(clocks: Mapping[str, WriterClock], writer_id: str, clock_us: int) -> int:
    """The writer's clock checked against the others': less the lead it was found to have (the slower clock rules)."""
    own = clocks.get(writer_id)
    return clock_us - own.ahead_by_us if own is not None and own.ahead_by_us > 0 else clock_us


# --------------------------------------------------------------------------- registration and retirement


def register_stream(catalog: Catalog, identifier: str, stream_id: str, clock_us: int, stream_clock: StreamClock) -> Table:
    """Make the stream active (a writer starting at commit clock `clock_us`): a new one claims nothing until its
    first checkpoint; its silence is measured from here (`since`, on the writer's `stream_clock`).

    An active stream is left as it is (its `seen` moves with its checkpoints only, so that a
    writer started again and again without committing still goes idle); a retired one becomes
    active again with the progress it had. A writer that hands its progress to per-partition
    streams (Kafka) never holds the watermark with its own: its partition streams are made active
    instead (those it had; the source's others join at its first checkpoint), its own stays retired.
    """

    writer_id = stream_clock.writer_id

    def build(table: Table, commit_id: str):
        streams = streams_of(table.properties)
        reading = stream_clock.read(streams)
        since, steady = {writer_id: reading.us}, reading.steady
        partitions = [s for sid, s in streams.items() if stream_id == writer_id and s.writer_id == writer_id and sid.startswith(writer_id + "/")]
        current = streams.get(stream_id)
        if partitions:
            changed = [replace(s, retired=False, seen_us=clock_us, since=since, steady=steady) for s in partitions if s.retired]
            if current is not None and not current.retired:
                changed.append(replace(current, retired=True))
        elif current is None:
            changed = [Stream(stream_id, writer_id, None, clock_us, since=since, steady=steady)]
        elif current.retired:
            changed = [replace(current, retired=False, seen_us=clock_us, since=since, steady=steady)]
        else:
            changed = []
        if not changed:
            return None
        tx = new_transaction(table)
        tx.set_properties({k: v for s in changed for k, v in stream_property(s).items()})
        return tx

    return commit_with_retry(catalog, identifier, build).table


def retire_stream(catalog: Catalog, identifier: str, stream_id: str) -> Stream:
    """Stop counting a stream (and, for a writer's own stream, its partition streams) in the watermark.

    Takes effect at the next checkpoint of any writer. A writer that starts again registers again.
    """
    retired: list[Stream] = []

    def build(table: Table, commit_id: str):
        streams = streams_of(table.properties)
        if stream_id not in streams:  # one an older partfin registered under a name outside the form can be retired
            check_stream_id(stream_id)
            known = ", ".join(sorted(streams)) or "none"
            raise UnknownStream(f"{identifier} has no stream {stream_id!r} (streams: {known})")
        targets = [s for sid, s in streams.items() if sid == stream_id or (s.writer_id == stream_id and sid.startswith(stream_id + "/"))]
        retired[:] = [replace(s, retired=True) for s in targets]
        tx = new_transaction(table)
        tx.set_properties({k: v for s in retired for k, v in stream_property(s).items()})
        return tx

    commit_with_retry(catalog, identifier, build)
    return next(s for s in retired if s.stream_id == stream_id)


def set_idle_timeout(catalog: Catalog, identifier: str, timeout: timedelta) -> None:
    if timeout <= timedelta(0):
        raise InvalidInput(f"the idle timeout must be positive, got {timeout}")
    set_table_properties(catalog, identifier, {K.PROP_STREAMS_IDLE_TIMEOUT: f"{timeout.total_seconds():g}s"})
