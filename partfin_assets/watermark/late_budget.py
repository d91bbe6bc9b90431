"""`late-budget:b`: floor_to_hour(min(arrival - L_b, latest plausible event time of the commit)), L_b the smallest
delay after which, by the table's recorded lateness, at most a share b of an hour's records would still arrive
(`learn_delay`). Its state: the delay learned, persisted in `partfin.watermark.late-budget` and learned again from
the late-data ledger every LEARN_REFRESH; until the ledger holds enough mature history it runs as min-of-last over
its fallback window. `late-budget:b` (canonically `late-budget:b:feedback`) adds the feedback term of feedback.py: the
delay widens at once when the hours it finalized recently had more late records than the budget allows, and narrows
back slowly; `late-budget:b:open-loop` is the learned delay alone (what `late-budget:b` was before)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from partfin_assets.iceberg.ledger import REPLAY_STREAM
from partfin_assets.model import summary_keys as K
from partfin_assets.model.stats import CommitStats, CommitWindow, compact_json
from partfin_assets.model.timeutil import US_PER_HOUR, US_PER_SECOND, floor_hour_us
from partfin_assets.watermark.feedback import Arrivals, Correction, corrected, finalized_at
from partfin_assets.watermark.policy import LEARN_MATURITY_US, LedgerRows, PolicyError, WatermarkPolicy, min_low_us

LATE_BUDGET = "late-budget"
FEEDBACK, OPEN_LOOP = "feedback", "open-loop"  # its variants: the learned delay corrected by feedback (default), or alone
# what it runs as until the table's ledger holds enough mature history to learn from
BUDGET_FALLBACK_WINDOW = CommitWindow(span_us=30 * 60 * US_PER_SECOND)
LEARN_HISTORY_US = 7 * 24 * US_PER_HOUR  # lateness is learned from at most this long before LEARN_MATURITY
LEARN_REFRESH_US = 15 * 60 * US_PER_SECOND  # the learned delay is recomputed from the ledger this often
# ... and this often while nothing is learned yet: a new table catching up on a backlog has mature hours in its ledger
# within minutes, and waiting 15 minutes on the fallback (which a late tail holds back) delays every hour. A table too
# small to ever learn pays one read of its (small) ledger per commit at most, and its commits are far apart
LEARN_RETRY_US = 10 * US_PER_SECOND
LEARN_STEP_S = 60  # the delay is learned on a one-minute grid
LEARN_MAX_DELAY_S = 48 * 3600
LEARN_COLUMNS = ("hour", "records", "commit_time", "lateness_digest", "watermark", "stream")


@dataclass(frozen=True)
class LearnedDelay:
    delay_us: int | None  # None: too little mature history yet (the fallback window runs)
    records: int  # records of the mature hours it was learned from
    learned_at_us: int
    correction: Correction = Correction()  # the feedback's (none: open loop, or a state recorded before it existed)

    @property
    def in_force_us(self) -> int | None:
        """The delay the candidate runs with: learned, plus the feedback's correction."""
        return None if self.delay_us is None else self.delay_us + self.correction.delay_us

    def to_json(self) -> dict:
        c = self.correction
        return {"delay-s": None if self.delay_us is None else self.delay_us / US_PER_SECOND, "records": self.records,
                "learned-at-us": self.learned_at_us, "correction-s": c.delay_us / US_PER_SECOND, "widened-at-us": c.widened_at_us,
                "changes": [[mark, delay / US_PER_SECOND] for mark, delay in c.changes]}

    @classmethod
    def from_json(cls, entry: dict) -> LearnedDelay:
        delay = entry.get("delay-s")
        correction = Correction(int(round(entry.get("correction-s", 0) * US_PER_SECOND)), entry.get("widened-at-us"),
                                tuple((int(mark), int(round(delay * US_PER_SECOND))) for mark, delay in entry.get("changes", [])))
        return cls(None if delay is None else int(round(delay * US_PER_SECOND)), int(entry["records"]), int(entry["learned-at-us"]),
                   correction)

    def stale(self, clock_us: int) -> bool:
        refresh = LEARN_REFRESH_US if self.delay_us is not None else LEARN_RETRY_US
        return not 0 <= clock_us - self.learned_at_us < refresh


@dataclass(frozen=True)
class LateBudget(WatermarkPolicy):
    budget: float  # share of records accepted arriving after finalization
    feedback: bool = True  # whether the late records it observed correct the learned delay (feedback.py)

    kind = LATE_BUDGET
    forms = "'late-budget:b' (or ':feedback', ':open-loop')"
    state_property = K.PROP_LATE_BUDGET_LEARNED

    @property
    def window(self) -> CommitWindow:  # type: ignore[override]
        return BUDGET_FALLBACK_WINDOW

    @classmethod
    def from_args(cls, args: list[str]) -> LateBudget:
        if len(args) not in (1, 2) or (len(args) == 2 and args[1] not in (FEEDBACK, OPEN_LOOP)):
            raise PolicyError("unknown form")
        return cls(budget=float(args[0]), feedback=len(args) == 1 or args[1] == FEEDBACK)

    def check(self, text: str) -> None:
        if not 0.0 < self.budget < 1.0:
            raise PolicyError(f"watermark policy {text!r}: b must be in (0, 1)")

    def __str__(self) -> str:
        return f"{LATE_BUDGET}:{self.budget:g}:{FEEDBACK if self.feedback else OPEN_LOOP}"

    def load_state(self, stored: str | None) -> LearnedDelay | None:
        entry = json.loads(stored) if stored else None
        return LearnedDelay.from_json(entry) if entry is not None and entry.get("budget") == self.budget else None

    def refresh_state(self, state: LearnedDelay | None, clock_us: int, ledger: LedgerRows) -> tuple[LearnedDelay, str | None]:
        if state is not None and not state.stale(clock_us):
            return state, None
        since = floor_hour_us(clock_us - LEARN_MATURITY_US - LEARN_HISTORY_US - US_PER_HOUR)
        rows = ledger(LEARN_COLUMNS, since)
        learned = learn_delay(rows, self.budget, clock_us)
        if self.feedback and learned.delay_us is not None:
            arrivals, watermark = recent_arrivals(rows, clock_us)
            before = state.correction if state is not None else Correction()
            learned = dataclasses.replace(learned, correction=corrected(before, arrivals, self.budget, clock_us, watermark))
        return learned, compact_json({"budget": self.budget, **learned.to_json()})

    def learning(self, state: LearnedDelay | None) -> bool:
        return state is None or state.delay_us is None

    def window_needed(self, state: LearnedDelay | None) -> bool:
        return state is None or state.delay_us is None

    def candidate_us(self, window: Sequence[CommitStats], state: LearnedDelay | None = None) -> int | None:
        """From the commit being made and the learned delay; without one (too little history yet) as
        min-of-last over its fallback window. `late-budget:b` (canonically `late-budget:b:feedback`) adds the feedback term of feedback.py: the
delay widens at once when the hours it finalized recently had more late records than the budget allows, and narrows
back slowly; `late-budget:b:open-loop` is the learned delay alone (what `late-budget:b` was before)."""
        if not window:
            return None
        if state is None or state.delay_us is None:
            return min_low_us(window)
        this = window[0]
        arrival = this.arrival_us if this.arrival_us is not None else this.clock_us
        if arrival is None:
            return None
        reach = arrival - (state.in_force_us if self.feedback else state.delay_us)  # open loop: a correction recorded before unused
        if this.high_us is not None:  # a backlog still being delivered: never past what it delivered
            reach = min(reach, this.high_us)
        return floor_hour_us(reach)


def recent_arrivals(rows: pl.DataFrame, now_us: int) -> tuple[Arrivals, int | None]:
    """The ledger rows committed before `now_us` as the feedback judges them (the records of hour replays are an
    operator's, not lateness: left out), and the table's watermark as of the last of them."""
    before = rows.filter(_epoch_us(rows["commit_time"]) < now_us)
    commit = _epoch_us(before["commit_time"]).to_numpy()
    marks = _epoch_us(before["watermark"]).fill_null(np.iinfo(np.int64).min).to_numpy()
    data = before["hour"].is_not_null() & (before["stream"] != REPLAY_STREAM)
    hour = _epoch_us(before["hour"].filter(data)).to_numpy()
    final = finalized_at(hour, commit, marks)
    watermark = int(marks.max()) if marks.size and marks.max() > np.iinfo(np.int64).min else None
    return Arrivals(hour, commit[data.to_numpy()], before["records"].filter(data).to_numpy(), final), watermark


def _epoch_us(column: pl.Series) -> pl.Series:
    return column.dt.epoch("us") if column.dtype != pl.Int64 else column


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
    hour_us, commit_us = _epoch_us(rows["hour"]), _epoch_us(rows["commit_time"])
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
