"""Bad input is rejected or quarantined, never fatal, as `partfin` users meet it.

- a `source.ts_ms` that is NaN, Infinity, past int64 or microseconds sent as milliseconds;
- float NaN / ±Infinity from Debezium (JsonConverter quotes them) and from PostgreSQL float8/real;
- a CDC payload the upsert cannot decode;
- a missing Debezium file; a declaration that does not match the file's schema.

(Heartbeats of an idle stream, and a poisoned message of every source kind: test_source_conformance.py.)
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import psycopg
from dagster import AssetCheckSeverity, DagsterInstance
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from partfin_assets.defs import build_definitions
from partfin_assets.defs.tables import PartfinTable
from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.tables import DELETED
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.model.records import CDC_RECORD_SCHEMA_WITHOUT_ARRIVAL, REJECTED_RECORD_SCHEMA, ChangeBatch
from partfin_assets.model.tablespec import TableSpec
from partfin_assets_tests.debezium_lines import change_line
from partfin_assets_tests.test_cli import partfin
from partfin_assets_tests.test_postgres_source import drop_slots

T0 = datetime(2026, 11, 1, tzinfo=UTC)
SHOP = TableSpec("shop", ("id",), {"id": pa.int64(), "amount": pa.float64()})
T0_MS = int(T0.timestamp() * 1000)
MINUTE_MS = 60_000
HOUR_MS = 60 * MINUTE_MS


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat().replace("+00:00", "Z")


def write_lines(path: Path, lines: list[str], mode: str = "w") -> Path:
    with path.open(mode) as file:
        file.write("".join(line + "\n" for line in lines))
    return path


def cdc_watermark(home: Path, table: str) -> str | None:
    status = json.loads(partfin(home, "status", "--json").stdout or '{"tables": []}')
    return next((t["watermark"] for t in status["tables"] if t["name"] == f"cdc.{table}"), None)


def table_rows(home: Path, identifier: str) -> pa.Table | None:
    catalog = load_partfin_catalog(home)
    return catalog.load_table(identifier).scan().to_arrow() if catalog.table_exists(identifier) else None


def last_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    return lines[-1] if lines else ""


# --------------------------------------------------------------------------- implausible event times

BAD_TS_MS = {
    "nan": float("nan"),  # json.dumps writes the bare token NaN
    "infinity": float("inf"),
    "past-int64": 2**64,
    "micros-as-millis": (T0_MS + 2 * HOUR_MS) * 1000,
}


@pytest.mark.parametrize("bad", list(BAD_TS_MS))
def test_implausible_event_time_is_rejected_and_the_stream_goes_on(tmp_path, bad):
    path = tmp_path / "changes.jsonl"
    good = [change_line({"id": i % 7, "amount": float(i), "note": None}, T0_MS + i * 10 * MINUTE_MS) for i in range(36)]
    bad_line = change_line({"id": 99, "amount": 1.0, "note": "bad clock"}, BAD_TS_MS[bad])
    write_lines(path, [*good[:12], bad_line, *good[12:]])
    args = ("ingest", "--table", "shop", "--source", f"debezium:{path}", "--primary-key", "id", "--checkpoint-records", "5")

    first = partfin(tmp_path, *args)
    first_watermark = cdc_watermark(tmp_path, "shop")
    later = [change_line({"id": i % 7, "amount": float(i), "note": None}, T0_MS + i * 10 * MINUTE_MS) for i in range(36, 54)]
    write_lines(path, later, mode="a")
    restart = partfin(tmp_path, *args)
    restart_watermark = cdc_watermark(tmp_path, "shop")
    cdc = table_rows(tmp_path, "cdc.shop")
    rejected = table_rows(tmp_path, "cdc.shop__rejected")
    print(
        f"\n{bad}: first run exit {first.returncode} ({last_line(first)!r}), watermark {first_watermark}; "
        f"restart exit {restart.returncode} ({last_line(restart)!r}), watermark {restart_watermark}; "
        f"cdc rows {cdc.num_rows if cdc is not None else None} of 54; "
        f"rejected {rejected.column('reason').to_pylist() if rejected is not None else None}"
    )

    assert first.returncode == 0, first.stderr
    assert restart.returncode == 0, restart.stderr
    assert cdc.num_rows == 54  # every good change landed
    assert rejected.column("source_seq").to_pylist() == [13]  # the bad line, once, with its reason
    (reason,) = rejected.column("reason").to_pylist()
    assert "source.ts_ms" in reason
    assert rejected.column("raw").to_pylist() == [bad_line]
    assert first_watermark is not None and restart_watermark > first_watermark  # not frozen


# --------------------------------------------------------------------------- float NaN / Infinity

DOUBLES = {1: "NaN", 2: "Infinity", 3: "-Infinity", 4: 1.5}  # how JsonConverter writes non-finite doubles


def base_values(home: Path, table: str, column: str) -> dict:
    data = table_rows(home, f"base.{table}")
    assert data is not None, f"base.{table} was not created"
    data = data.filter(pc.invert(data.column(DELETED)))
    assert column in data.column_names, f"column {column!r} missing from base.{table}: {data.column_names}"
    return dict(zip(data.column("id").to_pylist(), data.column(column).to_pylist()))


def assert_non_finite_kept(values: dict) -> None:
    shown = {key: repr(value) for key, value in sorted(values.items())}  # repr: nan == nan
    assert shown == {1: "nan", 2: "inf", 3: "-inf", 4: "1.5"}


def test_debezium_nan_and_infinity_reach_base(tmp_path):
    fields = {"id": {"type": "int64", "optional": False}, "reading": {"type": "double", "optional": True}}
    lines = [change_line({"id": k, "reading": v}, T0_MS + k * MINUTE_MS, fields=fields) for k, v in DOUBLES.items()]
    path = write_lines(tmp_path / "readings.jsonl", lines)
    ingest = partfin(tmp_path, "ingest", "--table", "readings", "--source", f"debezium:{path}", "--primary-key", "id")
    upsert = partfin(tmp_path, "upsert", "--table", "readings")
    print(f"\ningest exit {ingest.returncode}; upsert exit {upsert.returncode}: {last_line(upsert)!r}")
    assert ingest.returncode == 0 and upsert.returncode == 0, (ingest.stderr, upsert.stderr)
    assert_non_finite_kept(base_values(tmp_path, "readings", "reading"))


def wal2json_has_numbers_as_text(postgres, database: str) -> bool:
    """Whether the server's wal2json has numeric-data-types-as-string (2.6+), probed on a slot of the test's own."""
    with psycopg.connect(postgres.dsn(database), autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot('probe_numbers', 'wal2json')")
        try:
            conn.execute(
                "SELECT count(*) FROM pg_logical_slot_peek_changes('probe_numbers', NULL, NULL, "
                "'format-version', '2', 'numeric-data-types-as-string', '1')"
            )
            return True
        except psycopg.errors.InvalidParameterValue:
            return False
        finally:
            conn.execute("SELECT pg_drop_replication_slot('probe_numbers')")


def test_postgres_nan_and_infinity_are_kept_or_refused_never_nulled(postgres, tmp_path):
    """wal2json 2.6+ carries NaN / ±Infinity as text: kept. Debian bookworm's 2.5 writes them as null: a
    NOT NULL column refuses those changes with the reason, and ingest names the columns at risk."""
    database = "pf_nan_" + tmp_path.name[-8:].replace("-", "_").lower()
    postgres.create_database(database)
    try:
        exact = wal2json_has_numbers_as_text(postgres, database)
        with psycopg.connect(postgres.dsn(database), autocommit=True) as conn:
            conn.execute("CREATE TABLE readings (id bigint PRIMARY KEY, v float8 NOT NULL, r real)")
            source = f"postgres:{postgres.dsn(database)}"
            first = partfin(tmp_path, "ingest", "--table", "readings", "--source", source)  # creates the slot
            assert first.returncode == 0, first.stderr
            for key, value in {**DOUBLES, 5: 2.5}.items():
                conn.execute("INSERT INTO readings VALUES (%s, %s::float8, %s::real)", (key, str(value), None if key == 5 else str(value)))
            ingest = partfin(tmp_path, "ingest", "--table", "readings", "--source", source)
        upsert = partfin(tmp_path, "upsert", "--table", "readings")
        rejected = table_rows(tmp_path, "cdc.readings__rejected")
        reasons = rejected.column("reason").to_pylist() if rejected is not None else []
        print(f"\nwal2json numbers as text: {exact}; ingest exit {ingest.returncode}; upsert exit {upsert.returncode}; rejected {reasons}")
        assert ingest.returncode == 0 and upsert.returncode == 0, (ingest.stderr, upsert.stderr)
        v, r = base_values(tmp_path, "readings", "v"), base_values(tmp_path, "readings", "r")
        if exact:
            assert_non_finite_kept({k: v[k] for k in DOUBLES})
            assert_non_finite_kept({k: r[k] for k in DOUBLES})
            assert not reasons
        else:
            assert v == {4: 1.5, 5: 2.5} and r == {4: 1.5, 5: None}  # never a NaN turned into NULL
            assert len(reasons) == 3 and all("'v' is NOT NULL but arrived as null" in reason for reason in reasons)
            assert "column(s) v, r" in ingest.stderr and "wal2json 2.6" in ingest.stderr
    finally:
        drop_slots(postgres, database)


# --------------------------------------------------------------------------- undecodable payloads


def write_changes(home: Path, changes: list[tuple[int, str, int, str | None]], checkpoint: int) -> None:
    """Commit CDC rows (key id, op, minute, payload) the way any source would, through the CDC writer."""
    spec = SHOP
    records = pa.table(
        {
            "key": [json.dumps({"id": k}, separators=(",", ":")) for k, _, _, _ in changes],
            "op": [op for _, op, _, _ in changes],
            "event_time": pa.array([(T0_MS + m * MINUTE_MS) * 1000 for _, _, m, _ in changes], pa.int64()).cast(pa.timestamp("us", tz="UTC")),
            "source_seq": [checkpoint * 1000 + i for i in range(len(changes))],
            "payload": [p for _, _, _, p in changes],
        },
        schema=CDC_RECORD_SCHEMA_WITHOUT_ARRIVAL,
    )
    writer = CdcWriter(load_partfin_catalog(home), spec)
    try:
        writer.write_checkpoint(ChangeBatch(records, offset=str(checkpoint)))
    finally:
        writer.close()


def amount(key: int, value) -> str:
    return json.dumps({"id": key, "amount": value})


def test_undecodable_payload_is_quarantined_once_and_the_table_merges_on(tmp_path):
    # key 7's first change carries a payload that fits no double (a source bug, an older partfin...)
    write_changes(tmp_path, [(k, "c", k, amount(k, k * 1.5)) for k in range(1, 7)] + [(7, "c", 7, amount(7, "lots"))], 1)
    # a crash after the merged rows were written, before the base commit: the re-run must not quarantine twice
    crashed = partfin(tmp_path, "upsert", "--table", "shop", env_extra={"PARTFIN_CRASH_AT": "upsert-after-files:1"})
    first = partfin(tmp_path, "upsert", "--table", "shop")
    write_changes(tmp_path, [(2, "u", 20, amount(2, 99.0)), (7, "u", 21, amount(7, 7.5))], 2)
    second = partfin(tmp_path, "upsert", "--table", "shop")
    status = json.loads(partfin(tmp_path, "status", "--json").stdout)
    base = table_rows(tmp_path, "base.shop")
    quarantine = table_rows(tmp_path, "base.shop__rejected")
    print(
        f"\nupsert after crash exit {first.returncode} ({last_line(first)!r}); second exit {second.returncode}; "
        f"base rows {base.num_rows if base is not None else None}; quarantined "
        f"{quarantine.to_pylist() if quarantine is not None else None}"
    )
    assert crashed.returncode != 0
    assert first.returncode == 0 and second.returncode == 0, (first.stderr, second.stderr)
    live = {r["id"]: r["amount"] for r in base.to_pylist() if not r[DELETED]}
    assert live == {1: 1.5, 2: 99.0, 3: 4.5, 4: 6.0, 5: 7.5, 6: 9.0, 7: 7.5}  # key 7's later change merged normally
    assert quarantine.num_rows == 1  # exactly once, across the crash and the later run
    (row,) = quarantine.to_pylist()
    assert json.loads(row["key"]) == {"id": 7} and row["source_seq"] == 1006
    assert "amount" in row["reason"]
    (entry,) = [t for t in status["tables"] if t["name"] == "base.shop"]
    assert entry["quarantined"] == 1
    text = partfin(tmp_path, "status").stdout
    assert "base.shop: 1 change(s) could not be decoded: see base.shop__rejected" in text

    # the Dagster check on base/shop says so too
    check = quarantine_check(tmp_path)
    assert not check.passed and check.severity == AssetCheckSeverity.WARN
    assert check.metadata["records"].value == 1 and "base.shop__rejected" in check.description


def quarantine_check(home: Path):
    env = {"PARTFIN_HOME": str(home), "PARTFIN_CATALOG_URI": "", "PARTFIN_CATALOG": ""}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        table = PartfinTable(spec=SHOP, source="synthetic")
        result = build_definitions([table]).resolve_job_def("checks_shop").execute_in_process(instance=DagsterInstance.ephemeral())
    return {e.check_name: e for e in result.get_asset_check_evaluations()}["quarantined_changes"]


# --------------------------------------------------------------------------- missing file, declaration


@pytest.mark.parametrize("follow", [False, True], ids=["once", "follow"])
def test_missing_debezium_file_is_one_line_and_creates_nothing(tmp_path, follow):
    missing = tmp_path / "no-such-dir" / "changes.jsonl"
    args = ["ingest", "--table", "shop", "--source", f"debezium:{missing}", "--primary-key", "id"]
    result = partfin(tmp_path, *args, *(["--follow"] if follow else []), timeout=60)
    lines = result.stderr.strip().splitlines()
    print(f"\nexit {result.returncode}; {len(lines)} stderr line(s), last {lines[-1:]}; cdc.shop exists: {table_rows(tmp_path, 'cdc.shop') is not None}")
    assert result.returncode == 2
    assert len(lines) == 1 and str(missing) in lines[0]
    assert table_rows(tmp_path, "cdc.shop") is None and table_rows(tmp_path, "cdc.shop__rejected") is None


def test_primary_key_not_in_the_files_schema_is_refused_before_anything_is_committed(tmp_path):
    lines = [change_line({"id": i, "amount": 1.0, "note": None}, T0_MS + i * MINUTE_MS) for i in range(3)]
    path = write_lines(tmp_path / "changes.jsonl", lines)
    result = partfin(tmp_path, "ingest", "--table", "shop", "--source", f"debezium:{path}", "--primary-key", "order_id")
    lines_out = result.stderr.strip().splitlines()
    print(f"\nexit {result.returncode}; stderr {lines_out}; cdc.shop__rejected rows: {getattr(table_rows(tmp_path, 'cdc.shop__rejected'), 'num_rows', None)}")
    assert result.returncode == 2
    assert len(lines_out) == 1 and "order_id" in lines_out[0] and "id" in lines_out[0]
    assert table_rows(tmp_path, "cdc.shop") is None


def test_a_rejected_table_with_the_legacy_kafka_position_is_migrated_to_source_log_losing_nothing(catalog):
    """A cdc.<table>__rejected created before `source_log` (its Kafka rows placed by kafka_topic/partition/offset) is
    rewritten once when a writer opens the table: every row kept, each placed in its change log, the old columns gone;
    a reject read again at a migrated position is not written twice."""
    from pyiceberg.schema import Schema
    from pyiceberg.types import IntegerType, LongType, NestedField, StringType

    legacy = Schema(  # the rejected table's schema as partfin created it before source_log
        NestedField(1, "writer_id", StringType(), required=True), NestedField(2, "checkpoint_id", LongType(), required=True),
        NestedField(3, "source_seq", LongType(), required=True), NestedField(4, "raw", StringType(), required=True),
        NestedField(5, "reason", StringType(), required=True), NestedField(6, "kafka_topic", StringType(), required=False),
        NestedField(7, "kafka_partition", IntegerType(), required=False), NestedField(8, "kafka_offset", LongType(), required=False))
    catalog.create_namespace("cdc")
    old = catalog.create_table("cdc.orders__rejected", schema=legacy)
    rows = pa.table({"writer_id": ["orders-writer", "orders-writer", "orders-writer", "file-writer"], "checkpoint_id": [1, 1, 2, 3],
                     "source_seq": [12, 12, 13, 7], "raw": ["a", "b", "c", "d"], "reason": ["bad a", "bad b", "bad c", "bad d"],
                     "kafka_topic": ["t", "t", "t", None], "kafka_partition": [0, 1, 1, None], "kafka_offset": [12, 12, 13, None]},
                    schema=old.schema().as_arrow())
    old.append(rows)

    writer = CdcWriter(catalog, TableSpec("orders", ("id",)), heartbeat_interval_s=0)
    migrated = catalog.load_table("cdc.orders__rejected")
    assert [f.name for f in migrated.schema().fields] == ["writer_id", "checkpoint_id", "source_seq", "raw", "reason", "source_log"]
    got = migrated.scan().to_arrow().sort_by("raw")
    assert got.drop_columns(["source_log"]).equals(rows.drop_columns(["kafka_topic", "kafka_partition", "kafka_offset"]).cast(
        got.drop_columns(["source_log"]).schema))
    assert got.column("source_log").to_pylist() == ["orders-writer/t-0", "orders-writer/t-1", "orders-writer/t-1", "file-writer"]

    again = pa.table({"source_seq": [12, 14], "raw": ["b", "e"], "reason": ["bad b", "bad e"]}, schema=REJECTED_RECORD_SCHEMA)
    writer.write_checkpoint(ChangeBatch(CDC_RECORD_SCHEMA_WITHOUT_ARRIVAL.empty_table(), "x", rejected=again, stream="t-1"))
    writer.close()
    after = catalog.load_table("cdc.orders__rejected").scan().to_arrow().sort_by("raw")
    assert after.column("raw").to_pylist() == ["a", "b", "c", "d", "e"]  # b is there already, e is new
