"""kill -9 of `partfin ingest --source postgres:DSN --follow` while a workload commits: every committed change lands once.

The slot's confirmed_flush_lsn is watched throughout and must never pass the offset
committed in cdc.orders (the slot moves only after the Iceberg commit that holds the changes).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import psycopg
import pyarrow as pa

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.history import last_writer_position
from partfin_assets.sources.postgres import lsn_to_int
from partfin_assets_tests.test_postgres_source import (  # noqa: F401  (database is a fixture)
    TABLE_DDL,
    audit_rows,
    connect,
    create_slots,
    database,
    written_rows,
)

KILLS = 10
CHECKPOINT_RECORDS = 40


class Workload(threading.Thread):
    """Random transactions until stopped; `log` counts the (id, op) of every committed change."""

    def __init__(self, dsn: str, seed: int) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.log: Counter = Counter()
        self.transactions = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self.stop.is_set():
                    self.transaction(conn)
                    time.sleep(self.rng.uniform(0, 0.01))
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def transaction(self, conn) -> None:
        rng = self.rng
        changes: Counter = Counter()
        big = rng.random() < 0.05  # now and then larger than one checkpoint
        statements = rng.randint(CHECKPOINT_RECORDS + 5, 2 * CHECKPOINT_RECORDS) if big else rng.randint(1, 6)
        rollback = rng.random() < 0.05
        try:
            with conn.transaction():
                for _ in range(statements):
                    key = rng.randint(1, 400)
                    kind = rng.random()
                    if kind < 0.5:
                        cursor = conn.execute(
                            "INSERT INTO orders VALUES (%s, %s, 'new', now(), NULL) ON CONFLICT (id) DO NOTHING",
                            (key, rng.randint(1, 10_000) / 100),
                        )
                        op = "c"
                    elif kind < 0.8:
                        cursor = conn.execute("UPDATE orders SET amount = amount + 1, status = 'paid' WHERE id = %s", (key,))
                        op = "u"
                    else:
                        cursor = conn.execute("DELETE FROM orders WHERE id = %s", (key,))
                        op = "d"
                    if cursor.rowcount:
                        changes[(key, op)] += 1
                if rollback:
                    raise _Rollback
        except _Rollback:
            return
        self.log.update(changes)
        self.transactions += 1


class _Rollback(Exception):
    pass


def ingest(home, dsn: str, *, follow: bool, crash_at: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARTFIN_")}
    env["PARTFIN_HOME"] = str(home)
    if crash_at:
        env["PARTFIN_CRASH_AT"] = crash_at
    command = [sys.executable, "-m", "partfin_assets.cli", "ingest", "--table", "orders", "--source", f"postgres:{dsn}",
               "--checkpoint-records", str(CHECKPOINT_RECORDS)] + (["--follow"] if follow else [])  # fmt: skip
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def committed_advance_point(home) -> int | None:
    """Where the committed offset allows the slot to be: its commit LSN, or `safe` inside a transaction."""
    if not (home / "catalog.db").exists():
        return None
    catalog = load_partfin_catalog(home)
    if not catalog.table_exists("cdc.orders"):
        return None
    position = last_writer_position(catalog.load_table("cdc.orders").metadata, "orders-writer")
    if position is None:
        return None
    offset = json.loads(position.source_offset)
    return lsn_to_int(offset["safe"] if "n" in offset else offset["lsn"])


def test_kill_minus_nine_while_a_workload_commits(postgres, database, tmp_path):
    home = tmp_path / "home"
    dsn = postgres.dsn(database)
    rng = random.Random(20261129)
    with connect(postgres, database) as conn:
        conn.execute(TABLE_DDL)
        create_slots(conn, "partfin_orders", "audit")
        slot_start = lsn_to_int(conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'partfin_orders'").fetchone()[0])
        observations = 0

        def observe() -> None:
            nonlocal observations
            # slot first, committed offset second: the offset only grows, so this order cannot flag a false alarm
            confirmed = lsn_to_int(conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'partfin_orders'").fetchone()[0])
            committed = committed_advance_point(home)
            assert confirmed <= (committed if committed is not None else slot_start), "slot passed the committed offset"
            observations += 1

        workload = Workload(dsn, seed=7)
        workload.start()
        kills = Counter()
        try:
            for i in range(KILLS):
                moment = ["timed", "after-files", "after-commit"][i % 3]
                crash_at = f"{moment}:{rng.randint(1, 3)}" if moment != "timed" else None
                process = ingest(home, dsn, follow=True, crash_at=crash_at)
                deadline = time.monotonic() + (rng.uniform(1.0, 4.0) if moment == "timed" else 60.0)
                while process.poll() is None and time.monotonic() < deadline:
                    observe()
                    time.sleep(0.05)
                crashed_itself = process.poll() is not None
                if not crashed_itself:
                    process.send_signal(signal.SIGKILL)
                _, stderr = process.communicate(timeout=60)
                assert process.returncode == -signal.SIGKILL, stderr.decode()
                kills[moment if crashed_itself or moment == "timed" else "timed"] += 1
                observe()
        finally:
            workload.stop.set()
            workload.join(timeout=30)
        assert workload.error is None, workload.error
        assert workload.transactions > 100

        final = ingest(home, dsn, follow=False)
        _, stderr = final.communicate(timeout=120)
        assert final.returncode == 0, stderr.decode()
        observe()
        expected = audit_rows(conn)
        confirmed = lsn_to_int(conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'partfin_orders'").fetchone()[0])

    table = load_partfin_catalog(home).load_table("cdc.orders").scan().to_arrow()
    written = written_rows(table)
    assert sum(expected.values()) > 500 and observations > 50
    assert kills["after-files"] + kills["after-commit"] >= 4, kills  # most crash points were reached
    assert written == expected  # every committed change exactly once: key, op, commit time, position
    ids_ops = Counter(zip((json.loads(k)["id"] for k in table.column("key").to_pylist()), table.column("op").to_pylist()))
    assert ids_ops == workload.log  # and exactly what the workload committed
    assert confirmed == committed_advance_point(home)  # caught up: the slot sits at the committed offset
    assert table.schema.field("event_time").type == pa.timestamp("us", tz="UTC")
