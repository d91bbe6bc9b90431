"""The fanned-out upsert (`upsert_<table>_fanout`) on 2 processes vs 1: Dagster's multiprocess executor, same changes, same rows.

    .venv/bin/python bench/bench_fanout.py [--rows 4000000] [--changes 200000] [--repeats 4] [--keep DIR]

Setup (untimed): two identical tables, base.fa and base.fb, of --rows rows (the generator of
bench_upsert.py), each loaded through the CDC writer and one upsert.
Each round commits the same --changes changes (70% updates of random keys, 30% inserts) to both
tables, then runs the Dagster job `upsert_<table>_fanout` (plan -> one merge step per key group
-> one commit) on one table with `max_concurrent: 1` and on the other with `max_concurrent: 2`
(which table gets which alternates, and so does who goes first). Timed: the whole run as a
user launches it (`execute_job`, step processes forked from a forkserver), in the driver, after
one untimed run per table has started the forkserver (a Dagster run worker starts its own once
per run: about 2 s more of serial work in every run, not counted here for either side).
Reported: the per-round ratio time(1 process) / time(2 processes), median and range; per run the
span of its plan, merge and commit steps (launch to success) and how many of the machine's cores
were busy on average (/proc/stat), which bounds what a second process can add. At the end both
tables must hold exactly the same rows. Goal: >= 1.6x.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_upsert import HOUR_US, SPEC, T0_US, change_records  # noqa: E402
from bench_upsert_scale import load_table  # noqa: E402
from _sizes import parse_sizes  # noqa: E402

TABLES = ("fa", "fb")


def fanout_job_fa():
    return _job("fa")


def fanout_job_fb():
    return _job("fb")


def _job(name: str):
    from dagster import Definitions

    from partfin_assets.defs.platform.upsert_fanout import build_upsert_job
    from partfin_assets.defs.resources import IcebergCatalogResource
    from partfin_assets.defs.tables import PartfinTable

    job = build_upsert_job(PartfinTable(spec=dataclasses.replace(SPEC, name=name), source="synthetic"))
    return Definitions(jobs=[job], resources={"catalog": IcebergCatalogResource()}).get_job_def(job.name)


def setup(catalog, rows: int) -> None:
    for name in TABLES:
        load_table(catalog, name, rows)


def commit_changes(catalog, rows: int, changes: int, round_: int) -> None:
    from partfin_assets.iceberg.expiry import Retention
    from partfin_assets.ingest.writer import CdcWriter
    from partfin_assets.model.records import ChangeBatch

    rng = np.random.default_rng(round_)
    n_update = int(changes * 0.7)
    updates = rng.choice(np.arange(1, rows + 1), size=n_update, replace=False)
    first_new = rows + 1 + round_ * changes
    ids = rng.permutation(np.concatenate([updates, np.arange(first_new, first_new + changes - n_update)]))
    batch = change_records(ids, "u", 10 * rows + (round_ + 1) * changes, T0_US + (24 + round_) * HOUR_US, seed=round_)
    for name in TABLES:
        writer = CdcWriter(catalog, dataclasses.replace(SPEC, name=name), retention=Retention(keep_last=5))
        writer.write_checkpoint(ChangeBatch(batch, offset=f"round-{round_}"))
        writer.close()


@dataclasses.dataclass(frozen=True)
class Timed:
    seconds: float
    cores_busy: float  # the machine's busy CPU time / wall time over the run: what 2 cores allow is 2
    phases: dict[str, float]  # plan, merge, commit steps: first launch to last success, from the run's event log


def run(instance, table: str, processes: int, max_groups: int | None) -> Timed:
    from dagster import execute_job, reconstructable

    from partfin_assets.defs.platform.fanout import FORKSERVER

    target = reconstructable(fanout_job_fa if table == "fa" else fanout_job_fb)
    config = {"execution": {"config": {"max_concurrent": processes, "start_method": FORKSERVER}}}
    if max_groups is not None:
        config["ops"] = {f"plan_upsert_{table}": {"config": {"max_groups": max_groups}}}
    busy, started = busy_cpu_seconds(), time.perf_counter()
    with execute_job(target, instance=instance, run_config=config) as result:
        if not result.success:
            raise SystemExit(f"upsert_{table}_fanout failed")
        run_id = result.run_id
    seconds = time.perf_counter() - started
    return Timed(seconds, (busy_cpu_seconds() - busy) / seconds, phases(instance, run_id))


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (/proc/stat: all but idle and iowait)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def phases(instance, run_id: str) -> dict[str, float]:
    spans: dict[str, list[float]] = {}
    for record in instance.all_logs(run_id):
        event = record.dagster_event
        if event is not None and event.event_type_value in ("STEP_WORKER_STARTING", "STEP_SUCCESS"):
            span = spans.setdefault(event.step_key.split("_", 1)[0], [record.timestamp, record.timestamp])
            span[0], span[1] = min(span[0], record.timestamp), max(span[1], record.timestamp)
    return {kind: last - first for kind, (first, last) in spans.items()}


def shown(t: Timed) -> str:
    return (f"{t.seconds:.1f} s (plan {t.phases['plan']:.1f}, groups {t.phases.get('merge', 0.0):.1f}, commit {t.phases['commit']:.1f}; "
            f"{t.cores_busy:.2f} cores busy)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--changes", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--max-groups", type=int, help="key groups (merge steps) per run (default: the job's own, 8)")
    parser.add_argument("--keep", type=Path)
    args = parse_sizes(parser, smoke=dict(rows=2000, changes=200, repeats=1, max_groups=2))
    root = args.keep or Path(tempfile.mkdtemp(prefix="partfin-bench-fanout-"))
    os.environ["PARTFIN_HOME"] = str(root / "partfin")
    (root / "dagster").mkdir(parents=True, exist_ok=True)
    import logging

    logging.getLogger("dagster").setLevel(logging.WARNING)
    from dagster import DagsterInstance

    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets.iceberg.tables import SOURCE_LOG, read_base

    try:
        catalog = load_partfin_catalog(root / "partfin")
        started = time.perf_counter()
        setup(catalog, args.rows)
        print(f"setup (untimed): base.fa and base.fb, {args.rows:,} rows each, {time.perf_counter() - started:.0f} s")
        ratios, one, two = [], [], []
        with DagsterInstance.local_temp(str(root / "dagster")) as instance:
            # untimed: the first run starts the step processes' forkserver (a Dagster run worker pays that once per run)
            for table in TABLES:
                run(instance, table, 2, args.max_groups)
            for r in range(args.repeats):
                commit_changes(catalog, args.rows, args.changes, r)
                plan = [("fa", 1), ("fb", 2)] if r % 2 == 0 else [("fa", 2), ("fb", 1)]
                if r % 4 >= 2:
                    plan.reverse()
                timed = {processes: run(instance, table, processes, args.max_groups) for table, processes in plan}
                one.append(timed[1])
                two.append(timed[2])
                ratios.append(timed[1].seconds / timed[2].seconds)
                print(f"  round {r + 1}: 1 process {shown(timed[1])}, 2 processes {shown(timed[2])}: {ratios[-1]:.2f}x")
        # every column but `_source_log`, which names each table's own writer (fa-writer, fb-writer)
        fa, fb = (read_base(catalog, t, include_deleted=True).sort_by("id") for t in ("fa", "fb"))
        same = fa.drop_columns([SOURCE_LOG]).equals(fb.drop_columns([SOURCE_LOG]))
        print(f"{args.changes:,} changes into {args.rows:,} rows, upsert_<table>_fanout: 1 process median "
              f"{statistics.median(t.seconds for t in one):.1f} s ({statistics.median(t.cores_busy for t in one):.2f} cores busy), "
              f"2 processes median {statistics.median(t.seconds for t in two):.1f} s ({statistics.median(t.cores_busy for t in two):.2f} cores busy)")
        ratio = statistics.median(ratios)
        print(f"speedup 2 vs 1 processes: median {ratio:.2f}x (range {min(ratios):.2f} to {max(ratios):.2f}, n={len(ratios)}; "
              f"goal >= 1.6: {'met' if ratio >= 1.6 else 'NOT met'}); same rows in both tables: {same}")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
