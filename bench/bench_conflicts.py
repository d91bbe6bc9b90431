"""Conflict-detection cost vs the snapshots between a job's start and the head, and vs the table's size.

    .venv/bin/python bench/bench_conflicts.py [--commits 300] [--big-files 1500] [--repeat 5]

Setup (untimed): two hour-partitioned tables on the embedded SQLite catalog.
- `small`: --commits commits, each appending one tiny data file to one of 24 hours;
- `big`:   one commit of --big-files data files first (a table 100x larger in files and
           manifest entries), then the same --commits commits.
Measured (median of --repeat): `find_conflict(table, start, {an hour no commit touched})` for
starts k = 10 ... --commits snapshots behind the head -- the worst case, every snapshot in
between is examined. Three ways:
1. summaries  -- partition summaries present (partfin's tables): metadata only;
2. manifests  -- summaries ignored, every snapshot's own manifests read (the fallback);
3. scan       -- for comparison, a file-level look instead: plan the live files of one busy
                 hour at the head (grows with the table's files, not with k).
Goals: (1) linear in k (per-snapshot cost flat) and the same on `small` and `big`.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyiceberg.expressions import And, GreaterThanOrEqual, LessThan  # noqa: E402

from partfin_assets.iceberg.catalog import ensure_namespaces, load_partfin_catalog  # noqa: E402
from partfin_assets.iceberg.commit import MANAGED_TABLE_PROPERTIES  # noqa: E402
from partfin_assets.iceberg.files import hour_partition, write_data_files  # noqa: E402
from partfin_assets.iceberg.history import snapshots_since  # noqa: E402
from partfin_assets.iceberg.tables import CDC_PARTITION_SPEC, CDC_SCHEMA  # noqa: E402
from partfin_assets.jobs import conflicts  # noqa: E402
from partfin_assets.jobs.conflicts import find_conflict  # noqa: E402
from partfin_assets.model.records import CDC_RECORD_SCHEMA_WITHOUT_ARRIVAL, cdc_records, with_source_log  # noqa: E402
from partfin_assets.model.timeutil import iso_z  # noqa: E402
from _sizes import parse_sizes  # noqa: E402

T0 = 1_793_491_200_000_000  # 2026-11-01T00:00Z in us
HOUR = 3_600_000_000


def rows(hour: int, n: int, seq: int) -> pa.Table:
    """cdc.<table> rows as the writer stores them: the records and their change log."""
    times = T0 + hour * HOUR + np.arange(n, dtype=np.int64) * 1_000_000
    records = pa.table(
        {
            "key": [f'{{"id":{i}}}' for i in range(n)],
            "op": ["u"] * n,
            "event_time": pa.array(times, pa.timestamp("us", tz="UTC")),
            "source_seq": np.arange(seq, seq + n, dtype=np.int64),
            "payload": pa.nulls(n, pa.string()),
        },
        schema=CDC_RECORD_SCHEMA_WITHOUT_ARRIVAL,
    )
    return with_source_log(cdc_records(records), "bench").cast(CDC_SCHEMA.as_arrow())


def build(catalog, name: str, commits: int, big_files: int) -> None:
    table = catalog.create_table(f"bench.{name}", CDC_SCHEMA, partition_spec=CDC_PARTITION_SPEC, properties=MANAGED_TABLE_PROPERTIES)
    if big_files:
        files = []
        for i in range(big_files):
            files += list(write_data_files(table, rows(i % 23, 5, i * 10)))
        with table.transaction() as tx:
            with tx.update_snapshot().fast_append() as append:
                for f in files:
                    append.append_data_file(f)
        table = catalog.load_table(f"bench.{name}")
    for c in range(commits):
        files = list(write_data_files(table, rows(c % 23, 3, 10_000_000 + c * 10)))
        tx = table.transaction()
        with tx.update_snapshot().fast_append() as append:
            for f in files:
                append.append_data_file(f)
        table = tx.commit_transaction()


def median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--commits", type=int, default=300)
    parser.add_argument("--big-files", type=int, default=1500)
    parser.add_argument("--repeat", type=int, default=5)
    args = parse_sizes(parser, smoke=dict(commits=55, big_files=10, repeat=1))
    home = Path(tempfile.mkdtemp(prefix="bench-conflicts-"))
    try:
        run(home, args)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def run(home: Path, args: argparse.Namespace) -> None:
    catalog = load_partfin_catalog(home)
    ensure_namespaces(catalog, "bench")
    t = time.perf_counter()
    build(catalog, "small", args.commits, 0)
    build(catalog, "big", args.commits, args.big_files)
    print(f"setup: {args.commits} commits per table, big table +{args.big_files} files ({time.perf_counter() - t:.0f}s)")

    ks = [k for k in (10, 50, 100, 200, 400, 800, 1600) if k < args.commits]
    target = None
    results = {}
    for name in ("small", "big"):
        table = catalog.load_table(f"bench.{name}")
        target = {hour_partition(table.metadata, T0 + 23 * HOUR)}  # no commit touches hour 23
        chain = snapshots_since(table.metadata, None)
        live = sum(int(s.summary.additional_properties.get("added-data-files", "0")) for s in chain)
        print(f"\n{name}: {len(chain)} snapshots, {live} live data files")
        print(f"{'k':>6} {'summaries ms':>13} {'us/snapshot':>12} {'manifests ms':>13} {'us/snapshot':>12} {'scan ms':>9}")
        for k in ks:
            start = chain[k].snapshot_id  # k snapshots after it up to the head
            assert find_conflict(table, start, target) is None
            s = median_s(lambda: find_conflict(table, start, target), args.repeat)
            original = conflicts.PARTITION_SUMMARIES_INCLUDED
            conflicts.PARTITION_SUMMARIES_INCLUDED = "ignored-for-the-bench"
            try:
                m = median_s(lambda: find_conflict(table, start, target), max(1, args.repeat // 2))
            finally:
                conflicts.PARTITION_SUMMARIES_INCLUDED = original
            # a file-level check instead: plan the live files of a busy hour (hour 0) at the head
            hour_filter = And(GreaterThanOrEqual("event_time", iso_z(T0).replace("Z", "+00:00")),
                              LessThan("event_time", iso_z(T0 + HOUR).replace("Z", "+00:00")))
            scan = median_s(lambda: list(table.scan(row_filter=hour_filter).plan_files()), max(1, args.repeat // 2))
            results[(name, k)] = (s, m, scan)
            print(f"{k:>6} {s * 1e3:>13.2f} {s / k * 1e6:>12.1f} {m * 1e3:>13.1f} {m / k * 1e6:>12.0f} {scan * 1e3:>9.1f}")

    kmin, kmax = ks[0], ks[-1]
    print("\nratios (same run):")
    for name in ("small", "big"):
        s_lo, s_hi = results[(name, kmin)][0], results[(name, kmax)][0]
        print(f"  {name}: summaries cost k={kmax} / k={kmin} = {s_hi / s_lo:.1f}x for {kmax / kmin:.0f}x the snapshots "
              f"(per-snapshot {s_lo / kmin * 1e6:.1f} -> {s_hi / kmax * 1e6:.1f} us)")
    for k in (kmin, kmax):
        print(f"  k={k}: big / small table, summaries = {results[('big', k)][0] / results[('small', k)][0]:.2f}x; "
              f"file scan of the hour = {results[('big', k)][2] / results[('small', k)][2]:.1f}x")
    print(f"  k={kmax}: manifest fallback / summaries = {results[('small', kmax)][1] / results[('small', kmax)][0]:.0f}x")


if __name__ == "__main__":
    main()
