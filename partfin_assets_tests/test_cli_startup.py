"""`partfin --help` and every refused argument answer at once: the argument parser loads none of the heavy layers.

PyIceberg, PyArrow, pandas, SQLAlchemy (and Polars, NumPy, psycopg, Dagster) took seconds and 250 MB before
argparse saw its first argument. cli/__init__.py is the parser alone; a command's module is loaded only once
its arguments are accepted. Checked on the process a user starts (every module that
process holds when it exits), not on a timer; bench/bench_cli.py measures the time (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("pyiceberg", "pyarrow", "pandas", "sqlalchemy", "polars", "numpy", "psycopg", "dagster", "rich")


# `python -m partfin_assets.cli ARGS` as a user starts it, writing the modules it holds when it exits (sys.modules:
# what `-X importtime` misses, modules loaded by name, included) to the file named by argv[1]
WITH_MODULES_AT_EXIT = """
import atexit, json, runpy, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
sys.argv[0] = "partfin"
runpy.run_module("partfin_assets.cli", run_name="__main__", alter_sys=True)
"""


def imported_by_partfin(*args: str, home) -> tuple[subprocess.CompletedProcess, set[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARTFIN_")} | {"PARTFIN_HOME": str(home / "home")}
    out = home / "modules.json"
    result = subprocess.run([sys.executable, "-c", WITH_MODULES_AT_EXIT, str(out), *args], env=env,
                            capture_output=True, text=True, timeout=120)
    return result, set(json.loads(out.read_text()))


def heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


@pytest.mark.parametrize("args, code", [
    (("--help",), 0),
    (("ingest", "--help"), 0),
    (("policy-lab", "--help"), 0),
    ((), 2),
    (("status", "--bogus"), 2),
    (("nosuch",), 2),
    (("ingest", "--table", "orders"), 2),  # --source missing
    (("ingest", "--table", "orders", "--source", "synthetic", "--subtasks", "0"), 2),
    (("replay", "--table", "orders", "--hour", "bogus"), 2),
    (("streams", "idle-timeout", "--table", "orders", "soon"), 2),
    (("policy-lab", "--scenario", "nosuch"), 2),
], ids=lambda v: " ".join(v) if isinstance(v, tuple) else None)
def test_help_and_refused_arguments_load_no_heavy_layer(tmp_path, args, code):
    result, modules = imported_by_partfin(*args, home=tmp_path)
    assert result.returncode == code, result.stderr[-2000:]
    assert "partfin_assets.cli" in modules  # the measurement saw the command start
    assert heavy(modules) == []


def test_an_accepted_command_loads_its_layers(tmp_path):
    # the other side of the guard: the measurement does see them when a command runs
    result, modules = imported_by_partfin("status", home=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "partfin_assets.cli.status" in modules
    assert {m.split(".")[0] for m in heavy(modules)} >= {"pyiceberg", "pyarrow"}
