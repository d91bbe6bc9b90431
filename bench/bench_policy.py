"""Bench: watermark policies on four simulated streams, through the policy lab (`partfin policy-lab --scenario`).

Four simulated streams (steady, a 90-minute shard outage, a 4-hour idle night with heartbeats,
0.05 % of event clocks 2 days ahead; 3 events/s, 60 s checkpoints, 16 measured hours after 8 hours
of history), each replayed through the policies with the writer's own policy code, against an
oracle and two baselines tuned to the same late share. Prints one markdown table per stream and the
goal check for the default policy: late share <= 0.1 %, median lag <= 1.25x the oracle's, and no
later than both baselines at its own late share.

    python bench/bench_policy.py                      # all four streams
    python bench/bench_policy.py --scenarios steady --seed 7
"""

from __future__ import annotations

import argparse
import time
from _sizes import parse_sizes


def main() -> int:
    from partfin_assets.jobs.policy_lab import DEFAULT_POLICIES, SCENARIOS, run_lab, simulate
    from partfin_assets.model.tablespec import DEFAULT_WATERMARK_POLICY

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--budget", type=float, default=0.001)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--hours", type=int, default=16, help="measured hours per stream")
    parser.add_argument("--history-hours", type=int, default=8, help="hours of history before them")
    args = parse_sizes(parser, smoke=dict(scenarios=["steady"], hours=3, history_hours=2))
    budget_policy = f"late-budget:{args.budget:g}"
    policies = list(dict.fromkeys([*DEFAULT_POLICIES, budget_policy, DEFAULT_WATERMARK_POLICY]))
    checks = []
    for scenario in args.scenarios:
        started = time.perf_counter()
        report, _ = run_lab(simulate(scenario, seed=args.seed, hours=args.hours, history_hours=args.history_hours), policies, args.budget)
        print(f"## {scenario} ({time.perf_counter() - started:.0f} s)\n")
        print(report.table() + "\n")
        row = next(r for r in report.rows if r.outcome.name == DEFAULT_WATERMARK_POLICY)
        o = row.outcome
        met = (o.late_share <= 0.001 and o.lag_ratio <= 1.25 and o.median_lag_s <= row.fixed.median_lag_s
               and o.median_lag_s <= row.idle.median_lag_s)
        checks.append(f"{scenario}: default {o.name}: late {o.late_share:.3%}, lag {o.lag_ratio:.2f}x oracle, "
                      f"{o.median_lag_s / row.fixed.median_lag_s:.2f}x fixed delay, {o.median_lag_s / row.idle.median_lag_s:.2f}x "
                      f"idle time at the same late share: goal {'met' if met else 'NOT met'}")
    print("\n".join(checks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
