"""Live CDC from PostgreSQL: one table's changes through logical decoding (wal2json, format-version 2).

Plugin: wal2json (Debian: `postgresql-15-wal2json`). Format-version 2 gives one JSON
row per change with its LSN, the transaction's commit timestamp and commit LSN
(`include-timestamp`, `include-lsn`), the new row as typed values and the old key
("identity") of updates and deletes; numbers stay exact (parsed as Decimal). pgoutput
would need a binary-protocol parser, test_decoding a fragile text parser.

Interface: the SQL functions `pg_logical_slot_peek_changes` and
`pg_replication_slot_advance`, not the streaming replication protocol (psycopg 3 does not
speak it). Peeking never consumes, so the slot moves only when told that a position is
committed, which is exactly what exactly-once needs. Each peek decodes from the slot's
confirmed position; because the slot follows the committed offset closely (see below),
a peek re-decodes at most about one batch.

Records
-------
- `event_time` = the source transaction's commit timestamp (microseconds, UTC).
- `key` = canonical key JSON of the key columns (the primary key, else the REPLICA
  IDENTITY index, else `primary_key=`); deletes are keyed from the old-key identity.
  An update that changes the key is a delete of the old key then a `c` of the new one.
- `payload` = JSON after-image normalized like the Debezium reader: timestamps ISO-8601
  UTC with Z (a `timestamp` without zone is read as UTC), dates YYYY-MM-DD, times
  HH:MM:SS[.ffffff], numerics as exact decimal strings, bytea as base64.
- `source_seq` = max(previous source_seq + 1, LSN of the change): strictly increasing in
  delivery (= commit) order, equal to the WAL position where changes are sparse, and
  deterministic: a replay from a committed offset numbers every change as before.
- Changes that cannot be represented (TRUNCATE, an update missing an unchanged TOAST
  column) go to the rejected records with a reason, never silently dropped.

Offset
------
Compact JSON `{"lsn": L, "seq": S}` or, inside a transaction, `{"lsn": L, "n": k,
"safe": F, "seq": S}`: every transaction whose commit record ends before L has been
delivered; of the transaction whose commit record ends at L, all changes (no "n") or the
first k; F is the end of the last wholly delivered transaction (where the slot may be
advanced to); S is the last source_seq issued. LSNs are PostgreSQL's `X/Y` text.

The commit/advance contract
---------------------------
The slot is advanced only to positions that are committed in cdc.<table>:

1. `batches(start_offset, ...)` advances it to `start_offset` (the writer passes the offset
   of its last committed checkpoint), and refuses to run if the slot is already beyond it
   (changes would have been consumed elsewhere).
2. `on_committed(offset)` advances it to `offset`. `CdcWriter.run` calls it after each
   checkpoint commit that landed, before it asks for the next batch; batches the writer
   skips (an empty batch whose heartbeat is not due) are never reported, so the slot never
   passes them. A crash between the Iceberg commit and the advance only leaves the slot
   behind; on restart the source skips what the committed offset already covers.

Heartbeats
----------
When the source is caught up it yields an empty batch whose heartbeat is the database
clock T, at most every `heartbeat_interval` seconds (and once at the end of a non-follow
run). T means: every transaction that committed before T has been delivered. That holds
because the source (1) reads T = clock_timestamp(), then takes a transaction id X of
its own (a transaction whose commit timestamp is < T had its id before T, so its id is
below X); (2) waits until no transaction with an id below X is in progress (the oldest
running id of a fresh snapshot is >= X), so each of those has its commit record in the WAL;
(3) then reads the WAL insert position L, waits until L is flushed, and (4) decodes
everything up to L. Commit records of all transactions with commit time < T lie before
L, so they have been delivered (or were covered by the committed offset). If the
in-progress transactions do not finish within `heartbeat_settle` seconds, that round
emits no heartbeat (a session idling inside a write transaction holds heartbeats back).

Misconfigurations raise PostgresSourceError (a ValueError: the CLI prints one line):
wal_level not logical, missing table, no usable key or replica identity, a role without
REPLICATION, a missing wal2json plugin, a slot of another plugin or database, a slot that
was dropped or moved past the committed offset.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pyarrow as pa

from partfin_assets.model.errors import PartfinError, SourceError
from partfin_assets.model.redaction import redact
from partfin_assets.model.record_keys import key_json_column
from partfin_assets.model.records import CDC_RECORD_SCHEMA, REJECTED_RECORD_SCHEMA, UTC_US, ChangeBatch
from partfin_assets.model.source_identity import SourceIdentity
from partfin_assets.model.tablespec import TableSpec, type_to_text
from partfin_assets.model.timeutil import to_us

log = logging.getLogger(__name__)

PLUGIN = "wal2json"
_FETCH_ROWS = 2_000  # rows per round trip from a peek's server-side cursor
_SLOT_NAME = re.compile(r"^[a-z0-9_]{1,63}$")


class PostgresSourceError(SourceError):
    """A PostgreSQL configuration that logical decoding of the table cannot work with."""


# --------------------------------------------------------------------------- LSNs and offsets


def lsn_to_int(text: str) -> int:
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) | int(low, 16)


def lsn_to_text(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


@dataclass(frozen=True)
class _Position:
    lsn: int  # commit end LSN of the last (partly) delivered transaction
    seq: int  # last source_seq issued
    n: int | None = None  # changes of that transaction delivered; None: all
    safe: int | None = None  # end of the last wholly delivered transaction (when n is set)

    @property
    def advance_to(self) -> int:
        return self.lsn if self.n is None else (self.safe or 0)

    def to_offset(self) -> str:
        fields: dict[str, Any] = {"lsn": lsn_to_text(self.lsn)}
        if self.n is not None:
            fields["n"] = self.n
            fields["safe"] = lsn_to_text(self.safe or 0)
        fields["seq"] = self.seq
        return json.dumps(fields, separators=(",", ":"))

    @classmethod
    def from_offset(cls, offset: str) -> _Position:
        try:
            fields = json.loads(offset)
            n = fields.get("n")
            return cls(
                lsn_to_int(fields["lsn"]),
                int(fields["seq"]),
                None if n is None else int(n),
                lsn_to_int(fields["safe"]) if n is not None else None,
            )
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise SourceError(f"not a postgres offset: {offset!r} ({exc})") from exc


# --------------------------------------------------------------------------- column types and values

Normalize = Callable[[Any], Any]


def _as_int(value: Any) -> Any:
    return int(value) if isinstance(value, Decimal | str) else value


_NON_FINITE = {"NaN": "NaN", "Infinity": "Infinity", "-Infinity": "-Infinity"}


def _as_float(value: Any) -> Any:
    """A float8/real for the payload: a number, or NaN / ±Infinity as the strings JSON carries them in."""
    if isinstance(value, str) and value in _NON_FINITE:
        return value
    return float(value)


def _numeric_text(value: Any) -> str:
    """A numeric as exact text (NaN and ±Infinity, which PostgreSQL's numeric has, as their names)."""
    return format(value if isinstance(value, Decimal) else Decimal(str(value)), "f")


def _decimal_text(value: Any) -> str:
    text = _numeric_text(value)
    if text in ("NaN", "Infinity", "-Infinity", "sNaN"):
        raise ValueError(f"{value} does not fit a decimal column")
    return text


@functools.lru_cache(maxsize=4096)  # a transaction's now() repeats in every row it writes
def _timestamptz_text(value: Any) -> str:
    # The decoding session runs with TimeZone=UTC: "2026-11-29 12:51:14.100414+00".
    dt = datetime.fromisoformat(value)
    return _iso_z(dt.astimezone(UTC) if dt.tzinfo else dt.replace(tzinfo=UTC))


def _iso_z(dt: datetime) -> str:
    text = dt.isoformat(timespec="microseconds" if dt.microsecond else "seconds")
    return text.replace("+00:00", "Z")


def _time_text(value: Any) -> str:
    whole, dot, fraction = str(value).partition(".")
    if not dot or not fraction.strip("0"):
        return whole
    return f"{whole}.{fraction[:6].ljust(6, '0')}"


def _bytea_text(value: Any) -> str:
    text = str(value)
    if text.startswith("\\x"):
        text = text[2:]
    return base64.b64encode(bytes.fromhex(text)).decode("ascii")


def _text(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, Decimal):
        return _numeric_text(value)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _identity(value: Any) -> Any:
    return value


def _column_type(typname: str, typmod: int, is_array: bool) -> tuple[pa.DataType, Normalize | None]:
    """Arrow type (one TableSpec supports) and value normalizer of a PostgreSQL column type."""
    if is_array:
        return pa.string(), _text
    if typname in ("int2", "int4"):
        return pa.int32(), _as_int
    if typname == "int8":
        return pa.int64(), _as_int
    if typname == "float4":
        return pa.float32(), _as_float
    if typname == "float8":
        return pa.float64(), _as_float
    if typname == "numeric":
        if typmod >= 4:
            precision, scale = ((typmod - 4) >> 16) & 0xFFFF, (typmod - 4) & 0xFFFF
            if 0 < precision <= 38 and 0 <= scale <= precision:
                return pa.decimal128(precision, scale), _decimal_text
        return pa.string(), _numeric_text  # no fixed scale fits every value: exact decimal text
    if typname == "bool":
        return pa.bool_(), None
    if typname == "bytea":
        return pa.binary(), _bytea_text
    if typname == "date":
        return pa.date32(), _text
    if typname == "time":
        return pa.time64("us"), _time_text
    if typname in ("timestamptz", "timestamp"):
        return UTC_US, _timestamptz_text  # like Debezium's MicroTimestamp: a zoneless time is read as UTC
    return pa.string(), _text


@dataclass
class _TableInfo:
    schema: str
    name: str
    oid: int
    key: tuple[str, ...]
    types: dict[str, pa.DataType]
    normalizers: dict[str, Normalize | None]
    replica_identity: str  # d(efault) n(othing) f(ull) i(ndex)
    not_null: frozenset[str] = frozenset()
    # float columns whose NaN / ±Infinity the slot's wal2json writes as null (before 2.6): a null in
    # one of them that is NOT NULL can only be such a value, and is rejected rather than stored as null
    unreadable_nulls: frozenset[str] = frozenset()

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"


# --------------------------------------------------------------------------- the source


@dataclass
class _Change:
    key_values: dict[str, Any]
    op: str
    payload: str | None


@dataclass
class _Pending:
    """Records of the batch being built."""

    keys: list[dict[str, Any]] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    times: list[int] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    payloads: list[str | None] = field(default_factory=list)
    rejected: list[tuple[int, str, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ops) + len(self.rejected)


class PostgresSource:
    """Changes of one PostgreSQL table through a wal2json logical replication slot.

    `table` is `name` or `schema.name` (schema defaults to public); `slot` defaults to
    `partfin_<name>` and is created (logged) if missing. With follow=False the stream ends
    once it has caught up with the WAL position read at its start of each round (with a
    final heartbeat); with follow=True it polls every `poll_interval` seconds forever.
    See the module docstring for the offset format and the commit/advance contract.
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
        self.schema = schema if dot else "public"
        self.table = name
        self.slot = slot or f"partfin_{name.lower()}"
        if not _SLOT_NAME.match(self.slot):
            raise PostgresSourceError(
                f"replication slot name {self.slot!r} is not valid (lower-case letters, digits and _, at most 63); pass slot="
            )
        self.publication = publication
        self.primary_key = tuple(primary_key) if primary_key else None
        self.follow = follow
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_settle = heartbeat_settle
        self.poll_interval = poll_interval
        self.slot_busy_timeout = slot_busy_timeout
        self._sleep = sleep
        self._monotonic = monotonic
        self._control = None  # autocommit connection: checks, slot, clock, advance
        self._info: _TableInfo | None = None
        self._confirmed: int | None = None  # the slot's confirmed_flush_lsn as last seen
        self._numbers_as_text = False  # wal2json 2.6+: numbers as text (probed per run)
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
                f"postgres:{redact(self.dsn)}#{table},slot={self.slot}",
                {"system_identifier": system, "database": database, "table": table, "slot": self.slot},
                cannot_replay=f"replication slot {self.slot} holds only the changes not ingested yet, not the past ones",
            )
        return self._identity

    # ---- connections and checks

    def _connection(self):
        if self._control is None or self._control.closed:
            self._control = self._connect(autocommit=True)
        return self._control

    def _connect(self, autocommit: bool):
        import psycopg

        try:
            conn = psycopg.connect(self.dsn, autocommit=autocommit)
        except psycopg.Error as exc:  # libpq may echo a token of the DSN in its message: masked by value too
            raise PostgresSourceError(
                f"cannot connect to PostgreSQL ({redact(self.dsn)}): {redact(_first_line(exc), self.dsn)}"
            ) from None
        conn.execute("SET TimeZone = 'UTC'")
        conn.execute("SET DateStyle = 'ISO, YMD'")
        conn.execute("SET IntervalStyle = 'iso_8601'")
        conn.execute("SET extra_float_digits = 1")
        if not autocommit:
            conn.commit()
        return conn

    def close(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None

    def table_info(self) -> _TableInfo:
        """The table's key, column types and replica identity, checked for logical decoding."""
        if self._info is None:
            self._info = self._read_table_info(self._connection())
        return self._info

    def column_types(self) -> dict[str, pa.DataType]:
        """Arrow types of the table's columns, from the PostgreSQL catalog (as DebeziumFileSource's)."""
        return dict(self.table_info().types)

    def table_spec(self, name: str | None = None) -> TableSpec:
        """A declaration of cdc.<name> from the database table: its key and column types."""
        info = self.table_info()
        columns = {}
        for column, data_type in info.types.items():
            type_to_text(data_type)  # every mapped type is declarable; fail loudly otherwise
            columns[column] = data_type
        return TableSpec(name or info.name, info.key, columns)

    def _read_table_info(self, conn) -> _TableInfo:
        qualified = f"{self.schema}.{self.table}"
        row = conn.execute(
            "SELECT c.oid, c.relreplident, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = %s",
            (self.schema, self.table),
        ).fetchone()
        database = conn.info.dbname
        if row is None:
            raise PostgresSourceError(f"table {qualified} does not exist in database {database!r}")
        oid, identity, relkind = int(row[0]), str(row[1]), str(row[2])
        if relkind not in ("r", "p"):
            raise PostgresSourceError(f"{qualified} is not a table (relkind {relkind!r}): only tables are decoded")
        columns = conn.execute(
            "SELECT a.attname, t.typname, a.atttypmod, t.typcategory = 'A' OR a.attndims > 0, a.attnotnull "
            "FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
            "WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
            (oid,),
        ).fetchall()
        types: dict[str, pa.DataType] = {}
        normalizers: dict[str, Normalize | None] = {}
        for name, typname, typmod, is_array, _ in columns:
            types[name], normalizers[name] = _column_type(typname, int(typmod), bool(is_array))

        def index_columns(condition: str) -> tuple[str, ...]:
            found = conn.execute(
                "SELECT a.attname FROM pg_index i JOIN LATERAL unnest(i.indkey) WITH ORDINALITY k(attnum, ord) ON true "
                "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
                f"WHERE i.indrelid = %s AND {condition} ORDER BY k.ord",
                (oid,),
            ).fetchall()
            return tuple(r[0] for r in found)

        primary = index_columns("i.indisprimary")
        identity_index = index_columns("i.indisreplident") if identity == "i" else ()
        identity_name = {"d": "DEFAULT", "n": "NOTHING", "f": "FULL", "i": "USING INDEX"}.get(identity, identity)
        key = self.primary_key or primary or identity_index
        if not key:
            raise PostgresSourceError(
                f"table {qualified} has no primary key and REPLICA IDENTITY {identity_name}: deletes cannot be keyed; "
                f"add a primary key, or ALTER TABLE {qualified} REPLICA IDENTITY FULL and name the key columns "
                "(--primary-key)"
            )
        unknown = [c for c in key if c not in types]
        if unknown:
            raise PostgresSourceError(f"table {qualified} has no column(s) {unknown} (the key given)")
        logged_old = {"d": primary, "i": identity_index, "f": tuple(types), "n": ()}.get(identity, ())
        if not set(key) <= set(logged_old):
            raise PostgresSourceError(
                f"table {qualified} has REPLICA IDENTITY {identity_name}, which does not log key column(s) "
                f"{sorted(set(key) - set(logged_old))} of deleted rows: deletes cannot be keyed; "
                f"ALTER TABLE {qualified} REPLICA IDENTITY FULL (or key by the primary key)"
            )
        not_null = frozenset(name for name, *_, is_not_null in columns if is_not_null)
        return _TableInfo(self.schema, self.table, oid, tuple(key), types, normalizers, identity, not_null)

    def _check_server(self, conn) -> None:
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
                f"role {role} lacks REPLICATION privilege to create or read replication slot {self.slot!r} "
                f"(ALTER ROLE {role} REPLICATION)"
            )

    def _ensure_slot(self, conn, expect_existing: bool) -> int:
        """The slot's confirmed_flush_lsn, creating the slot if it is missing."""
        import psycopg

        row = conn.execute(
            "SELECT plugin, database, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            (self.slot,),
        ).fetchone()
        database = conn.info.dbname
        if row is not None:
            plugin, slot_db, confirmed = row
            if plugin != PLUGIN or slot_db != database:
                raise PostgresSourceError(
                    f"replication slot {self.slot!r} exists for plugin {plugin!r} in database {slot_db!r}; "
                    f"partfin needs a {PLUGIN} slot in {database!r} (pass another slot name, or drop it)"
                )
            return lsn_to_int(confirmed)
        if expect_existing:
            raise PostgresSourceError(
                f"replication slot {self.slot!r} does not exist, but cdc.{self.table} has a committed offset: changes "
                "since then are gone; drop cdc.* for this table to start over, or restore the slot"
            )
        try:
            row = conn.execute(
                "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, %s)", (self.slot, PLUGIN)
            ).fetchone()
        except psycopg.errors.UndefinedFile:
            raise PostgresSourceError(
                f"output plugin {PLUGIN} is not installed on the server (Debian: apt-get install postgresql-15-wal2json)"
            ) from None
        except psycopg.errors.InsufficientPrivilege as exc:
            if "output plugin" in str(exc):
                raise PostgresSourceError(
                    f"the server does not allow the wal2json output plugin: add wal2json to output_plugin_libraries "
                    f"in postgresql.conf (PostgreSQL 15.20+): {_first_line(exc)}"
                ) from None
            raise PostgresSourceError(
                f"role lacks REPLICATION privilege to create slot {self.slot!r}: {_first_line(exc)}"
            ) from None
        except psycopg.errors.ConfigurationLimitExceeded as exc:
            raise PostgresSourceError(f"cannot create slot {self.slot!r}: {_first_line(exc)} (max_replication_slots)") from None
        except psycopg.errors.DuplicateObject:
            return self._ensure_slot(conn, expect_existing=True)  # created concurrently
        log.info("created logical replication slot %s (%s) in database %s at %s", self.slot, PLUGIN, database, row[0])
        return lsn_to_int(row[0])

    # ---- the commit/advance contract

    def on_committed(self, offset: str) -> None:
        """The writer committed everything up to `offset`: the slot may move there."""
        self._advance(_Position.from_offset(offset).advance_to)

    def _advance(self, target: int) -> None:
        conn = self._connection()
        if self._confirmed is None:
            self._confirmed = self._slot_confirmed(conn)
        if target <= self._confirmed:
            return
        row = self._with_slot(
            lambda: conn.execute(
                "SELECT end_lsn::text FROM pg_replication_slot_advance(%s, %s::pg_lsn)", (self.slot, lsn_to_text(target))
            ).fetchone()
        )
        self._confirmed = max(self._confirmed, lsn_to_int(row[0]))

    def _slot_confirmed(self, conn) -> int:
        row = conn.execute(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (self.slot,)
        ).fetchone()
        if row is None:
            raise PostgresSourceError(f"replication slot {self.slot!r} disappeared")
        return lsn_to_int(row[0])

    def _with_slot(self, call: Callable[[], Any]) -> Any:
        """Run a slot function, waiting while a killed predecessor's backend still holds the slot."""
        import psycopg

        deadline = self._monotonic() + self.slot_busy_timeout
        while True:
            try:
                return call()
            except psycopg.errors.ObjectInUse as exc:
                if self._monotonic() >= deadline:
                    raise PostgresSourceError(
                        f"replication slot {self.slot!r} stays in use by another process: {_first_line(exc)}"
                    ) from None
                self._sleep(0.2)

    # ---- batches

    def batches(self, start_offset: str | None, max_records: int) -> Iterator[ChangeBatch]:
        if max_records < 1:
            raise SourceError(f"max_records must be at least 1, got {max_records}")
        conn = self._connection()
        self._check_server(conn)
        info = self.table_info()
        confirmed = self._ensure_slot(conn, expect_existing=start_offset is not None)
        self._confirmed = confirmed
        info = self._probe_numbers_as_text(conn, info)
        if start_offset is None:
            position = _Position(lsn=confirmed, seq=0)
        else:
            position = _Position.from_offset(start_offset)
            if confirmed > position.advance_to:
                raise PostgresSourceError(
                    f"replication slot {self.slot!r} is at {lsn_to_text(confirmed)}, beyond the committed offset "
                    f"{lsn_to_text(position.advance_to)} of cdc.{self.table}: changes in between were consumed "
                    "elsewhere; use a slot of its own per writer"
                )
            self._advance(position.advance_to)
        log.info("reading %s from slot %s after %s", info.qualified, self.slot, position.to_offset())
        peek_conn = self._connect(autocommit=False)
        try:
            last_heartbeat = None
            while True:
                heartbeat_due = not self.follow or last_heartbeat is None or (
                    self._monotonic() - last_heartbeat >= self.heartbeat_interval
                )
                fence = self._fence(conn) if heartbeat_due else None
                upto = fence[1] if fence is not None else lsn_to_int(
                    conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0]
                )
                before = position
                for batch, position in self._drain(peek_conn, info, position, upto, max_records):
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

    def _fence(self, conn) -> tuple[datetime, int] | None:
        """(T, L): every transaction committed before T has its commit record before L (see module doc)."""
        (clock,) = conn.execute("SELECT clock_timestamp()").fetchone()
        # An id of our own, taken after T: every transaction that committed before T has a smaller one.
        # (pg_current_snapshot() cannot list them: it leaves out running ids at or past its xmax.)
        (ours,) = conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
        deadline = self._monotonic() + self.heartbeat_settle
        while True:
            (oldest_running,) = conn.execute("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint").fetchone()
            if oldest_running >= ours:
                break
            if self._monotonic() >= deadline:
                log.info("no heartbeat this round: transaction %s (older than %s) still in progress", oldest_running, ours)
                return None
            self._sleep(0.01)
        insert = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0]
        target = lsn_to_int(insert)
        while lsn_to_int(conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0]) < target:
            if self._monotonic() >= deadline:
                return None
            self._sleep(0.01)
        return clock.astimezone(UTC), target

    def _peek_options(self, info: _TableInfo) -> list[str]:
        escaped = ".".join(re.sub(r"([ ',.*\\])", r"\\\1", part) for part in (info.schema, info.name))
        options = [
            "format-version", "2",
            "include-timestamp", "1",
            "include-lsn", "1",
            "include-types", "0",
            "add-tables", escaped,
        ]  # fmt: skip
        if self._numbers_as_text:  # float NaN / ±Infinity as text, not null
            options += ["numeric-data-types-as-string", "1"]
        return options

    def _probe_numbers_as_text(self, conn, info: _TableInfo) -> _TableInfo:
        """Whether the slot's wal2json has numeric-data-types-as-string (2.6+); without it, say what is at risk."""
        import psycopg

        def probe() -> bool:
            try:
                conn.execute(
                    "SELECT count(*) FROM pg_logical_slot_peek_changes(%s, '0/1'::pg_lsn, NULL, "
                    "'format-version', '2', 'numeric-data-types-as-string', '1')",
                    (self.slot,),
                )
                return True
            except psycopg.errors.InvalidParameterValue:
                return False

        self._numbers_as_text = self._with_slot(probe)
        floats = [name for name, data_type in info.types.items() if pa.types.is_floating(data_type)]
        if self._numbers_as_text or not floats:
            return info
        log.warning(
            "%s: this server's wal2json (before 2.6) writes float NaN and ±Infinity as null: in column(s) %s they "
            "cannot be told from NULL (a NOT NULL column rejects such changes); install wal2json 2.6 or later",
            info.qualified, ", ".join(floats),
        )
        return dataclasses.replace(info, unreadable_nulls=frozenset(floats) & info.not_null)

    def _drain(
        self, peek_conn, info: _TableInfo, position: _Position, upto: int, max_records: int
    ) -> Iterator[tuple[ChangeBatch, _Position]]:
        """Batches of every change after `position` whose transaction commits before `upto`."""
        options = self._peek_options(info)
        placeholders = ", ".join(["%s"] * len(options))
        window = max(4 * max_records, 1_000)
        pending = _Pending()
        reader = _TxnReader(info, position)
        while True:
            returned = 0
            delivered_before = reader.position
            rows = self._peek(peek_conn, placeholders, options, upto, window)
            for lsn_text, data in rows:
                returned += 1
                reader.row(lsn_text, data, pending)
                if len(pending) >= max_records:
                    yield reader.batch(pending), reader.position
                    pending = _Pending()
            peek_conn.commit()
            if reader.position == delivered_before and reader.in_txn is None and returned >= window:
                window *= 2  # the slot is behind what was delivered (not yet committed): look further
            if returned < window:
                break
        if len(pending) or reader.position != position:
            yield reader.batch(pending), reader.position

    def _peek(self, peek_conn, placeholders: str, options: list[str], upto: int, window: int) -> Iterator[tuple[str, str]]:
        cursor = peek_conn.cursor(name="partfin_peek")
        self._with_slot(
            lambda: _execute_peek(peek_conn, cursor, placeholders, options, self.slot, lsn_to_text(upto), window)
        )
        try:
            while True:
                rows = cursor.fetchmany(_FETCH_ROWS)
                if not rows:
                    return
                yield from rows
        finally:
            cursor.close()


def _execute_peek(peek_conn, cursor, placeholders, options, slot, upto, window) -> None:
    import psycopg

    try:
        cursor.execute(
            f"SELECT lsn::text, data FROM pg_logical_slot_peek_changes(%s, %s::pg_lsn, %s, {placeholders})",
            (slot, upto, window, *options),
        )
    except psycopg.errors.ObjectInUse:
        peek_conn.rollback()
        raise


class _TxnReader:
    """Turns wal2json v2 rows into records, skipping what `position` already covers."""

    def __init__(self, info: _TableInfo, position: _Position) -> None:
        self.info = info
        self.position = position
        self.safe = position.advance_to  # end of the last wholly delivered transaction
        self.in_txn: int | None = None  # commit end LSN of the transaction being read
        self.index = 0  # changes of it seen so far
        self.skip = 0  # of them, already delivered
        self.event_time_us = 0
        self._loads = json.JSONDecoder(parse_float=Decimal).decode

    def row(self, lsn_text: str, data: str, pending: _Pending) -> None:
        head = data[:40]
        if '"action":"B"' in head:
            fields = json.loads(data)
            commit_end = lsn_to_int(fields["nextlsn"])
            self.index = 0
            if commit_end < self.position.lsn or (commit_end == self.position.lsn and self.position.n is None):
                self.in_txn, self.skip = None, 0  # delivered before
                return
            self.in_txn = commit_end
            self.skip = self.position.n if commit_end == self.position.lsn else 0
            self.event_time_us = to_us(datetime.fromisoformat(fields["timestamp"]))
            return
        if self.in_txn is None:
            return
        if '"action":"C"' in head:
            self.position = _Position(self.in_txn, self.position.seq)
            self.safe = self.in_txn
            self.in_txn = None
            return
        if '"action":"M"' in head:
            return  # logical decoding messages of other tools
        self.index += 1
        if self.index <= self.skip:
            return
        seq_base = self.position.seq
        change_lsn = lsn_to_int(lsn_text)
        try:
            changes = self._changes(self._loads(data))
            reason = None
        except _Reject as exc:
            changes, reason = [], str(exc)
        if reason is not None:
            seq = max(seq_base + 1, change_lsn)
            pending.rejected.append((seq, data, reason))
        else:
            seq = seq_base
            for change in changes:
                seq = max(seq + 1, change_lsn)
                pending.keys.append(change.key_values)
                pending.ops.append(change.op)
                pending.times.append(self.event_time_us)
                pending.seqs.append(seq)
                pending.payloads.append(change.payload)
        self.position = _Position(self.in_txn, seq, self.index, self.safe)

    def _changes(self, change: dict[str, Any]) -> list[_Change]:
        action = change.get("action")
        info = self.info
        if action == "T":
            raise _Reject(f"TRUNCATE of {info.qualified} cannot be keyed per row (not applied to base tables)")
        if action not in ("I", "U", "D"):
            raise _Reject(f"unknown wal2json action {action!r}")
        old = self._image(change.get("identity") or [])
        if action == "D":
            return [_Change(self._key(old, "old-key identity"), "d", None)]
        new = self._image(change.get("columns") or [])
        missing = [c for c in info.types if c not in new]
        for column in missing:
            if column in old:  # REPLICA IDENTITY FULL carries unchanged TOAST values
                new[column] = old[column]
        missing = [c for c in info.types if c not in new]
        if missing:
            raise _Reject(
                f"column(s) {missing} missing from the change (unchanged TOAST values?): "
                f"ALTER TABLE {info.qualified} REPLICA IDENTITY FULL"
            )
        key = self._key(new, "new row")
        payload = json.dumps(new, separators=(",", ":"), ensure_ascii=False)
        if action == "I":
            return [_Change(key, "c", payload)]
        old_key = {c: old[c] for c in info.key if c in old}
        if len(old_key) == len(info.key) and old_key != key:
            return [_Change(old_key, "d", None), _Change(key, "c", payload)]
        return [_Change(key, "u", payload)]

    def _image(self, columns: list[dict[str, Any]]) -> dict[str, Any]:
        image = {}
        normalizers = self.info.normalizers
        for column in columns:
            name, value = column["name"], column.get("value")
            if value is None and name in self.info.unreadable_nulls:
                raise _Reject(
                    f"column {name!r} is NOT NULL but arrived as null: a float NaN or ±Infinity, which this server's "
                    "wal2json (before 2.6) cannot carry"
                )
            if value is not None:
                normalize = normalizers.get(name, _text)
                if normalize is not None:
                    try:
                        value = normalize(value)
                    except (ValueError, TypeError, ArithmeticError) as exc:
                        raise _Reject(f"bad value in column {name!r} ({exc})") from None
            image[name] = value
        return image

    def _key(self, image: dict[str, Any], what: str) -> dict[str, Any]:
        missing = [c for c in self.info.key if image.get(c) is None]
        if missing:
            raise _Reject(f"key column(s) {missing} missing from the {what}")
        return {c: image[c] for c in self.info.key}

    def batch(self, pending: _Pending) -> ChangeBatch:
        key_columns = {name: [k[name] for k in pending.keys] for name in self.info.key}
        records = pa.table(
            {
                "key": key_json_column(key_columns) if pending.keys else pa.array([], pa.string()),
                "op": pa.array(pending.ops, pa.string()),
                "event_time": pa.array(pending.times, pa.int64()).cast(UTC_US),
                "source_seq": pa.array(pending.seqs, pa.int64()),
                "payload": pa.array(pending.payloads, pa.string()),
                # logical decoding sees a change once its transaction committed: the commit is its arrival
                "arrival_time": pa.array(pending.times, pa.int64()).cast(UTC_US),
            },
            schema=CDC_RECORD_SCHEMA,
        )
        rejected = pa.table(
            {
                "source_seq": [r[0] for r in pending.rejected],
                "raw": [r[1] for r in pending.rejected],
                "reason": [r[2] for r in pending.rejected],
            },
            schema=REJECTED_RECORD_SCHEMA,
        )
        return ChangeBatch(records=records, offset=self.position.to_offset(), rejected=rejected)


class _Reject(PartfinError, ValueError):
    pass


# --------------------------------------------------------------------------- spec text


def parse_postgres_spec(argument: str, default_table: str) -> tuple[str, str, dict[str, str]]:
    """`DSN[#[schema.]table][,slot=NAME,...]` -> (dsn, table, options).

    A `#` inside a password (quoted or not, in key/value pairs, URI user info or `?password=`)
    belongs to the password; the first `#` outside one starts the table and options.
    """
    dsn, fragment = _split_fragment(argument)
    table, options = f"public.{default_table}", {}
    for item in filter(None, (part.strip() for part in fragment.split(","))):
        name, equals, value = item.partition("=")
        if equals:
            options[name.strip().replace("-", "_")] = value.strip()
        else:
            table = item if "." in item else f"public.{item}"
    return dsn.strip(), table, options


_URI_DSN = re.compile(r"postgres(?:ql)?://", re.IGNORECASE)
# libpq key/value pair: key = 'quoted value' (\' and \\ escaped) or a value up to whitespace
_DSN_PAIR = re.compile(r"\s*(\w+)\s*=\s*('(?:[^'\\]|\\.)*'|\S*)")


def _split_fragment(argument: str) -> tuple[str, str]:
    if _URI_DSN.match(argument):
        start = max(argument.rfind("@") + 1, _URI_DSN.match(argument).end())  # the user info ends at its last '@'
        passwords = [m.span(1) for m in re.finditer(r"[?&]password=([^&\s]*)", argument, re.IGNORECASE)]
        for i in range(start, len(argument)):
            if argument[i] == "#" and not any(a <= i < b for a, b in passwords):
                return argument[:i], argument[i + 1 :]
        return argument, ""
    position = 0
    while match := _DSN_PAIR.match(argument, position):
        if not match.group(0).strip():
            break
        key, value = match.group(1), match.group(2)
        if key.lower() != "password" and not value.startswith("'") and "#" in value:
            cut = match.start(2) + value.index("#")
            return argument[:cut], argument[cut + 1 :]
        position = match.end()
    cut = argument.find("#", position)
    return (argument[:cut], argument[cut + 1 :]) if cut >= 0 else (argument, "")


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
