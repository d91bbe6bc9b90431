"""PostgreSQL logical decoding vs a Debezium file: events/s into cdc.<table>, both measured in the same run.

    .venv/bin/python bench/bench_postgres_source.py [--events 200000] [--txn-rows 100] [--checkpoint-records 10000] [--repeat 3]

Starts a throwaway PostgreSQL 15 cluster (wal_level=logical, wal2json), runs a workload of
inserts, updates and deletes in transactions of --txn-rows rows, then:

1. PostgresSource -> CdcWriter into cdc.orders (slot peek/advance, one commit per checkpoint);
2. the same events written as a Debezium JSON-lines file -> DebeziumFileSource -> CdcWriter;
3. the two sources alone (no writer), to show where the time goes.

Each is run --repeat times, interleaved (a fresh slot per postgres run); prints the median
events/s of each and the ratio postgres / debezium (end to end and source only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import psycopg
import pyarrow as pa
import pyarrow.compute as pc

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.sources.debezium import DebeziumFileSource
from partfin_assets.sources.postgres import PostgresSource
from partfin_assets_tests.postgres_cluster import throwaway_cluster
from _sizes import parse_sizes

DDL = "CREATE TABLE orders (id bigint PRIMARY KEY, amount numeric(12, 2), status text, placed timestamptz)"


def workload(dsn: str, events: int, txn_rows: int) -> None:
    """Inserts, then updates and deletes of what was inserted: about `events` changes in all."""
    inserts = events // 2
    updates = events * 3 // 10
    deletes = events - inserts - updates
    with psycopg.connect(dsn, autocommit=True) as conn:
        for start in range(0, inserts, txn_rows):
            conn.execute(
                "INSERT INTO orders SELECT g, g %% 1000 + 0.25, 'new', now() FROM generate_series(%s::bigint, %s::bigint) g",
                (start + 1, min(start + txn_rows, inserts)),
            )
        for start in range(0, updates, txn_rows):
            conn.execute(
                "UPDATE orders SET status = 'paid', amount = amount + 1 WHERE id BETWEEN %s AND %s",
                (start + 1, min(start + txn_rows, updates)),
            )
        for start in range(0, deletes, txn_rows):
            conn.execute("DELETE FROM orders WHERE id BETWEEN %s AND %s", (inserts - start - txn_rows + 1, inserts - start))


def to_debezium_file(records: pa.Table, path: Path) -> None:
    """The same events as Debezium envelopes (schemaless), one per line."""
    times_ms = (pc.cast(records.column("event_time"), pa.int64()).to_numpy() // 1000).tolist()
    with path.open("w") as out:
        for key, op, ts_ms, payload in zip(
            records.column("key").to_pylist(), records.column("op").to_pylist(), times_ms, records.column("payload").to_pylist()
        ):
            image = json.loads(payload) if payload is not None else None
            envelope = {
                "op": op,
                "source": {"ts_ms": ts_ms, "connector": "postgresql"},
                "before": json.loads(key) if op == "d" else None,
                "after": image,
            }
            out.write(json.dumps(envelope, separators=(",", ":")) + "\n")


def run_writer(home: Path, spec, source, checkpoint_records: int) -> tuple[int, float]:
    writer = CdcWriter(load_partfin_catalog(home), spec)
    start = time.perf_counter()
    records = sum(r.records for r in writer.run(source, max_records=checkpoint_records))
    elapsed = time.perf_counter() - start
    writer.close()
    return records, elapsed


def run_source(source, checkpoint_records: int) -> tuple[int, float]:
    """Read every batch; a source with on_committed is told each offset, as CdcWriter.run does."""
    on_committed = getattr(source, "on_committed", None)
    start = time.perf_counter()
    records = 0
    for batch in source.batches(None, checkpoint_records):
        records += batch.records.num_rows
        if on_committed is not None:
            on_committed(batch.offset)
    return records, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--txn-rows", type=int, default=100)
    parser.add_argument("--checkpoint-records", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs of each; medians are reported")
    args = parse_sizes(parser, smoke=dict(events=200, txn_rows=50, checkpoint_records=100, repeat=1))

    end_to_end: dict[str, list[float]] = {"postgres": [], "debezium": []}
    source_only: dict[str, list[float]] = {"postgres": [], "debezium": []}
    counts = set()
    with throwaway_cluster() as cluster, tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        cluster.create_database("bench")
        dsn = cluster.dsn("bench")
        slots = [f"bench_{kind}_{i}" for i in range(args.repeat) for kind in ("writer", "source")]
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(DDL)
            for slot in slots:
                conn.execute("SELECT pg_create_logical_replication_slot(%s, 'wal2json')", (slot,))
        t0 = time.perf_counter()
        workload(dsn, args.events, args.txn_rows)
        print(f"workload: {args.events:,} changes in {args.txn_rows}-row transactions, {time.perf_counter() - t0:.1f}s")
        spec = PostgresSource(dsn, "orders").table_spec()
        # the file holds the writer's payloads, decimals as exact text: declared so (a Debezium decimal's default is base64)
        file_spec = dataclasses.replace(spec, decimal_encodings={n: "numeric" for n, t in spec.columns.items() if pa.types.is_decimal(t)})
        path = tmp_path / "orders.jsonl"
        for i in range(args.repeat):
            home = tmp_path / f"pg{i}"
            records, seconds = run_writer(home, spec, PostgresSource(dsn, "orders", slot=f"bench_writer_{i}"), args.checkpoint_records)
            counts.add(records)
            end_to_end["postgres"].append(records / seconds)
            if i == 0:  # the same events, as the writer stored them, as a Debezium file
                to_debezium_file(load_partfin_catalog(home).load_table("cdc.orders").scan().to_arrow().sort_by("source_seq"), path)
            records, seconds = run_writer(tmp_path / f"dbz{i}", file_spec, DebeziumFileSource(path, spec=file_spec), args.checkpoint_records)
            counts.add(records)
            end_to_end["debezium"].append(records / seconds)
            records, seconds = run_source(PostgresSource(dsn, "orders", slot=f"bench_source_{i}"), args.checkpoint_records)
            counts.add(records)
            source_only["postgres"].append(records / seconds)
            records, seconds = run_source(DebeziumFileSource(path, spec=file_spec), args.checkpoint_records)
            counts.add(records)
            source_only["debezium"].append(records / seconds)
    assert len(counts) == 1, counts
    (events,) = counts
    for title, rates in (
        (f"end to end into cdc.orders ({events:,} events, {args.checkpoint_records:,} per checkpoint)", end_to_end),
        ("source only (no writer; the postgres slot is advanced after every batch)", source_only),
    ):
        pg, dbz = statistics.median(rates["postgres"]), statistics.median(rates["debezium"])
        print(f"{title}, median of {args.repeat}:")
        print(f"  postgres logical decoding  {pg:>10,.0f} events/s   runs: {', '.join(f'{r:,.0f}' for r in rates['postgres'])}")
        print(f"  debezium file              {dbz:>10,.0f} events/s   runs: {', '.join(f'{r:,.0f}' for r in rates['debezium'])}")
        print(f"  ratio postgres/debezium    {pg / dbz:.2f}")


if __name__ == "__main__":
    main()
