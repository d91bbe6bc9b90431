"""Commit cost on a table of many progress streams (Kafka partitions) vs a fresh one.

    .venv/bin/python bench/bench_partition_streams.py [--partitions 64] [--per-partition 20] [--rounds 20]

Setup: a writer commits --partitions x --per-partition 10-record checkpoints, each in the progress stream of
partition i mod --partitions (as `partfin ingest` from a topic of that many partitions does), as fast as it
goes (reported: checkpoints/s); a second writer commits 10 checkpoints of one stream into a fresh table.
Timed: --rounds more checkpoints of each, in turn (so the machine's noise hits both alike): the median of the
per-round ratios many streams / fresh. Reported with the snapshots the many-stream table keeps.
Each stream's window used to keep up to 20 of its commits: 1,280 snapshots at 64 partitions, 13.9x.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from partfin_assets.iceberg.catalog import load_partfin_catalog  # noqa: E402
from partfin_assets.ingest.writer import CdcWriter  # noqa: E402
from bench_ingest import SPEC, make_batches  # noqa: E402
from _sizes import parse_sizes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--partitions", type=int, default=64)
    parser.add_argument("--per-partition", type=int, default=20, help="checkpoints of each partition before the timed rounds")
    parser.add_argument("--rounds", type=int, default=20)
    options = parse_sizes(parser, smoke=dict(partitions=4, per_partition=3, rounds=2))
    backlog = options.partitions * options.per_partition
    total = backlog + 2 * options.rounds + 10
    batches = [dataclasses.replace(batch, offset=str(i)) for i, batch in enumerate(make_batches(10 * total, total, seed=1))]

    with tempfile.TemporaryDirectory() as tmp:
        many = CdcWriter(load_partfin_catalog(Path(tmp) / "many"), SPEC)
        fresh = CdcWriter(load_partfin_catalog(Path(tmp) / "fresh"), SPEC)
        start = time.perf_counter()
        for i, batch in enumerate(batches[:backlog]):
            many.write_checkpoint(dataclasses.replace(batch, stream=f"topic-{i % options.partitions}"))
        backlog_s = time.perf_counter() - start
        for batch in batches[backlog:backlog + 10]:
            fresh.write_checkpoint(dataclasses.replace(batch, stream="topic-0"))
        seconds: dict[str, list[float]] = {"many": [], "fresh": []}
        rest = batches[backlog + 10:]
        for i in range(options.rounds):
            turns = [("many", many, f"topic-{i % options.partitions}"), ("fresh", fresh, "topic-0")]
            for j, (name, writer, stream) in enumerate(turns if i % 2 == 0 else turns[::-1]):
                started = time.perf_counter()
                writer.write_checkpoint(dataclasses.replace(rest[2 * i + j], stream=stream))
                seconds[name].append(time.perf_counter() - started)
        snapshots = len(many.table.metadata.snapshots)

    ratios = [m / f for m, f in zip(seconds["many"], seconds["fresh"])]
    print(json.dumps({
        "partitions": options.partitions, "checkpoints_per_partition": options.per_partition, "rounds": options.rounds,
        "backlog_checkpoints_per_s": round(backlog / backlog_s, 1),
        "commit_ms_many_streams": round(statistics.median(seconds["many"]) * 1000, 1),
        "commit_ms_fresh": round(statistics.median(seconds["fresh"]) * 1000, 1),
        "ratio_many_streams_vs_fresh": round(statistics.median(ratios), 2),
        "snapshots_retained": snapshots,
    }, indent=2))


if __name__ == "__main__":
    main()
