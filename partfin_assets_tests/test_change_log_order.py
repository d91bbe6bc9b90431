"""Order within one source: the change log's own order (file position, LSN) decides which change
of a key is the latest, not event time; a source clock that steps back (a failover, an NTP step) must not make
a later change lose. As users meet it: `partfin ingest` and `partfin upsert` as real processes."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import psycopg
import pytest

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.tables import read_base
from partfin_assets_tests.scenario_helpers import append_lines, change, ms, partfin

T = ms("2026-11-01T10:00:00Z")


def base_rows(home) -> dict[int, str]:
    rows = read_base(load_partfin_catalog(home), "orders")
    return dict(zip(rows.column("id").to_pylist(), rows.column("status").to_pylist()))


def ingest_and_upsert(home, source: str, *extra: str) -> None:
    for args in (("ingest", "--table", "orders", "--source", source, *extra), ("upsert", "--table", "orders")):
        result = partfin(home, *args)
        assert result.returncode == 0, result.stderr


def test_file_position_orders_changes_when_the_source_clock_steps_back(tmp_path):
    """Order 1 is created at 10:00:05, then the source clock steps back 3 s and the next change of order 1 is
    stamped 10:00:02, a third (next run) 10:00:01. Before: base kept `created` for good (both later changes lost);
    order 2, whose clock did not step, shows the same file going through normally."""
    path, home = tmp_path / "orders.jsonl", tmp_path / "home"
    append_lines(path, [
        change("c", 1, T + 5_000, status="created", wrapped=True),
        change("c", 2, T + 5_100, status="created", wrapped=True),
        change("u", 1, T + 2_000, status="paid", wrapped=True),  # the clock stepped back 3 s
        change("u", 2, T + 6_000, status="paid", wrapped=True),
    ])
    source = f"debezium:{path}"
    ingest_and_upsert(home, source, "--primary-key", "id")
    first = base_rows(home)
    append_lines(path, [change("u", 1, T + 1_000, status="shipped", wrapped=True)])  # a later run, the clock still behind
    ingest_and_upsert(home, source)
    second = base_rows(home)
    print(f"clock step back (file): after one upsert {first}, after the next {second}")
    assert first == {1: "paid", 2: "paid"}
    assert second == {1: "shipped", 2: "paid"}


@pytest.mark.timeout(300)
def test_lsn_orders_changes_when_the_postgres_clock_steps_back(tmp_path):
    """A real PostgreSQL whose clock steps back 30 s between two updates of order 1 (commit timestamps go back,
    the WAL goes on). Before: the update committed later (higher LSN) lost to the earlier one."""
    from partfin_assets_tests.postgres_cluster import throwaway_cluster

    clock_dir = Path(tempfile.mkdtemp(prefix="partfin-clock-"))  # the server (user postgres) must read it
    clock_dir.chmod(0o755)
    clock = clock_dir / "faketime"
    clock.write_text("+0\n")
    clock.chmod(0o644)
    home = tmp_path / "home"
    try:
        with throwaway_cluster(clock_file=clock) as cluster:
            dsn = cluster.dsn()
            source = f"postgres:{dsn}"
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("CREATE TABLE orders (id bigint PRIMARY KEY, user_id bigint, amount float8, status text)")
                assert partfin(home, "ingest", "--table", "orders", "--source", source).returncode == 0  # the slot
                conn.execute("INSERT INTO orders VALUES (1, 1, 10, 'created'), (2, 2, 20, 'created')")
                clock.write_text("-30s\n")  # failover to a server whose clock is behind / an NTP step
                conn.execute("UPDATE orders SET status = 'paid' WHERE id = 1")
            ingest_and_upsert(home, source)
            rows = base_rows(home)
    finally:
        shutil.rmtree(clock_dir, ignore_errors=True)
    cdc = load_partfin_catalog(home).load_table("cdc.orders").scan(row_filter="key == '{\"id\":1}'").to_arrow()
    (created, paid) = sorted(zip(cdc.column("source_seq").to_pylist(), cdc.column("event_time").to_pylist(), cdc.column("op").to_pylist()))
    assert paid[1] < created[1], "the update's commit time must be earlier (the clock stepped back)"
    print(f"clock step back (postgres): commit times {created[1]} then {paid[1]}; base {rows}")
    assert rows == {1: "paid", 2: "created"}



@pytest.mark.timeout(300)
def test_partition_offset_orders_changes_when_the_source_clock_steps_back(tmp_path, kafka_cluster):
    """Debezium over Kafka (the mock cluster, real `partfin ingest` processes): a key's changes share a partition,
    whose offsets are its log. Order 1's second change is stamped 3 s before its first, a third (next run) 4 s
    before; order 2, on another partition, goes through normally."""
    from partfin_assets_tests.debezium_messages import DebeziumMessage
    from partfin_assets_tests.test_kafka_source import TOPIC, kafka_spec, produce_to

    def message(op: str, key: int, ts_ms: int, status: str) -> DebeziumMessage:
        return DebeziumMessage(f'{{"id":{key}}}'.encode(), change(op, key, ts_ms, status=status, wrapped=True).encode(), ts_ms)

    kafka_cluster.create_topic(TOPIC, 2)
    home, source = tmp_path / "home", kafka_spec(kafka_cluster)
    produce_to(kafka_cluster, 0, [message("c", 1, T + 5_000, "created"), message("u", 1, T + 2_000, "paid")])
    produce_to(kafka_cluster, 1, [message("c", 2, T + 5_100, "created"), message("u", 2, T + 6_000, "paid")])
    ingest_and_upsert(home, source, "--primary-key", "id")
    first = base_rows(home)
    produce_to(kafka_cluster, 0, [message("u", 1, T + 1_000, "shipped")])
    ingest_and_upsert(home, source, "--primary-key", "id")
    second = base_rows(home)
    print(f"clock step back (kafka): after one upsert {first}, after the next {second}")
    assert first == {1: "paid", 2: "paid"}
    assert second == {1: "shipped", 2: "paid"}
    logs = set(load_partfin_catalog(home).load_table("cdc.orders").scan().to_arrow().column("source_log").to_pylist())
    assert logs == {f"orders-writer/{TOPIC}-0", f"orders-writer/{TOPIC}-1"}
