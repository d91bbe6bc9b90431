"""Pictures: `partfin report` (finalization of cdc.<table>, HTML + PNG) and `partfin policy-lab`."""

from __future__ import annotations

import argparse
from pathlib import Path

from partfin_assets.cli.running import existing_catalog, say
from partfin_assets.finalization.report import finalization_picture, report_dir, write_report
from partfin_assets.iceberg.catalog import CatalogConfig, load_existing_table
from partfin_assets.iceberg.ledger import read_ledger
from partfin_assets.jobs.policy_lab import LAB_COLUMNS, lab_policies, recorded, run_lab, simulate, write_plot
from partfin_assets.model.errors import InvalidInput


def report_command(args: argparse.Namespace) -> int:
    config = CatalogConfig.from_env()
    out = Path(args.out) if args.out else report_dir(config.home)
    page, picture = write_report(finalization_picture(config.load(create=False), args.table), out)
    say(f"cdc.{args.table}: {page} (self-contained HTML) and {picture} (PNG)")
    return 0


def policy_lab_command(args: argparse.Namespace) -> int:
    if not 0 < args.budget < 1:
        raise InvalidInput(f"--budget must be in (0, 1), got {args.budget:g}")
    if args.scenario is not None:
        data = simulate(args.scenario, seed=args.seed, hours=args.hours)
    else:
        catalog = existing_catalog()
        load_existing_table(catalog, f"cdc.{args.table}")  # a clear error for a table that is not there
        data = recorded(read_ledger(catalog, f"cdc.{args.table}", columns=LAB_COLUMNS), args.table)
    policies = args.policies or lab_policies(args.budget)
    report, lab = run_lab(data, policies, args.budget)
    for line in [*report.table().splitlines(), ""]:
        say(line)
    png, page = write_plot(report, lab, Path(args.out))
    recommended = next(row.outcome for row in report.rows if row.outcome.name == report.recommended)
    why = (f"the smallest median lag within {args.budget:.2%} late" if recommended.late_share <= args.budget
           else f"none kept within {args.budget:.2%} late: the fewest late records")
    say(f"recommended: {report.recommended} ({why})")
    say(f"plot: {png} and {page}")
    return 0


