"""The feedback term of `late-budget`: a correction of the learned delay from the late records the table actually had.

The learned delay (late_budget.learn_delay) knows only hours that ended 6 hours ago: when the lateness changes
(a connector falls behind), it learns the change 6 hours late, and meanwhile the budget is broken. The ledger,
though, records every late record the moment it lands. So the hours finalized recently are judged by what
came late in them so far (a lower bound of what will: more may still come), and the delay is corrected:

- *widen at once* when the late records of the newest judged hours are significantly above the budget (the
  lower bound of their count, -2 sigma Poisson, exceeds budget x records): by the smallest extra delay that
  would have kept those hours within the budget (half of it: the evidence is a lower bound), measured on their
  own records (what they would have been had the hours been finalized that much later);
- each hour is judged as if finalized under the correction in force now: a record is counted late when it came
  more than (now's correction - the one its hour was finalized under) after its hour's finalization. So the same
  late records never widen twice, and an hour's late records that keep coming after a widening still count,
  for what the widening did not cover;
- *narrow slowly* once the model had time to learn the regime that widened it (LEARN_MATURITY after the last
  widening) and the judged hours stay well below the budget (the upper bound of their late count, +2 sigma,
  under half the budget): the correction shrinks by a tenth per refresh, back to the learned delay;
- the watermark never moves back (step.advance): a correction changes which hours finalize next, never
  un-finalizes one.

An additive-increase/multiplicative-decrease rule on the delay, with the increase sized by the ledger instead of
a fixed step, and a one-sided CUSUM-like test over the newest hours (each suffix of them) to trigger it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from partfin_assets.model.timeutil import US_PER_HOUR, US_PER_SECOND
from partfin_assets.watermark.policy import LEARN_MATURITY_US

FEEDBACK_HORIZON_US = LEARN_MATURITY_US  # finalized hours younger than this are judged (older ones the model knows)
NARROW_HOLD_US = LEARN_MATURITY_US  # no narrowing before the model has learned from the hours that widened it
NARROW_FACTOR = 0.9  # per refresh (LEARN_REFRESH: 15 minutes): half the correction gone in about 1.6 h
CORRECTION_STEP_US = 60 * US_PER_SECOND  # corrections on a one-minute grid, like the learned delay
# a widening aims at this share of the budget: its evidence is a lower bound (more late records of those hours may
# come), and the hours it protects are the next ones, not those
WIDEN_TARGET = 0.5
NOT_FINAL = np.iinfo(np.int64).max


@dataclass(frozen=True)
class Correction:
    """What the feedback keeps (persisted with the learned delay)."""

    delay_us: int = 0  # added to the learned delay, >= 0
    widened_at_us: int | None = None
    # its changes within the horizon: (the watermark when it changed, the correction from then): an hour that ended
    # after that watermark was finalized under that correction (or a later one's)
    changes: tuple[tuple[int, int], ...] = ()

    def in_force_at(self, hour_end_us: np.ndarray) -> np.ndarray:
        """The correction each hour (by its end) was finalized under (0 before its first change)."""
        if not self.changes:
            return np.full(hour_end_us.size, self.delay_us, dtype=np.int64)
        marks = np.array([w for w, _ in self.changes], dtype=np.int64)
        values = np.array([0] + [c for _, c in self.changes], dtype=np.int64)
        return values[np.searchsorted(marks, hour_end_us, side="left")]

    def changed(self, delay_us: int, watermark_us: int | None, floor_us: int, widened_at_us: int | None) -> Correction:
        """With a change to `delay_us` now; changes no judged hour needs any more are dropped (the last of them kept)."""
        mark = watermark_us if watermark_us is not None else np.iinfo(np.int64).min
        kept = [c for c in self.changes if c[0] >= floor_us - US_PER_HOUR]
        older = [c for c in self.changes if c[0] < floor_us - US_PER_HOUR]
        return Correction(delay_us, widened_at_us, tuple(older[-1:] + kept) + ((mark, delay_us),))


@dataclass(frozen=True)
class Arrivals:
    """The ledger rows of the recent hours: per row its event hour, commit clock and records, and when its hour was
    finalized (`finalized_at`; NOT_FINAL: not yet)."""

    hour_us: np.ndarray
    commit_us: np.ndarray
    records: np.ndarray
    final_us: np.ndarray


def finalized_at(hour_us: np.ndarray, commit_us: np.ndarray, watermark_us: np.ndarray) -> np.ndarray:
    """Per hour, the clock of the first commit whose watermark passed its end (NOT_FINAL: none did), from the ledger's
    rows (each carries the table's watermark after its commit; missing ones as int64 min)."""
    order = np.argsort(commit_us, kind="stable")
    clocks, marks = commit_us[order], np.maximum.accumulate(watermark_us[order])
    at = np.searchsorted(marks, hour_us + US_PER_HOUR, side="left")
    return np.where(at < marks.size, clocks[np.minimum(at, max(marks.size - 1, 0))], NOT_FINAL)


def _significantly_above(late: float, allowed: float, sigmas: float) -> bool:
    return late - sigmas * math.sqrt(late) > allowed


def _extra_delay_us(overshoot_us: np.ndarray, records: np.ndarray, allowed: float) -> int:
    """The smallest extra delay (one-minute grid) after which at most `allowed` of these late records would have
    come after finalization (`overshoot_us`: how long after its hour's finalization each row was committed)."""
    order = np.argsort(overshoot_us)[::-1]
    later = np.cumsum(records[order])  # records committed at or after each overshoot, largest first
    beyond = np.searchsorted(later, allowed, side="right")  # rows that may stay late
    if beyond >= order.size:
        return 0
    needed = int(overshoot_us[order[beyond]])
    return (needed // CORRECTION_STEP_US + 1) * CORRECTION_STEP_US


def corrected(correction: Correction, arrivals: Arrivals, budget: float, now_us: int, watermark_us: int | None) -> Correction:
    """The correction in force from `now_us` on: the decision rule of the feedback (module docstring).

    `arrivals`: the ledger rows committed before `now_us`; `watermark_us`: the table's watermark now.
    """
    floor = now_us - FEEDBACK_HORIZON_US
    end = arrivals.hour_us + US_PER_HOUR
    judged = (arrivals.final_us != NOT_FINAL) & (end > floor) & (arrivals.commit_us < now_us)
    hour, records = arrivals.hour_us[judged], arrivals.records[judged].astype(np.float64)
    # how long after its hour's finalization each row came, had the hour been finalized under today's correction
    credit = correction.delay_us - correction.in_force_at(end[judged])
    overshoot = arrivals.commit_us[judged] - arrivals.final_us[judged] - credit
    late = overshoot > 0
    # a change is detected at 2 sigma; once it widened, following it needs less evidence (1 sigma) until the model
    # has learned the new regime: a widening sized on a lower bound may fall short
    tracking = correction.widened_at_us is not None and now_us - correction.widened_at_us < NARROW_HOLD_US
    sigmas = 1.0 if tracking else 2.0
    widen_us = 0
    for oldest in np.unique(hour)[::-1]:  # the newest hour, the newest two, ...: a shift shows first in the newest
        these = hour >= oldest
        allowed = budget * float(records[these].sum())
        if _significantly_above(float(records[these & late].sum()), allowed, sigmas):
            widen_us = max(widen_us, _extra_delay_us(overshoot[these & late], records[these & late], WIDEN_TARGET * allowed))
    if widen_us > 0:
        return correction.changed(correction.delay_us + widen_us, watermark_us, floor, now_us)
    total_late, allowed = float(records[late].sum()), budget * float(records.sum())
    settled = correction.widened_at_us is None or now_us - correction.widened_at_us >= NARROW_HOLD_US
    if correction.delay_us > 0 and settled and records.size and total_late + 2 * math.sqrt(total_late) < allowed / 2:
        narrowed = int(correction.delay_us * NARROW_FACTOR) // CORRECTION_STEP_US * CORRECTION_STEP_US
        return correction.changed(narrowed, watermark_us, floor, correction.widened_at_us)
    return correction
