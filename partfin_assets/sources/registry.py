"""Build a CDC source from a one-line spec: `synthetic`, `synthetic:seed=7,rate=5,hours=24`, `debezium:PATH`, `postgres:DSN`.

`postgres:DSN[#[schema.]table][,option=value,...]` reads a PostgreSQL table's changes through
logical decoding (sources/postgres/). DSN is a libpq connection string or URI
(`host=db port=5432 user=cdc dbname=shop` or `postgresql://cdc@db/shop`). The source table
defaults to `public.<--table>`; a `#` fragment names another one and options:
`slot=NAME` (default partfin_<table>), `heartbeat_interval=10s`, `heartbeat_settle=5s`,
`poll_interval=0.5s`. Example: `postgres:postgresql://cdc@db/shop#sales.orders,slot=orders_cdc`.

`kafka:BOOTSTRAP#TOPIC[,group=NAME,<librdkafka property>=value,...]` reads Debezium JSON change
events from a Kafka topic (sources/kafka.py: options, secrets from the environment, exactly once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from partfin_assets.model import conninfo
from partfin_assets.model.errors import SourceError
from partfin_assets.model.redaction import redact
from partfin_assets.model.records import CdcSource, ReplayableSource
from partfin_assets.model.source_identity import ReplayNotPossible, SourceIdentity
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.model.timeutil import parse_duration, parse_iso
from partfin_assets.sources.debezium import DebeziumFileSource, debezium_table_spec
from partfin_assets.sources.kafka import KafkaSource, parse_kafka_spec
from partfin_assets.sources.postgres import PostgresSource, parse_postgres_spec
from partfin_assets.sources.synthetic import ORDERS_SPEC, SyntheticSource


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise SourceError(f"not a boolean: {text!r}")


def _optional_duration(text: str) -> timedelta | None:
    return None if text.strip().lower() in ("none", "off", "0") else parse_duration(text)


_SYNTHETIC_OPTIONS: dict[str, Callable[[str], Any]] = {
    "seed": int,
    "rate": float,
    "hours": float,
    "start": parse_iso,
    "end": parse_iso,
    "follow": parse_bool,
    "key_space": int,
    "delete_fraction": float,
    "late_fraction": float,
    "max_lateness": parse_duration,
    "idle_every": _optional_duration,
    "idle_for": parse_duration,
    "heartbeat_every": parse_duration,
    "speed": float,
    "speed_since": parse_iso,
    "speed_event": parse_iso,
}


@dataclass(frozen=True)
class SourceKind:
    """One registry entry: how a kind's spec reads, opens a source and declares a new cdc table.

    `open(spec, table, key_columns, complete, options)` -> the source; `declare(spec, table_name, key_columns,
    complete)` -> the declaration of a new cdc.<table_name> read from the source itself (see source_table_spec).
    """

    name: str
    usage: str  # the spec's form, as the unknown-kind error and docs/sources.md show it
    open: Callable[..., CdcSource]
    declare: Callable[..., TableSpec]


@dataclass(frozen=True)
class SourceSpec:
    """A source spec read once: its kind's registry entry and what follows `kind:` (the kind's own options)."""

    kind: SourceKind
    argument: str
    text: str  # as written (shown only through model/redaction.py)

    @classmethod
    def parse(cls, text: str | SourceSpec) -> SourceSpec:
        """The spec `text` names; an unknown kind is an error naming the known ones."""
        if isinstance(text, SourceSpec):
            return text
        name, _, argument = text.strip().partition(":")
        kind = SOURCE_KINDS.get(name)
        if kind is None:
            raise SourceError(f"unknown source kind {name!r}; expected " + ", ".join(repr(k.usage) for k in SOURCE_KINDS.values()))
        return cls(kind, argument, text)


def source_kind(spec_text: str) -> str:
    """The kind named by a source spec; an unknown kind is an error naming the known ones."""
    return SourceSpec.parse(spec_text).kind.name


def make_source(
    spec_text: str | SourceSpec, table: TableSpec, primary_key: str | tuple[str, ...] | None = None, *, complete: bool = False,
    **options: Any
) -> CdcSource:
    """The source described by spec_text for `table`; keyword options override those in the text.

    `complete`: what the source holds now is complete (`partfin ingest` without --follow): a Debezium
    file's last line is read even without its trailing newline. Otherwise such a line is taken as
    still being written and read once its newline is there.
    """
    spec = SourceSpec.parse(spec_text)
    return spec.kind.open(spec, table, _key_columns(primary_key), complete, options)


def source_table_spec(
    spec_text: str | SourceSpec, table_name: str, primary_key: str | tuple[str, ...] | None = None, *, complete: bool = False
) -> TableSpec:
    """The declaration of a new cdc.<table_name> read from the source itself, before anything is committed.

    postgres: key and column types of the database table. debezium: the column types of the file's
    first schema block (the key must be given; with `complete`, as in make_source, a file without any
    change event is refused). kafka: the given key (column types come from the messages as they are
    read). synthetic: the orders table.
    """
    spec = SourceSpec.parse(spec_text)
    return spec.kind.declare(spec, table_name, _key_columns(primary_key), complete)


def _debezium_path(argument: str, spec_text: str) -> str:
    if not argument:
        raise SourceError(f"source {redact(spec_text)!r}: debezium needs a file path, e.g. debezium:/data/orders.jsonl")
    return argument


def _given_key(table_name: str, key_columns: tuple[str, ...] | None) -> tuple[str, ...]:
    if not key_columns:
        raise SourceError(f"cdc.{table_name} does not exist yet: give its key with --primary-key COL[,COL]")
    return key_columns


def _open_synthetic(spec: SourceSpec, table: TableSpec, key_columns, complete: bool, options: dict[str, Any]) -> CdcSource:
    _check_orders_table(table, key_columns)
    return SyntheticSource(**{**_parse_options(spec.argument, spec.text), **options})


def _declare_synthetic(spec: SourceSpec, table_name: str, key_columns, complete: bool) -> TableSpec:
    return TableSpec(table_name, ORDERS_SPEC.primary_key, dict(ORDERS_SPEC.columns), ORDERS_SPEC.watermark_policy)


def _open_debezium(spec: SourceSpec, table: TableSpec, key_columns, complete: bool, options: dict[str, Any]) -> CdcSource:
    return DebeziumFileSource(_debezium_path(spec.argument, spec.text), primary_key=key_columns, spec=table, complete_file=complete,
                              **options)


def _declare_debezium(spec: SourceSpec, table_name: str, key_columns, complete: bool) -> TableSpec:
    path = _debezium_path(spec.argument, spec.text)
    return debezium_table_spec(path, table_name, _given_key(table_name, key_columns), complete=complete)


def _open_kafka(spec: SourceSpec, table: TableSpec, key_columns, complete: bool, options: dict[str, Any]) -> CdcSource:
    return KafkaSource(parse_kafka_spec(spec.argument, spec.text), table, key_columns, **options)


def _declare_kafka(spec: SourceSpec, table_name: str, key_columns, complete: bool) -> TableSpec:
    parse_kafka_spec(spec.argument, spec.text)  # column types come from the messages' schema blocks as they are read
    return TableSpec(table_name, _given_key(table_name, key_columns))


def _open_postgres(spec: SourceSpec, table: TableSpec, key_columns, complete: bool, options: dict[str, Any]) -> CdcSource:
    return _postgres_source(spec.argument, spec.text, table.name, key_columns or table.primary_key, options)


def _declare_postgres(spec: SourceSpec, table_name: str, key_columns, complete: bool) -> TableSpec:
    """The declaration of cdc.<table_name> read from the PostgreSQL table a `postgres:` spec names."""
    source = _postgres_source(spec.argument, spec.text, table_name, key_columns, {})
    try:
        return source.table_spec(table_name)
    finally:
        source.close()


def open_history(identity: SourceIdentity, table: TableSpec) -> ReplayableSource:
    """The source that reads a recorded history again (its spec names it exactly: a file, a generator's options)."""
    if identity.cannot_replay:
        raise ReplayNotPossible(f"{identity.spec} cannot read its history again: {identity.cannot_replay}")
    source = make_source(identity.spec, table)
    assert isinstance(source, ReplayableSource), f"{type(source).__name__} reads no history but its identity says it can"
    return source


_POSTGRES_OPTIONS: dict[str, Callable[[str], Any]] = {
    "slot": str,
    "heartbeat_interval": lambda text: parse_duration(text).total_seconds(),
    "heartbeat_settle": lambda text: parse_duration(text).total_seconds(),
    "poll_interval": lambda text: parse_duration(text).total_seconds(),
}


def _postgres_source(
    argument: str, spec_text: str, table_name: str, key_columns: tuple[str, ...] | None, options: dict[str, Any]
) -> CdcSource:
    dsn, source_table, text_options = parse_postgres_spec(argument, table_name)
    if not dsn:
        raise SourceError("a postgres source needs a DSN, e.g. postgres:service=shop or postgres:host=db dbname=shop user=cdc")
    shown = f"postgres:{conninfo.display(dsn)}#{source_table}"  # never the text as written: libpq's reading, secrets masked
    parsed: dict[str, Any] = {}
    for name, value in text_options.items():
        parse = _POSTGRES_OPTIONS.get(name)
        if parse is None:
            raise SourceError(f"source {shown!r}: unknown postgres option {name!r}; known: {', '.join(_POSTGRES_OPTIONS)}")
        try:
            parsed[name] = parse(value)
        except ValueError as exc:
            raise SourceError(f"source {shown!r}: option {name}: {redact(str(exc), spec_text)}") from None
    return PostgresSource(dsn, source_table, primary_key=key_columns, **{**parsed, **options})


def _key_columns(primary_key: str | tuple[str, ...] | None) -> tuple[str, ...] | None:
    if isinstance(primary_key, str):  # as given on the command line: "id,region"
        primary_key = tuple(column.strip() for column in primary_key.split(",") if column.strip())
    return tuple(primary_key) if primary_key else None


def _check_orders_table(table: TableSpec, key_columns: tuple[str, ...] | None) -> None:
    """The synthetic source produces `orders` rows; a table declared otherwise would not match them."""
    for declared in (table.primary_key, key_columns or ORDERS_SPEC.primary_key):
        if declared != ORDERS_SPEC.primary_key:
            raise SourceError(f"the synthetic source keys rows by {ORDERS_SPEC.primary_key}, not by {declared}")
    # Names only: a declaration read back from the catalog may spell the types differently (large_string).
    if table.columns and set(table.columns) != set(ORDERS_SPEC.columns):
        raise SourceError(
            f"the synthetic source produces columns {list(ORDERS_SPEC.columns)}; table {table.name!r} declares "
            f"{list(table.columns)} (use ORDERS_SPEC's columns)"
        )


def _parse_options(text: str, spec_text: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, equals, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not equals:
            raise SourceError(f"source {redact(spec_text)!r}: option {item!r} is not name=value")
        parse = _SYNTHETIC_OPTIONS.get(name)
        if parse is None:
            raise SourceError(
                f"source {redact(spec_text)!r}: unknown synthetic option {name!r}; known: {', '.join(_SYNTHETIC_OPTIONS)}"
            )
        try:
            options[name] = parse(value.strip())
        except ValueError as exc:
            raise SourceError(f"source {redact(spec_text)!r}: option {name}: {redact(str(exc), spec_text)}") from None
    return options


# One entry per source kind: adding a source is its package and one line here.
SOURCE_KINDS: dict[str, SourceKind] = {kind.name: kind for kind in (
    SourceKind("synthetic", "synthetic[:option=value,...]", _open_synthetic, _declare_synthetic),
    SourceKind("debezium", "debezium:PATH", _open_debezium, _declare_debezium),
    SourceKind("postgres", "postgres:DSN[#schema.table]", _open_postgres, _declare_postgres),
    SourceKind("kafka", "kafka:BOOTSTRAP#TOPIC[,option=value,...]", _open_kafka, _declare_kafka),
)}
