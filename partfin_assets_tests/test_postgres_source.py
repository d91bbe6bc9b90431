"""Live CDC from PostgreSQL (wal2json): a real workload lands once, heartbeats, misconfigurations, CLI, Dagster.

Expectations are built independently of PostgresSource: an "audit" wal2json slot created
next to the source's slot is read with plain SQL and parsed here, and the workload
records what it committed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from datetime import datetime

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.model import summary_keys as K
from partfin_assets.model.timeutil import parse_iso, to_us
from partfin_assets.sources.postgres import PostgresSource, PostgresSourceError, lsn_to_int
from partfin_assets.sources.registry import make_source

TABLE_DDL = """
CREATE TABLE orders (
    id bigint PRIMARY KEY,
    amount numeric(12, 2),
    status text,
    placed timestamptz,
    due date
)
"""
AUDIT_OPTIONS = ("format-version", "2", "include-timestamp", "1", "include-lsn", "1", "add-tables", "public.orders")
OPS = {"I": "c", "U": "u", "D": "d"}


@pytest.fixture
def database(postgres):
    """A fresh database; its replication slots (names are cluster-wide) are dropped afterwards."""
    name = f"pf_{uuid.uuid4().hex[:10]}"
    postgres.create_database(name)
    yield name
    drop_slots(postgres, name)


def drop_slots(postgres, database: str) -> None:
    with psycopg.connect(postgres.dsn(), autocommit=True) as conn:
        for (slot,) in conn.execute("SELECT slot_name FROM pg_replication_slots WHERE database = %s", (database,)).fetchall():
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))


def connect(postgres, database: str) -> psycopg.Connection:
    return psycopg.connect(postgres.dsn(database), autocommit=True)


def create_slots(conn, *slots: str) -> None:
    for slot in slots:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'wal2json')", (slot,))


def audit_rows(conn, slot: str = "audit") -> Counter:
    """(key, op, event time us, source_seq) of every public.orders change, parsed here from raw wal2json."""
    conn.execute("SET TimeZone = 'UTC'")
    rows = conn.execute(
        "SELECT lsn::text, data FROM pg_logical_slot_peek_changes(%s, NULL, NULL, " + ", ".join(["%s"] * len(AUDIT_OPTIONS)) + ")",
        (slot, *AUDIT_OPTIONS),
    ).fetchall()
    expected: Counter = Counter()
    seq = 0
    for lsn, data in rows:
        change = json.loads(data)
        if change["action"] not in OPS:
            continue
        when = to_us(datetime.fromisoformat(change["timestamp"]))
        new = {c["name"]: c["value"] for c in change.get("columns", [])}
        old = {c["name"]: c["value"] for c in change.get("identity", [])}
        entries = []
        if change["action"] == "D":
            entries.append((old["id"], "d"))
        elif change["action"] == "U" and old and old["id"] != new["id"]:
            entries += [(old["id"], "d"), (new["id"], "c")]
        else:
            entries.append((new["id"], OPS[change["action"]]))
        for key, op in entries:
            seq = max(seq + 1, lsn_to_int(lsn))
            expected[(f'{{"id":{key}}}', op, when, seq)] += 1
    return expected


def written_rows(table: pa.Table) -> Counter:
    times = pc.cast(table.column("event_time"), pa.int64()).to_pylist()
    return Counter(zip(table.column("key").to_pylist(), table.column("op").to_pylist(), times, table.column("source_seq").to_pylist()))


def committed_offset(catalog, writer_id: str = "orders-writer") -> dict | None:
    from partfin_assets.iceberg.history import last_writer_position

    position = last_writer_position(catalog.load_table("cdc.orders").metadata, writer_id)
    return json.loads(position.source_offset) if position and position.source_offset else None


def slot_confirmed(conn, slot: str) -> int:
    return lsn_to_int(conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()[0])


def workload_part_one(conn, log: Counter) -> None:
    conn.execute("CREATE TABLE other (id int PRIMARY KEY)")  # changes of other tables are not ours
    for i in range(1, 21):  # single-row transactions
        conn.execute("INSERT INTO orders VALUES (%s, %s, 'new', now(), '2026-11-01')", (i, f"{i}.50"))
        log[(i, "c")] += 1
    with conn.transaction():  # one multi-row transaction mixing operations and tables
        conn.execute("UPDATE orders SET status = 'paid', amount = amount + 1 WHERE id <= 5")
        conn.execute("INSERT INTO other VALUES (1)")
        conn.execute("DELETE FROM orders WHERE id = 20")
        log.update({(i, "u"): 1 for i in range(1, 6)})
        log[(20, "d")] += 1
    with conn.transaction():  # larger than one batch (max_records=25 below)
        for i in range(100, 180):
            conn.execute("INSERT INTO orders VALUES (%s, 1, 'bulk', now(), NULL)", (i,))
            log[(i, "c")] += 1
    try:
        with conn.transaction():  # rolled back: must never appear
            conn.execute("INSERT INTO orders VALUES (999, 1, 'ghost', now(), NULL)")
            raise RuntimeError("rollback")
    except RuntimeError:
        pass


def workload_part_two(conn, log: Counter) -> None:
    conn.execute("UPDATE orders SET id = 1000 WHERE id = 1")  # a key change: delete + create
    log.update({(1, "d"): 1, (1000, "c"): 1})
    with conn.transaction():
        conn.execute("DELETE FROM orders WHERE id BETWEEN 100 AND 139")
        conn.execute("UPDATE orders SET status = 'shipped' WHERE id BETWEEN 140 AND 150")
        log.update({(i, "d"): 1 for i in range(100, 140)})
        log.update({(i, "u"): 1 for i in range(140, 151)})
    for i in range(2, 8):
        conn.execute("UPDATE orders SET status = 'delivered' WHERE id = %s", (i,))
        log[(i, "u")] += 1


def ingest(catalog, dsn: str, max_records: int = 25, **options) -> list:
    source = PostgresSource(dsn, "orders", **options)
    writer = CdcWriter(catalog, source.table_spec(), heartbeat_interval_s=0)
    try:
        return list(writer.run(source, max_records=max_records))
    finally:
        writer.close()


def test_workload_lands_exactly_once_with_commit_times_and_resumes(postgres, database, catalog):
    dsn = postgres.dsn(database)
    log: Counter = Counter()
    with connect(postgres, database) as conn:
        conn.execute(TABLE_DDL)
        create_slots(conn, "partfin_orders", "audit")
        workload_part_one(conn, log)

        first = ingest(catalog, dsn)
        assert sum(r.records for r in first) == sum(log.values())
        assert any(json.loads(r.summary[K.SOURCE_OFFSET]).get("n") for r in first)  # a transaction split across batches
        offset = committed_offset(catalog)
        assert "n" not in offset and slot_confirmed(conn, "partfin_orders") == lsn_to_int(offset["lsn"])

        workload_part_two(conn, log)
        second = ingest(catalog, dsn)
        assert sum(r.records for r in second) == 2 + 40 + 11 + 6
        offset = committed_offset(catalog)
        assert slot_confirmed(conn, "partfin_orders") == lsn_to_int(offset["lsn"])
        assert ingest(catalog, dsn)[-1].records == 0  # nothing new: a heartbeat only

        expected = audit_rows(conn)
        commit_times = {r[2] for r in expected}

    table = catalog.load_table("cdc.orders").scan().to_arrow()
    written = written_rows(table)
    assert written == expected  # key, op, commit time and position: every change exactly once
    assert Counter((json.loads(k)["id"], op) for k, op in zip(table.column("key").to_pylist(), table.column("op").to_pylist())) == log
    assert {t for _, _, t, _ in written} == commit_times and len(commit_times) >= 25
    by_seq = table.sort_by("source_seq").to_pylist()
    assert [r["event_time"] for r in by_seq] == sorted(r["event_time"] for r in by_seq)  # seq follows commit order
    first_row = next(r for r in by_seq if r["key"] == '{"id":3}' and r["op"] == "c")
    payload = json.loads(first_row["payload"])
    assert payload["amount"] == "3.50" and payload["due"] == "2026-11-01" and payload["placed"].endswith("Z")
    assert parse_iso(payload["placed"]) <= first_row["event_time"]


def test_heartbeat_waits_for_transactions_in_progress(postgres, database, catalog):
    dsn = postgres.dsn(database)
    with connect(postgres, database) as conn, connect(postgres, database) as other:
        conn.execute(TABLE_DDL)
        list(PostgresSource(dsn, "orders").batches(None, 10))  # creates the slot
        other.execute("BEGIN")
        other.execute("INSERT INTO orders VALUES (7, 1, 'open', now(), NULL)")  # holds an xid
        held = list(PostgresSource(dsn, "orders", heartbeat_settle=0.3).batches(None, 10))
        assert all(b.heartbeat is None for b in held) and all(b.records.num_rows == 0 for b in held)
        other.execute("COMMIT")
        batches = list(PostgresSource(dsn, "orders").batches(None, 10))
    (change,) = [b for b in batches if b.records.num_rows]
    assert batches[-1].heartbeat is not None
    assert to_us(batches[-1].heartbeat) >= pc.cast(change.records.column("event_time"), pa.int64())[0].as_py()


# --------------------------------------------------------------------------- misconfigurations


def test_wal_level_replica_is_a_clear_error():
    from partfin_assets_tests.postgres_cluster import throwaway_cluster

    with throwaway_cluster(logical=False) as cluster:
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            conn.execute(TABLE_DDL)
        with pytest.raises(PostgresSourceError, match=r"wal_level is 'replica'; logical decoding needs wal_level=logical"):
            list(PostgresSource(cluster.dsn(), "orders").batches(None, 10))


def test_server_that_does_not_list_wal2json_as_an_output_plugin_is_a_clear_cli_error(tmp_path):
    from partfin_assets_tests.postgres_cluster import _knows_setting, postgres_bindir, throwaway_cluster

    if not _knows_setting(postgres_bindir(), "output_plugin_libraries"):
        pytest.skip("this PostgreSQL loads any output plugin (output_plugin_libraries came with 15.20)")
    with throwaway_cluster(settings=["output_plugin_libraries=pgoutput,test_decoding"]) as cluster:
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            conn.execute(TABLE_DDL)
        result = partfin(tmp_path, "ingest", "--table", "orders", "--source", f"postgres:{cluster.dsn()}")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "add wal2json to output_plugin_libraries" in result.stderr


def test_table_without_key_missing_table_and_role_without_replication(postgres, database):
    dsn = postgres.dsn(database)
    role = f"noreplication_{uuid.uuid4().hex[:6]}"
    with connect(postgres, database) as conn:
        conn.execute("CREATE TABLE events (id bigint, note text)")
        conn.execute(TABLE_DDL)
        conn.execute(f"CREATE ROLE {role} LOGIN")
        with pytest.raises(PostgresSourceError, match=r"table public\.events has no primary key and REPLICA IDENTITY DEFAULT: deletes cannot be keyed"):
            PostgresSource(dsn, "events").table_spec()
        with pytest.raises(PostgresSourceError, match=r"REPLICA IDENTITY DEFAULT, which does not log key column"):
            PostgresSource(dsn, "events", primary_key=("id",)).table_spec()
        conn.execute("ALTER TABLE events REPLICA IDENTITY FULL")
        assert PostgresSource(dsn, "events", primary_key=("id",)).table_spec().primary_key == ("id",)
        with pytest.raises(PostgresSourceError, match=r"table public\.missing does not exist"):
            PostgresSource(dsn, "missing").table_spec()
        role_dsn = f"host={postgres.host} port={postgres.port} user={role} dbname={database}"
        with pytest.raises(PostgresSourceError, match=rf"role {role} lacks REPLICATION privilege to create or read replication slot 'partfin_orders'"):
            list(PostgresSource(role_dsn, "orders").batches(None, 10))


def test_slot_dropped_or_moved_past_the_committed_offset(postgres, database, catalog):
    dsn = postgres.dsn(database)
    with connect(postgres, database) as conn:
        conn.execute(TABLE_DDL)
        ingest(catalog, dsn)
        conn.execute("INSERT INTO orders VALUES (1, 1, 'x', now(), NULL)")
        offset = committed_offset(catalog)
        conn.execute("SELECT pg_replication_slot_advance('partfin_orders', pg_current_wal_lsn())")  # consumed elsewhere
        with pytest.raises(PostgresSourceError, match="beyond the committed offset"):
            list(PostgresSource(dsn, "orders").batches(json.dumps(offset), 10))
        conn.execute("SELECT pg_drop_replication_slot('partfin_orders')")
        with pytest.raises(PostgresSourceError, match="does not exist, but cdc.orders has a committed offset"):
            list(PostgresSource(dsn, "orders").batches(json.dumps(offset), 10))


# --------------------------------------------------------------------------- CLI and Dagster


def partfin(home, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARTFIN_")}
    env["PARTFIN_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "partfin_assets.cli", *args], env=env, capture_output=True, text=True, timeout=120)


def test_cli_ingest_from_postgres_declares_the_table_from_the_database(postgres, database, tmp_path):
    with connect(postgres, database) as conn:
        conn.execute("CREATE SCHEMA sales")
        conn.execute(TABLE_DDL.replace("orders", "sales.orders"))
        conn.execute("CREATE TABLE events (id bigint, note text)")
        source = f"postgres:{postgres.dsn(database)}#sales.orders,slot=cli_orders"
        assert partfin(tmp_path, "ingest", "--table", "orders", "--source", source).returncode == 0
        conn.execute("INSERT INTO sales.orders VALUES (1, 2.5, 'x', now(), '2026-11-02')")
        result = partfin(tmp_path, "ingest", "--table", "orders", "--source", source)
        assert result.returncode == 0, result.stderr
        bad = partfin(tmp_path, "ingest", "--table", "events", "--source", f"postgres:{postgres.dsn(database)}")
    catalog = load_partfin_catalog(tmp_path)
    table = catalog.load_table("cdc.orders")
    assert json.loads(table.properties["partfin.columns"]) == {
        "id": "int64", "amount": "decimal128(12, 2)", "status": "string", "placed": "timestamp[us, tz=UTC]", "due": "date32[day]",
    }  # fmt: skip
    assert table.properties["partfin.primary-key"] == "id"
    assert table.scan().to_arrow().column("key").to_pylist() == ['{"id":1}']
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "partfin: error: table public.events has no primary key" in bad.stderr


def test_dagster_source_resource_opens_a_postgres_source(postgres):
    from partfin_assets.defs.resources import CdcSourceResource
    from partfin_assets.defs.tables import TABLES

    spec_text = f"postgres:{postgres.dsn('postgres')}#public.orders,heartbeat_interval=2s"
    source = CdcSourceResource(source=spec_text).open(TABLES[0])
    assert isinstance(source, PostgresSource)
    assert (source.schema, source.table, source.slot, source.heartbeat_interval) == ("public", "orders", "partfin_orders", 2.0)
    assert isinstance(make_source(spec_text, TABLES[0].spec), PostgresSource)
