"""Event-time statistics of one checkpoint: count, min, max and a t-digest, overall and per hour.

fastdigest (Rust) builds and merges digests from whole numpy arrays; the stored
form is the `tdigest` package's dict layout so that any consumer can read it
back with `tdigest.TDigest().update_from_dict(json.loads(...))`.

The per-hour entry (`partfin.event-time.by-hour`, docs/contracts.md) holds
exact count/min/max/p50/p99 per hour plus a small digest, so that the hour partitions of
cdc and base tables can be described from snapshot summaries alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from fastdigest import TDigest
from pydantic_core import to_json

from partfin_assets.model import summary_keys as K
from partfin_assets.model.timeutil import US_PER_HOUR, US_PER_SECOND, floor_hour_us, iso_z, parse_iso, to_us

# 50 centroids keep the summary entry near 1.6 KB and the rank error far below 0.5%
# at p1/p50/p99 (the accuracy test measures it on the data actually written).
DIGEST_CENTROIDS = 50
DIGEST_INPUT_POINTS = 4096  # values fed to fastdigest per digest at most (see _digest)
# The tdigest package's own defaults: recorded so a reader that keeps updating
# the digest it loaded compresses it the way that package expects.
TDIGEST_DELTA = 0.01
TDIGEST_K = 25
BY_HOUR_LIMIT = 200  # like write.summary.partition-limit: a commit touching more hours omits the entry
BY_HOUR_CENTROIDS = 12  # small digest per hour so that several commits merge into p50/p99 for base


@dataclass(frozen=True)
class EventTimeStats:
    count: int = 0
    min_us: int | None = None
    max_us: int | None = None
    digest: TDigest | None = None  # over epoch seconds (float)

    @property
    def is_empty(self) -> bool:
        return self.count == 0

    @classmethod
    def merge_all(cls, parts: Iterable[EventTimeStats]) -> EventTimeStats:
        """Merge subtask stats; the result does not depend on the order of `parts`.

        t-digest merging is not associative to the bit, so the parts are merged in a
        canonical order of their own content rather than in arrival order.
        """
        non_empty = sorted((p for p in parts if not p.is_empty), key=_canonical_order)
        if not non_empty:
            return cls()
        digest = non_empty[0].digest
        for part in non_empty[1:]:
            digest = digest.merge(part.digest)
        return cls(
            count=sum(p.count for p in non_empty),
            min_us=min(p.min_us for p in non_empty),
            max_us=max(p.max_us for p in non_empty),
            digest=digest,
        )

    def quantile_us(self, q: float) -> int:
        if self.digest is None:
            raise ValueError("quantile of empty event-time stats")
        return int(round(self.digest.quantile(q) * US_PER_SECOND))

    def to_summary(self) -> dict[str, str]:
        """The snapshot-summary entries of a checkpoint (count always; the rest when non-empty)."""
        out = {K.EVENT_TIME_COUNT: str(self.count)}
        if self.is_empty:
            return out
        out[K.EVENT_TIME_MIN] = iso_z(self.min_us)
        out[K.EVENT_TIME_MAX] = iso_z(self.max_us)
        out[K.EVENT_TIME_TDIGEST] = compact_json(self.tdigest_dict())
        return out

    def tdigest_dict(self) -> dict:
        assert self.digest is not None
        return tdigest_dict(self.digest, self.count)

    @classmethod
    def from_summary(cls, summary: Mapping[str, str], *, with_digest: bool = True) -> EventTimeStats | None:
        """Stats of a committed snapshot; None when the commit carries no event-time stats.

        with_digest=False skips parsing the t-digest when only count/min/max are needed.
        """
        if K.EVENT_TIME_COUNT not in summary:
            return None
        count = int(summary[K.EVENT_TIME_COUNT])
        if count == 0:
            return cls()
        digest = None
        if with_digest:
            digest = digest_from_dict(json.loads(summary[K.EVENT_TIME_TDIGEST]))
        return cls(
            count=count,
            min_us=to_us(parse_iso(summary[K.EVENT_TIME_MIN])),
            max_us=to_us(parse_iso(summary[K.EVENT_TIME_MAX])),
            digest=digest,
        )


@dataclass(frozen=True)
class HourStats:
    """Records and event-time stats of one hour, as one commit (or several merged) wrote them."""

    hour_us: int
    records: int
    min_us: int | None = None
    max_us: int | None = None
    p50_us: int | None = None
    p99_us: int | None = None
    late_records: int = 0
    centroids: tuple[tuple[float, float], ...] = ()  # (mean epoch s, weight)


@dataclass(frozen=True)
class EventTimeProfile:
    """A batch of event times summarised: count, min, max, t-digest, and the same per hour."""

    stats: EventTimeStats
    by_hour: tuple[HourStats, ...]

    @classmethod
    def of(cls, event_time_us: np.ndarray) -> EventTimeProfile:
        return cls.of_sorted(np.sort(event_time_us.astype(np.int64, copy=False)))

    @classmethod
    def of_sorted(cls, times: np.ndarray) -> EventTimeProfile:
        """Profile of ascending event times (epoch microseconds, int64): one fastdigest pass.

        Each hour gets a full-size digest; the batch digest is their merge in hour order, and
        each hour keeps a BY_HOUR_CENTROIDS compression of its own. Exact figures (count, min,
        max, p50, p99) come from the array. A batch spanning more than BY_HOUR_LIMIT hours
        (its by-hour entry is omitted anyway) gets one digest over all values instead.
        """
        if times.size == 0:
            return cls(EventTimeStats(), ())
        bounds = hour_bounds(times, BY_HOUR_LIMIT)
        if bounds is None:
            return cls(EventTimeStats(int(times.size), int(times[0]), int(times[-1]), _digest(times, DIGEST_CENTROIDS)), ())
        digest = None
        by_hour = []
        for start, end in zip(bounds, bounds[1:]):
            hour = times[start:end]
            hour_digest = _digest(hour, DIGEST_CENTROIDS)
            digest = hour_digest if digest is None else digest.merge(hour_digest)
            small = hour_digest  # a handful of late records: every value is its own centroid already
            if end - start > BY_HOUR_CENTROIDS:
                small = TDigest(max_centroids=BY_HOUR_CENTROIDS)
                small.merge_inplace(hour_digest)
            first, last = int(hour[0]), int(hour[-1])
            by_hour.append(
                HourStats(
                    floor_hour_us(first),
                    end - start,
                    first,
                    last,
                    _sorted_quantile(hour, 0.5),
                    _sorted_quantile(hour, 0.99),
                    0,
                    tuple((round(m, 3), c) for m, c in small.centroids),
                )
            )
        return cls(EventTimeStats(int(times.size), int(times[0]), int(times[-1]), digest), tuple(by_hour))

    def to_summary(self) -> dict[str, str]:
        out = self.stats.to_summary()
        if self.by_hour:
            out[K.EVENT_TIME_BY_HOUR] = encode_by_hour(self.by_hour)
        return out


def hour_bounds(sorted_us: np.ndarray, limit: int | None = None) -> list[int] | None:
    """Where each hour's run starts in an ascending array, then its end; None past `limit` hours."""
    bounds = [0]
    while bounds[-1] < sorted_us.size:
        if limit is not None and len(bounds) > limit:
            return None
        next_hour = floor_hour_us(sorted_us[bounds[-1]]) + US_PER_HOUR
        bounds.append(int(np.searchsorted(sorted_us, next_hour)))
    return bounds


def _digest(sorted_us: np.ndarray, max_centroids: int) -> TDigest:
    """fastdigest's t-digest, over epoch seconds, of ascending event times (epoch microseconds).

    fastdigest takes its input one Python float at a time (about 12 ns each, from a memoryview;
    numpy scalars are 3x slower). Past DIGEST_INPUT_POINTS values, equal runs of consecutive
    values go in as weighted means, which is what a t-digest's centroids are anyway: estimates
    move by a few 1/DIGEST_INPUT_POINTS in rank at most, within the digest's own error (a test
    holds it to 4/DIGEST_INPUT_POINTS against fastdigest fed every value).
    """
    run = -(-sorted_us.size // DIGEST_INPUT_POINTS)
    if run == 1:
        return TDigest.from_values(memoryview(sorted_us / US_PER_SECOND), max_centroids=max_centroids)
    whole = sorted_us.size // run * run
    first = int(sorted_us[0])
    # offsets from the first value keep the sums exact in int64
    sums = np.add.reduceat(sorted_us[:whole] - first, np.arange(0, whole, run))
    means = (first + sums / run) / US_PER_SECOND
    digest = TDigest.from_values(memoryview(means), float(run), max_centroids=max_centroids)
    if whole < sorted_us.size:  # the values after the last whole run go in one by one
        digest.batch_update(memoryview(sorted_us[whole:] / US_PER_SECOND))
    return digest


def tdigest_dict(digest: TDigest, count: int) -> dict:
    """A fastdigest digest in the `tdigest` package's dict layout (`tdigest.TDigest().update_from_dict`)."""
    centroids = np.array(digest.centroids)  # rows of (mean, weight)
    # millisecond precision is plenty for hour-level decisions and halves the size
    means = np.round(centroids[:, 0], 3).tolist()
    return {
        "n": count,
        "delta": TDIGEST_DELTA,
        "K": TDIGEST_K,
        "centroids": [{"m": m, "c": c} for m, c in zip(means, centroids[:, 1].tolist())],
    }


def digest_of_sorted(sorted_us: np.ndarray, max_centroids: int = DIGEST_CENTROIDS) -> TDigest:
    """The t-digest, over seconds, of ascending microsecond values (event times, or durations such as lateness)."""
    return _digest(sorted_us, max_centroids)


def digest_from_dict(stored: Mapping) -> TDigest:
    """A digest stored in the `tdigest` dict layout, back as fastdigest (to merge or query)."""
    return TDigest.from_dict({"max_centroids": DIGEST_CENTROIDS, "centroids": stored["centroids"]})


def _sorted_quantile(sorted_values: np.ndarray, q: float) -> int:
    """The inverted-CDF q-quantile (an actual value) of an ascending array."""
    return int(sorted_values[max(int(np.ceil(q * sorted_values.size)) - 1, 0)])


def compact_json(value: object) -> str:
    """How partfin writes JSON into snapshot summaries: no spaces, non-ASCII as UTF-8 (pydantic-core, 3x json.dumps)."""
    return to_json(value).decode()


def encode_by_hour(stats: Iterable[HourStats]) -> str:
    return compact_json(
        {
            iso_z(s.hour_us): {
                "n": s.records,
                "min": iso_z(s.min_us),
                "max": iso_z(s.max_us),
                "p50": iso_z(s.p50_us),
                "p99": iso_z(s.p99_us),
                "c": [list(c) for c in s.centroids],
            }
            for s in stats
        }
    )


def decode_by_hour(text: str | None) -> dict[int, HourStats]:
    if not text:
        return {}
    out = {}
    for hour, entry in json.loads(text).items():
        hour_us = to_us(parse_iso(hour))
        out[hour_us] = HourStats(
            hour_us,
            int(entry["n"]),
            to_us(parse_iso(entry["min"])),
            to_us(parse_iso(entry["max"])),
            to_us(parse_iso(entry["p50"])),
            to_us(parse_iso(entry["p99"])),
            0,
            tuple((float(m), float(c)) for m, c in entry.get("c", [])),
        )
    return out


def _canonical_order(stats: EventTimeStats) -> tuple:
    return (stats.min_us, stats.max_us, stats.count, stats.digest.to_bytes())


@dataclass(frozen=True)
class CommitStats:
    """A stats-bearing commit as the watermark policy sees it."""

    snapshot_id: int | None
    low_us: int  # its min event time, or its heartbeat time when it carried no records
    stats: EventTimeStats  # empty for heartbeat-only commits
    clock_us: int | None = None  # its commit clock (the writer's)
    # the commit being made, for a policy that reads arrival: the source's processing time (None: the commit clock),
    # and its latest plausible event time or heartbeat
    arrival_us: int | None = None
    high_us: int | None = None
    source_clock_us: int | None = None  # its partfin.source-clock: the source's processing time

    @property
    def arrival_clock_us(self) -> int | None:
        """When the commit's data arrived, as windows in arrival time see it: the source's processing
        time (a file replayed fast keeps the pace it was written at), else the commit clock."""
        return self.source_clock_us if self.source_clock_us is not None else self.clock_us


@dataclass(frozen=True)
class CommitWindow:
    """The recent stats-bearing commits of a stream a watermark policy looks at, newest first:
    the last `commits` of them, or those whose arrival clock lies within `span_us` of the newest's."""

    commits: int | None = None
    span_us: int | None = None

    def __post_init__(self) -> None:
        if (self.commits is None) == (self.span_us is None):
            raise ValueError("a commit window has either a commit count or a span")

    def holds(self, taken: int, clock_us: int | None, newest_clock_us: int) -> bool:
        """Whether the next older commit belongs to the window, `taken` newer ones being in it already."""
        if self.commits is not None:
            return taken < self.commits
        return clock_us is not None and clock_us > newest_clock_us - self.span_us

    def covers(self, other: CommitWindow) -> bool:
        """Whether what this window keeps always includes what `other` needs (same unit, no longer)."""
        if self.commits is not None:
            return other.commits is not None and other.commits <= self.commits
        return other.span_us is not None and other.span_us <= self.span_us


def commit_clock_us(summary: Mapping[str, str], timestamp_ms: int | None = None) -> int | None:
    """The writer's clock for a commit (`partfin.commit-clock`), else the snapshot's own timestamp."""
    clock = summary.get(K.COMMIT_CLOCK)
    if clock:
        return to_us(parse_iso(clock))
    return timestamp_ms * 1000 if timestamp_ms is not None else None


def source_clock_us(summary: Mapping[str, str]) -> int | None:
    """A checkpoint's `partfin.source-clock` (None: not recorded)."""
    clock = summary.get(K.SOURCE_CLOCK)
    return to_us(parse_iso(clock)) if clock else None


def commit_stats(
    summary: Mapping[str, str], snapshot_id: int | None = None, *, with_digest: bool = False, clock_us: int | None = None
) -> CommitStats | None:
    """None for commits that claim no progress: without event-time stats (compaction, deletes,
    overwrites, stat-less appends), or whose every event time (or heartbeat) lay in the future
    of their commit clock (`partfin.suspect-future`: such times never drive progress)."""
    stats = EventTimeStats.from_summary(summary, with_digest=with_digest)
    if stats is None:
        return None
    suspect = suspect_future(summary)
    if not stats.is_empty:
        if suspect.get("records", 0) >= stats.count:
            return None
        # ascending: the min is never the suspect one
        return CommitStats(snapshot_id, stats.min_us, stats, clock_us, source_clock_us=source_clock_us(summary))
    heartbeat = summary.get(K.EVENT_TIME_HEARTBEAT)
    if heartbeat is None or "heartbeat" in suspect:
        return None
    return CommitStats(snapshot_id, to_us(parse_iso(heartbeat)), stats, clock_us, source_clock_us=source_clock_us(summary))


def suspect_future(summary: Mapping[str, str]) -> dict:
    """The commit's `partfin.suspect-future` entry ({} when it has none, as nearly every commit)."""
    text = summary.get(K.SUSPECT_FUTURE)
    return json.loads(text) if text else {}
