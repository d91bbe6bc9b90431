"""The fanned-out CDC writer (`ingest_<table>_fanout`): 2 shares on 2 processes vs 1 share vs `partfin ingest` in one process.

    .venv/bin/python bench/bench_ingest_fanout.py [--rate 50] [--hours 2] [--checkpoint-records 90000] [--repeats 3] [--keep DIR]

The same records every time: the synthetic `orders` stream over a fixed window (`--rate` events/s
for `--hours` hours from 2026-01-01), cut into checkpoints of `--checkpoint-records`. Each round
ingests the whole stream three times, each into a fresh warehouse: `ingest_orders_fanout` with
`shares: 2` on `max_concurrent: 2` (step processes forked from a forkserver), the same job with
`shares: 1` on `max_concurrent: 1`, and `partfin ingest` (a process of its own, the writer's
default one subtask). Who goes first rotates. Timed: the whole run as a user launches it
(`execute_job` / the command), in the driver. Reported: per-round ratios against the 2-share run,
median and range. All three tables must end with the same records and checkpoint summaries.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from _sizes import parse_sizes

POLICY = "min-of-last:3"


def fanout_job():
    from dagster import Definitions

    from partfin_assets.defs.platform.ingest_fanout import build_ingest_fanout_job
    from partfin_assets.defs.resources import CdcSourceResource, IcebergCatalogResource
    from partfin_assets.defs.tables import PartfinTable
    from partfin_assets.sources.synthetic import ORDERS_SPEC

    job = build_ingest_fanout_job(PartfinTable(spec=dataclasses.replace(ORDERS_SPEC, watermark_policy=POLICY), source="synthetic"))
    return Definitions(jobs=[job], resources={"catalog": IcebergCatalogResource(), "cdc_source": CdcSourceResource()}).get_job_def(job.name)


def run_fanout(instance, home: Path, source: str, shares: int, checkpoint_records: int) -> float:
    from dagster import execute_job, reconstructable

    from partfin_assets.defs.platform.fanout import FORKSERVER

    config = {
        "execution": {"config": {"max_concurrent": shares, "start_method": FORKSERVER}},
        "resources": {"catalog": {"config": {"home": str(home)}}, "cdc_source": {"config": {"source": source}}},
        "ops": {"plan_ingest_orders": {"config": {"max_records": checkpoint_records, "max_checkpoints": 1000, "shares": shares}}},
    }
    started = time.perf_counter()
    with execute_job(reconstructable(fanout_job), instance=instance, run_config=config) as result:
        if not result.success:
            raise SystemExit(f"ingest_orders_fanout ({shares} shares) failed")
    return time.perf_counter() - started


def run_cli(home: Path, source: str, checkpoint_records: int) -> float:
    env = {**os.environ, "PARTFIN_HOME": str(home)}
    command = [sys.executable, "-m", "partfin_assets.cli", "ingest", "--table", "orders", "--source", source,
               "--checkpoint-records", str(checkpoint_records), "--watermark-policy", POLICY]
    started = time.perf_counter()
    out = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if out.returncode != 0:
        raise SystemExit(f"partfin ingest failed: {out.stderr[-2000:]}")
    return seconds


def landed(home: Path):
    """The table's records (sorted) and its checkpoints' partfin summary entries but the commit's own id and clock."""
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets.iceberg.history import summary_of
    from partfin_assets.model import summary_keys as K

    table = load_partfin_catalog(home).load_table("cdc.orders")
    rows = table.scan().to_arrow().drop_columns(["arrival_time"]).sort_by("source_seq")
    summaries = [{k: v for k, v in summary_of(s).items() if k.startswith("partfin.") and k not in (K.COMMIT_ID, K.COMMIT_CLOCK)}
                 for s in table.snapshots() if K.CHECKPOINT_ID in summary_of(s)]
    return rows, summaries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--hours", type=float, default=2.0)
    parser.add_argument("--checkpoint-records", type=int, default=90_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", type=Path)
    args = parse_sizes(parser, smoke=dict(rate=1.0, hours=0.1, checkpoint_records=1000, repeats=1))
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    end = start + timedelta(hours=args.hours)
    iso = "%Y-%m-%dT%H:%M:%SZ"
    source = f"synthetic:seed=5,rate={args.rate},start={start.strftime(iso)},end={end.strftime(iso)},key_space=100000"
    root = args.keep or Path(tempfile.mkdtemp(prefix="partfin-bench-ingest-fanout-"))
    (root / "dagster").mkdir(parents=True, exist_ok=True)
    import logging

    logging.getLogger("dagster").setLevel(logging.WARNING)
    from dagster import DagsterInstance

    variants = ("2 shares", "1 share", "partfin ingest")
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    try:
        with DagsterInstance.local_temp(str(root / "dagster")) as instance:
            for r in range(args.repeats):
                order = variants[r % 3:] + variants[:r % 3]
                for variant in order:
                    home = root / f"round{r}-{variant.replace(' ', '-')}"
                    if variant == "partfin ingest":
                        seconds[variant].append(run_cli(home, source, args.checkpoint_records))
                    else:
                        seconds[variant].append(run_fanout(instance, home, source, int(variant[0]), args.checkpoint_records))
                print(f"  round {r + 1}: " + ", ".join(f"{v} {seconds[v][-1]:.1f} s" for v in variants))
            homes = [root / f"round{args.repeats - 1}-{v.replace(' ', '-')}" for v in variants]
            results = [landed(h) for h in homes]
        rows = results[0][0].num_rows
        same = all(r[0].equals(results[0][0]) and r[1] == results[0][1] for r in results)
        print(f"{rows:,} records in checkpoints of {args.checkpoint_records:,}; medians: "
              + ", ".join(f"{v} {statistics.median(seconds[v]):.1f} s" for v in variants))
        for slower in ("1 share", "partfin ingest"):
            ratios = [a / b for a, b in zip(seconds[slower], seconds["2 shares"])]
            print(f"{slower} / 2 shares: median {statistics.median(ratios):.2f}x (range {min(ratios):.2f} to {max(ratios):.2f}, n={len(ratios)})")
        print(f"same records and checkpoint summaries in all three tables: {same}")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
