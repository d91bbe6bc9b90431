"""Real Debezium output (../shared/debezium-corpus/) through `partfin ingest` and `partfin upsert`, as a user runs it.

For every `<table>.jsonl` of the corpus: ingest it into cdc.<table>, upsert, and compare the live rows
of base.<table> with `<table>.expected.json`, value by value. The expected values are the corpus's
(decimals as exact decimal strings, dates/times/timestamps ISO, bytes hex, geometry {wkb, srid}); the
expected *kind* of each column (a decimal, a zoneless timestamp, an int...) comes from the Connect
schema Debezium wrote in the file itself. Every difference is reported per file and per column.

The corpus is reference data: it is read where it lies, never copied into the project.
"""

from __future__ import annotations

import json
import math
import os
import struct
from datetime import UTC, date, datetime, time
from decimal import Decimal
from pathlib import Path

import pyarrow.compute as pc
import pytest

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.tables import META_COLUMNS
from partfin_assets_tests.test_cli import partfin

REPO_ROOT = Path(__file__).resolve().parents[1]


def _corpus_dir() -> Path | None:
    """`../shared/debezium-corpus` next to the repository (a worktree may sit one level deeper)."""
    configured = os.environ.get("PARTFIN_DEBEZIUM_CORPUS")
    if configured:
        return Path(configured)
    for parent in REPO_ROOT.parents:
        candidate = parent / "shared" / "debezium-corpus"
        if candidate.is_dir():
            return candidate
    return None


CORPUS = _corpus_dir()
FILES = sorted(p.stem for p in CORPUS.glob("*.jsonl")) if CORPUS else []

# --------------------------------------------------------------------------- what a user expects


def connect_fields(path: Path) -> dict[str, dict]:
    """Column -> its Connect field schema, from the before/after structs of every envelope in the file."""
    fields: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        document = json.loads(line) if line.strip() else None
        schema = document.get("schema") if isinstance(document, dict) else None
        for image in (schema or {}).get("fields", []):
            if image.get("field") in ("before", "after"):
                for field in image.get("fields", []):
                    fields.setdefault(field["field"], field)
    return fields


_KIND_BY_NAME = {
    "io.debezium.time.Date": date,
    "org.apache.kafka.connect.data.Date": date,
    "io.debezium.time.Time": time,
    "io.debezium.time.MicroTime": time,
    "io.debezium.time.NanoTime": time,
    "org.apache.kafka.connect.data.Time": time,
    "io.debezium.time.Timestamp": "timestamp",
    "io.debezium.time.MicroTimestamp": "timestamp",
    "io.debezium.time.NanoTimestamp": "timestamp",
    "org.apache.kafka.connect.data.Timestamp": "timestamp",
    "io.debezium.time.ZonedTimestamp": "timestamptz",
    "io.debezium.time.Year": int,
    "io.debezium.data.Bits": bytes,
    "io.debezium.data.Json": str,
    "io.debezium.data.Enum": str,
    "io.debezium.data.EnumSet": str,
    "io.debezium.data.Uuid": str,
    "io.debezium.data.VariableScaleDecimal": (Decimal, str),  # no fixed scale: exact text is fine
    "io.debezium.data.geometry.Point": dict,
    "io.debezium.data.geometry.Geometry": dict,
}
_KIND_BY_TYPE = {
    "int8": int, "int16": int, "int32": int, "int64": int,
    "float": float, "float32": float, "double": float, "float64": float,
    "boolean": bool, "string": str, "bytes": bytes,
}


def expected_kind(field: dict):
    """The Python value kind a user expects to read back for a Connect field."""
    name = field.get("name")
    if name == "org.apache.kafka.connect.data.Decimal":
        precision = int((field.get("parameters") or {}).get("connect.decimal.precision", 38))
        return str if precision > 38 else Decimal  # Iceberg decimals hold 38 digits: beyond, exact text
    if name in _KIND_BY_NAME:
        return _KIND_BY_NAME[name]
    return _KIND_BY_TYPE.get(field.get("type"))


def kind_of(value) -> object:
    if isinstance(value, datetime):
        return "timestamp" if value.tzinfo is None else "timestamptz"
    return type(value)


def as_expected_form(value):
    """A value read from base.<table> in the corpus's notation."""
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, datetime):
        if value.tzinfo is None:
            return value.isoformat()
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if isinstance(value, date | time):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: as_expected_form(v) for k, v in value.items()}
    return value


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def value_difference(column: str, expected, actual, field: dict | None) -> str | None:
    """None if `actual` (read from base) is what the corpus expects, else what differs."""
    kind = expected_kind(field) if field else None
    if actual is not None and kind is not None:
        allowed = kind if isinstance(kind, tuple) else (kind,)
        if kind_of(actual) not in allowed:
            return f"{column}: expected a {_kind_name(kind)}, got {_kind_name(kind_of(actual))} {actual!r}"
    shown = as_expected_form(actual)
    if expected is None or actual is None:
        return None if expected is None and actual is None else f"{column}: expected {expected!r}, got {shown!r}"
    if isinstance(expected, float) or (isinstance(expected, int) and isinstance(actual, float)):
        if isinstance(actual, float) and (
            actual == expected or _float32(actual) == _float32(expected) or (math.isnan(actual) and math.isnan(expected))
        ):
            return None
        return f"{column}: expected {expected!r}, got {shown!r}"
    if isinstance(expected, dict):  # geometry: {wkb, srid} (+ x, y for a Point)
        if not isinstance(shown, dict):
            return f"{column}: expected {expected!r}, got {shown!r}"
        wrong = [k for k in expected if k not in shown or value_difference(f"{column}.{k}", expected[k], actual.get(k), None)]
        return f"{column}: expected {expected!r}, got {shown!r} (differs in {wrong})" if wrong else None
    if field and field.get("name") == "io.debezium.data.Bits" and isinstance(actual, bytes):
        if expected in (actual.hex(), actual[::-1].hex()):  # either byte order is accepted
            return None
    if shown == expected and type(shown) is type(expected):
        return None
    return f"{column}: expected {expected!r}, got {shown!r}"


def _kind_name(kind) -> str:
    if isinstance(kind, tuple):
        return " or ".join(_kind_name(k) for k in kind)
    return kind if isinstance(kind, str) else kind.__name__


# --------------------------------------------------------------------------- the run


def base_rows(home: Path, table: str) -> tuple[dict[tuple, dict], list[str]]:
    catalog = load_partfin_catalog(home)
    data = catalog.load_table(f"base.{table}").scan().to_arrow()
    data = data.filter(pc.invert(data.column("_deleted")))
    columns = [c for c in data.column_names if c not in META_COLUMNS]
    return data.select(columns).to_pylist(), columns


def rejected_lines(home: Path, table: str) -> list[str]:
    catalog = load_partfin_catalog(home)
    if not catalog.table_exists(f"cdc.{table}__rejected"):
        return []
    return catalog.load_table(f"cdc.{table}__rejected").scan().to_arrow().column("reason").to_pylist()


def corpus_differences(home: Path, name: str) -> list[str]:
    """Everything about base.<name> that is not what <name>.expected.json says, one line each."""
    path = CORPUS / f"{name}.jsonl"
    expected = json.loads((CORPUS / f"{name}.expected.json").read_text())
    key = expected["primary_key"]
    ingest = partfin(home, "ingest", "--table", name, "--source", f"debezium:{path}", "--primary-key", ",".join(key))
    problems = []
    if ingest.returncode != 0:
        problems.append(f"ingest exit {ingest.returncode}: {ingest.stderr.strip().splitlines()[-1:]}")
    problems += [f"line rejected: {reason}" for reason in rejected_lines(home, name)]
    fields = connect_fields(path)
    expected_columns = list(expected["rows"][0]) if expected["rows"] else list(fields)
    upsert = partfin(home, "upsert", "--table", name)
    if upsert.returncode != 0:
        problems.append(f"upsert exit {upsert.returncode}: {upsert.stderr.strip().splitlines()[-1:]}")
        return [*problems, f"all {len(expected_columns)} columns and {len(expected['rows'])} row(s) lost"]

    rows, columns = base_rows(home, name)
    problems += [f"{c}: column missing from base.{name} (Connect type {_describe(fields.get(c))})" for c in expected_columns if c not in columns]
    problems += [f"{c}: column in base.{name} but not in the expected rows" for c in columns if c not in expected_columns]

    def key_of(row: dict) -> tuple:
        return tuple(json.dumps(as_expected_form(row[k]), sort_keys=True) for k in key)

    actual_by_key = {key_of(r): r for r in rows}
    expected_by_key = {key_of(r): r for r in expected["rows"]}
    problems += [f"row {k} missing from base.{name}" for k in expected_by_key if k not in actual_by_key]
    problems += [f"row {k} in base.{name} but not expected" for k in actual_by_key if k not in expected_by_key]
    for k, want in expected_by_key.items():
        got = actual_by_key.get(k)
        if got is None:
            continue
        for column, value in want.items():
            if column in got:
                difference = value_difference(column, value, got[column], fields.get(column))
                if difference:
                    problems.append(f"row {k}: {difference}")
    return problems


def _describe(field: dict | None) -> str:
    if not field:
        return "?"
    return field.get("name") or field.get("type", "?")


@pytest.mark.skipif(CORPUS is None, reason="../shared/debezium-corpus is not next to this repository (or set PARTFIN_DEBEZIUM_CORPUS)")
@pytest.mark.parametrize("name", FILES)
def test_corpus_file_lands_in_base_exactly(tmp_path, name):
    problems = corpus_differences(tmp_path, name)
    report = "\n".join(f"  {p}" for p in problems) or "  all rows and columns as expected"
    print(f"\n{name}: {len(problems)} difference(s)\n{report}")
    assert not problems, f"{name}: base.{name} differs from {name}.expected.json:\n{report}"
