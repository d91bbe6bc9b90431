"""The fanned-out upsert (`upsert_<table>_fanout`) on 2 processes vs 1: Dagster's multiprocess executor, same changes, same rows.

    .venv/bin/python bench/bench_fanout.py [--rows 4000000] [--changes 200000] [--repeats 4] [--keep DIR]

Setup (untimed): two identical tables, base.fa and base.fb, of --rows rows (the generator of
bench_upsert.py), each loaded through the CDC writer and one upsert.
Each round commits the same --changes changes (70% updates of random keys, 30% inserts) to both
tables, then runs the Dagster job `upsert_<table>_fanout` (plan -> one merge step per key group
-> one commit) on one table with `max_concurrent: 1` and on the other with `max_concurrent: 2`
(which table gets which alternates, and so does who goes first). Timed: the whole run as a
user launches it (`execute_job`, step processes forked from a forkserver), in the driver.
Reported: the per-round ratio time(1 process) / time(2 processes), median and range. At the end
both tables must hold exactly the same rows. Goal: >= 1.6x.
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


def run(instance, table: str, processes: int) -> float:
    from dagster import execute_job, reconstructable

    from partfin_assets.defs.platform.fanout import FORKSERVER

    target = reconstructable(fanout_job_fa if table == "fa" else fanout_job_fb)
    config = {"execution": {"config": {"max_concurrent": processes, "start_method": FORKSERVER}}}
    started = time.perf_counter()
    with execute_job(target, instance=instance, run_config=config) as result:
        if not result.success:
            raise SystemExit(f"upsert_{table}_fanout failed")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--changes", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--keep", type=Path)
    args = parser.parse_args()
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
            for r in range(args.repeats):
                commit_changes(catalog, args.rows, args.changes, r)
                plan = [("fa", 1), ("fb", 2)] if r % 2 == 0 else [("fa", 2), ("fb", 1)]
                if r % 4 >= 2:
                    plan.reverse()
                seconds = {}
                for table, processes in plan:
                    seconds[processes] = run(instance, table, processes)
                one.append(seconds[1])
                two.append(seconds[2])
                ratios.append(seconds[1] / seconds[2])
                print(f"  round {r + 1}: 1 process {seconds[1]:.1f} s, 2 processes {seconds[2]:.1f} s: {ratios[-1]:.2f}x")
        # every column but `_source_log`, which names each table's own writer (fa-writer, fb-writer)
        fa, fb = (read_base(catalog, t, include_deleted=True).sort_by("id") for t in ("fa", "fb"))
        same = fa.drop_columns([SOURCE_LOG]).equals(fb.drop_columns([SOURCE_LOG]))
        print(f"{args.changes:,} changes into {args.rows:,} rows, upsert_<table>_fanout: 1 process median {statistics.median(one):.1f} s, "
              f"2 processes median {statistics.median(two):.1f} s")
        ratio = statistics.median(ratios)
        print(f"speedup 2 vs 1 processes: median {ratio:.2f}x (range {min(ratios):.2f} to {max(ratios):.2f}, n={len(ratios)}; "
              f"goal >= 1.6: {'met' if ratio >= 1.6 else 'NOT met'}); same rows in both tables: {same}")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
