"""Ingest benchmarks; every figure is a ratio against a baseline measured in the same run.

    .venv/bin/python bench/bench_ingest.py [--records 400000] [--checkpoints 20] [--repeats 16] [--commits 1000]

1. writer with its default accumulator (event-time stats overall and per hour) and the watermark
   processor vs the same writer with none (goal >= 0.98): 20,000-record checkpoints, the Dagster
   sync's default size; the writers take turns checkpoint by checkpoint and the figure is the median
   of the per-checkpoint ratios over all repeats (quartiles printed beside it)
2. writer vs a plain PyIceberg Table.append of the same Arrow data (the floor of this stack)
2b. small checkpoints: the writer with every feature vs a plain Table.append of 500 records (goal <= 1.5x),
   taking turns checkpoint by checkpoint as in 1 (median of the per-checkpoint ratios, quartiles beside it)
3. accumulator update vs np.sort of the same event-time column
4. a fast-checkpoint backlog: commit latency after N 10-record checkpoints committed as fast as the writer goes vs
   after 10, with the default policy and retention (goal <= 1.2x): the two tables' writers commit in turn (median of
   the per-round ratios, quartiles beside it); also the backlog's checkpoints/s and the snapshots the table keeps
5. the late-data ledger's overhead: total ingest time of the writer as it is (ledger rows per
   checkpoint, recorded in batches, reconciled before expiry) vs the same writer without the ledger,
   with `--ledger-checkpoints` checkpoints of 20,000 and of 500 records (a streaming cadence),
   taking turns checkpoint by checkpoint; also with one ledger commit per checkpoint (max_pending=1),
   the way it worked before batching. Ratio = time(with) / time(without), median over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog.sql import SqlCatalog

import partfin_assets.iceberg.expiry as expiry
from partfin_assets.iceberg.catalog import CATALOG_NAME, CatalogConfig, load_partfin_catalog
from partfin_assets.ingest.event_time import EventTimeAccumulator
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.model.records import CDC_RECORD_SCHEMA, ChangeBatch, cdc_records, with_source_log
from partfin_assets.model.tablespec import TableSpec
from _sizes import parse_sizes

SPEC = TableSpec("bench", ("id",), {"id": pa.int64(), "amount": pa.float64()})
T0_US = 1_790_000_000_000_000


def make_batches(total: int, checkpoints: int, seed: int = 0) -> list[ChangeBatch]:
    rng = np.random.default_rng(seed)
    per = total // checkpoints
    batches = []
    for i in range(checkpoints):
        ids = rng.integers(0, 100_000, per)
        times = T0_US + (i * per + np.arange(per)) * 10_000 - (rng.pareto(1.5, per) * 5e6).astype(np.int64)
        payload = pc.binary_join_element_wise('{"id":', pa.array(ids).cast(pa.string()), ',"amount":1.5}', "")
        records = pa.table(
            {
                "key": pc.binary_join_element_wise('{"id":', pa.array(ids).cast(pa.string()), "}", ""),
                "op": pa.array(["u"] * per),
                "event_time": pa.array(times, pa.timestamp("us", tz="UTC")),
                "source_seq": pa.array(np.arange(i * per, (i + 1) * per)),
                "payload": payload,
                # the source saw each change up to a second after its event time
                "arrival_time": pa.array(times + rng.integers(0, 1_000_000, per), pa.timestamp("us", tz="UTC")),
            },
            schema=CDC_RECORD_SCHEMA,
        )
        batches.append(ChangeBatch(records, offset=str(i)))
    return batches


def checkpoint_times(home: Path, batches, variants: dict[str, dict]) -> dict[str, list[float]]:
    """Seconds per checkpoint for each writer variant, the variants taking turns checkpoint by checkpoint.

    Turn-taking puts the variants of one checkpoint through the same stretch of machine noise,
    so their per-checkpoint ratios can be compared pairwise. The first two variants (the pair
    the goal is about) swap places every checkpoint so that neither goes first more often;
    the rest follow them.
    """
    writers = {name: CdcWriter(load_partfin_catalog(home / name), SPEC, **args) for name, args in variants.items()}
    plain = writers.pop("plain_append", None)
    if plain is not None:
        writers["plain_append"] = PlainAppend(pyiceberg_catalog(home / "plain_append").load_table(SPEC.cdc_identifier))
    times: dict[str, list[float]] = {name: [] for name in writers}
    names = list(writers)
    for i, batch in enumerate(batches):
        for name in (names[:2] if i % 2 == 0 else names[1::-1]) + names[2:]:
            start = time.perf_counter()
            writers[name].write_checkpoint(batch)
            times[name].append(time.perf_counter() - start)
    return times


def paired_ratio(runs: list[dict[str, list[float]]], faster: str, slower: str) -> tuple[float, float, float]:
    """Median and quartiles of time(faster) / time(slower) over all checkpoints of all repeats."""
    ratios = [run[faster][i] / run[slower][i] for run in runs for i in range(len(run[faster]))]
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    return median, q1, q3


def pyiceberg_catalog(home: Path) -> SqlCatalog:
    """The same catalog through PyIceberg's own SqlCatalog, without what partfin's adds (its metadata cache)."""
    config = CatalogConfig.from_env(home)
    return SqlCatalog(CATALOG_NAME, uri=config.sql_uri, warehouse=config.warehouse)


class PlainAppend:
    """PyIceberg's own Table.append of the same rows (the records and their change log, as the writer stores them),
    through PyIceberg's own catalog."""

    def __init__(self, table) -> None:
        self.table = table
        self.schema = table.schema().as_arrow()

    def write_checkpoint(self, batch: ChangeBatch) -> None:
        self.table.append(with_source_log(cdc_records(batch.records), "plain-append").cast(self.schema))


class NoLedger:
    """The writer without its late-data ledger: rows are neither built nor recorded."""

    pending = 0

    def add(self, rows) -> None:
        pass

    def flush(self) -> None:
        pass

    def flush_if_due(self) -> None:
        pass

    def flush_if_expiring(self, expired) -> None:
        pass


class NoLedgerWriter(CdcWriter):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._ledger = NoLedger()
        WITHOUT_LEDGER.add(self.table.location())

    def _record_in_ledger(self, *args) -> None:
        pass


WITHOUT_LEDGER: set[str] = set()
_reconcile = expiry.reconcile


def _reconcile_unless_without_ledger(catalog, table, snapshots=None):
    return 0 if table.location() in WITHOUT_LEDGER else _reconcile(catalog, table, snapshots)


def ledger_overhead(root: Path, batches: list[ChangeBatch], repeats: int) -> dict[str, float]:
    """Total seconds of each variant over all checkpoints, per repeat, variants taking turns per checkpoint."""
    expiry.reconcile = _reconcile_unless_without_ledger  # the baseline's expiry has no ledger to reconcile
    totals: dict[str, list[float]] = {"ledger": [], "none": [], "ledger_each_checkpoint": []}
    for r in range(repeats):
        writers = {
            "ledger": CdcWriter(load_partfin_catalog(root / f"l{r}"), SPEC),
            "none": NoLedgerWriter(load_partfin_catalog(root / f"n{r}"), SPEC),
            "ledger_each_checkpoint": CdcWriter(load_partfin_catalog(root / f"e{r}"), SPEC),
        }
        writers["ledger_each_checkpoint"]._ledger.max_pending = 1
        spent = dict.fromkeys(writers, 0.0)
        names = list(writers)
        for i, batch in enumerate(batches):
            for name in names[i % 3:] + names[: i % 3]:
                start = time.perf_counter()
                writers[name].write_checkpoint(batch)
                spent[name] += time.perf_counter() - start
        for name, writer in writers.items():  # what the writer still holds goes to the ledger when it stops
            start = time.perf_counter()
            writer.close()
            spent[name] += time.perf_counter() - start
            totals[name].append(spent[name])
    return {
        "ratio": statistics.median(w / n for w, n in zip(totals["ledger"], totals["none"])),
        "ratio_each_checkpoint": statistics.median(w / n for w, n in zip(totals["ledger_each_checkpoint"], totals["none"])),
        "ms_per_checkpoint_none": statistics.median(totals["none"]) / len(batches) * 1000,
        "ms_per_checkpoint_ledger": statistics.median(totals["ledger"]) / len(batches) * 1000,
    }


def backlog_latency(root: Path, commits: int, rounds: int = 30) -> dict[str, float]:
    """Row 4: a writer commits `commits` 10-record checkpoints as fast as it goes; then it and a writer of a fresh
    table (10 checkpoints in) commit in turn, `rounds` times each, so that the machine's noise (fsyncs of other
    processes, mostly) hits both alike: the ratio is the median of the per-round ratios."""
    tiny = make_batches(10 * (commits + 2 * rounds + 10), commits + 2 * rounds + 10, seed=1)
    backlog = CdcWriter(load_partfin_catalog(root / "backlog"), SPEC)
    fresh = CdcWriter(load_partfin_catalog(root / "fresh"), SPEC)
    start = time.perf_counter()
    for batch in tiny[:commits]:
        backlog.write_checkpoint(batch)
    backlog_s = time.perf_counter() - start
    for batch in tiny[commits:commits + 10]:
        fresh.write_checkpoint(batch)
    paired: dict[str, list[float]] = {"backlog": [], "fresh": []}
    rest = tiny[commits + 10:]
    for i in range(rounds):
        turns = (("backlog", backlog), ("fresh", fresh)) if i % 2 == 0 else (("fresh", fresh), ("backlog", backlog))
        for j, (name, writer) in enumerate(turns):
            start = time.perf_counter()
            writer.write_checkpoint(rest[2 * i + j])
            paired[name].append(time.perf_counter() - start)
    ratios = [b / f for b, f in zip(paired["backlog"], paired["fresh"])]
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    return {
        f"backlog_checkpoints_per_s_over_{commits}": commits / backlog_s,
        "commit_ms_after_10": statistics.median(paired["fresh"]) * 1000,
        f"commit_ms_after_{commits}": statistics.median(paired["backlog"]) * 1000,
        f"ratio_commit_after_{commits}_vs_10 (goal <= 1.2)": median,
        f"ratio_commit_after_{commits}_vs_10_q1": q1,
        f"ratio_commit_after_{commits}_vs_10_q3": q3,
        "snapshots_retained": len(backlog.table.metadata.snapshots),
    }


def best_of(repeats: int, run) -> float:
    return min(run(i) for i in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=400_000)
    parser.add_argument("--checkpoints", type=int, default=20)
    parser.add_argument("--commits", type=int, default=1000, help="checkpoints for the latency test")
    parser.add_argument("--repeats", type=int, default=16)
    parser.add_argument("--small-checkpoints", type=int, default=60, help="500-record checkpoints per repeat of row 2b")
    parser.add_argument("--ledger-checkpoints", type=int, default=60, help="checkpoints per repeat of the ledger test")
    parser.add_argument("--ledger-repeats", type=int, default=5)
    parser.add_argument("--only-ledger", action="store_true", help="run the ledger overhead test (5) alone")
    args = parse_sizes(parser, smoke=dict(records=4000, checkpoints=4, repeats=1, commits=20, small_checkpoints=3, ledger_checkpoints=3, ledger_repeats=1))
    batches = make_batches(args.records, args.checkpoints)
    results: dict[str, float] = {}

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for per in (20_000, 500):
            overhead = ledger_overhead(root / f"ledger{per}", make_batches(per * args.ledger_checkpoints, args.ledger_checkpoints, 2),
                                       args.ledger_repeats)
            results[f"ratio_ledger_vs_none_{per}_records_per_checkpoint"] = overhead["ratio"]
            results[f"ratio_ledger_each_checkpoint_vs_none_{per}_records_per_checkpoint"] = overhead["ratio_each_checkpoint"]
            results[f"ms_per_checkpoint_none_{per}"] = overhead["ms_per_checkpoint_none"]
            results[f"ms_per_checkpoint_ledger_{per}"] = overhead["ms_per_checkpoint_ledger"]
        if args.only_ledger:
            print(json.dumps({k: round(v, 3) for k, v in results.items()}, indent=2))
            return
        variants = {"with_stats": {}, "none": {"accumulators": [], "processors": []}, "plain_append": {"accumulators": [], "processors": []}}
        runs = [checkpoint_times(root / f"run{r}", batches, variants) for r in range(args.repeats)]
        # events/s from the median time of each checkpoint over the repeats
        seconds = {name: sum(statistics.median(run[name][i] for run in runs) for i in range(args.checkpoints)) for name in variants}
        eps = {name: args.records / s for name, s in seconds.items()}
        results["events_per_s_with_stats_and_watermark"] = eps["with_stats"]
        results["events_per_s_no_extensions"] = eps["none"]
        results["events_per_s_plain_table_append"] = eps["plain_append"]
        # throughput ratio = time(none) / time(with), paired per checkpoint: noise that hits one
        # checkpoint's turn hits both variants, and the median ignores the bursts that do not
        ratio, q1, q3 = paired_ratio(runs, "none", "with_stats")
        results["ratio_stats_vs_none (goal >= 0.98)"] = ratio
        results["ratio_stats_vs_none_q1"] = q1
        results["ratio_stats_vs_none_q3"] = q3
        results["ratio_writer_vs_plain_append"] = paired_ratio(runs, "plain_append", "with_stats")[0]

        small = make_batches(500 * args.small_checkpoints, args.small_checkpoints, seed=4)
        small_runs = [checkpoint_times(root / f"small{r}", small, {"with_stats": {}, "plain_append": {"accumulators": [], "processors": []}})
                      for r in range(args.repeats)]
        ratio, q1, q3 = paired_ratio(small_runs, "with_stats", "plain_append")
        results["ratio_writer_vs_plain_append_500_records (goal <= 1.5)"] = ratio
        results["ratio_writer_vs_plain_append_500_records_q1"] = q1
        results["ratio_writer_vs_plain_append_500_records_q3"] = q3

        column = pc.cast(batches[0].records.column("event_time"), pa.int64()).to_numpy()

        def accumulate(_):
            start = time.perf_counter()
            accumulator = EventTimeAccumulator()
            accumulator.add(batches[0].records)
            accumulator.partial()
            return time.perf_counter() - start

        def sort(_):
            start = time.perf_counter()
            np.sort(column)
            return time.perf_counter() - start

        results["ratio_accumulator_vs_np_sort"] = best_of(20, accumulate) / best_of(20, sort)

        results.update(backlog_latency(root, args.commits))

    print(json.dumps({k: round(v, 3) for k, v in results.items()}, indent=2))


if __name__ == "__main__":
    main()
