"""The feedback term of late-budget (watermark/feedback.py) as a pure decision rule: late records observed in the
hours it finalized recently widen the delay at once, the same evidence never twice, and only a long calm narrows it.
Through real commits: test_policy.py (a writer on a shifting stream, replayed by the lab)."""

from __future__ import annotations

import numpy as np

from partfin_assets.model.timeutil import US_PER_HOUR
from partfin_assets.watermark.feedback import NARROW_HOLD_US, NOT_FINAL, Arrivals, Correction, corrected, finalized_at

MINUTE = 60_000_000
T0 = 1_000 * US_PER_HOUR
NOW = T0 + 10 * US_PER_HOUR
BUDGET = 0.001


def arrivals(hours: dict[int, tuple[int, list[tuple[int, int]]]], final_after_end_us: int = 150 * MINUTE) -> Arrivals:
    """Per hour (offset from T0): its records before finalization, and its late ones as (minutes after finalization,
    records); each hour finalized `final_after_end_us` after its end."""
    hour, commit, records, final = [], [], [], []
    for h, (on_time, late) in hours.items():
        start = T0 + h * US_PER_HOUR
        at = start + US_PER_HOUR + final_after_end_us
        for after_min, count in [(-30, on_time), *late]:
            hour.append(start)
            commit.append(at + after_min * MINUTE)
            records.append(count)
            final.append(at)
    return Arrivals(*(np.asarray(x, dtype=np.int64) for x in (hour, commit, records, final)))


def test_late_records_above_the_budget_widen_at_once_by_what_would_have_kept_them_within():
    # the newest finalized hour: 10,000 records, 40 late (4x the budget): 20 at 5 min after finalization, 20 at 25 min
    seen = arrivals({5: (9_960, [(5, 20), (25, 20)])})
    after = corrected(Correction(), seen, BUDGET, NOW, T0 + 6 * US_PER_HOUR)
    # finalized 26 minutes later, none of them would have been late (it aims at half the budget: 5 records)
    assert after == Correction(26 * MINUTE, NOW, ((T0 + 6 * US_PER_HOUR, 26 * MINUTE),))
    # a correction in force (all along) grows by it
    assert corrected(Correction(10 * MINUTE), seen, BUDGET, NOW, T0 + 6 * US_PER_HOUR).delay_us == 36 * MINUTE


def test_late_records_within_the_noise_of_the_budget_change_nothing():
    # 10,000 records, 16 late: above 0.1 % but within two standard deviations of it (Poisson)
    seen = arrivals({4: (9_984, [(5, 16)]), 5: (10_000, [(5, 8)])})
    assert corrected(Correction(), seen, BUDGET, NOW, T0 + 6 * US_PER_HOUR) == Correction()


def test_a_shift_shows_in_the_newest_hour_before_it_shows_in_the_six():
    calm = {h: (10_000, [(5, 8)]) for h in range(0, 5)}
    seen = arrivals({**calm, 5: (9_970, [(10, 30)])})  # the newest hour alone: 3x the budget
    assert corrected(Correction(), seen, BUDGET, NOW, T0 + 6 * US_PER_HOUR).delay_us == 11 * MINUTE


def test_the_same_late_records_never_widen_twice_and_what_comes_after_a_widening_still_counts():
    seen = arrivals({5: (9_960, [(5, 20), (25, 20)])})
    once = corrected(Correction(), seen, BUDGET, NOW, T0 + 6 * US_PER_HOUR)
    # 15 minutes later, nothing new: the hour was finalized 26 minutes too early by today's correction, and none of its
    # records came later than that
    assert corrected(once, seen, BUDGET, NOW + 15 * MINUTE, T0 + 6 * US_PER_HOUR) == once
    # then 20 more of its records come 50 minutes after its finalization: 24 minutes after the widened delay; while
    # it follows a shift it needs one sigma of evidence
    more = arrivals({5: (9_940, [(5, 20), (25, 20), (50, 20)])})
    again = corrected(once, more, BUDGET, NOW + US_PER_HOUR, T0 + 6 * US_PER_HOUR)
    assert again.delay_us == (26 + 25) * MINUTE and again.widened_at_us == NOW + US_PER_HOUR
    # an hour finalized under the widened delay is judged by its own finalization
    later = arrivals({5: (9_960, [(5, 20), (25, 20)]), 6: (9_950, [(3, 50)])})
    assert corrected(once, later, BUDGET, NOW + US_PER_HOUR, T0 + 7 * US_PER_HOUR).delay_us == 30 * MINUTE


def test_hours_not_finalized_or_older_than_the_horizon_are_not_judged():
    seen = arrivals({5: (9_960, [(5, 40)])})
    unfinalized = Arrivals(seen.hour_us, seen.commit_us, seen.records, np.full(seen.final_us.size, NOT_FINAL))
    assert corrected(Correction(), unfinalized, BUDGET, NOW, None) == Correction()
    assert corrected(Correction(), seen, BUDGET, NOW + 7 * US_PER_HOUR, T0 + 6 * US_PER_HOUR) == Correction()  # the model's
    # what was committed after now (a replay's future rows) is not seen
    assert corrected(Correction(), seen, BUDGET, T0 + 8 * US_PER_HOUR, T0 + 6 * US_PER_HOUR) == Correction()


def test_narrowing_waits_for_the_model_then_is_slow_and_never_below_the_learned_delay():
    quiet = arrivals({h: (10_000, []) for h in range(10, 15)})  # finalized by T0 + 17.5 h
    now = NOW + 8 * US_PER_HOUR  # T0 + 18 h
    widened = Correction(30 * MINUTE, now - NARROW_HOLD_US + MINUTE, ((T0 + 4 * US_PER_HOUR, 30 * MINUTE),))
    assert corrected(widened, quiet, BUDGET, now, T0 + 16 * US_PER_HOUR) == widened  # the model has not learned yet
    later = now + MINUTE
    narrowed = corrected(widened, quiet, BUDGET, later, T0 + 16 * US_PER_HOUR)
    assert narrowed.delay_us == 27 * MINUTE and narrowed.changes[-1] == (T0 + 16 * US_PER_HOUR, 27 * MINUTE)  # a tenth
    steps = [narrowed]
    for _ in range(40):
        steps.append(corrected(steps[-1], quiet, BUDGET, later, T0 + 16 * US_PER_HOUR))
    assert steps[-1].delay_us == 0 and all(s.delay_us >= 0 for s in steps)
    # hours near the budget (half of it or more) keep the correction
    busy = arrivals({h: (10_000, [(5, 5)]) for h in range(10, 15)})
    assert corrected(widened, busy, BUDGET, later, T0 + 16 * US_PER_HOUR) == widened


def test_an_hour_is_finalized_by_the_first_commit_whose_watermark_passed_its_end():
    commit = np.array([30, 10, 20, 40], dtype=np.int64) * MINUTE
    watermark = np.array([T0 + US_PER_HOUR, np.iinfo(np.int64).min, T0, T0 + 2 * US_PER_HOUR], dtype=np.int64)
    hours = np.array([T0, T0 + US_PER_HOUR, T0 + 2 * US_PER_HOUR], dtype=np.int64)
    assert finalized_at(hours, commit, watermark).tolist() == [30 * MINUTE, 40 * MINUTE, NOT_FINAL]
