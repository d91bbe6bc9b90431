"""Source specs and the registry of source kinds: `synthetic[:option=value,...]`, `debezium:PATH`,
`postgres:DSN[#[schema.]table][,option=value,...]`, `kafka:BOOTSTRAP#TOPIC[,option=value,...]`.

A spec is read once into a `SourceSpec` (its kind's entry + what follows `kind:`); each kind is one
`SourceKind` line in SOURCE_KINDS below, whose `open` and `declare` live with the source and read
the kind's own options (sources/synthetic.py, sources/debezium.py, sources/postgres/spec.py,
sources/kafka.py; docs/sources.md describes each kind's options).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from partfin_assets.model.errors import SourceError
from partfin_assets.model.records import CdcSource, ReplayableSource
from partfin_assets.model.source_identity import ReplayNotPossible, SourceIdentity
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.sources.debezium import DebeziumFileSource, declare_debezium, open_debezium
from partfin_assets.sources.kafka import KafkaSource, declare_kafka, open_kafka
from partfin_assets.sources.postgres import PostgresSource
from partfin_assets.sources.postgres.spec import declare_postgres, open_postgres
from partfin_assets.sources.synthetic import SyntheticSource, declare_synthetic, open_synthetic


@dataclass(frozen=True)
class SourceKind:
    """One registry entry: the kind's source class (its bases declare its capabilities), how its spec opens a source
    and declares a new cdc table.

    `open(argument, text, table, key_columns, complete, options)` -> the source; `declare(argument, text, table_name,
    key_columns, complete)` -> the declaration of a new cdc.<table_name> read from the source itself (see source_table_spec).
    """

    name: str
    usage: str  # the spec's form, as the unknown-kind error and docs/sources.md show it
    source: type[CdcSource]
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
    return spec.kind.open(spec.argument, spec.text, table, _key_columns(primary_key), complete, options)


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
    return spec.kind.declare(spec.argument, spec.text, table_name, _key_columns(primary_key), complete)





def open_history(identity: SourceIdentity, table: TableSpec) -> ReplayableSource:
    """The source that reads a recorded history again (its spec names it exactly: a file, a generator's options)."""
    if identity.cannot_replay:
        raise ReplayNotPossible(f"{identity.spec} cannot read its history again: {identity.cannot_replay}")
    source = make_source(identity.spec, table)
    assert isinstance(source, ReplayableSource), f"{type(source).__name__} reads no history but its identity says it can"
    return source


def _key_columns(primary_key: str | tuple[str, ...] | None) -> tuple[str, ...] | None:
    if isinstance(primary_key, str):  # as given on the command line: "id,region"
        primary_key = tuple(column.strip() for column in primary_key.split(",") if column.strip())
    return tuple(primary_key) if primary_key else None


# One entry per source kind: adding a source is its package and one line here.
SOURCE_KINDS: dict[str, SourceKind] = {kind.name: kind for kind in (
    SourceKind("synthetic", "synthetic[:option=value,...]", SyntheticSource, open_synthetic, declare_synthetic),
    SourceKind("debezium", "debezium:PATH", DebeziumFileSource, open_debezium, declare_debezium),
    SourceKind("postgres", "postgres:DSN[#schema.table]", PostgresSource, open_postgres, declare_postgres),
    SourceKind("kafka", "kafka:BOOTSTRAP#TOPIC[,option=value,...]", KafkaSource, open_kafka, declare_kafka),
)}
