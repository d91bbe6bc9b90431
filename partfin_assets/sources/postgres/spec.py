"""The text after `postgres:` in a source spec, `DSN[#[schema.]table][,option=value,...]`, and the registry entry's
functions: open a source from it, declare a new cdc table from the database table it names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from partfin_assets.model import conninfo
from partfin_assets.model.errors import SourceError
from partfin_assets.model.records import CdcSource
from partfin_assets.model.redaction import redact
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.model.timeutil import parse_duration
from partfin_assets.sources.postgres.source import PostgresSource


def parse_postgres_spec(argument: str, default_table: str) -> tuple[str, str, dict[str, str]]:
    """`DSN[#[schema.]table][,slot=NAME,...]` -> (dsn, table, options).

    The DSN ends at the first `#` libpq does not read as part of a password (model/conninfo.py):
    a `#` inside a password (quoted or not, in key/value pairs, URI user info or `?password=`)
    belongs to the password. A DSN libpq cannot read, or reads other than written (an '@' inside
    URI user info), is a ConninfoError that shows nothing of it.
    """
    dsn, fragment = conninfo.split_fragment(argument)
    conninfo.read(dsn)
    table, options = f"public.{default_table}", {}
    for item in filter(None, (part.strip() for part in fragment.split(","))):
        name, equals, value = item.partition("=")
        if equals:
            options[name.strip().replace("-", "_")] = value.strip()
        else:
            table = item if "." in item else f"public.{item}"
    return dsn.strip(), table, options


# ---- the registry entry's functions (sources/registry.py SOURCE_KINDS)


POSTGRES_OPTIONS: dict[str, Callable[[str], Any]] = {
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
        parse = POSTGRES_OPTIONS.get(name)
        if parse is None:
            raise SourceError(f"source {shown!r}: unknown postgres option {name!r}; known: {', '.join(POSTGRES_OPTIONS)}")
        try:
            parsed[name] = parse(value)
        except ValueError as exc:
            raise SourceError(f"source {shown!r}: option {name}: {redact(str(exc), spec_text)}") from None
    return PostgresSource(dsn, source_table, primary_key=key_columns, **{**parsed, **options})


def open_postgres(argument: str, text: str, table: TableSpec, key_columns, complete: bool, options: dict[str, Any]) -> CdcSource:
    return _postgres_source(argument, text, table.name, key_columns or table.primary_key, options)


def declare_postgres(argument: str, text: str, table_name: str, key_columns, complete: bool) -> TableSpec:
    """The declaration of cdc.<table_name> read from the PostgreSQL table a `postgres:` spec names."""
    source = _postgres_source(argument, text, table_name, key_columns, {})
    try:
        return source.table_spec(table_name)
    finally:
        source.close()
