"""Does an upsert's cost follow the changes, not the table? And what do the delete files cost readers?

    .venv/bin/python bench/bench_upsert_scale.py [--small 1000000] [--large 10000000] [--changes 10000]
                                                 [--repeats 5] [--read-upserts 20] [--read-repeats 5] [--keep DIR]

Setup (untimed): two tables, base.small and base.large, loaded through the CDC writer and one
upsert each (the same generator as bench_upsert.py: 70% updates of random existing keys, 30%
inserts of new keys, one change per key).

1. Scale: `--repeats` rounds; each round commits `--changes` new changes to each table and runs
   `run_upsert` on each, small and large alternating (who goes first alternates too), each in its
   own process under GNU `time -v` (wall time inside the process, and peak RSS). Reported: the
   per-round ratio large / small, median and range; peak RSS of the large table's upserts; and,
   beside it, the same ratio of the upserts' CPU time (`time.process_time`, all threads), which
   other work on a shared machine disturbs less than wall time.
   Goal: ratio <= 1.3, peak RSS <= 600 MB at the large size.
2. Reads after many upserts: base.small gets upserts until it has had `--read-upserts` of them;
   then full reads of it (`read_base`, every column, tombstones included) alternate with full
   reads of `copy.small`, the same rows written at once (one sorted file per bucket, no delete
   files), `--read-repeats` times each, each read in its own process; reported as the median and
   range of the per-pair ratios. Then `compact(base.small)` and the same again.
   Goals: <= 1.3x before compaction, 1.0x after. The same reads in a process that never
   imported partfin (plain PyIceberg 0.12, whose position-delete step is slow:
   apache/iceberg-python#1271) are reported beside them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_upsert as upsert_bench  # noqa: E402
from bench_upsert import HOUR_US, SPEC, T0_US, change_records  # noqa: E402
from _sizes import parse_sizes  # noqa: E402


def spec_named(name: str):
    import dataclasses

    return dataclasses.replace(SPEC, name=name)


# --------------------------------------------------------------------------- phases (each in its own process)


def load_table(catalog, name: str, rows: int) -> None:
    """base.<name> with ids 1..rows, through the CDC writer and one upsert."""
    from partfin_assets.iceberg.expiry import Retention
    from partfin_assets.iceberg.tables import ensure_base_table
    from partfin_assets.ingest.writer import CdcWriter
    from partfin_assets.jobs.upsert import run_upsert
    from partfin_assets.model.records import ChangeBatch

    spec = spec_named(name)
    ensure_base_table(catalog, spec)
    writer = CdcWriter(catalog, spec, retention=Retention(keep_last=5))
    ids = np.arange(1, rows + 1)
    for i, part in enumerate(np.array_split(ids, max(1, rows // 500_000))):
        writer.write_checkpoint(ChangeBatch(change_records(part, "c", int(part[0]), T0_US, seed=i), offset=f"load-{i}"))
    writer.close()
    run_upsert(catalog, name)


def phase_setup(home: Path, args) -> dict:
    from partfin_assets.iceberg.catalog import ensure_namespaces, load_partfin_catalog

    catalog = load_partfin_catalog(home)
    ensure_namespaces(catalog, "copy")
    out = {}
    for name, rows in (("small", args.small), ("large", args.large)):
        started = time.perf_counter()
        load_table(catalog, name, rows)
        out[name] = round(time.perf_counter() - started, 1)
    return out


def phase_changes(home: Path, args) -> dict:
    """Commit --changes new changes (round --round) to cdc.<--table>."""
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets.iceberg.expiry import Retention
    from partfin_assets.ingest.writer import CdcWriter
    from partfin_assets.model.records import ChangeBatch

    catalog = load_partfin_catalog(home)
    rows = args.small if args.table == "small" else args.large
    rng = np.random.default_rng(1000 + args.round)
    n_update = int(args.changes * 0.7)
    updates = rng.choice(np.arange(1, rows + 1), size=n_update, replace=False)
    first_new = rows + 1 + args.round * args.changes
    inserts = np.arange(first_new, first_new + args.changes - n_update)
    ids = rng.permutation(np.concatenate([updates, inserts]))
    seq = 10 * rows + (args.round + 1) * args.changes
    writer = CdcWriter(catalog, spec_named(args.table), retention=Retention(keep_last=5))
    batch = change_records(ids, "u", seq, T0_US + (24 + args.round) * HOUR_US, seed=2000 + args.round)
    writer.write_checkpoint(ChangeBatch(batch, offset=f"round-{args.round}"))
    writer.close()
    return {"changes": len(ids)}


def phase_upsert(home: Path, args) -> dict:
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets.jobs.upsert import run_upsert

    catalog = load_partfin_catalog(home)
    started, cpu = time.perf_counter(), time.process_time()
    result = run_upsert(catalog, args.table)
    # CPU seconds of the upsert (all threads): less at the mercy of other work on a shared machine than wall time
    return {"seconds": time.perf_counter() - started, "cpu_s": round(time.process_time() - cpu, 3), "files_scanned": result.files_scanned,
            "row_groups_hit": result.row_groups_hit, "row_groups_settled": result.row_groups_settled, "added": result.files_added,
            "removed": result.files_removed, "updated": result.updated, "inserted": result.inserted}


def phase_copy(home: Path, args) -> dict:
    """copy.small: the rows of base.small written at once (sorted by key), same schema and partitioning."""
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets.iceberg.tables import read_base

    catalog = load_partfin_catalog(home)
    base = catalog.load_table("base.small")
    if catalog.table_exists("copy.small"):
        catalog.drop_table("copy.small")
    copy = catalog.create_table("copy.small", schema=base.schema(), partition_spec=base.spec(), properties={"format-version": "2"})
    rows = read_base(catalog, "small", include_deleted=True).sort_by("id")
    copy.append(rows)
    return {"rows": rows.num_rows}


READ = """
import sys, time
from pyiceberg.catalog.sql import SqlCatalog
if sys.argv[3] == "partfin":
    import partfin_assets.iceberg.files  # noqa: F401 - partfin's reader, as read_base uses it
home = sys.argv[1]
catalog = SqlCatalog("partfin", uri=f"sqlite:///{home}/catalog.db", warehouse=f"file://{home}/warehouse")
table = catalog.load_table(sys.argv[2])
started = time.perf_counter()
rows = table.scan().to_arrow()
print(time.perf_counter() - started, rows.num_rows)
"""


def timed_read(home: Path, identifier: str, reader: str) -> tuple[float, int]:
    out = subprocess.run([sys.executable, "-c", READ, str(home), identifier, reader], capture_output=True, text=True, check=True)
    seconds, rows = out.stdout.split()
    return float(seconds), int(rows)


def phase_compact(home: Path, args) -> dict:
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets.jobs.compaction import compact

    catalog = load_partfin_catalog(home)
    started = time.perf_counter()
    result = compact(catalog, "base.small", finalized_only=False)
    return {"seconds": time.perf_counter() - started, "files_before": result.files_before, "files_after": result.files_after}


def phase_layout(home: Path, args) -> dict:
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets.iceberg.files import data_files, position_delete_files

    catalog = load_partfin_catalog(home)
    base = catalog.load_table("base.small")
    snapshot = base.current_snapshot()
    return {"data_files": len(data_files(base, snapshot)), "delete_files": len(position_delete_files(base, snapshot))}


PHASES = {
    "setup": phase_setup, "changes": phase_changes, "upsert": phase_upsert, "copy": phase_copy,
    "compact": phase_compact, "layout": phase_layout,
}


# --------------------------------------------------------------------------- driver


def run_phase(name: str, home: Path, argv: list[str], *, measure: bool = False, **extra) -> dict:
    return upsert_bench.run_phase(name, home, argv, measure=measure, script=__file__, **extra)


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} (range {min(values):.2f} to {max(values):.2f}, n={len(values)})"


def read_pairs(home: Path, repeats: int, reader: str) -> list[float]:
    ratios = []
    for i in range(repeats):
        order = [("base.small", 0), ("copy.small", 1)] if i % 2 == 0 else [("copy.small", 1), ("base.small", 0)]
        seconds = [0.0, 0.0]
        rows = [0, 0]
        for identifier, slot in order:
            seconds[slot], rows[slot] = timed_read(home, identifier, reader)
        if rows[0] != rows[1]:
            raise SystemExit(f"row counts differ: base {rows[0]} vs copy {rows[1]}")
        ratios.append(seconds[0] / seconds[1])
        print(f"  read {i + 1}: base {seconds[0]:.2f} s, compacted copy {seconds[1]:.2f} s ({rows[0]} rows): {ratios[-1]:.2f}x")
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=1_000_000)
    parser.add_argument("--large", type=int, default=10_000_000)
    parser.add_argument("--changes", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--read-upserts", type=int, default=20)
    parser.add_argument("--read-repeats", type=int, default=5)
    parser.add_argument("--skip-reads", action="store_true")
    parser.add_argument("--keep", type=Path)
    parser.add_argument("--phase", choices=list(PHASES), help=argparse.SUPPRESS)
    parser.add_argument("--home", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--table", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = parse_sizes(parser, smoke=dict(small=2000, large=4000, changes=100, repeats=1, read_upserts=1, read_repeats=1))
    if args.phase:
        print(json.dumps(PHASES[args.phase](args.home, args), default=str))
        return

    argv = [f"--small={args.small}", f"--large={args.large}", f"--changes={args.changes}"]
    home = args.keep or Path(tempfile.mkdtemp(prefix="partfin-bench-scale-"))
    try:
        setup = run_phase("setup", home, argv)
        print(f"setup (untimed): base.small {args.small:,} rows in {setup['small']} s, base.large {args.large:,} rows in {setup['large']} s")
        ratios, small_s, large_s, large_rss, small_rss, cpu_ratios = [], [], [], [], [], []
        for r in range(args.repeats):
            seconds, cpu = {}, {}
            for table in (("small", "large") if r % 2 == 0 else ("large", "small")):
                run_phase("changes", home, argv, table=table, round=r)
                result = run_phase("upsert", home, argv, measure=True, table=table, round=r)
                seconds[table] = result["seconds"]
                cpu[table] = result.get("cpu_s")
                (large_rss if table == "large" else small_rss).append(result.get("peak_rss_mb") or 0)
                print(f"  round {r + 1} {table}: {result['seconds']:.2f} s (CPU {result.get('cpu_s')} s), peak RSS {result.get('peak_rss_mb')} MB, "
                      f"key columns of {result['files_scanned']} file(s) read, ordering columns of "
                      f"{result['row_groups_hit'] - result['row_groups_settled']} of {result['row_groups_hit']} hit row group(s), "
                      f"+{result['added']} -{result['removed']} files")
            small_s.append(seconds["small"])
            large_s.append(seconds["large"])
            ratios.append(seconds["large"] / seconds["small"])
            if cpu["large"] and cpu["small"]:
                cpu_ratios.append(cpu["large"] / cpu["small"])
        print(f"{args.changes:,} changes into {args.small:,} rows: {spread(small_s)} s; peak RSS {spread(small_rss)} MB")
        print(f"{args.changes:,} changes into {args.large:,} rows: {spread(large_s)} s; peak RSS {spread(large_rss)} MB")
        ratio = statistics.median(ratios)
        print(f"time ratio large / small: {spread(ratios)} (goal <= 1.3: {'met' if ratio <= 1.3 else 'NOT met'}); "
              f"peak RSS at {args.large:,}: max {max(large_rss)} MB (goal <= 600: {'met' if max(large_rss) <= 600 else 'NOT met'})")
        if cpu_ratios:
            print(f"  CPU time of the upserts (process_time, all threads) large / small: {spread(cpu_ratios)}")
        if args.skip_reads:
            return

        done = args.repeats
        for r in range(done, args.read_upserts):
            run_phase("changes", home, argv, table="small", round=r)
            run_phase("upsert", home, argv, table="small", round=r)
        layout = run_phase("layout", home, argv)
        copy = run_phase("copy", home, argv)
        print(f"reads after {max(done, args.read_upserts)} upserts of {args.changes:,} changes: base.small has {layout['data_files']} data files "
              f"and {layout['delete_files']} delete files; copy.small the same {copy['rows']:,} rows written at once")
        before = read_pairs(home, args.read_repeats, "partfin")
        print(f"read base / compacted copy, before compaction: {spread(before)} (goal <= 1.3)")
        plain = read_pairs(home, max(1, args.read_repeats // 2), "pyiceberg")
        print(f"  the same with plain PyIceberg 0.12 (no partfin in the process): {spread(plain)}")
        compacted = run_phase("compact", home, argv)
        print(f"compact(base.small): {compacted['seconds']:.1f} s, files {compacted['files_before']} -> {compacted['files_after']}")
        after = read_pairs(home, args.read_repeats, "partfin")
        print(f"read base / compacted copy, after compaction: {spread(after)} (goal 1.0)")
    finally:
        if args.keep is None:
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
