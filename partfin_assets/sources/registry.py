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


def source_kind(spec_text: str) -> str:
    """The kind named by a source spec; an unknown kind is an error naming the known ones."""
    kind = spec_text.strip().partition(":")[0]
    if kind not in ("synthetic", "debezium", "postgres", "kafka"):
        raise SourceError(
            f"unknown source kind {kind!r}; expected 'synthetic[:option=value,...]', 'debezium:PATH',"
            " 'postgres:DSN[#schema.table]' or 'kafka:BOOTSTRAP#TOPIC[,option=value,...]'"
        )
    return kind


def make_source(
    spec_text: str, table: TableSpec, primary_key: str | tuple[str, ...] | None = None, *, complete: bool = False, **options: Any
) -> CdcSource:
    """The source described by spec_text for `table`; keyword options override those in the text.

    `complete`: what the source holds now is complete (`partfin ingest` without --follow): a Debezium
    file's last line is read even without its trailing newline. Otherwise such a line is taken as
    still being written and read once its newline is there.
    """
    kind = source_kind(spec_text)
    argument = spec_text.strip().partition(":")[2]
    key_columns = _key_columns(primary_key)
    if kind == "synthetic":
        _check_orders_table(table, key_columns)
        return SyntheticSource(**{**_parse_options(argument, spec_text), **options})
    if kind == "postgres":
        return _postgres_source(argument, spec_text, table.name, key_columns or table.primary_key, options)
    if kind == "kafka":
        return KafkaSource(parse_kafka_spec(argument, spec_text), table, key_columns, **options)
    return DebeziumFileSource(_debezium_path(argument, spec_text), primary_key=key_columns, spec=table, complete_file=complete, **options)


def _debezium_path(argument: str, spec_text: str) -> str:
    if not argument:
        raise SourceError(f"source {redact(spec_text)!r}: debezium needs a file path, e.g. debezium:/data/orders.jsonl")
    return argument


def source_table_spec(
    spec_text: str, table_name: str, primary_key: str | tuple[str, ...] | None = None, *, complete: bool = False
) -> TableSpec:
    """The declaration of a new cdc.<table_name> read from the source itself, before anything is committed.

    postgres: key and column types of the database table. debezium: the column types of the file's
    first schema block (the key must be given; with `complete`, as in make_source, a file without any
    change event is refused). synthetic: the orders table.
    """
    kind = source_kind(spec_text)
    if kind == "synthetic":
        return TableSpec(table_name, ORDERS_SPEC.primary_key, dict(ORDERS_SPEC.columns), ORDERS_SPEC.watermark_policy)
    if kind == "postgres":
        return postgres_table_spec(spec_text, table_name, primary_key)
    key_columns = _key_columns(primary_key)
    if kind == "kafka":  # column types come from the messages' schema blocks as they are read
        parse_kafka_spec(spec_text.strip().partition(":")[2], spec_text)
        if not key_columns:
            raise SourceError(f"cdc.{table_name} does not exist yet: give its key with --primary-key COL[,COL]")
        return TableSpec(table_name, key_columns)
    path = _debezium_path(spec_text.strip().partition(":")[2], spec_text)
    if not key_columns:
        raise SourceError(f"cdc.{table_name} does not exist yet: give its key with --primary-key COL[,COL]")
    return debezium_table_spec(path, table_name, key_columns, complete=complete)


def open_history(identity: SourceIdentity, table: TableSpec) -> ReplayableSource:
    """The source that reads a recorded history again (its spec names it exactly: a file, a generator's options)."""
    if identity.cannot_replay:
        raise ReplayNotPossible(f"{identity.spec} cannot read its history again: {identity.cannot_replay}")
    source = make_source(identity.spec, table)
    assert hasattr(source, "history"), f"{type(source).__name__} reads no history but its identity says it can"
    return source  # type: ignore[return-value]


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


def postgres_table_spec(spec_text: str, table_name: str, primary_key: str | tuple[str, ...] | None = None) -> TableSpec:
    """The declaration of cdc.<table_name> read from the PostgreSQL table a `postgres:` spec names."""
    source = _postgres_source(spec_text.strip().partition(":")[2], spec_text, table_name, _key_columns(primary_key), {})
    try:
        return source.table_spec(table_name)
    finally:
        source.close()


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
