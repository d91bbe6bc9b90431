"""The heartbeat fence: a database time T before which every transaction has been delivered.

When the source is caught up it yields an empty batch whose heartbeat is the database clock T,
at most every `heartbeat_interval` seconds (and once at the end of a non-follow run). T means:
every transaction that committed before T has been delivered. That holds because the source
(1) reads T = clock_timestamp(), then takes a transaction id X of its own (a transaction whose
commit timestamp is < T had its id before T, so its id is below X); (2) waits until no
transaction with an id below X is in progress (the oldest running id of a fresh snapshot is
>= X), so each of those has its commit record in the WAL; (3) then reads the WAL insert
position L, waits until L is flushed, and (4) decodes everything up to L. Commit records of all
transactions with commit time < T lie before L, so they have been delivered (or were covered by
the committed offset). If the in-progress transactions do not finish within `heartbeat_settle`
seconds, that round emits no heartbeat (a session idling inside a write transaction holds
heartbeats back).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime

import psycopg

from partfin_assets.sources.postgres.position import lsn_to_int

log = logging.getLogger(__name__)


def flushed_lsn(conn: psycopg.Connection) -> int:
    return lsn_to_int(conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])


def heartbeat_fence(
    conn: psycopg.Connection, settle: float, sleep: Callable[[float], None], monotonic: Callable[[], float]
) -> tuple[datetime, int] | None:
    """(T, L): every transaction committed before T has its commit record before L; None if none settles in time."""
    (clock,) = conn.execute("SELECT clock_timestamp()").fetchone()
    # An id of our own, taken after T: every transaction that committed before T has a smaller one.
    # (pg_current_snapshot() cannot list them: it leaves out running ids at or past its xmax.)
    (ours,) = conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
    deadline = monotonic() + settle
    while True:
        (oldest_running,) = conn.execute("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint").fetchone()
        if oldest_running >= ours:
            break
        if monotonic() >= deadline:
            log.info("no heartbeat this round: transaction %s (older than %s) still in progress", oldest_running, ours)
            return None
        sleep(0.01)
    insert = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0]
    target = lsn_to_int(insert)
    while flushed_lsn(conn) < target:
        if monotonic() >= deadline:
            return None
        sleep(0.01)
    return clock.astimezone(UTC), target
