"""Bench: how soon the `partfin` command answers, and how much memory it takes.

Each case is a fresh process as a user starts it (`python -m partfin_assets.cli ...`), timed from
start to exit, with its peak RSS (os.wait4). Baselines measured in the same run, in turn with the cases:

- `python -c pass`: the interpreter's own start-up, what no command can beat;
- the import of the layers `status` reads with, reading nothing: the floor under `status`;
- `--before PATH` (optional): the same cases run from another checkout, e.g. the code before a change
  (`git worktree add --detach /tmp/before <commit>`), printed as after / before.

Cases: `--help`, `ingest --help`, a refused argument (`replay --hour bogus`), a refused command on a
missing table (after the catalog is opened), and `status` on a catalog of `--tables` declared tables
(each a cdc and a base table, with their late-data ledgers and rejected tables).

    python bench/bench_cli.py                          # 15 declared tables = 30 cdc/base tables, 5 runs
    python bench/bench_cli.py --before /tmp/before     # and the same against the code before
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from _sizes import parse_sizes

REPO = Path(__file__).resolve().parents[1]


def build_catalog(home: str, tables: int) -> None:
    """`tables` declared tables of synthetic orders (a day of them, some late), each upserted into its base."""
    from partfin_assets.defs.tables import TABLES
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets.iceberg.tables import ensure_base_table
    from partfin_assets.ingest.writer import CdcWriter
    from partfin_assets.jobs.upsert import run_upsert
    from partfin_assets.sources.synthetic import SyntheticSource

    catalog = load_partfin_catalog(Path(home))
    end = datetime(2026, 6, 1, tzinfo=UTC)
    for i in range(tables):
        spec = dataclasses.replace(TABLES[0].spec, name=f"t{i:02}")
        source = SyntheticSource(seed=i, rate=20 / 3600, start=end - timedelta(hours=24), end=end, idle_every=None,
                                 late_fraction=0.05, heartbeat_every=timedelta(hours=1), key_space=1000)
        writer = CdcWriter(catalog, spec, writer_id="bench")
        for _ in writer.run(source, max_records=60):
            pass
        writer.close()
        ensure_base_table(catalog, spec)
        run_upsert(catalog, spec.name)


def timed(command: list[str], env: dict[str, str], cwd: str) -> tuple[float, float, int]:
    """(wall seconds, peak RSS in MB, exit code) of one process, started in `cwd`: `python -m` puts its folder first
    on the path, ahead of PYTHONPATH, so a process started in a checkout runs that checkout's code."""
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - start, usage.ru_maxrss / 1024, process.returncode


CASES = {
    "--help": (["--help"], 0),
    "ingest --help": (["ingest", "--help"], 0),
    "refused argument (--hour bogus)": (["replay", "--table", "t00", "--hour", "bogus"], 2),
    "refused: no such table": (["streams", "list", "--table", "nosuch"], 2),
    "status": (["status"], 0),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=15, help="declared tables in the catalog status reads (each: cdc + base)")
    parser.add_argument("--runs", type=int, default=5, help="runs of each case (the median is shown)")
    parser.add_argument("--before", type=Path, help="another checkout to run the same cases from (the code before)")
    args = parse_sizes(parser, smoke=dict(tables=1, runs=1), argv=argv)

    with tempfile.TemporaryDirectory(prefix="bench-cli-") as work:
        home = Path(work) / "home"
        t0 = time.perf_counter()
        # in a process of its own: a child's peak RSS counts its parent's from before the exec, so the parent stays small
        subprocess.run([sys.executable, "-c", f"from bench_cli import build_catalog; build_catalog({str(home)!r}, {args.tables})"],
                       cwd=Path(__file__).parent, check=True)
        print(f"setup: {args.tables} declared tables ({2 * args.tables} cdc/base tables) in {time.perf_counter() - t0:.0f} s")
        base_env = {k: v for k, v in os.environ.items() if not k.startswith(("PARTFIN_", "PYTHONPATH"))} | {"PARTFIN_HOME": str(home)}
        sides = {"after": REPO, **({"before": args.before.resolve()} if args.before else {})}
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for _ in range(args.runs):  # every case and baseline in turn, run after run: the machine's noise hits them alike
            wall, rss, _ = timed([sys.executable, "-c", "pass"], base_env, work)
            results.setdefault(("python -c pass", "-"), []).append((wall, rss))
            # the floor under `status`: loading the layers it reads with (PyIceberg, PyArrow, SQLAlchemy, Polars), nothing read
            wall, rss, _ = timed([sys.executable, "-c", "import partfin_assets.cli.status"], base_env | {"PYTHONPATH": str(REPO)}, work)
            results.setdefault(("import of status's layers", "after"), []).append((wall, rss))
            for side, root in sides.items():
                env = base_env | {"PYTHONPATH": str(root)}
                for name, (cli_args, code) in CASES.items():
                    wall, rss, exit_code = timed([sys.executable, "-m", "partfin_assets.cli", *cli_args], env, work)
                    if exit_code != code:
                        raise SystemExit(f"{side}: partfin {' '.join(cli_args)} exited {exit_code}, not {code}")
                    results.setdefault((name, side), []).append((wall, rss))

    median = {key: (statistics.median(w for w, _ in runs), max(r for _, r in runs)) for key, runs in results.items()}
    start_s = median[("python -c pass", "-")][0]
    print(f"\n{'case':<34} {'side':<7} {'median s':>9} {'peak MB':>8} {'x python -c pass':>17} {'after / before':>15}")
    print(f"{'python -c pass':<34} {'-':<7} {start_s:>9.3f} {median[('python -c pass', '-')][1]:>8.0f} {1.0:>16.2f}x")
    floor = "import of status's layers"
    wall, rss = median[(floor, "after")]
    print(f"{floor:<34} {'after':<7} {wall:>9.3f} {rss:>8.0f} {wall / start_s:>16.2f}x")
    for name in CASES:
        for side in sides:
            wall, rss = median[(name, side)]
            versus = f"{wall / median[(name, 'before')][0]:.2f}x" if side == "after" and "before" in sides else ""
            print(f"{name:<34} {side:<7} {wall:>9.3f} {rss:>8.0f} {wall / start_s:>16.2f}x {versus:>15}")


if __name__ == "__main__":
    main()
