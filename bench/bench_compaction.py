"""Compaction throughput (MB/s) vs a plain read + write of the same files, same run.

    .venv/bin/python bench/bench_compaction.py [--files 200] [--rows-per-file 20000] [--repeat 3]

Setup (untimed): cdc.bench gets --files checkpoints of --rows-per-file CDC records each, all in
one hour (one small file per checkpoint), written by partfin's CDC writer.
Measured on --repeat freshly built tables (median):
1. compaction: `compact(catalog, "cdc.bench", finalized_only=False)` -- plan from manifests,
   read the files, write ~128 MB files, one MERGE commit with the conflict check;
2. plain: pyarrow reads the same parquet files and writes one zstd parquet file (what any
   compaction must at least do), no Iceberg.
Reported: input MB (on disk), MB/s of each, and compaction time / plain time.
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
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partfin_assets.iceberg.catalog import load_partfin_catalog  # noqa: E402
from partfin_assets.iceberg.expiry import Retention  # noqa: E402
from partfin_assets.iceberg.files import live_files  # noqa: E402
from partfin_assets.ingest.writer import CdcWriter  # noqa: E402
from partfin_assets.jobs.compaction import compact  # noqa: E402
from partfin_assets.model.records import CDC_RECORD_SCHEMA_WITHOUT_ARRIVAL, ChangeBatch  # noqa: E402
from partfin_assets.model.tablespec import TableSpec  # noqa: E402
from _sizes import parse_sizes  # noqa: E402

T0 = 1_793_491_200_000_000
SPEC = TableSpec("bench", ("id",), {"id": pa.int64(), "amount": pa.float64()})


def batch(i: int, n: int, rng) -> ChangeBatch:
    ids = rng.integers(0, 1_000_000, n)
    times = T0 + np.sort(rng.integers(0, 3_600_000_000, n))
    return ChangeBatch(
        pa.table(
            {
                "key": [f'{{"id":{k}}}' for k in ids],
                "op": ["u"] * n,
                "event_time": pa.array(times, pa.timestamp("us", tz="UTC")),
                "source_seq": np.arange(i * n, (i + 1) * n, dtype=np.int64),
                "payload": [f'{{"amount":{a:.2f},"id":{k}}}' for k, a in zip(ids, rng.random(n) * 1000)],
            },
            schema=CDC_RECORD_SCHEMA_WITHOUT_ARRIVAL,
        ),
        offset=str(i),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--rows-per-file", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parse_sizes(parser, smoke=dict(files=3, rows_per_file=200, repeat=1))
    root = Path(tempfile.mkdtemp(prefix="bench-compaction-"))
    compaction_s, plain_s, setup_s = [], [], []
    input_mb = output_files = None
    for r in range(args.repeat):
        # a fresh table per run (the catalog stores absolute paths: copies would share files)
        t = time.perf_counter()
        catalog = load_partfin_catalog(root / f"run{r}")
        writer = CdcWriter(catalog, SPEC, retention=Retention(keep_last=100_000))
        rng = np.random.default_rng(1)
        for i in range(args.files):
            writer.write_checkpoint(batch(i, args.rows_per_file, rng))
        writer.close()
        setup_s.append(time.perf_counter() - t)
        table = catalog.load_table("cdc.bench")
        files = [f for fs in live_files(table).values() for f in fs]
        input_mb = sum(f.file_size_in_bytes for f in files) / 1e6
        paths = [f.file_path.removeprefix("file://") for f in files]

        start = time.perf_counter()
        plain = pa.concat_tables([pq.read_table(p) for p in paths])
        pq.write_table(plain, str(root / f"run{r}" / "plain.parquet"), compression="zstd")
        plain_s.append(time.perf_counter() - start)
        del plain

        start = time.perf_counter()
        result = compact(catalog, "cdc.bench", finalized_only=False)
        compaction_s.append(time.perf_counter() - start)
        assert result.partitions and result.partitions[0].records == args.files * args.rows_per_file
        output_files = result.files_after
        shutil.rmtree(root / f"run{r}", ignore_errors=True)
    print(f"setup (untimed): {args.files} files x {args.rows_per_file} rows, {statistics.median(setup_s):.0f}s per run")

    c, p = statistics.median(compaction_s), statistics.median(plain_s)
    print(f"input: {args.files} files, {input_mb:.1f} MB on disk, {args.files * args.rows_per_file} rows -> {output_files} file(s)")
    print(f"compaction (partfin MERGE job): {c:.2f}s  {input_mb / c:.1f} MB/s")
    print(f"plain read + write (pyarrow):   {p:.2f}s  {input_mb / p:.1f} MB/s")
    print(f"ratio compaction / plain: {c / p:.2f}x the time ({p / c:.0%} of plain throughput)")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
