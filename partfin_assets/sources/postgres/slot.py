"""The logical replication slot, and the commit/advance contract that makes the source exactly once.

The slot is advanced only to positions that are committed in cdc.<table>:

1. `PostgresSource.batches(start_offset, ...)` advances it to `start_offset` (the writer passes
   the offset of its last committed checkpoint), and refuses to run if the slot is already beyond
   it (changes would have been consumed elsewhere).
2. `PostgresSource.on_committed(offset)` advances it to `offset`. `CdcWriter.run` calls it after
   each checkpoint commit that landed, before it asks for the next batch, and so does the
   fan-out's committer step (ingest/fanout.py `commit_plan`) in the run that landed it; batches the writer
   skips (an empty batch whose heartbeat is not due) are never reported, so the slot never
   passes them. A crash between the Iceberg commit and the advance only leaves the slot
   behind; on restart the source skips what the committed offset already covers.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import psycopg

from partfin_assets.sources.postgres.connection import PostgresSourceError, quote_error
from partfin_assets.sources.postgres.position import lsn_to_int, lsn_to_text

log = logging.getLogger(__name__)

PLUGIN = "wal2json"
_SLOT_NAME = re.compile(r"^[a-z0-9_]{1,63}$")


def check_slot_name(name: str) -> str:
    if not _SLOT_NAME.match(name):
        raise PostgresSourceError(
            f"replication slot name {name!r} is not valid (lower-case letters, digits and _, at most 63); pass slot="
        )
    return name


def check_server(conn: psycopg.Connection, slot: str) -> None:
    """The server decodes logically and the role may use replication slots."""
    wal_level = conn.execute("SHOW wal_level").fetchone()[0]
    if wal_level != "logical":
        raise PostgresSourceError(
            f"wal_level is {wal_level!r}; logical decoding needs wal_level=logical "
            "(ALTER SYSTEM SET wal_level = logical; restart)"
        )
    role, allowed = conn.execute(
        "SELECT rolname, rolsuper OR rolreplication FROM pg_roles WHERE rolname = current_user"
    ).fetchone()
    if not allowed:
        raise PostgresSourceError(
            f"role {role} lacks REPLICATION privilege to create or read replication slot {slot!r} "
            f"(ALTER ROLE {role} REPLICATION)"
        )


class ReplicationSlot:
    """One wal2json slot, reached through the source's control connection (autocommit)."""

    def __init__(
        self,
        name: str,
        connection: Callable[[], psycopg.Connection],
        *,
        busy_timeout: float,
        sleep: Callable[[float], None],
        monotonic: Callable[[], float],
    ) -> None:
        self.name = check_slot_name(name)
        self._connection = connection
        self.busy_timeout = busy_timeout
        self._sleep = sleep
        self._monotonic = monotonic
        self.confirmed: int | None = None  # the slot's confirmed_flush_lsn as last seen

    def ensure(self, table: str, expect_existing: bool) -> int:
        """The slot's confirmed_flush_lsn, creating the slot if it is missing."""
        conn = self._connection()
        row = conn.execute(
            "SELECT plugin, database, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            (self.name,),
        ).fetchone()
        database = conn.info.dbname
        if row is not None:
            plugin, slot_db, confirmed = row
            if plugin != PLUGIN or slot_db != database:
                raise PostgresSourceError(
                    f"replication slot {self.name!r} exists for plugin {plugin!r} in database {slot_db!r}; "
                    f"partfin needs a {PLUGIN} slot in {database!r} (pass another slot name, or drop it)"
                )
            self.confirmed = lsn_to_int(confirmed)
            return self.confirmed
        if expect_existing:
            raise PostgresSourceError(
                f"replication slot {self.name!r} does not exist, but cdc.{table} has a committed offset: changes "
                "since then are gone; drop cdc.* for this table to start over, or restore the slot"
            )
        try:
            row = conn.execute(
                "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, %s)", (self.name, PLUGIN)
            ).fetchone()
        except psycopg.errors.UndefinedFile:
            raise PostgresSourceError(
                f"output plugin {PLUGIN} is not installed on the server (Debian: apt-get install postgresql-15-wal2json)"
            ) from None
        except psycopg.errors.InsufficientPrivilege as exc:
            if "output plugin" in str(exc):
                raise PostgresSourceError(
                    f"the server does not allow the wal2json output plugin: add wal2json to output_plugin_libraries "
                    f"in postgresql.conf (PostgreSQL 15.20+): {quote_error(exc)}"
                ) from None
            raise PostgresSourceError(
                f"role lacks REPLICATION privilege to create slot {self.name!r}: {quote_error(exc)}"
            ) from None
        except psycopg.errors.ConfigurationLimitExceeded as exc:
            raise PostgresSourceError(f"cannot create slot {self.name!r}: {quote_error(exc)} (max_replication_slots)") from None
        except psycopg.errors.DuplicateObject:
            return self.ensure(table, expect_existing=True)  # created concurrently
        log.info("created logical replication slot %s (%s) in database %s at %s", self.name, PLUGIN, database, row[0])
        self.confirmed = lsn_to_int(row[0])
        return self.confirmed

    def advance(self, target: int) -> None:
        """Move the slot to `target` (a committed position); never backwards."""
        conn = self._connection()
        if self.confirmed is None:
            self.confirmed = self._read_confirmed(conn)
        if target <= self.confirmed:
            return
        row = self.when_free(
            lambda: conn.execute(
                "SELECT end_lsn::text FROM pg_replication_slot_advance(%s, %s::pg_lsn)", (self.name, lsn_to_text(target))
            ).fetchone()
        )
        self.confirmed = max(self.confirmed, lsn_to_int(row[0]))

    def _read_confirmed(self, conn: psycopg.Connection) -> int:
        row = conn.execute(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (self.name,)
        ).fetchone()
        if row is None:
            raise PostgresSourceError(f"replication slot {self.name!r} disappeared")
        return lsn_to_int(row[0])

    def when_free(self, call: Callable[[], Any]) -> Any:
        """Run a slot function, waiting while a killed predecessor's backend still holds the slot."""
        deadline = self._monotonic() + self.busy_timeout
        while True:
            try:
                return call()
            except psycopg.errors.ObjectInUse as exc:
                if self._monotonic() >= deadline:
                    raise PostgresSourceError(
                        f"replication slot {self.name!r} stays in use by another process: {quote_error(exc)}"
                    ) from None
                self._sleep(0.2)
