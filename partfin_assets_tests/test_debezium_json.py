"""The Debezium JSON decoder (sources/debezium_json.py), message by message: what a file source and a Kafka source call."""

from __future__ import annotations

import base64
import json
import logging
import re
from datetime import datetime, time
from decimal import Decimal

import pyarrow as pa
import pytest

from partfin_assets.iceberg.tables import DELETED
from partfin_assets.sources.debezium_json import (
    DebeziumJsonDecoder,
    DecodedChange,
    DecodedHeartbeat,
    RejectedMessage,
    connect_column,
)
from partfin_assets_tests.debezium_lines import change_line, heartbeat_line

TS_MS = 1_793_491_200_000  # 2026-11-01T00:00:00Z
DECIMAL = "org.apache.kafka.connect.data.Decimal"


def decimal_field(scale: int, precision: int | None = None) -> dict:
    parameters = {"scale": str(scale), **({"connect.decimal.precision": str(precision)} if precision else {})}
    return {"type": "bytes", "name": DECIMAL, "parameters": parameters}


def unscaled_base64(unscaled: int) -> str:
    return base64.b64encode(unscaled.to_bytes((unscaled.bit_length() + 8) // 8, "big", signed=True)).decode()


def decoded_payload(field: dict, value, declared: dict | None = None) -> dict:
    fields = {"id": {"type": "int64"}, "c": field}
    change = DebeziumJsonDecoder("t", ("id",), declared).decode(change_line({"id": 1, "c": value}, TS_MS, fields=fields))
    assert isinstance(change, DecodedChange)
    return json.loads(change.payload)


# Connect field schema, value as Debezium writes it, column type, payload value (partfin's convention)
TYPES = [
    ({"type": "int8"}, 7, pa.int32(), 7),
    ({"type": "int16"}, -300, pa.int32(), -300),
    ({"type": "int32"}, 2**31 - 1, pa.int32(), 2**31 - 1),
    ({"type": "int64"}, 2**62, pa.int64(), 2**62),
    ({"type": "float"}, 0.0211, pa.float32(), 0.0211),
    ({"type": "double"}, 1.000011, pa.float64(), 1.000011),
    ({"type": "double"}, "NaN", pa.float64(), "NaN"),
    ({"type": "double"}, "-Infinity", pa.float64(), "-Infinity"),
    ({"type": "float64"}, 0.5, pa.float64(), 0.5),
    ({"type": "boolean"}, True, pa.bool_(), True),
    ({"type": "string"}, "ünï", pa.string(), "ünï"),
    ({"type": "bytes"}, "AAEC", pa.binary(), "AAEC"),
    ({"type": "bytes", "name": "io.debezium.data.Bits", "parameters": {"length": "64"}}, "xwcAAAAAAAA=", pa.binary(), "xwcAAAAAAAA="),
    (decimal_field(2, 5), "MDk=", pa.decimal128(5, 2), "123.45"),
    (decimal_field(2, 5), 123.4, pa.decimal128(5, 2), "123.40"),  # decimal.format=NUMERIC
    (decimal_field(6, 5), unscaled_base64(23456), pa.decimal128(6, 6), "0.023456"),  # numeric(5,6): widened to the scale
    (decimal_field(2), unscaled_base64(12345678), pa.decimal128(38, 2), "123456.78"),  # money: no precision
    (decimal_field(0, 39), unscaled_base64(58569102859845154622791691858438258688), pa.string(), "58569102859845154622791691858438258688"),
    (
        {"type": "struct", "name": "io.debezium.data.VariableScaleDecimal", "fields": []},
        {"scale": 3, "value": "AeJA1Q=="},
        pa.string(),
        "31604.949",
    ),
    ({"type": "int32", "name": "io.debezium.time.Date"}, 19284, pa.date32(), "2022-10-19"),
    ({"type": "int32", "name": "org.apache.kafka.connect.data.Date"}, -1, pa.date32(), "1969-12-31"),
    ({"type": "int32", "name": "io.debezium.time.Time"}, 10162813, pa.time64("us"), "02:49:22.813000"),
    ({"type": "int64", "name": "io.debezium.time.MicroTime"}, 86_399_999_999, pa.time64("us"), "23:59:59.999999"),
    ({"type": "int64", "name": "io.debezium.time.NanoTime"}, 1_000_001_999, pa.time64("us"), "00:00:01.000001"),
    ({"type": "int32", "name": "org.apache.kafka.connect.data.Time"}, 0, pa.time64("us"), "00:00:00"),
    ({"type": "int64", "name": "io.debezium.time.Timestamp"}, 1666147762813, pa.timestamp("us"), "2022-10-19T02:49:22.813000"),
    ({"type": "int64", "name": "io.debezium.time.MicroTimestamp"}, -1, pa.timestamp("us"), "1969-12-31T23:59:59.999999"),
    ({"type": "int64", "name": "io.debezium.time.NanoTimestamp"}, 1_000_000_000, pa.timestamp("us"), "1970-01-01T00:00:01"),
    ({"type": "int64", "name": "org.apache.kafka.connect.data.Timestamp"}, 0, pa.timestamp("us"), "1970-01-01T00:00:00"),
    ({"type": "string", "name": "io.debezium.time.ZonedTimestamp"}, "2011-12-12T13:12:12.123456789+01:00", pa.timestamp("us", tz="UTC"), "2011-12-12T12:12:12.123456Z"),
    ({"type": "int32", "name": "io.debezium.time.Year"}, 2023, pa.int32(), 2023),
    ({"type": "string", "name": "io.debezium.data.Json"}, '{"a": "b"}', pa.string(), '{"a": "b"}'),
    ({"type": "string", "name": "io.debezium.data.Enum"}, "value1", pa.string(), "value1"),
    ({"type": "string", "name": "io.debezium.data.EnumSet"}, "a,b", pa.string(), "a,b"),
    ({"type": "string", "name": "io.debezium.data.Uuid"}, "855ac320-1067-4d99-b4f1-6d46c64c514f", pa.string(), "855ac320-1067-4d99-b4f1-6d46c64c514f"),
    (
        {"type": "struct", "name": "io.debezium.data.geometry.Point", "fields": []},
        {"x": 1.0, "y": 2.0, "wkb": "AQEAAAAAAAAAAADwPwAAAAAAAABA", "srid": 4326},
        pa.struct([("x", pa.float64()), ("y", pa.float64()), ("wkb", pa.binary()), ("srid", pa.int32())]),
        {"x": 1.0, "y": 2.0, "wkb": "AQEAAAAAAAAAAADwPwAAAAAAAABA", "srid": 4326},
    ),
    (
        {"type": "struct", "name": "io.debezium.data.geometry.Geometry", "fields": []},
        {"wkb": "AQEAAAAAAAAAAADwPwAAAAAAAABA", "srid": None},
        pa.struct([("wkb", pa.binary()), ("srid", pa.int32())]),
        {"wkb": "AQEAAAAAAAAAAADwPwAAAAAAAABA", "srid": None},
    ),
    ({"type": "array", "items": {"type": "string"}}, ["a", "b"], pa.string(), '["a","b"]'),
]


@pytest.mark.parametrize(("field", "value", "column_type", "payload"), TYPES, ids=[f"{t[0].get('name') or t[0]['type']}-{i}" for i, t in enumerate(TYPES)])
def test_every_connect_type_has_a_column_type_and_an_exact_payload_value(field, value, column_type, payload):
    assert connect_column(field).type == column_type
    assert decoded_payload(field, value)["c"] == payload


def test_decimals_are_exact_whatever_their_size_and_form():
    # a JSON number is never read through a float (it would come back ...2222400000000000.0000000000)
    line = change_line({"id": 1, "c": 0}, TS_MS, fields={"id": {"type": "int64"}, "c": decimal_field(10, 38)})
    exact = line.replace('"c":0', '"c":2222222222222222300000001111.1234567890')
    change = DebeziumJsonDecoder("t", ("id",)).decode(exact)
    assert json.loads(change.payload)["c"] == "2222222222222222300000001111.1234567890"
    # 38 digits from base64 bytes: no 28-digit context rounding
    big = 12345678901234567890123456789012345678
    assert decoded_payload(decimal_field(10, 38), unscaled_base64(big))["c"] == "1234567890123456789012345678.9012345678"
    assert decoded_payload(decimal_field(0, 39), unscaled_base64(-(10**38)))["c"] == "-" + "1" + "0" * 38


def test_bare_nan_and_infinity_tokens_are_floats_kept():
    fields = {"id": {"type": "int64"}, "c": {"type": "double"}}
    for token, kept in (("NaN", "NaN"), ("Infinity", "Infinity"), ("-Infinity", "-Infinity")):
        line = change_line({"id": 1, "c": 0.25}, TS_MS, fields=fields).replace('"c":0.25', f'"c":{token}')
        assert json.loads(DebeziumJsonDecoder("t", ("id",)).decode(line).payload)["c"] == kept


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ({"type": "int16"}, 2**31, "column 'c': 2147483648 is out of the int32 range"),
        ({"type": "int64"}, "7", "column 'c': not an integer: '7'"),
        ({"type": "double"}, "lots", "column 'c': not a number: 'lots'"),
        (decimal_field(2, 5), 1234.5, "column 'c': 1234.50 has more than 5 digits"),
        (decimal_field(2, 5), 1.234, "column 'c': 1.234 has more than 2 fraction digits"),
        ({"type": "int64", "name": "io.debezium.time.MicroTime"}, 86_400_000_000, "column 'c': 86400000000 is not a time of day"),
        ({"type": "bytes"}, "not base64!", "column 'c': not base64 text"),
    ],
)
def test_a_value_that_does_not_fit_rejects_the_message_naming_the_column(field, value, reason):
    with pytest.raises(RejectedMessage, match="^bad column value in 'after': " + reason.replace("(", r"\(")):
        decoded_payload(field, value)


def test_an_unknown_type_is_kept_as_text_with_one_warning_naming_the_column(caplog):
    fields = {"id": {"type": "int64"}, "vec": {"type": "struct", "name": "io.debezium.data.SparseVector", "fields": []}}
    decoder = DebeziumJsonDecoder("t", ("id",))
    with caplog.at_level(logging.WARNING):
        for i in range(3):
            change = decoder.decode(change_line({"id": i, "vec": {"dimensions": 3, "vector": {"1": 0.5}}}, TS_MS, fields=fields))
    assert json.loads(change.payload)["vec"] == '{"dimensions":3,"vector":{"1":0.5}}'
    assert decoder.column_types()["vec"] == pa.string()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["cdc.t: column 'vec': Debezium type io.debezium.data.SparseVector (struct) is unknown to partfin: kept as text"]


@pytest.mark.parametrize(
    ("ts_ms", "reason"),
    [
        (float("nan"), "source.ts_ms is not a finite number: NaN"),
        (float("inf"), "source.ts_ms is not a finite number: Infinity"),
        (2**64, "source.ts_ms 18446744073709551616 is outside the plausible range"),
        (-1, "source.ts_ms -1 is outside the plausible range"),
        (TS_MS * 1000, "microseconds sent as milliseconds?"),
        (TS_MS * 1_000_000, "nanoseconds sent as milliseconds?"),
        ("soon", "source.ts_ms is not an integer: 'soon'"),
        (1.5, "source.ts_ms is not an integer"),
    ],
)
def test_implausible_event_times_are_rejected_with_the_reason(ts_ms, reason):
    with pytest.raises(RejectedMessage, match=reason.replace("?", r"\?").replace("(", r"\(")):
        DebeziumJsonDecoder("t", ("id",)).decode(change_line({"id": 1, "amount": 1.0, "note": None}, ts_ms))


def test_epoch_zero_is_plausible_and_the_envelope_ts_ms_is_the_arrival_time():
    decoder = DebeziumJsonDecoder("t", ("id",))
    assert decoder.decode(change_line({"id": 1, "amount": 1.0, "note": None}, 0)).event_time_us == 0  # Flink CDC's snapshot rows
    change = decoder.decode(change_line({"id": 1, "amount": 1.0, "note": None}, TS_MS, arrival_ms=TS_MS + 1500))
    assert (change.event_time_us, change.arrival_us) == (TS_MS * 1000, (TS_MS + 1500) * 1000)


def test_heartbeats_tombstones_and_kafka_null_values():
    decoder = DebeziumJsonDecoder("t", ("id",))
    assert decoder.decode(heartbeat_line(TS_MS)) == DecodedHeartbeat(TS_MS * 1000)
    assert decoder.decode(heartbeat_line(TS_MS, wrapped=False).encode()) == DecodedHeartbeat(TS_MS * 1000)
    assert decoder.decode(b'{"schema":null,"payload":null}') is None
    assert decoder.decode(None) is None and decoder.decode(b"") is None
    with pytest.raises(RejectedMessage, match="heartbeat ts_ms is not a finite number"):
        decoder.decode(heartbeat_line(TS_MS).replace(str(TS_MS), "NaN"))


def test_a_repeated_schema_block_is_parsed_once_and_decodes_the_same():
    decoder = DebeziumJsonDecoder("t", ("id",))
    lines = [change_line({"id": i, "amount": i / 3, "note": "x" * i}, TS_MS + i) for i in range(5)]
    first = [decoder.decode(line) for line in lines]
    assert len(decoder._by_prefix) == 1
    assert first == [DebeziumJsonDecoder("t", ("id",)).decode(line) for line in lines]
    # a payload with a trailing surprise falls back to the full parser, which names the problem
    with pytest.raises(RejectedMessage, match="invalid JSON"):
        decoder.decode(lines[0] + " x")


def test_messages_are_checked_against_the_declaration():
    declared = {"id": pa.int64(), "amount": pa.float64(), "when": pa.timestamp("us", tz="UTC"), "gone": pa.string()}
    fields = {
        "id": {"type": "int32"},  # widened: int32 fits an int64 column
        "amount": {"type": "double"},
        "when": {"type": "int64", "name": "io.debezium.time.MicroTimestamp"},  # zoneless into an older UTC declaration
        "extra": {"type": "string"},  # not declared: kept in the payload
    }
    decoder = DebeziumJsonDecoder("t", ("id",), declared)
    change = decoder.decode(change_line({"id": 1, "amount": 2.5, "when": 0, "extra": "x"}, TS_MS, fields=fields))
    assert json.loads(change.payload) == {"id": 1, "amount": 2.5, "when": "1970-01-01T00:00:00Z", "extra": "x", "gone": None}
    retyped = {**fields, "amount": {"type": "string"}}
    with pytest.raises(RejectedMessage, match="column 'amount' is string in this message's schema, cdc.t declares double"):
        decoder.decode(change_line({"id": 1, "amount": "n/a", "when": 0, "extra": "x"}, TS_MS, fields=retyped))


def test_schemaless_messages_are_typed_by_the_declaration():
    declared = {"id": pa.int64(), "total": pa.decimal128(10, 2), "score": pa.float32(), "at": pa.timestamp("us")}
    decoder = DebeziumJsonDecoder("t", ("id",), declared, decimal_encodings={"total": "numeric"})
    line = '{"op":"u","after":{"id":1,"total":7.5,"score":NaN,"at":"2024-05-01T12:00:00.5","more":1.10},"source":{"ts_ms":%d}}' % TS_MS
    payload = json.loads(decoder.decode(line).payload)
    assert payload == {"id": 1, "total": "7.50", "score": "NaN", "at": "2024-05-01T12:00:00.500000", "more": "1.10"}
    assert json.loads(decoder.decode(line.replace("7.5", '"-0.5e1"')).payload)["total"] == "-5.00"
    for bad in ('"abc"', '"NaN"', '" 7.5"', '"MDk="'):
        with pytest.raises(RejectedMessage, match="column 'total': .* is not decimal text"):
            decoder.decode(line.replace("7.5", bad))
    in_base64 = DebeziumJsonDecoder("t", ("id",), declared)  # the default: a Connect Decimal's bytes
    assert json.loads(in_base64.decode(line.replace("7.5", '"MDk="')).payload)["total"] == "123.45"
    for bad, reason in (("7.5", r"a JSON number \(7.5\) is not base64"), ('"7.5"', "'7.5' is not base64"), ('""', "empty")):
        with pytest.raises(RejectedMessage, match=f"column 'total': {reason}"):
            in_base64.decode(line.replace("7.5", bad))


def test_a_decimal_encoding_is_part_of_the_declared_column_type():
    from partfin_assets.model.errors import InvalidInput
    from partfin_assets.model.tablespec import TableSpec

    spec = TableSpec("t", ("id",), {"id": pa.int64(), "a": pa.decimal128(12, 2), "b": pa.decimal128(5, 0)},
                     decimal_encodings={"a": "numeric"})
    properties = spec.to_properties()
    assert json.loads(properties["partfin.columns"]) == {"id": "int64", "a": "decimal128(12, 2) numeric", "b": "decimal128(5, 0)"}
    assert TableSpec.from_properties("t", properties) == spec
    explicit = {**properties, "partfin.columns": '{"id":"int64","b":"decimal128(5, 0) base64"}'}
    assert TableSpec.from_properties("t", explicit).decimal_encodings == {"b": "base64"}
    for columns, encodings, reason in (
        ({"id": pa.int64()}, {"id": "numeric"}, "is not a declared decimal"),
        ({"id": pa.int64(), "a": pa.decimal128(3, 1)}, {"a": "text"}, "is not one of base64, numeric"),
    ):
        with pytest.raises(InvalidInput, match=reason):
            TableSpec("t", ("id",), columns, decimal_encodings=encodings)
    with pytest.raises(InvalidInput, match="only a decimal has an encoding"):
        TableSpec.from_properties("t", {**properties, "partfin.columns": '{"id":"int64 numeric"}'})


# --------------------------------------------------------------------------- through the CLI: the types the corpus lacks

# Connect field, a value as Debezium writes it, the Iceberg type of base.<table>'s column, the value read back
BEYOND_CORPUS = {
    "tiny": ({"type": "int8"}, -7, "int", -7),
    "single": ({"type": "float"}, "NaN", "float", "nan"),
    "single_inf": ({"type": "float32"}, "-Infinity", "float", "-inf"),
    "t_ms": ({"type": "int32", "name": "io.debezium.time.Time"}, 10162813, "time", time(2, 49, 22, 813000)),
    "t_ns": ({"type": "int64", "name": "io.debezium.time.NanoTime"}, 1_000_001_999, "time", time(0, 0, 1, 1)),
    "ts_ms": ({"type": "int64", "name": "io.debezium.time.Timestamp"}, 1666147762813, "timestamp", datetime(2022, 10, 19, 2, 49, 22, 813000)),
    "ts_ns": (
        {"type": "int64", "name": "io.debezium.time.NanoTimestamp"}, 1_666_147_762_813_456_789, "timestamp",
        datetime(2022, 10, 19, 2, 49, 22, 813456),
    ),
    "duration": ({"type": "int64", "name": "io.debezium.time.MicroDuration"}, 90_000_000, "long", 90_000_000),
    "zoned_time": ({"type": "string", "name": "io.debezium.time.ZonedTime"}, "10:15:30Z", "string", "10:15:30Z"),
    "interval": ({"type": "string", "name": "io.debezium.time.Interval"}, "P1Y2M3DT4H5M6.78S", "string", "P1Y2M3DT4H5M6.78S"),
    "xml": ({"type": "string", "name": "io.debezium.data.Xml"}, "<a>b</a>", "string", "<a>b</a>"),
    "place": (
        {"type": "struct", "name": "io.debezium.data.geometry.Geography", "fields": []},
        {"wkb": "AQEAAAAAAAAAAADwPwAAAAAAAABA", "srid": 4326}, "struct<wkb: binary, srid: int>",
        {"wkb": base64.b64decode("AQEAAAAAAAAAAADwPwAAAAAAAABA"), "srid": 4326},
    ),
    "tags": ({"type": "array", "items": {"type": "string"}}, ["a", "b"], "string", '["a","b"]'),
    "attrs": ({"type": "map", "keys": {"type": "string"}, "values": {"type": "int32"}}, {"k": 1}, "string", '{"k":1}'),
    "d38": (decimal_field(10, 38), unscaled_base64(12345678901234567890123456789012345678), "decimal(38, 10)",
            Decimal("1234567890123456789012345678.9012345678")),
    "d40_number": (decimal_field(2, 40), "NUMBER", "string", "12345678901234567890123456789012345678.10"),
    "vec": ({"type": "struct", "name": "io.debezium.data.SparseVector", "fields": []}, {"dimensions": 3, "vector": {"1": 0.5}},
            "string", '{"dimensions":3,"vector":{"1":0.5}}'),
}
NUMBER = "12345678901234567890123456789012345678.10"  # decimal.format=NUMERIC: a JSON number with 40 digits


def test_types_the_corpus_lacks_land_in_base_through_the_cli(tmp_path):
    """`partfin ingest` + `partfin upsert` of a Debezium file with every type the corpus does not have: each column
    gets its Iceberg type and exact value in base; the unknown type is text with one warning naming it; a line
    with a value that fits no column is rejected naming the column and the rest goes on."""
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets_tests.test_cli import partfin

    fields = {"id": {"type": "int64", "optional": False}, **{name: field for name, (field, _, _, _) in BEYOND_CORPUS.items()}}
    row = {"id": 1, **{name: value for name, (_, value, _, _) in BEYOND_CORPUS.items()}}
    lines = [change_line({**row, "id": key}, TS_MS + key * 60_000, fields=fields).replace('"NUMBER"', NUMBER) for key in (1, 2, 3)]
    lines.insert(1, change_line({**row, "id": 9, "tiny": "7"}, TS_MS, fields=fields).replace('"NUMBER"', NUMBER))
    path = tmp_path / "beyond.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    ingest = partfin(tmp_path, "ingest", "--table", "beyond", "--source", f"debezium:{path}", "--primary-key", "id")
    upsert = partfin(tmp_path, "upsert", "--table", "beyond")
    assert ingest.returncode == 0 and upsert.returncode == 0, (ingest.stderr, upsert.stderr)
    warnings = [line for line in ingest.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "'vec'" in warnings[0] and "io.debezium.data.SparseVector" in warnings[0], ingest.stderr

    catalog = load_partfin_catalog(tmp_path)
    rejected = catalog.load_table("cdc.beyond__rejected").scan().to_arrow().to_pylist()
    assert [(r["source_seq"], "column 'tiny'" in r["reason"]) for r in rejected] == [(2, True)]
    base = catalog.load_table("base.beyond")
    types = {f.name: re.sub(r"\b\d+: |\b(?:optional|required) ", "", str(f.field_type)) for f in base.schema().fields}  # no field ids
    rows = {r["id"]: r for r in base.scan().to_arrow().to_pylist() if not r[DELETED]}
    assert sorted(rows) == [1, 2, 3]
    for name, (_, _, iceberg_type, value) in BEYOND_CORPUS.items():
        assert types[name] == iceberg_type, (name, types[name])
        got = rows[3][name]
        assert (repr(got) if isinstance(got, float) else got) == value, (name, got)


# --------------------------------------------------------------------------- through the CLI: decimals without a schema block

AMOUNT = {"id": {"type": "int64", "optional": False}, "amount": decimal_field(2, 12)}


def schemaless_line(key: int, amount_json: str) -> str:
    """A change without its schema block (JsonConverter with schemas.enable=false); `amount_json` is written verbatim."""
    return '{"before":null,"after":{"id":%d,"amount":%s},"source":{"ts_ms":%d},"op":"c","ts_ms":%d}' % (
        key, amount_json, TS_MS + key * 1000, TS_MS + key * 1000)


def ingested_amounts(home, table: str, lines: list[str]) -> tuple[dict, dict, dict]:
    """`partfin ingest` + `partfin upsert` of `lines`: base's amounts by id, the rejected reasons by line, the declaration."""
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets_tests.test_cli import partfin

    path = home / f"{table}.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    ingest = partfin(home, "ingest", "--table", table, "--source", f"debezium:{path}", "--primary-key", "id")
    upsert = partfin(home, "upsert", "--table", table)
    assert ingest.returncode == 0 and upsert.returncode == 0, (ingest.stderr, upsert.stderr)
    catalog = load_partfin_catalog(home)
    rows = catalog.load_table(f"base.{table}").scan().to_arrow().to_pylist()
    rejected = catalog.load_table(f"cdc.{table}__rejected").scan().to_arrow().to_pylist()
    declared = json.loads(catalog.load_table(f"cdc.{table}").properties["partfin.columns"])
    return {r["id"]: r["amount"] for r in rows if not r[DELETED]}, {r["source_seq"]: r["reason"] for r in rejected}, declared


def test_schemaless_decimals_are_read_in_the_declared_base64_encoding_never_as_numbers(tmp_path):
    """A table declared from a Connect Decimal sent as base64 (JsonConverter's default decimal.format=BASE64):
    lines without a schema block carry the same base64 bytes, also when their text looks like a number
    ("1234" is -26588.24, never 1234.00; "NaN1" is +35152.53); a value that is not base64 (decimal text, a
    JSON number) fits no declared encoding and is rejected with its reason."""
    lines = [
        change_line({"id": 1, "amount": unscaled_base64(12345)}, TS_MS, fields=AMOUNT),
        schemaless_line(2, '"1234"'),
        schemaless_line(3, '"0000"'),
        schemaless_line(4, '"NaN1"'),
        schemaless_line(5, '"12.34"'),
        schemaless_line(6, "12.5"),
        schemaless_line(7, '""'),
    ]
    amounts, rejected, declared = ingested_amounts(tmp_path, "dec_b64", lines)
    assert declared["amount"] == "decimal128(12, 2)"  # no encoding written: the default, base64
    assert amounts == {1: Decimal("123.45"), 2: Decimal("-26588.24"), 3: Decimal("-29293.56"), 4: Decimal("35152.53")}
    assert sorted(rejected) == [5, 6, 7]
    assert "column 'amount'" in rejected[5] and "'12.34' is not base64" in rejected[5], rejected[5]
    assert "column 'amount'" in rejected[6] and "a JSON number (12.5)" in rejected[6] and "base64" in rejected[6], rejected[6]
    assert "column 'amount'" in rejected[7] and "empty" in rejected[7], rejected[7]


def test_schemaless_decimals_are_read_as_numbers_in_a_table_that_recorded_the_numeric_encoding(tmp_path):
    """A table declared from a Connect Decimal sent as a JSON number (decimal.format=NUMERIC) records the numeric
    encoding on first sight: later lines without a schema block are read as the number they spell ("1234" is
    1234.00), and base64 bytes or text that is no decimal ("NaN1") are rejected with their reason."""
    lines = [
        change_line({"id": 1, "amount": "123.45"}, TS_MS, fields=AMOUNT).replace('"123.45"', "123.45"),
        schemaless_line(2, '"1234"'),
        schemaless_line(3, '"0000"'),
        schemaless_line(4, "7.5"),
        schemaless_line(5, '"NaN1"'),
        schemaless_line(6, '"MDk="'),
        schemaless_line(7, '"1_000"'),
    ]
    amounts, rejected, declared = ingested_amounts(tmp_path, "dec_num", lines)
    assert declared["amount"] == "decimal128(12, 2) numeric"
    assert amounts == {1: Decimal("123.45"), 2: Decimal("1234.00"), 3: Decimal("0.00"), 4: Decimal("7.50")}
    assert sorted(rejected) == [5, 6, 7]
    for seq, text in ((5, "'NaN1'"), (6, "'MDk='"), (7, "'1_000'")):
        assert "column 'amount'" in rejected[seq] and f"{text} is not decimal text" in rejected[seq], rejected[seq]


def test_a_byte_order_mark_before_the_first_line_is_not_part_of_the_change_and_resume_keeps_its_place(tmp_path):
    """A file written with a UTF-8 byte-order mark (Windows tools do): its first change is ingested like the others,
    and a run stopped after it resumes at the right byte (offsets count the mark's three bytes)."""
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets_tests.test_cli import partfin

    lines = [change_line({"id": key, "amount": unscaled_base64(key * 100)}, TS_MS + key * 1000, fields=AMOUNT) for key in (1, 2, 3)]
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(line + "\n" for line in lines).encode())
    args = ("ingest", "--table", "bom", "--source", f"debezium:{path}", "--primary-key", "id", "--checkpoint-records", "1")
    first = partfin(tmp_path, *args, "--max-checkpoints", "1")
    rest = partfin(tmp_path, *args)
    assert first.returncode == 0 and rest.returncode == 0, (first.stderr, rest.stderr)
    catalog = load_partfin_catalog(tmp_path)
    assert catalog.load_table("cdc.bom__rejected").scan().to_arrow().num_rows == 0
    cdc = catalog.load_table("cdc.bom").scan().to_arrow().to_pylist()
    assert sorted((json.loads(r["payload"])["id"], r["source_seq"]) for r in cdc) == [(1, 1), (2, 2), (3, 3)]
    summaries = [s.summary.additional_properties for s in catalog.load_table("cdc.bom").snapshots()]
    offsets = [json.loads(summary["partfin.source-offset"]) for summary in summaries if "partfin.source-offset" in summary]
    assert offsets[0]["byte"] == 3 + len(lines[0]) + 1 and offsets[-1]["byte"] == path.stat().st_size, offsets
