"""The erasure rule (model/erasure.py) and the registry (iceberg/erasures.py): which changes and raw lines a request
covers, what a replay and the quarantine leave out."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from partfin_assets.iceberg.erasures import erasures_identifier, load_erasures, register_erasure
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.jobs.privacy import privacy_delete
from partfin_assets.jobs.replay import replay_hour
from partfin_assets.jobs.upsert.quarantine import quarantine_changes
from partfin_assets.model import summary_keys as K
from partfin_assets.model.erasure import Erasure, Erasures, key_hash, redact_raw_lines, without_erased
from partfin_assets.model.tablespec import TableSpec
from partfin_assets_tests.conftest import MINUTE_US, ORDERS, T0_US, change_batch


def erasures_of(keys: dict[str, int], primary_key=("id",)) -> Erasures:
    return Erasures(tuple(primary_key), 1, "salt", tuple(Erasure("r1", key_hash("salt", k), cutoff) for k, cutoff in keys.items()))


def test_a_change_is_erased_up_to_the_cutoff_and_later_ones_are_new_data():
    erasures = erasures_of({'{"id":42}': 1_000})
    records = pa.table({
        "key": ['{"id":42}', '{"id":42}', '{"id":42}', '{"id":7}'],
        "event_time": pa.array([999, 1_000, 1_001, 5], pa.int64()).cast(pa.timestamp("us", tz="UTC")),
    })
    kept, erased = without_erased(records, erasures)
    assert erased == 2
    assert list(zip(kept.column("key").to_pylist(), kept.column("event_time").cast(pa.int64()).to_pylist())) == [
        ('{"id":42}', 1_001), ('{"id":7}', 5)]
    assert without_erased(records, Erasures(("id",)))[1] == 0


@pytest.mark.parametrize(("raw", "named"), [
    ('{"after":{"id":42,"amount":', True),
    ('{"after": {"id" : 42}}', True),
    ('{"value":"{\\"id\\":42,\\"amount\\":1}"}', True),  # JSON inside a JSON string (a Kafka message as text)
    ('{"after":{"id":42.0}}', True),
    ('{"after":{"id":420}}', False),
    ('{"after":{"user_id":42}}', False),
    ('{"after":{"id":"42"}}', False),  # another key: the string "42"
    ("id=42 garbage", False),  # not JSON: cannot be told apart from any other 42
    ("", False),
])
def test_raw_lines_naming_an_erased_key(raw, named):
    erasures = erasures_of({'{"id":42}': 0})
    assert (erasures.naming_erased([raw]) == ["r1"]) == named


def test_raw_lines_of_a_key_of_several_columns_and_their_redaction():
    erasures = erasures_of({json.dumps({"region": "eu", "id": 7}, sort_keys=True, separators=(",", ":")): 0}, ("id", "region"))
    rows = pa.table({"source_seq": [1, 2], "raw": ['{"region":"eu","x":1,"id":7', '{"region":"us","id":7}'], "reason": ["cut", "bad"]})
    redacted, count = redact_raw_lines(rows, erasures)
    assert count == 1
    assert redacted.column("raw").to_pylist() == ["", '{"region":"us","id":7}']
    assert redacted.column("reason").to_pylist()[0] == "raw text removed: it names a key erased by privacy request r1"
    assert redacted.column("source_seq").to_pylist() == [1, 2]


def test_the_registry_keeps_hashes_never_keys_and_a_rerun_keeps_its_cutoff(catalog):
    CdcWriter(catalog, ORDERS).close()
    first = register_erasure(catalog, ORDERS, "r1", ['{"id":42}'], 1_000, 2_000)
    again = register_erasure(catalog, ORDERS, "r1", ['{"id":42}'], 5_000, 6_000)
    assert again.version == first.version and [e.erased_before_us for e in again.entries] == [1_000]
    rows = catalog.load_table(erasures_identifier(ORDERS)).scan().to_arrow()
    text = json.dumps(rows.to_pylist(), default=str)
    assert "id" not in text.replace('"request_id"', "")  # neither the key's text nor its column: a hash (hex digits only)
    assert all(len(h) == 64 and set(h) <= set("0123456789abcdef") for h in rows.column("key_hash").to_pylist())
    assert load_erasures(catalog, ORDERS).erased(pa.array(['{"id":42}']), None).tolist() == [True]


def test_a_replay_leaves_the_erased_changes_out(catalog):
    writer = CdcWriter(catalog, ORDERS)
    batch = change_batch(T0_US + np.arange(6) * MINUTE_US, offset="1", keys=[1, 2, 42, 3, 42, 4])
    writer.write_checkpoint(batch)
    privacy_delete(catalog, "orders", [{"id": 42}], request_id="r1")
    result = replay_hour(catalog, "orders", T0_US, batch.records)
    assert sorted(catalog.load_table("cdc.orders").scan().to_arrow().column("key").to_pylist()) == [
        '{"id":1}', '{"id":2}', '{"id":3}', '{"id":4}']
    summary = catalog.load_table("cdc.orders").current_snapshot().summary.additional_properties
    assert summary[K.PRIVACY_ERASED_RECORDS] == "2" and result.added_records == 0


def test_the_quarantine_filters_a_request_registered_after_its_rows_were_read(catalog):
    """An upsert read (and filtered) before the request; its quarantine append sees the fence and filters again."""
    CdcWriter(catalog, ORDERS).close()
    spec = TableSpec.from_properties("orders", catalog.load_table("cdc.orders").properties)
    stale = load_erasures(catalog, spec)
    privacy_delete(catalog, "orders", [{"id": 42}], request_id="r1")
    unfit = pa.table({
        "key": ['{"id":42}', '{"id":5}'], "op": ["u", "u"],
        "event_time": pa.array([T0_US, T0_US], pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        "source_seq": pa.array([1, 2], pa.int64()), "payload": ['{"id":42,"amount":"x"}', '{"id":5,"amount":"y"}'],
        "column": ["amount", "amount"], "reason": ["not a double", "not a double"], "source_log": ["orders-writer"] * 2,
    })
    assert quarantine_changes(catalog, spec, unfit, 1, stale) == 1
    assert catalog.load_table(spec.quarantine_identifier).scan().to_arrow().column("key").to_pylist() == ['{"id":5}']


def test_a_replay_that_read_before_the_request_fails_and_its_rerun_leaves_the_key_out(catalog):
    from partfin_assets.jobs.conflicts import CommitConflictError

    writer = CdcWriter(catalog, ORDERS)
    batch = change_batch(T0_US + np.arange(4) * MINUTE_US, offset="1", keys=[1, 42, 2, 42])
    writer.write_checkpoint(batch)
    fired = []

    def request_meanwhile(job):
        if not fired:
            fired.append(privacy_delete(catalog, "orders", [{"id": 42}], request_id="r1"))

    with pytest.raises(CommitConflictError) as lost:
        replay_hour(catalog, "orders", T0_US, batch.records, before_commit=request_meanwhile)
    assert "privacy request" in lost.value.reason
    assert '{"id":42}' not in catalog.load_table("cdc.orders").scan().to_arrow().column("key").to_pylist()
    replay_hour(catalog, "orders", T0_US, batch.records)
    assert sorted(catalog.load_table("cdc.orders").scan().to_arrow().column("key").to_pylist()) == ['{"id":1}', '{"id":2}']


def test_status_lists_the_tables_not_the_registry(catalog):
    from partfin_assets.finalization.status import all_table_status

    CdcWriter(catalog, ORDERS).write_checkpoint(change_batch(T0_US + np.arange(2) * MINUTE_US, offset="1", keys=[1, 42]))
    privacy_delete(catalog, "orders", [{"id": 42}], request_id="r1")
    assert catalog.table_exists(erasures_identifier(ORDERS))
    assert [s.name for s in all_table_status(catalog)] == ["cdc.orders"]
