"""A privacy key is read against the table's key columns and their types, as an operator meets it: `partfin
privacy-delete` (and the Dagster job `privacy_delete_<table>`) on real tables written by `partfin ingest`/`upsert`.

A key that does not denote exactly one value of each key column's declared type (9.0, 10.5, "9" or true for an
integer; a missing or an extra column; a column named twice) is refused in one line, exit 2, and nothing changes:
no table, the erasure registry included, gets a snapshot. A key that does is erased everywhere, under the same
canonical key the sources write, so the registry filters its re-deliveries. Every key column type partfin declares
is covered: integers, strings, decimals, dates, zoned and zoneless timestamps, times, uuids (strings), composite keys.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from dagster import DagsterInstance, RunConfig

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.tables import read_base
from partfin_assets_tests.cdc_files import HOUR_MS, orders_lines, partfin, write_lines

pytestmark = pytest.mark.timeout(600)

START_MS = 1_795_000_000_000 // HOUR_MS * HOUR_MS
ERASURES = "cdc.{table}__erasures"


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("partfin: error: "), result.stderr
    return lines[0]


def heads(home: Path) -> dict[str, int | None]:
    """The current snapshot of every table in the catalog: a refusal leaves all of them as they were."""
    catalog = load_partfin_catalog(home)
    out = {}
    for namespace in ("cdc", "base"):
        for identifier in catalog.list_tables(namespace):
            name = ".".join(identifier)
            snapshot = catalog.load_table(name).current_snapshot()
            out[name] = snapshot.snapshot_id if snapshot is not None else None
    return out


def cdc_keys(home: Path, table: str) -> list[str]:
    return load_partfin_catalog(home).load_table(f"cdc.{table}").scan(selected_fields=("key",)).to_arrow().column("key").to_pylist()


def delete(home: Path, table: str, *keys: str, request: str = "req-1") -> subprocess.CompletedProcess:
    return partfin(home, "privacy-delete", "--table", table, *[a for k in keys for a in ("--key", k)], "--request-id", request)


# --------------------------------------------------------------------------- an integer key (the orders)


@pytest.fixture
def orders(tmp_path):
    """cdc.orders and base.orders from a Debezium file with typed columns (id int64): keys 1..40, each changed 3 times."""
    home, path = tmp_path / "home", tmp_path / "orders.jsonl"
    events = [START_MS + i * 20_000 for i in range(120)]
    write_lines(path, orders_lines(events, seed=3, key_space=40, wrapped=True))
    ingest = partfin(home, "ingest", "--table", "orders", "--source", f"debezium:{path}", "--primary-key", "id")
    assert ingest.returncode == 0, ingest.stderr
    assert partfin(home, "upsert", "--table", "orders").returncode == 0
    return home, path


def test_an_integer_key_is_refused_unless_it_is_exactly_one_integer(orders):
    home, _ = orders
    keys = cdc_keys(home, "orders")
    present = sorted({json.loads(k)["id"] for k in keys})
    nine, ten = present[0], present[1]
    before = heads(home)
    refused = {
        f'{{"id": {nine}.0}}': "9.0: an integral float is not the integer",
        f'{{"id": {ten}.5}}': "10.5: would have erased key 10's base row",
        f'{{"id": {nine}e0}}': "an exponent",
        f'{{"id": "{nine}"}}': "a string",
        '{"id": true}': "a boolean",
        '{"id": null}': "null",
        '{"id": [9]}': "a list",
        '{"id": 9223372036854775808}': "past int64",
        '{"id": NaN}': "not JSON",
        '{}': "no column",
        f'{{"id": {nine}, "user_id": 1}}': "an extra column",
        '{"user_id": 1}': "another column",
        f'{{"id": {nine}, "id": {ten}}}': "a column named twice (json.loads would keep the last)",
    }
    for key, why in refused.items():
        error = one_line_error(delete(home, "orders", key))
        assert "key #1" in error, (why, error)
    # one bad key of several: nothing of the good ones is erased either
    one_line_error(delete(home, "orders", f'{{"id": {ten}}}', f'{{"id": {nine}.0}}'))
    assert heads(home) == before  # nothing written anywhere: no erasure registry, no fence, no delete
    assert f'{{"id":{nine}}}' in keys and f'{{"id":{ten}}}' in keys

    # the key as it is: erased from cdc and base, and the registry filters a re-delivery of its changes
    done = delete(home, "orders", f'{{"id": {nine}}}')
    assert done.returncode == 0, done.stderr
    assert f'{{"id":{nine}}}' not in cdc_keys(home, "orders")
    base_ids = set(read_base(load_partfin_catalog(home), "orders", selected_fields=("id",)).column("id").to_pylist())
    assert nine not in base_ids and ten in base_ids


def test_the_registry_holds_the_canonical_key_so_redeliveries_are_filtered(orders):
    home, path = orders
    nine = json.loads(cdc_keys(home, "orders")[0])["id"]
    done = delete(home, "orders", f'{{ "id" : {nine} }}')  # spacing is no part of a key
    assert done.returncode == 0, done.stderr
    # the same file again under another writer id: every change of the key is a re-delivery from before the request
    again = partfin(home, "ingest", "--table", "orders", "--source", f"debezium:{path}", "--primary-key", "id", "--writer-id", "again")
    assert again.returncode == 0, again.stderr
    assert f'{{"id":{nine}}}' not in cdc_keys(home, "orders")
    assert partfin(home, "upsert", "--table", "orders").returncode == 0
    assert nine not in set(read_base(load_partfin_catalog(home), "orders", selected_fields=("id",)).column("id").to_pylist())


def test_the_dagster_job_reads_its_keys_the_same_way(orders, monkeypatch):
    home, _ = orders
    nine = json.loads(cdc_keys(home, "orders")[0])["id"]
    monkeypatch.setenv("PARTFIN_HOME", str(home))
    from partfin_assets.defs import build_definitions
    from partfin_assets.defs.tables import PartfinTable
    from partfin_assets.model.tablespec import TableSpec

    spec = TableSpec.from_properties("orders", load_partfin_catalog(home).load_table("cdc.orders").properties)
    job = build_definitions([PartfinTable(spec=spec, source=f"debezium:{home}/unused.jsonl")]).resolve_job_def("privacy_delete_orders")
    before = heads(home)
    instance = DagsterInstance.ephemeral()
    try:
        for key in ({"id": float(nine)}, {"id": str(nine)}, {"id": nine, "user_id": 1}):
            config = RunConfig(ops={"privacy_delete_orders_op": {"config": {"keys": [key], "request_id": "req-d"}}})
            result = job.execute_in_process(instance=instance, run_config=config, raise_on_error=False)
            assert not result.success
            failure = result.failure_data_for_node("privacy_delete_orders_op")
            assert failure is not None and "key #1 for cdc.orders" in failure.user_failure_data.description, key
        assert heads(home) == before
        config = RunConfig(ops={"privacy_delete_orders_op": {"config": {"keys": [{"id": nine}], "request_id": "req-d"}}})
        assert job.execute_in_process(instance=instance, run_config=config).success
    finally:
        instance.dispose()
    assert f'{{"id":{nine}}}' not in cdc_keys(home, "orders")


# --------------------------------------------------------------------------- every key column type, one composite key

_IMAGE = {
    "type": "struct", "optional": True,
    "fields": [
        {"type": "string", "optional": False, "field": "tenant"},
        {"type": "bytes", "optional": False, "field": "amount", "name": "org.apache.kafka.connect.data.Decimal",
         "parameters": {"scale": "2", "connect.decimal.precision": "10"}},
        {"type": "int32", "optional": False, "field": "day", "name": "io.debezium.time.Date"},
        {"type": "string", "optional": False, "field": "at", "name": "io.debezium.time.ZonedTimestamp"},
        {"type": "int64", "optional": False, "field": "local", "name": "io.debezium.time.MicroTimestamp"},
        {"type": "int64", "optional": False, "field": "clock", "name": "io.debezium.time.MicroTime"},
        {"type": "string", "optional": False, "field": "uid", "name": "io.debezium.data.Uuid"},
        {"type": "int32", "optional": False, "field": "n"},
        {"type": "string", "optional": True, "field": "note"},
    ],
}
_ENVELOPE = {"type": "struct", "fields": [{**_IMAGE, "field": "before"}, {**_IMAGE, "field": "after"},
                                          {"type": "string", "optional": False, "field": "op"}]}
UID = "6f1c2a4e-0b7d-4c1e-9a55-3d2f8e7b6a10"


def ledger_row(n: int) -> dict:
    """Row n of `ledgers` as Debezium writes it (decimal.format=NUMERIC, dates as days, times in microseconds): its
    timestamp `at` is 2026-01-02T0<n-1>:04:05.25Z, `local` 2026-01-02T03:04:05.00000<n>, `clock` 01:02:03.00000<n>."""
    return {"tenant": f"acme-{n % 2}", "amount": 12 + n + 0.5, "day": 20_454 + n, "at": f"2026-01-02T0{n}:04:05.25+01:00",
            "local": 1_767_323_045_000_000 + n, "clock": 3_723_000_000 + n, "uid": UID, "n": n, "note": "x"}


def ledger_key(row: int, **override) -> str:
    """Row `row`'s key as a user writes it: decimal as a number, date/timestamps/time as ISO text."""
    key = {"tenant": f"acme-{row % 2}", "amount": json.loads(f"{12 + row}.5"), "day": f"2026-01-{1 + row:02d}",
           "at": f"2026-01-02T0{row}:04:05.250+01:00", "local": f"2026-01-02T03:04:05.{row:06d}", "clock": f"01:02:03.{row:06d}",
           "uid": UID, "n": row}
    key.update(override)
    return json.dumps({k: v for k, v in key.items() if v is not ...})


@pytest.fixture
def ledgers(tmp_path):
    home, path = tmp_path / "home", tmp_path / "ledgers.jsonl"
    lines = []
    for n in range(1, 6):
        for version in range(3):
            envelope = {"op": "c" if version == 0 else "u", "before": None, "after": {**ledger_row(n), "note": f"v{version}"},
                        "source": {"ts_ms": START_MS + n * 60_000 + version * 1_000}}
            lines.append(json.dumps({"schema": _ENVELOPE, "payload": envelope}, separators=(",", ":")))
    write_lines(path, lines)
    key = "tenant,amount,day,at,local,clock,uid,n"
    ingest = partfin(home, "ingest", "--table", "ledgers", "--source", f"debezium:{path}", "--primary-key", key)
    assert ingest.returncode == 0, ingest.stderr
    upsert = partfin(home, "upsert", "--table", "ledgers")
    assert upsert.returncode == 0, upsert.stderr
    return home, path


def test_every_key_column_type_is_read_against_its_declaration(ledgers):
    home, path = ledgers
    before = heads(home)
    assert len(cdc_keys(home, "ledgers")) == 15
    refused = [
        ledger_key(2, amount=json.loads("14.505")),  # more fraction digits than the decimal's scale
        ledger_key(2, amount="14.5x"),
        ledger_key(2, amount=True),
        ledger_key(2, amount=json.loads("123456789.5")),  # more digits than decimal(10, 2) holds
        ledger_key(2, day="2026-02-30"),
        ledger_key(2, day=20_456),  # days since the epoch: Debezium's encoding, not a date a user writes
        ledger_key(2, at="2026-01-02T02:04:05.25"),  # a zoned timestamp without its zone
        ledger_key(2, local="2026-01-02T03:04:05.000002Z"),  # a zoneless timestamp with one
        ledger_key(2, clock="25:00:00"),
        ledger_key(2, uid=7),
        ledger_key(2, tenant=None),
        ledger_key(2, n=2.0),
        ledger_key(2, n=2**31),  # past int32
        ledger_key(2, uid=...),  # a key column missing
    ]
    for key in refused:
        one_line_error(delete(home, "ledgers", key))
    assert heads(home) == before

    # row 2 and row 3 in the forms a user writes: decimal as text or number, timestamps in any zone
    done = delete(home, "ledgers", ledger_key(2), ledger_key(3, amount="15.50", at="2026-01-02T02:04:05.25Z"))
    assert done.returncode == 0, done.stderr
    left = {json.loads(k)["n"] for k in cdc_keys(home, "ledgers")}
    assert left == {1, 4, 5}
    base = read_base(load_partfin_catalog(home), "ledgers", selected_fields=("n",)).column("n").to_pylist()
    assert sorted(base) == [1, 4, 5]
    # re-delivered: the registry knows rows 2 and 3 by the keys the source writes
    again = partfin(home, "ingest", "--table", "ledgers", "--source", f"debezium:{path}", "--writer-id", "again")
    assert again.returncode == 0, again.stderr
    assert {json.loads(k)["n"] for k in cdc_keys(home, "ledgers")} == {1, 4, 5}
