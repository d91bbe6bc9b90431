"""Upsert benchmark: partfin's incremental merge vs PyIceberg's own Table.upsert, same run, same changes.

    .venv/bin/python bench/bench_upsert.py [--base-rows 1000000] [--changes 100000] [--update-fraction 0.7]
                                           [--buckets 16] [--skip-pyiceberg] [--keep DIR]

Setup (untimed): cdc.bench holds --base-rows inserts, merged into base.bench by one upsert; a
plain Iceberg table `plain.bench` with the same schema and partitioning receives the same rows.
Then --changes changes (updates of random existing keys, the rest inserts of new keys; one
change per key, because Table.upsert rejects duplicate keys) are committed to cdc.bench.

Measured, each in its own process under GNU `time -v` (wall time and peak RSS):
1. partfin: `run_upsert(catalog, "bench")` -- reads the new CDC snapshot, decodes the JSON
   payloads, merges, rewrites the touched buckets, commits (data + watermark + position);
2. PyIceberg: `Table.upsert(changes)` of the same changes, already typed (no JSON decoding),
   on `plain.bench`.
Both end states are compared (same live rows). Goals: partfin >= 10x faster, with a peak RSS no
higher than Table.upsert's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from partfin_assets.iceberg.catalog import ensure_namespaces, load_partfin_catalog
from partfin_assets.iceberg.tables import DELETED, EVENT_TIME, ORDER_TIME, SOURCE_LOG, SOURCE_SEQ, ensure_base_table, read_base
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.jobs.upsert import run_upsert
from partfin_assets.model.records import CDC_RECORD_SCHEMA_WITHOUT_ARRIVAL, ChangeBatch
from partfin_assets.model.tablespec import TableSpec
from _sizes import parse_sizes

SPEC = TableSpec(
    "bench",
    ("id",),
    {"id": pa.int64(), "user_id": pa.int64(), "amount": pa.float64(), "status": pa.string(), "note": pa.string()},
)
T0_US = 1_790_000_000_000_000
HOUR_US = 3_600_000_000
STATUSES = ["pending", "paid", "shipped", "delivered", "cancelled"]
GNU_TIME = "/usr/bin/time"


def change_records(ids: np.ndarray, ops: list[str] | str, start_seq: int, start_us: int, seed: int) -> pa.Table:
    """CDC records for `ids` (one change each), payloads built vectorized by polars."""
    rng = np.random.default_rng(seed)
    n = len(ids)
    frame = pl.DataFrame(
        {
            "id": ids.astype(np.int64),
            "user_id": rng.integers(1, 50_000, n),
            "amount": np.round(rng.random(n) * 1000, 2),
            "status": pl.Series(np.array(STATUSES)[rng.integers(0, len(STATUSES), n)]),
            "note": pl.Series([f"note-{seed}"] * n) if n else pl.Series([], dtype=pl.String),
        }
    )
    payload = frame.select(pl.struct(frame.columns).struct.json_encode().alias("p")).to_series().to_arrow()
    key = pc.binary_join_element_wise('{"id":', pa.array(ids.astype(np.int64)).cast(pa.string()), "}", "")
    times = start_us + np.sort(rng.integers(0, 6 * HOUR_US, n))
    return pa.table(
        {
            "key": key.cast(pa.string()),
            "op": pa.array([ops] * n if isinstance(ops, str) else ops, pa.string()),
            "event_time": pa.array(times, pa.timestamp("us", tz="UTC")),
            "source_seq": pa.array(np.arange(start_seq, start_seq + n, dtype=np.int64)),
            "payload": payload.cast(pa.string()),
        },
        schema=CDC_RECORD_SCHEMA_WITHOUT_ARRIVAL,
    )


def typed_rows(records: pa.Table) -> pa.Table:
    """What the base table holds for these (upsert-only) records: for feeding Table.upsert."""
    frame = pl.from_arrow(records)
    decoded = frame.select(
        pl.col("payload").str.json_decode(pl.Struct({c: pl.from_arrow(pa.array([], t)).dtype for c, t in SPEC.columns.items()})).struct.unnest(),
        pl.col("event_time").alias(EVENT_TIME),
        pl.col("source_seq").alias(SOURCE_SEQ),
        pl.lit(False).alias(DELETED),
        pl.lit(None, pl.String).alias(SOURCE_LOG),
        pl.col("event_time").alias(ORDER_TIME),
    )
    return decoded.to_arrow()


# --------------------------------------------------------------------------- phases (each in its own process)


def phase_setup(home: Path, args) -> dict:
    catalog = load_partfin_catalog(home)
    ensure_base_table(catalog, SPEC, buckets=args.buckets)
    writer = CdcWriter(catalog, SPEC)
    ids = np.arange(1, args.base_rows + 1)
    chunks = max(1, args.base_rows // 250_000)
    start = time.perf_counter()
    for i, part in enumerate(np.array_split(ids, chunks)):
        writer.write_checkpoint(ChangeBatch(change_records(part, "c", int(part[0]), T0_US, seed=i), offset=f"load-{i}"))
    load = run_upsert(catalog, SPEC.name)
    setup_s = time.perf_counter() - start

    # The same starting state for PyIceberg's upsert: a plain table with the base schema and layout.
    base = catalog.load_table(SPEC.base_identifier)
    ensure_namespaces(catalog, "plain")
    plain = catalog.create_table("plain.bench", schema=base.schema(), partition_spec=base.spec())
    plain.append(read_base(catalog, SPEC.name, include_deleted=True))

    rng = np.random.default_rng(42)
    n_update = int(args.changes * args.update_fraction)
    updates = rng.choice(ids, size=n_update, replace=False)
    inserts = np.arange(args.base_rows + 1, args.base_rows + 1 + args.changes - n_update)
    change_ids = rng.permutation(np.concatenate([updates, inserts]))
    records = change_records(change_ids, "u", args.base_rows + 1, T0_US + 24 * HOUR_US, seed=1000)
    writer.write_checkpoint(ChangeBatch(records, offset="changes"))
    import pyarrow.parquet as pq

    pq.write_table(typed_rows(records), home / "changes.parquet")
    return {"setup_s": round(setup_s, 2), "initial_merge_inserted": load.inserted, "updates": n_update, "inserts": args.changes - n_update}


def phase_partfin(home: Path, args) -> dict:
    catalog = load_partfin_catalog(home)
    start = time.perf_counter()
    result = run_upsert(catalog, SPEC.name)
    elapsed = time.perf_counter() - start
    return {
        "seconds": elapsed,
        "inserted": result.inserted,
        "updated": result.updated,
        "deleted": result.deleted,
        "buckets_rewritten": result.buckets_rewritten,
        "describe": result.describe(),
    }


def phase_pyiceberg(home: Path, args) -> dict:
    import pyarrow.parquet as pq

    catalog = load_partfin_catalog(home)
    table = catalog.load_table("plain.bench")
    changes = pq.read_table(home / "changes.parquet").cast(table.schema().as_arrow())
    start = time.perf_counter()
    result = table.upsert(changes, join_cols=["id"])
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "inserted": result.rows_inserted, "updated": result.rows_updated}


def phase_compare(home: Path, args) -> dict:
    catalog = load_partfin_catalog(home)
    ordering = [SOURCE_LOG, ORDER_TIME]  # partfin's rank of a version between change logs: not what Table.upsert was given
    ours = read_base(catalog, SPEC.name).drop_columns(ordering).sort_by("id")
    theirs = catalog.load_table("plain.bench").scan().to_arrow().drop_columns([DELETED, *ordering]).sort_by("id")
    return {"rows": ours.num_rows, "identical": ours.equals(theirs.cast(ours.schema))}


PHASES = {"setup": phase_setup, "partfin": phase_partfin, "pyiceberg": phase_pyiceberg, "compare": phase_compare}


# --------------------------------------------------------------------------- driver


def run_phase(name: str, home: Path, argv: list[str], *, measure: bool = False, script: str = __file__, **extra) -> dict:
    """Run phase `name` of `script` in a process of its own; its last output line is its JSON result.

    `extra` become `--key=value` arguments. With `measure` (and GNU time installed) the result gets
    the process's peak_rss_mb and process_wall.
    """
    command = [sys.executable, script, "--phase", name, "--home", str(home), *argv, *[f"--{k}={v}" for k, v in extra.items()]]
    timed = measure and os.path.exists(GNU_TIME)
    if timed:
        command = [GNU_TIME, "-v", *command]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"phase {name} failed:\n{proc.stdout}\n{proc.stderr}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if timed:
        rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
        wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", proc.stderr)
        result["peak_rss_mb"] = round(int(rss[1]) / 1024) if rss else None
        result["process_wall"] = wall[1] if wall else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-rows", type=int, default=1_000_000)
    parser.add_argument("--changes", type=int, default=100_000)
    parser.add_argument("--update-fraction", type=float, default=0.7)
    parser.add_argument("--buckets", type=int, default=16)
    parser.add_argument("--skip-pyiceberg", action="store_true")
    parser.add_argument("--keep", type=Path, help="keep the warehouse in this directory")
    parser.add_argument("--phase", choices=list(PHASES), help=argparse.SUPPRESS)
    parser.add_argument("--home", type=Path, help=argparse.SUPPRESS)
    args = parse_sizes(parser, smoke=dict(base_rows=2000, changes=200))
    if args.phase:
        print(json.dumps(PHASES[args.phase](args.home, args), default=str))
        return

    argv = [f"--base-rows={args.base_rows}", f"--changes={args.changes}", f"--update-fraction={args.update_fraction}", f"--buckets={args.buckets}"]
    home = args.keep or Path(tempfile.mkdtemp(prefix="partfin-bench-upsert-"))
    if not os.path.exists(GNU_TIME):
        print(f"note: {GNU_TIME} missing (apt-get install -y time): no peak-memory figures", file=sys.stderr)
    try:
        started = time.perf_counter()
        setup = run_phase("setup", home, argv, measure=False)
        print(f"setup: base {args.base_rows} rows, changes {args.changes} ({setup['updates']} updates, {setup['inserts']} inserts), {setup['setup_s']} s")
        ours = run_phase("partfin", home, argv, measure=True)
        print(ours.pop("describe"))
        print(
            f"partfin run_upsert:     {ours['seconds']:7.2f} s  {args.changes / ours['seconds']:10,.0f} changes/s  "
            f"peak RSS {ours.get('peak_rss_mb')} MB  (+{ours['inserted']} ~{ours['updated']})"
        )
        if not args.skip_pyiceberg:
            theirs = run_phase("pyiceberg", home, argv, measure=True)
            print(
                f"PyIceberg Table.upsert: {theirs['seconds']:7.2f} s  {args.changes / theirs['seconds']:10,.0f} changes/s  "
                f"peak RSS {theirs.get('peak_rss_mb')} MB  (+{theirs['inserted']} ~{theirs['updated']})"
            )
            compare = run_phase("compare", home, argv, measure=False)
            ratio = theirs["seconds"] / ours["seconds"]
            print(f"speedup: {ratio:.1f}x (goal >= 10x: {'met' if ratio >= 10 else 'NOT met'}); end states identical: {compare['identical']} ({compare['rows']} rows)")
            if ours.get("peak_rss_mb") and theirs.get("peak_rss_mb"):
                lower = ours["peak_rss_mb"] <= theirs["peak_rss_mb"]
                print(f"peak RSS partfin / Table.upsert: {ours['peak_rss_mb']} / {theirs['peak_rss_mb']} MB (goal: no higher: {'met' if lower else 'NOT met'})")
        print(f"total bench time {time.perf_counter() - started:.0f} s")
    finally:
        if args.keep is None:
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
