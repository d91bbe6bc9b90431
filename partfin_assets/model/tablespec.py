"""A table is declared once; the CDC table, base table, assets and checks all derive from it."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import pyarrow as pa

from partfin_assets.model.errors import InvalidInput, SourceError
from partfin_assets.model.summary_keys import PROP_COLUMNS, PROP_PRIMARY_KEY
from partfin_assets.model.table_options import WATERMARK_POLICY

DEFAULT_WATERMARK_POLICY = WATERMARK_POLICY.default
# partfin's companion tables of cdc.<t> and base.<t>: cdc.<t>__rejected, cdc.<t>__ledger, cdc.<t>__erasures,
# base.<t>__rejected
REJECTED_SUFFIX = "__rejected"
LEDGER_SUFFIX = "__ledger"
ERASURES_SUFFIX = "__erasures"
COMPANION_SUFFIXES = (REJECTED_SUFFIX, LEDGER_SUFFIX, ERASURES_SUFFIX)


def check_table_name(name: str) -> str:
    """A table name a user gives, if partfin can use it: a plain identifier that is not a companion table's name."""
    if not name.isidentifier():
        raise InvalidInput(f"table name {name!r} must be a plain identifier: letters, digits and _ (it becomes cdc.<name>)")
    for suffix in COMPANION_SUFFIXES:
        if name.endswith(suffix) and name != suffix:
            owner = name[: -len(suffix)]
            raise InvalidInput(f"table name {name!r} is taken by partfin: cdc.{name} is the {suffix[2:]} table of cdc.{owner}; "
                               "choose a name that does not end in " + " or ".join(COMPANION_SUFFIXES))
    return name

_SIMPLE_TYPES = {
    "bool": pa.bool_(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float": pa.float32(),
    "double": pa.float64(),
    "string": pa.string(),
    "binary": pa.binary(),
    "date32[day]": pa.date32(),
    "time64[us]": pa.time64("us"),
    "timestamp[us, tz=UTC]": pa.timestamp("us", tz="UTC"),
    "timestamp[us]": pa.timestamp("us"),
}


# How a decimal column's values are written in JSON without a schema block (a Debezium/Kafka Connect message with
# schemas.enable=false), where a string could be either: `base64`, a Connect Decimal's unscaled two's-complement
# big-endian bytes (JsonConverter's default decimal.format=BASE64 with Debezium's default decimal.handling.mode=precise);
# `numeric`, a JSON number (decimal.format=NUMERIC) or decimal text in a string (decimal.handling.mode=string).
# Declared after the type, `decimal128(12, 2) numeric`; a decimal declared without one has the default.
DECIMAL_ENCODINGS = ("base64", "numeric")
DEFAULT_DECIMAL_ENCODING = "base64"


def type_to_text(data_type: pa.DataType) -> str:
    """A declared column type as text: a simple type, decimal128(p, s), or a struct of those (geometry)."""
    if pa.types.is_struct(data_type):
        fields = [data_type.field(i) for i in range(data_type.num_fields)]
        for child in fields:
            if not child.name.isidentifier():
                raise InvalidInput(f"struct field name {child.name!r} is not supported in a table declaration")
        return "struct<" + ", ".join(f"{child.name}: {type_to_text(child.type)}" for child in fields) + ">"
    text = str(data_type)
    if text not in _SIMPLE_TYPES and not isinstance(data_type, pa.Decimal128Type):
        raise InvalidInput(f"column type {text} is not supported in a table declaration")
    return text


def type_from_text(text: str) -> pa.DataType:
    if text in _SIMPLE_TYPES:
        return _SIMPLE_TYPES[text]
    match = re.fullmatch(r"decimal128\((\d+), (\d+)\)", text)
    if match:
        return pa.decimal128(int(match[1]), int(match[2]))
    if text.startswith("struct<") and text.endswith(">"):
        return pa.struct([_struct_field(item) for item in _top_level_items(text[len("struct<") : -1])])
    raise InvalidInput(f"column type {text!r} is not supported in a table declaration")


def column_from_text(text: str) -> tuple[pa.DataType, str | None]:
    """A declared column's type text: its type, and the decimal encoding written after it (`decimal128(12, 2) numeric`)."""
    head, space, encoding = text.rpartition(" ")
    if space and encoding in DECIMAL_ENCODINGS:
        data_type = type_from_text(head)
        if not pa.types.is_decimal(data_type):
            raise InvalidInput(f"column type {text!r}: only a decimal has an encoding ({', '.join(DECIMAL_ENCODINGS)})")
        return data_type, encoding
    return type_from_text(text), None


def column_to_text(data_type: pa.DataType, encoding: str | None) -> str:
    """The inverse of `column_from_text`: the default encoding is not written."""
    text = type_to_text(data_type)
    return f"{text} {encoding}" if encoding not in (None, DEFAULT_DECIMAL_ENCODING) else text


def _struct_field(item: str) -> pa.Field:
    name, colon, child = item.partition(": ")
    if not colon or not name.isidentifier():
        raise InvalidInput(f"struct field {item!r} is not supported in a table declaration")
    return pa.field(name, type_from_text(child))


def _top_level_items(text: str) -> list[str]:
    """Split `a: int32, b: struct<c: int32, d: binary>` at the commas outside <> and ()."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char in "<("
        depth -= char in ">)"
        if char == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    items.append(text[start:].strip())
    return [item for item in items if item]


@dataclass(frozen=True)
class TableSpec:
    name: str  # bare name: cdc.<name> and base.<name>
    primary_key: tuple[str, ...]
    # Typed columns of base.<name> (primary key included), mapped from the CDC payload.
    columns: dict[str, pa.DataType] = field(default_factory=dict)
    # None: not declared (a new table gets the default; an existing one keeps its own). A declaration that differs
    # from the table's takes effect with the next writer, as a recorded policy change (watermark/change.py).
    watermark_policy: str | None = None
    # Decimal columns whose schemaless JSON is not in the default encoding, e.g. {"amount": "numeric"} (DECIMAL_ENCODINGS)
    decimal_encodings: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_table_name(self.name)
        for column, encoding in self.decimal_encodings.items():
            if encoding not in DECIMAL_ENCODINGS:
                raise InvalidInput(f"table {self.name!r}: column {column!r}: decimal encoding {encoding!r} is not one of "
                                   f"{', '.join(DECIMAL_ENCODINGS)}")
            if not pa.types.is_decimal(self.columns.get(column, pa.null())):
                raise InvalidInput(f"table {self.name!r}: column {column!r} has a decimal encoding but is not a declared decimal")
        if not self.primary_key:
            raise InvalidInput(f"table {self.name!r} declares no primary key")
        missing = [c for c in self.primary_key if self.columns and c not in self.columns]
        if missing:
            raise InvalidInput(
                f"table {self.name!r}: primary-key column(s) {missing} are not among its columns {list(self.columns)}"
            )

    def to_properties(self) -> dict[str, str]:
        """The declaration as table properties; `from_properties` reads it back whole."""
        declared = {WATERMARK_POLICY.key: self.watermark_policy} if self.watermark_policy is not None else {}
        return {
            PROP_PRIMARY_KEY: ",".join(self.primary_key),
            PROP_COLUMNS: json.dumps({n: column_to_text(t, self.decimal_encodings.get(n)) for n, t in self.columns.items()},
                                     separators=(",", ":")),
            **declared,
        }

    @classmethod
    def from_properties(cls, name: str, properties: Mapping[str, str]) -> TableSpec:
        if PROP_PRIMARY_KEY not in properties:
            raise InvalidInput(f"cdc.{name} carries no table declaration (property {PROP_PRIMARY_KEY}); ingest with partfin first")
        columns = {n: column_from_text(t) for n, t in json.loads(properties.get(PROP_COLUMNS) or "{}").items()}
        return cls(
            name=name,
            primary_key=tuple(properties[PROP_PRIMARY_KEY].split(",")),
            columns={n: data_type for n, (data_type, _) in columns.items()},
            watermark_policy=properties.get(WATERMARK_POLICY.key),  # partfin writes it with every cdc table
            decimal_encodings={n: encoding for n, (_, encoding) in columns.items() if encoding is not None},
        )

    @property
    def cdc_identifier(self) -> str:
        return f"cdc.{self.name}"

    @property
    def base_identifier(self) -> str:
        return f"base.{self.name}"

    @property
    def rejected_identifier(self) -> str:
        """Lines the CDC writer could not read (the raw line and why)."""
        return f"cdc.{self.name}{REJECTED_SUFFIX}"

    @property
    def quarantine_identifier(self) -> str:
        """CDC changes the upsert could not decode (key, source position and why)."""
        return f"base.{self.name}{REJECTED_SUFFIX}"

    @property
    def row_identifiers(self) -> tuple[str, ...]:
        """Every table holding the table's rows or raw lines: what a privacy request erases from and maintenance expires."""
        return (self.cdc_identifier, self.rejected_identifier, self.base_identifier, self.quarantine_identifier)


def new_table_key(table_name: str, key_columns: tuple[str, ...] | None) -> tuple[str, ...]:
    """The key of a cdc.<table_name> about to be declared from a source that does not know it (a file, a topic)."""
    if not key_columns:
        raise SourceError(f"cdc.{table_name} does not exist yet: give its key with --primary-key COL[,COL]")
    return key_columns
