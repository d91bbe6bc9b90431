"""Every benchmark still runs: each `bench/*.py` at a tiny size (`--smoke`), as a user starts it.

A bench that only runs when someone measures rots: a schema change breaks its baseline and
nobody notices until the figures in docs/benchmarks.md can no longer be reproduced. So every
script in bench/ (found by glob: a new bench is picked up without touching this test) runs here
in a process of its own with `--smoke` (bench/_sizes.py) and must finish and print its ratios.
No timing is asserted: at these sizes the figures mean nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHES = sorted(p for p in (REPO / "bench").glob("*.py") if not p.name.startswith("_"))  # _sizes.py: a helper
# a ratio as the benches print them: "1.08x", "ratio compaction / plain: 1.41x", "ratio_stats_vs_none": 0.96, "kafka_vs_file": 0.84
RATIO = re.compile(r"\d\.\d+x\b|\bratio\w*\b[^\n]*\d|_vs_\w*\"?:\s*\d", re.I)


def test_every_bench_is_found():
    assert len(BENCHES) >= 12, [p.name for p in BENCHES]


@pytest.mark.parametrize("bench", BENCHES, ids=lambda p: p.stem)
def test_the_bench_runs_at_a_tiny_size_and_prints_its_ratios(bench):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PARTFIN_", "DAGSTER_"))}  # its own catalog, its own instance
    result = subprocess.run([sys.executable, str(bench), "--smoke"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    shown = f"\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    assert result.returncode == 0, f"{bench.name} --smoke exited {result.returncode}{shown}"
    assert RATIO.search(result.stdout), f"{bench.name} --smoke printed no ratio{shown}"


def test_the_ratio_pattern_tells_a_ratio_from_other_output():
    assert RATIO.search("speedup: 53.0x (goal >= 10x: met)")
    assert RATIO.search('  "ratio_stats_vs_none (goal >= 0.95)": 0.956,')
    assert RATIO.search('  "kafka_vs_file": 0.84,')
    assert RATIO.search("ratio compaction / plain: 1.41x the time")
    assert not RATIO.search("setup: 55 commits per table, big table +10 files (3s)")
