"""A record's identity is its change log and its position in that log.

Two Debezium files ingested under two writer ids (the table's own writer and `backfill-1`, as the
README recommends for a second source) both change hour 00; their line numbers, the records'
positions, coincide. A replay of hour 00 as the operator runs it (a materialization of partition 00
of `cdc_orders`) must re-create every record of both logs, report what it added and removed per log,
and leave base as it was.
"""

from __future__ import annotations

from collections import Counter

import pyarrow.compute as pc
import pytest
from dagster import DagsterInstance

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.tables import read_base
from partfin_assets.model.timeutil import US_PER_HOUR
from partfin_assets_tests.conftest import T0_US
from partfin_assets_tests.scenario_helpers import append_lines, change, ms, partfin
from partfin_assets_tests.test_replay_sources import FILE_SPEC, H0_KEY, HOURS, failure_message, replay_in_dagster

pytestmark = pytest.mark.timeout(300)


def hour_records(catalog, hour_us: int) -> Counter:
    """(log, key, position, payload) of every record of the hour in cdc.orders, duplicates counted."""
    rows = catalog.load_table("cdc.orders").scan().to_arrow()
    times = pc.cast(rows.column("event_time"), "int64")
    rows = rows.filter(pc.and_(pc.greater_equal(times, hour_us), pc.less(times, hour_us + US_PER_HOUR)))
    return Counter(zip(rows.column("source_log").to_pylist(), rows.column("key").to_pylist(),
                       rows.column("source_seq").to_pylist(), rows.column("payload").to_pylist()))


def base_rows(catalog) -> dict[int, tuple]:
    live = read_base(catalog, "orders", selected_fields=("id", "status", "amount"))
    return {r["id"]: (r["status"], r["amount"]) for r in live.to_pylist()}


@pytest.fixture
def two_logs(tmp_path, monkeypatch):
    """orders.jsonl (writer orders-writer): hours 00-03, ids 1-10 created in 00; backfill.jsonl (writer backfill-1):
    the same ids updated later in 00, on the same line numbers. Both ingested by `partfin ingest`, the backfill first."""
    main, backfill = tmp_path / "orders.jsonl", tmp_path / "backfill.jsonl"
    append_lines(main, [change("c", key, ms(HOURS[0]) + 2 * key * 60_000, wrapped=True) for key in range(1, 11)])
    for n, hour in enumerate(HOURS[1:], start=1):
        append_lines(main, [change("c", 100 * n + i, ms(hour) + 5 * i * 60_000, wrapped=True) for i in range(10)])
    append_lines(backfill, [change("u", key, ms(HOURS[0]) + (30 + key) * 60_000, status="shipped", amount=99.0, wrapped=True)
                            for key in range(1, 11)])
    home = tmp_path / "home"
    monkeypatch.setenv("PARTFIN_HOME", str(home))
    monkeypatch.delenv("PARTFIN_SOURCE", raising=False)
    monkeypatch.setenv("PARTFIN_PARTITIONS_START", "2026-11-01-00:00")
    monkeypatch.setenv("PARTFIN_MAX_RECORDS", "10")
    for path, writer in ((backfill, "backfill-1"), (main, "orders-writer")):
        ingest = partfin(home, "ingest", "--table", "orders", "--source", f"debezium:{path}", "--primary-key", "id",
                         "--writer-id", writer, "--checkpoint-records", "10")
        assert ingest.returncode == 0, ingest.stderr
    from partfin_assets.defs import build_definitions
    from partfin_assets.defs.tables import PartfinTable

    defs = build_definitions([PartfinTable(spec=FILE_SPEC, source=f"debezium:{main}")])
    with DagsterInstance.ephemeral() as instance:
        yield home, defs, instance, load_partfin_catalog(home)


def test_replay_of_an_hour_written_by_two_logs_recreates_every_record_of_each(two_logs):
    """Before: the replay kept 10 of the hour's 20 records (positions 1-10 of both logs collapsed), reported
    removed=0, and the upsert after it gave base the older values ("new", 10.0) of ids 1-10."""
    home, defs, instance, catalog = two_logs
    before = hour_records(catalog, T0_US)
    assert sum(before.values()) == 20 and {log for log, *_ in before} == {"orders-writer", "backfill-1"}

    result = replay_in_dagster(defs, instance, H0_KEY)
    assert result.success, failure_message(result)
    (event,) = result.get_asset_materialization_events()
    meta = {name: value.value for name, value in event.materialization.metadata.items()}
    upsert = partfin(home, "upsert", "--table", "orders")
    assert upsert.returncode == 0, upsert.stderr
    after, base_after = hour_records(catalog, T0_US), base_rows(catalog)
    print(f"replay of 00 written by two logs: {sum(before.values())} records -> {sum(after.values())}; "
          f"added {meta['added_records']}, removed {meta['removed_records']}, by log {meta.get('by_log')}; "
          f"base ids 1-10 with their older values: {sum(base_after[k] != ('shipped', 99.0) for k in range(1, 11))}")
    assert after == before
    assert meta["records"] == 20 and meta["added_records"] == 0 and meta["removed_records"] == 0
    assert meta["by_log"] == {"backfill-1": {"added": 0, "removed": 0, "records": 10},
                              "orders-writer": {"added": 0, "removed": 0, "records": 10}}
    assert {key: base_after[key] for key in range(1, 11)} == dict.fromkeys(range(1, 11), ("shipped", 99.0))
    assert len(base_after) == 40


def test_two_records_are_the_same_only_in_the_same_log_and_a_row_without_one_matches_by_position():
    """records_not_in: line 1 of log a is not line 1 of log b; a row written before partfin kept its log (null)
    matches a record of any log at its key and position, in either direction."""
    import polars as pl

    from partfin_assets.model.records import records_by_log, records_not_in

    schema = {"source_log": pl.String, "key": pl.String, "source_seq": pl.Int64}
    new = pl.DataFrame({"source_log": ["a", "b", "a", None], "key": ["k1", "k1", "k2", "k3"], "source_seq": [1, 1, 2, 3]},
                       schema=schema)
    old = pl.DataFrame({"source_log": ["a", None, "c"], "key": ["k1", "k2", "k3"], "source_seq": [1, 2, 3]}, schema=schema)
    assert records_not_in(new, old).rows() == [("b", "k1", 1)]
    assert records_not_in(old, new).is_empty()
    assert records_not_in(old.with_columns(pl.lit(9, pl.Int64).alias("source_seq")), new).height == 3
    assert records_by_log(new) == {"a": 2, "b": 1, "unknown": 1}


def test_unfit_changes_of_two_logs_at_one_position_are_both_quarantined(tmp_path):
    """Two writer ids each commit an unfit change (an amount that is no number) of key 3 at position 3 and the same
    event time, each merged by an upsert of its own. Both are changes of their own logs: the quarantine holds both,
    once each, also after a full re-merge reads them again. Before: the first only (the second upsert took the
    second change for the first)."""
    import json

    from partfin_assets.ingest.writer import CdcWriter
    from partfin_assets.model import summary_keys as K
    from partfin_assets.model.records import ChangeBatch
    from partfin_assets_tests.test_upsert import Harness, records

    unfit = records([(3, "c", 2, 3, 3.0)], payload=lambda c: json.dumps({"id": 3, "amount": "lots", "status": "x"}))
    table = Harness(tmp_path, writer_id="orders-writer")
    table.write(table=unfit)
    table.upsert()
    backfill = CdcWriter(table.catalog, table.spec, writer_id="backfill-1")
    backfill.write_checkpoint(ChangeBatch(unfit, "1"))
    backfill.close()
    table.upsert()
    with table.catalog.load_table(table.spec.base_identifier).transaction() as tx:
        tx.remove_properties(K.PROP_SOURCE_SNAPSHOT_ID)  # a full re-merge reads every CDC file again
    table.upsert()
    held = table.catalog.load_table(table.spec.quarantine_identifier).scan().to_arrow()
    assert held.num_rows == 2
    assert sorted(held.column("source_log").to_pylist()) == ["backfill-1", "orders-writer"]
