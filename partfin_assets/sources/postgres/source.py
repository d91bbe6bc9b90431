"""`PostgresSource`: one table's changes as partfin batches, resumable from a committed offset.

It ties the parts together: the table's description (table.py), the slot (slot.py: advanced
only to committed offsets), the wal2json reader (wal2json.py: decodes up to a WAL position) and
the heartbeat fence (fence.py: when the source is caught up, an empty batch saying up to which
database time everything was delivered).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import psycopg
import pyarrow as pa

from partfin_assets.model.errors import SourceError
from partfin_assets.model.records import CDC_RECORD_SCHEMA, AcknowledgesCommits, CdcSource, ChangeBatch, DiscoversColumns, HoldsConnections
from partfin_assets.model import conninfo
from partfin_assets.model.source_identity import SourceIdentity
from partfin_assets.model.tablespec import TableSpec, type_to_text
from partfin_assets.sources.postgres.connection import PostgresSourceError, connect
from partfin_assets.sources.postgres.fence import flushed_lsn, heartbeat_fence
from partfin_assets.sources.postgres.position import Position, lsn_to_text
from partfin_assets.sources.postgres.slot import ReplicationSlot, check_server
from partfin_assets.sources.postgres.table import TableInfo, read_table_info
from partfin_assets.sources.postgres.wal2json import drain, probe_numbers_as_text

log = logging.getLogger(__name__)


class PostgresSource(CdcSource, AcknowledgesCommits, HoldsConnections, DiscoversColumns):
    """Changes of one PostgreSQL table through a wal2json logical replication slot.

    `table` is `name` or `schema.name` (schema defaults to public); `slot` defaults to
    `partfin_<name>` and is created (logged) if missing. With follow=False the stream ends
    once it has caught up with the WAL position read at its start of each round (with a
    final heartbeat); with follow=True it polls every `poll_interval` seconds forever.
    See position.py for the offset format and slot.py for the commit/advance contract.
    `publication` is accepted for symmetry with pgoutput-based tools and ignored: wal2json
    filters by table (`add-tables`).
    """

    kind = "postgres"

    def __init__(
        self,
        dsn: str,
        table: str,
        slot: str | None = None,
        publication: str | None = None,
        *,
        primary_key: tuple[str, ...] | None = None,
        follow: bool = False,
        heartbeat_interval: float = 10.0,
        heartbeat_settle: float = 5.0,
        poll_interval: float = 0.5,
        slot_busy_timeout: float = 30.0,
        sleep: Callable[[float], None] = time.sleep,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        schema, dot, name = table.rpartition(".")
        self.dsn = dsn
        self.shown_dsn = conninfo.display(dsn)  # read by libpq now: an unreadable DSN fails here, in one line
        self.schema = schema if dot else "public"
        self.table = name
        self._slot = ReplicationSlot(
            slot or f"partfin_{name.lower()}", self._connection, busy_timeout=slot_busy_timeout, sleep=sleep, monotonic=monotonic
        )
        self.slot = self._slot.name
        self.publication = publication
        self.primary_key = tuple(primary_key) if primary_key else None
        self.follow = follow
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_settle = heartbeat_settle
        self.poll_interval = poll_interval
        self._sleep = sleep
        self._monotonic = monotonic
        self._control: psycopg.Connection | None = None  # autocommit connection: checks, slot, clock, advance
        self._info: TableInfo | None = None
        self._identity: SourceIdentity | None = None

    def identity(self, offset: str | None) -> SourceIdentity:
        """The server (system identifier), database, table and slot: the log a position is in.

        A slot holds only the changes not confirmed yet, so this history cannot be read again.
        """
        if self._identity is None:
            conn = self._connection()
            system, database = conn.execute("SELECT system_identifier::text, current_database() FROM pg_control_system()").fetchone()
            table = f"{self.schema}.{self.table}"
            self._identity = SourceIdentity(
                self.kind,
                f"postgres:{self.shown_dsn}#{table},slot={self.slot}",
                {"system_identifier": system, "database": database, "table": table, "slot": self.slot},
                cannot_replay=f"replication slot {self.slot} holds only the changes not ingested yet, not the past ones",
            )
        return self._identity

    def _connection(self) -> psycopg.Connection:
        if self._control is None or self._control.closed:
            self._control = connect(self.dsn, autocommit=True)
        return self._control

    def close(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None

    def table_info(self) -> TableInfo:
        """The table's key, column types and replica identity, checked for logical decoding."""
        if self._info is None:
            self._info = read_table_info(self._connection(), self.schema, self.table, self.primary_key)
        return self._info

    def column_types(self) -> dict[str, pa.DataType]:
        """Arrow types of the table's columns, from the PostgreSQL catalog (as DebeziumFileSource's)."""
        return dict(self.table_info().types)

    def decimal_encodings(self) -> dict[str, str]:
        return {}  # its decimals come from the PostgreSQL catalog, not from JSON values: the default stands

    def table_spec(self, name: str | None = None) -> TableSpec:
        """A declaration of cdc.<name> from the database table: its key and column types."""
        info = self.table_info()
        columns = {}
        for column, data_type in info.types.items():
            type_to_text(data_type)  # every mapped type is declarable; fail loudly otherwise
            columns[column] = data_type
        return TableSpec(name or info.name, info.key, columns)

    def on_committed(self, offset: str) -> None:
        """The writer committed everything up to `offset`: the slot may move there."""
        self._slot.advance(Position.from_offset(offset).advance_to)

    def batches(self, start_offset: str | None, max_records: int) -> Iterator[ChangeBatch]:
        if max_records < 1:
            raise SourceError(f"max_records must be at least 1, got {max_records}")
        conn = self._connection()
        check_server(conn, self.slot)
        info = self.table_info()
        confirmed = self._slot.ensure(self.table, expect_existing=start_offset is not None)
        numbers_as_text, info = probe_numbers_as_text(self._slot, conn, info)
        if start_offset is None:
            position = Position(lsn=confirmed, seq=0)
        else:
            position = Position.from_offset(start_offset)
            if confirmed > position.advance_to:
                raise PostgresSourceError(
                    f"replication slot {self.slot!r} is at {lsn_to_text(confirmed)}, beyond the committed offset "
                    f"{lsn_to_text(position.advance_to)} of cdc.{self.table}: changes in between were consumed "
                    "elsewhere; use a slot of its own per writer"
                )
            self._slot.advance(position.advance_to)
        log.info("reading %s from slot %s after %s", info.qualified, self.slot, position.to_offset())
        peek_conn = connect(self.dsn, autocommit=False)
        try:
            last_heartbeat = None
            while True:
                heartbeat_due = not self.follow or last_heartbeat is None or (
                    self._monotonic() - last_heartbeat >= self.heartbeat_interval
                )
                fence = heartbeat_fence(conn, self.heartbeat_settle, self._sleep, self._monotonic) if heartbeat_due else None
                upto = fence[1] if fence is not None else flushed_lsn(conn)
                before = position
                for batch, position in drain(self._slot, peek_conn, info, numbers_as_text, position, upto, max_records):
                    yield batch
                if fence is not None:
                    last_heartbeat = self._monotonic()
                    yield ChangeBatch(CDC_RECORD_SCHEMA.empty_table(), position.to_offset(), heartbeat=fence[0])
                if not self.follow:
                    return
                if position == before:
                    self._sleep(self.poll_interval)
        finally:
            peek_conn.close()
            self.close()
