"""How every bench takes its sizes: its own flags, or `--smoke` for the test suite's tiny run.

`--smoke` swaps the bench's defaults for sizes that finish in seconds, so the test suite
(partfin_assets_tests/test_benchmarks_smoke.py) runs every bench end to end and a change that
breaks one fails CI; flags given beside it still win. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def parse_sizes(parser: argparse.ArgumentParser, smoke: dict, argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes that finish in seconds (the test suite's smoke run; the figures mean nothing)")
    known, _ = parser.parse_known_args(argv)
    if known.smoke:
        unknown = [name for name in smoke if not hasattr(known, name)]
        if unknown:
            raise SystemExit(f"--smoke sets options the bench does not have: {sorted(unknown)}")
        parser.set_defaults(**smoke)
    return parser.parse_args(argv)
