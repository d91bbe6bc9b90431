"""Watermark policies: a stream's recent commits -> an hour-aligned candidate; the watermark never moves back.

`min-of-last:X`            floor_to_hour(min of min_i over the stream's last X stats-bearing commits)
`min-of-last:30m`          the same over the commits of the last 30 minutes of arrival (commit clock)
`percentile:q:last:X|30m`  floor_to_hour(q-quantile of the merged t-digests of that window)
`late-budget:b`            floor_to_hour(min(arrival - L_b, latest plausible event time of the commit)),
                           L_b the smallest delay after which, by the table's recorded lateness, at most
                           a share b of an hour's records would still arrive (see learn_delay)

min_i is a commit's min event time, or its heartbeat time when it carried no records. A window in
arrival time looks at the same arrivals whatever the checkpoint cadence; a count of commits does not.
The new watermark is max(previous, candidate): late data never moves it back.

This module is the one implementation of every policy: the writer's WatermarkProcessor and the
policy lab (jobs/policy_lab.py) both call `candidate_us`, `learn_delay` and `advance`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl
from pyiceberg.catalog import Catalog

from partfin_assets.iceberg.commit import set_table_properties
from partfin_assets.model.errors import InvalidInput
from partfin_assets.model.stats import CommitStats, CommitWindow, EventTimeStats
from partfin_assets.model.table_options import WATERMARK_POLICY
from partfin_assets.model.timeutil import US_PER_HOUR, US_PER_SECOND, floor_hour_us, parse_duration

MIN_OF_LAST, PERCENTILE, LATE_BUDGET = "min-of-last", "percentile", "late-budget"
# late-budget: what it runs as until the table's ledger holds enough mature history to learn from
BUDGET_FALLBACK_WINDOW = CommitWindow(span_us=30 * 60 * US_PER_SECOND)
LEARN_MATURITY_US = 6 * US_PER_HOUR  # lateness is learned from event hours that ended at least this long ago
LEARN_HISTORY_US = 7 * 24 * US_PER_HOUR  # ... and at most this long before that
LEARN_REFRESH_US = 15 * 60 * US_PER_SECOND  # the learned delay is recomputed from the ledger this often
# ... and this often while nothing is learned yet: a new table catching up on a backlog has mature history in its
# ledger within minutes, and waiting 15 minutes on the fallback (which a late tail holds back) delays every hour
LEARN_RETRY_US = 10 * US_PER_SECOND
LEARN_STEP_S = 60  # the delay is learned on a one-minute grid
LEARN_MAX_DELAY_S = 48 * 3600

log = logging.getLogger(__name__)


class PolicyError(InvalidInput):
    """A watermark policy text that does not parse (e.g. a table property set by hand)."""


def _format_span(span_us: int) -> str:
    seconds = span_us // US_PER_SECOND
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _parse_window(text: str) -> CommitWindow:
    if text.isdigit():
        return CommitWindow(commits=int(text))
    span = parse_duration(text)
    return CommitWindow(span_us=int(span.total_seconds() * US_PER_SECOND))


@dataclass(frozen=True)
class WatermarkPolicy:
    kind: str
    window: CommitWindow  # the commits looked at (late-budget: those of its fallback)
    quantile: float | None = None  # percentile
    budget: float | None = None  # late-budget: share of records accepted arriving after finalization

    @classmethod
    def parse(cls, spec: str) -> WatermarkPolicy:
        """The one parser of a policy text (a table's: `table_policy`)."""
        text = spec.strip()
        parts = text.split(":")
        try:
            if parts[0] == MIN_OF_LAST and len(parts) == 2:
                policy = cls(MIN_OF_LAST, _parse_window(parts[1]))
            elif parts[0] == PERCENTILE and len(parts) == 4 and parts[2] == "last":
                policy = cls(PERCENTILE, _parse_window(parts[3]), quantile=float(parts[1]))
            elif parts[0] == LATE_BUDGET and len(parts) == 2:
                policy = cls(LATE_BUDGET, BUDGET_FALLBACK_WINDOW, budget=float(parts[1]))
            else:
                raise PolicyError("unknown form")
        except (ValueError, InvalidInput) as exc:
            raise PolicyError(
                f"watermark policy {text!r} is not valid ({exc}); use 'min-of-last:X', 'min-of-last:30m', "
                "'percentile:q:last:X' (or ':last:30m') or 'late-budget:b'"
            ) from None
        window = policy.window
        if (window.commits is not None and window.commits < 1) or (window.span_us is not None and window.span_us <= 0):
            raise PolicyError(f"watermark policy {text!r}: the window must be at least 1 commit or a positive duration")
        if policy.quantile is not None and not 0.0 <= policy.quantile < 1.0:
            raise PolicyError(f"watermark policy {text!r}: q must be in [0, 1)")
        if policy.budget is not None and not 0.0 < policy.budget < 1.0:
            raise PolicyError(f"watermark policy {text!r}: b must be in (0, 1)")
        return policy

    def __str__(self) -> str:
        if self.kind == LATE_BUDGET:
            return f"{LATE_BUDGET}:{self.budget:g}"
        window = str(self.window.commits) if self.window.commits is not None else _format_span(self.window.span_us)
        if self.kind == MIN_OF_LAST:
            return f"{MIN_OF_LAST}:{window}"
        return f"{PERCENTILE}:{self.quantile:g}:last:{window}"

    @property
    def needs_digest(self) -> bool:
        return self.kind == PERCENTILE

    def candidate_us(self, commits: Sequence[CommitStats], delay_us: int | None = None) -> int | None:
        """Hour-aligned candidate of a stream from its window (newest first: the commit being made, then
        the older ones `window` selects). late-budget: from the commit being made and the learned
        delay; without one (too little history yet) as min-of-last over its fallback window."""
        if not commits:
            return None
        if self.kind == LATE_BUDGET and delay_us is not None:
            this = commits[0]
            arrival = this.arrival_us if this.arrival_us is not None else this.clock_us
            if arrival is None:
                return None
            reach = arrival - delay_us
            if this.high_us is not None:  # a backlog still being delivered: never past what it delivered
                reach = min(reach, this.high_us)
            return floor_hour_us(reach)
        if self.kind != PERCENTILE:
            return floor_hour_us(min(c.low_us for c in commits))
        with_records = [c.stats for c in commits if not c.stats.is_empty]
        lows = [c.low_us for c in commits if c.stats.is_empty]
        if with_records:
            lows = lows + [EventTimeStats.merge_all(with_records).quantile_us(self.quantile)]
        return floor_hour_us(min(lows))


def table_policy(properties: Mapping[str, str]) -> WatermarkPolicy:
    """The policy in force on a table: its property (model/table_options.py; the default when unset)."""
    return WatermarkPolicy.parse(WATERMARK_POLICY.read(properties))


def declare_policy(catalog: Catalog, identifier: str, declared: str | None) -> str:
    """Make a declared policy the one in force on an existing table; returns the one in force.

    None (nothing declared) keeps the table's. A declaration that differs sets the property: the
    first checkpoint under it records the change (partfin.watermark-policy.change, ingest/watermark_processor.py),
    whoever declared it: `partfin ingest --watermark-policy`, a sync run's table declaration, a writer's spec.
    """
    properties = catalog.load_table(identifier).properties
    if declared is None:
        return str(table_policy(properties))
    policy = str(WatermarkPolicy.parse(declared))
    if policy != WATERMARK_POLICY.text(properties):
        log.warning("%s: watermark policy declared %s (was %s): it takes effect with the next checkpoint", identifier, policy,
                    WATERMARK_POLICY.text(properties))
        set_table_properties(catalog, identifier, {WATERMARK_POLICY.key: policy})
    return policy


def advance(previous_us: int | None, candidate_us: int | None) -> int | None:
    """Monotonic: the watermark only ever moves forward."""
    if candidate_us is None:
        return previous_us
    if previous_us is None:
        return candidate_us
    return max(previous_us, candidate_us)


# --------------------------------------------------------------------------- late-budget: learning the delay


@dataclass(frozen=True)
class LearnedDelay:
    delay_us: int | None  # None: too little mature history yet (the fallback window runs)
    records: int  # records of the mature hours it was learned from
    learned_at_us: int

    def to_json(self) -> dict:
        return {"delay-s": None if self.delay_us is None else self.delay_us / US_PER_SECOND, "records": self.records,
                "learned-at-us": self.learned_at_us}

    @classmethod
    def from_json(cls, entry: dict) -> LearnedDelay:
        delay = entry.get("delay-s")
        return cls(None if delay is None else int(round(delay * US_PER_SECOND)), int(entry["records"]), int(entry["learned-at-us"]))

    def stale(self, clock_us: int) -> bool:
        refresh = LEARN_REFRESH_US if self.delay_us is not None else LEARN_RETRY_US
        return not 0 <= clock_us - self.learned_at_us < refresh


LEARN_COLUMNS = ("hour", "records", "commit_time", "lateness_digest")


def learn_delay(rows: pl.DataFrame, budget: float, now_us: int) -> LearnedDelay:
    """The smallest delay L (after an hour's end) such that at most a share `budget` of an hour's records
    arrive later, by the lateness (arrival - event time) the ledger recorded.

    Learned from the rows, committed before `now_us`, of event hours that ended at least LEARN_MATURITY
    (6 h) before it (a younger hour's late records have not all arrived: its tail is not known yet),
    and at most LEARN_HISTORY (7 days) before that. Hours in the future of their commits never
    mature. With event times spread over the hour, a record of event time H + s (0 <= s < 1 h)
    arrives after H + 1 h + L when its lateness exceeds L + (1 h - s): the late share is the mean
    of the lateness survival S over [L, L + 1 h]. The upper bound of its count (+2 sigma, Poisson)
    must stay within the budget. Needs 10 / budget records: fewer, and the delay is None.
    Lateness digests' centroids are read as point masses (their tail centroids are single values).
    """
    hour_us = rows["hour"].dt.epoch("us") if rows["hour"].dtype != pl.Int64 else rows["hour"]
    commit_us = rows["commit_time"].dt.epoch("us") if rows["commit_time"].dtype != pl.Int64 else rows["commit_time"]
    end = now_us - LEARN_MATURITY_US
    mature = rows.filter(
        (hour_us + US_PER_HOUR <= end) & (hour_us + US_PER_HOUR > end - LEARN_HISTORY_US) & (commit_us < now_us)
        & pl.col("lateness_digest").is_not_null()
    )
    records = int(mature["records"].sum()) if mature.height else 0
    if records < 10 / budget:
        return LearnedDelay(None, records, now_us)
    means, weights = [], []
    for text in mature["lateness_digest"].to_list():
        for c in json.loads(text)["centroids"]:
            means.append(c["m"])
            weights.append(c["c"])
    order = np.argsort(means)
    means_s = np.asarray(means)[order]
    tail_weight = np.cumsum(np.asarray(weights)[order][::-1])[::-1]  # weight of centroids at or above each
    grid = np.arange(0, LEARN_MAX_DELAY_S + 3600 + LEARN_STEP_S, LEARN_STEP_S, dtype=float)
    at = np.searchsorted(means_s, grid, side="right")
    survival = np.append(tail_weight, 0.0)[at] / records
    per_hour = 3600 // LEARN_STEP_S
    share = np.convolve(survival, np.ones(per_hour) / per_hour, mode="valid")  # share[i]: mean of S over [i, i + 1 h)
    late = share * records
    fits = np.flatnonzero(late + 2 * np.sqrt(late) <= budget * records)
    fits = fits[fits * LEARN_STEP_S <= LEARN_MAX_DELAY_S]
    delay_s = int(fits[0]) * LEARN_STEP_S if fits.size else LEARN_MAX_DELAY_S
    return LearnedDelay(int(delay_s * US_PER_SECOND), records, now_us)
