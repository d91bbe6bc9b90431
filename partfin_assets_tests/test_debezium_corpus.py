"""Real Debezium output (../shared/debezium-corpus/) through `partfin ingest` and `partfin upsert`, as a user runs it.

For every `<table>.jsonl` of the corpus: ingest it into cdc.<table>, upsert, and compare the live rows
of base.<table> with `<table>.expected.json`, value by value. The expected values are the corpus's
(decimals as exact decimal strings, dates/times/timestamps ISO, bytes hex, geometry {wkb, srid}); the
expected *kind* of each column (a decimal, a zoneless timestamp, an int...) comes from the Connect
schema Debezium wrote in the file itself. Every difference is reported per file and per column.

The corpus is reference data: it is read where it lies, never copied into the project.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import struct
from dataclasses import dataclass
from datetime import UTC, date, datetime, time
from decimal import Context, Decimal
from pathlib import Path

import pyarrow.compute as pc
import pytest

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.tables import DELETED, META_COLUMNS
from partfin_assets_tests.test_cli import partfin

REPO_ROOT = Path(__file__).resolve().parents[1]


def _corpus_dir() -> Path | None:
    """`../shared/debezium-corpus` next to the repository (a worktree may sit one level deeper), or next to the local
    repository this one was cloned from (a clone in a temporary directory, `git clone -q . "$(mktemp -d)"`)."""
    configured = os.environ.get("PARTFIN_DEBEZIUM_CORPUS")
    if configured:
        return Path(configured)
    roots = [REPO_ROOT]
    origin = subprocess.run(["git", "-C", str(REPO_ROOT), "config", "--get", "remote.origin.url"], capture_output=True, text=True)
    if origin.returncode == 0 and Path(origin.stdout.strip()).is_dir():
        roots.append(Path(origin.stdout.strip()).resolve())
    for root in roots:
        for parent in root.parents:
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
        single = field is not None and field.get("type") in ("float", "float32")  # a float32 column: its precision
        if isinstance(actual, float) and (
            actual == expected or (single and _float32(actual) == _float32(expected)) or (math.isnan(actual) and math.isnan(expected))
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


def base_rows(home: Path, table: str) -> tuple[list[dict], list[str]]:
    catalog = load_partfin_catalog(home)
    data = catalog.load_table(f"base.{table}").scan().to_arrow()
    data = data.filter(pc.invert(data.column(DELETED)))
    columns = [c for c in data.column_names if c not in META_COLUMNS]
    return data.select(columns).to_pylist(), columns


def set_aside(home: Path, identifier: str) -> list[str]:
    """The reasons in a rejected (cdc.<t>__rejected) or quarantine (base.<t>__rejected) table, if it exists."""
    catalog = load_partfin_catalog(home)
    if not catalog.table_exists(identifier):
        return []
    return catalog.load_table(identifier).scan().to_arrow().column("reason").to_pylist()


@dataclass
class Landed:
    """What `partfin ingest` + `partfin upsert` of one corpus file left: problems on the way, base's live rows."""

    problems: list[str]
    rows: list[dict]
    columns: list[str]


def corpus_key(name: str) -> list[str]:
    return json.loads((CORPUS / f"{name}.expected.json").read_text())["primary_key"]


def land(home: Path, name: str) -> Landed:
    """Ingest <name>.jsonl and upsert, as a user does; every rejected line, quarantined change or warning is a problem."""
    path = CORPUS / f"{name}.jsonl"
    ingest = partfin(home, "ingest", "--table", name, "--source", f"debezium:{path}", "--primary-key", ",".join(corpus_key(name)))
    problems = []
    if ingest.returncode != 0:
        problems.append(f"ingest exit {ingest.returncode}: {ingest.stderr.strip().splitlines()[-1:]}")
    return upsert_ingested(home, name, problems, ingest.stderr)


def upsert_ingested(home: Path, name: str, problems: list[str] = (), ingest_stderr: str = "") -> Landed:
    """After cdc.<name> was ingested (from whichever source): its rejected lines, `partfin upsert`, its
    quarantined changes and warnings, then base's live rows."""
    problems = [*problems, *(f"line rejected: {reason}" for reason in set_aside(home, f"cdc.{name}__rejected"))]
    upsert = partfin(home, "upsert", "--table", name)
    if upsert.returncode != 0:
        problems.append(f"upsert exit {upsert.returncode}: {upsert.stderr.strip().splitlines()[-1:]}")
        return Landed(problems, [], [])
    problems += [f"change quarantined: {reason}" for reason in set_aside(home, f"base.{name}__rejected")]
    # a warning means a column was not typed from its schema (an unknown type, an undeclared column)
    problems += [line for line in (ingest_stderr + upsert.stderr).splitlines() if line.startswith(("WARNING", "ERROR"))]
    rows, columns = base_rows(home, name)
    return Landed(problems, rows, columns)


def differences(expected: dict, rows: list[dict], columns: list[str], fields: dict[str, dict], table: str) -> list[str]:
    """Everything about base.<table>'s live rows that is not what the expected file says, one line each."""
    key = expected["primary_key"]
    expected_columns = list(expected["rows"][0]) if expected["rows"] else list(fields)
    problems = [f"{c}: column missing from base.{table} (Connect type {_describe(fields.get(c))})" for c in expected_columns if c not in columns]
    problems += [f"{c}: column in base.{table} but not in the expected rows" for c in columns if c not in expected_columns]

    def key_of(row: dict) -> tuple:
        return tuple(json.dumps(as_expected_form(row.get(k)), sort_keys=True) for k in key)

    actual_by_key = {key_of(r): r for r in rows}
    expected_by_key = {key_of(r): r for r in expected["rows"]}
    if len(actual_by_key) != len(rows):
        problems.append(f"base.{table} holds {len(rows)} live rows for {len(actual_by_key)} keys")
    problems += [f"row {k} missing from base.{table}" for k in expected_by_key if k not in actual_by_key]
    problems += [f"row {k} in base.{table} but not expected" for k in actual_by_key if k not in expected_by_key]
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


def corpus_differences(home: Path, name: str) -> list[str]:
    """Everything about base.<name> that is not what <name>.expected.json says, one line each."""
    return expected_differences(land(home, name), name)


def base_differences(home: Path, name: str) -> list[str]:
    """The same for a cdc.<name> ingested from another source (Kafka): upsert, then compare."""
    return expected_differences(upsert_ingested(home, name), name)


def expected_differences(landed: Landed, name: str) -> list[str]:
    expected = json.loads((CORPUS / f"{name}.expected.json").read_text())
    if not landed.columns:
        return [*landed.problems, f"all {len(expected['rows'][0]) if expected['rows'] else 0} columns and {len(expected['rows'])} row(s) lost"]
    fields = connect_fields(CORPUS / f"{name}.jsonl")
    return landed.problems + differences(expected, landed.rows, landed.columns, fields, name)


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


# --------------------------------------------------------------------------- the comparison can fail

skip_without_corpus = pytest.mark.skipif(CORPUS is None, reason="../shared/debezium-corpus is not next to this repository")


@skip_without_corpus
def test_every_corpus_file_has_its_expected_rows():
    """The parametrized test above cannot pass by finding nothing: every file is there with rows to compare."""
    expected = sorted(p.name.removesuffix(".expected.json") for p in CORPUS.glob("*.expected.json"))
    assert FILES and FILES == expected
    assert all(json.loads((CORPUS / f"{name}.expected.json").read_text())["rows"] for name in FILES)


ALL_TYPES = "mysql_all_types"  # one row, 78 columns: every kind of value the corpus has


@pytest.fixture(scope="module")
def all_types(tmp_path_factory) -> Landed:
    landed = land(tmp_path_factory.mktemp("corpus"), ALL_TYPES)
    assert not landed.problems and landed.rows
    return landed


def _expected(edit):
    """A mutation of the expected row."""
    return lambda expected, rows: edit(expected["rows"][0])


def _actual(edit):
    """A mutation of the row read from base (what a wrong decoder would have stored)."""
    return lambda expected, rows: edit(rows[0])


def _set(column, value):
    return lambda row: row.__setitem__(column, value)


# each must be reported, naming the column (or the row): what a wrong decoder or an empty table would look like
MUTATIONS = {
    "decimal-scale": ("_numeric", _expected(_set("_numeric", "12345.11"))),
    "decimal-last-digit": ("_big_decimal", _expected(_set("_big_decimal", "2222222222222222300000001111.1234567891"))),
    "decimal-as-text": ("_numeric", _actual(lambda row: row.__setitem__("_numeric", str(row["_numeric"])))),
    "decimal-via-float": ("_big_decimal", _actual(lambda row: row.__setitem__("_big_decimal", Decimal(float(row["_big_decimal"])).quantize(Decimal("1E-10"), context=Context(prec=60))))),
    "beyond-38-digits-as-float": ("_fixed", _actual(lambda row: row.__setitem__("_fixed", float(row["_fixed"])))),
    "double-next-ulp": ("_double", _expected(lambda row: row.__setitem__("_double", math.nextafter(row["_double"], 2.0)))),
    "double-as-float32": ("_real", _actual(lambda row: row.__setitem__("_real", _float32(row["_real"])))),
    "int-as-float": ("_tinyint", _expected(_set("_tinyint", 1.0))),
    "int-as-bool": ("_boolean", _expected(_set("_boolean", True))),
    "bool-as-int": ("_bit1", _actual(_set("_bit1", 1))),
    "zoneless-timestamp-with-zone": ("_datetime6", _actual(lambda row: row.__setitem__("_datetime6", row["_datetime6"].replace(tzinfo=UTC)))),
    "zoned-timestamp-without-zone": ("_timestamp", _actual(lambda row: row.__setitem__("_timestamp", row["_timestamp"].replace(tzinfo=None)))),
    "timestamp-microsecond": ("_datetime6", _expected(_set("_datetime6", "2023-03-23T14:30:05.123457"))),
    "date": ("_date", _expected(_set("_date", "2023-03-24"))),
    "date-as-text": ("_date", _actual(_set("_date", "2023-03-23"))),
    "time": ("_time", _expected(_set("_time", "10:13:24"))),
    "year": ("_year", _expected(_set("_year", 2024))),
    "bytes": ("_bin", _expected(_set("_bin", "62797465730000000001"))),
    "bits": ("_bit", _expected(_set("_bit", "c707000000000001"))),
    "json-text": ("_json", _expected(_set("_json", '{"a":"b"}'))),
    "null": ("_char", _actual(_set("_char", None))),
    "point-srid": ("_point", _actual(lambda row: row.__setitem__("_point", {**row["_point"], "srid": 4326}))),
    "geometry-wkb": ("_geometry", _actual(lambda row: row.__setitem__("_geometry", {**row["_geometry"], "wkb": b"\x01"}))),
    "column-missing": ("_extra", _expected(_set("_extra", 1))),
    "column-unexpected": ("_set: column in base", _expected(lambda row: row.pop("_set"))),
    "another-key": ("missing from base", _expected(_set("_id", 2))),
    "table-empty": ("missing from base", lambda expected, rows: rows.clear()),
    "row-twice": ("live rows for 1 keys", lambda expected, rows: rows.append(dict(rows[0]))),
}


@skip_without_corpus
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_the_comparison_reports_every_kind_of_difference(all_types, mutation):
    needle, mutate = MUTATIONS[mutation]
    expected = json.loads((CORPUS / f"{ALL_TYPES}.expected.json").read_text())
    fields = connect_fields(CORPUS / f"{ALL_TYPES}.jsonl")
    assert not differences(expected, all_types.rows, all_types.columns, fields, ALL_TYPES)
    rows = copy.deepcopy(all_types.rows)
    mutate(expected, rows)
    found = differences(expected, rows, all_types.columns, fields, ALL_TYPES)
    assert found and any(needle in line for line in found), found
