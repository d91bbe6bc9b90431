"""Every table partfin writes, read by engines other than PyIceberg (DuckDB, ClickHouse/chdb), row for row
the same as partfin's own reader, tombstones included.

Stages: base after upserts with updates and deletes (merge-on-read: position delete files), after a
rebucket with both partition specs live (old files in the old spec, the next upsert's in the new one, deletes
on both), after compaction; cdc.<t>, its rejected lines, its late-data ledger and the quarantine
(base.<t>__rejected); and base read at an older snapshot (time travel).
"""

from __future__ import annotations

import json

import pyarrow as pa

from partfin_assets.iceberg.ledger import read_ledger
from partfin_assets.iceberg.tables import DELETED, read_base
from partfin_assets.jobs.compaction import compact
from partfin_assets.jobs.rebucket import rebucket
from partfin_assets.model.records import REJECTED_RECORD_SCHEMA, ChangeBatch
from partfin_assets_tests.engines import ENGINES, plain_rows
from partfin_assets_tests.test_upsert import Harness, records


def changes(round_: int, keys: range, *, delete_every: int = 0) -> list:
    """One change per key, an hour apart per round: updates (creates the first time), every `delete_every`-th a delete."""
    out = []
    for i, key in enumerate(keys):
        op = "d" if delete_every and i % delete_every == 0 else ("c" if round_ == 0 else "u")
        out.append((key, op, 60 * round_ + i % 50, 100 * round_ + i + 1, float(key * 10 + round_)))
    return out


def assert_engines_agree(table, expected: pa.Table, what: str, snapshot_id: int | None = None) -> dict[str, int]:
    columns = expected.column_names
    want = plain_rows(expected, columns)
    assert want, f"{what}: nothing to compare"
    for engine, read in ENGINES.items():
        got = read(table, snapshot_id)
        assert sorted(got.column_names) == sorted(columns), f"{engine} {what}: columns {got.column_names}"
        rows = plain_rows(got, columns)
        assert rows == want, f"{engine} reads {what} differently: {len(rows)} rows vs partfin's {len(want)}"
    return {"rows": len(want)}


def test_every_partfin_table_reads_the_same_in_duckdb_and_chdb(tmp_path):
    h = Harness(tmp_path)
    h.write(changes(0, range(1, 201)))
    h.upsert()
    h.write(changes(1, range(1, 201, 2), delete_every=5))
    undecodable = records([(999, "c", 70, 5000, 0.0)], payload=lambda c: json.dumps({"id": 999, "amount": "lots", "status": "x"}))
    rejected = pa.table({"source_seq": [4242], "raw": ["{not json"], "reason": ["unparseable line"]}, schema=REJECTED_RECORD_SCHEMA)
    h.offset += 1
    h.writer.write_checkpoint(ChangeBatch(undecodable, str(h.offset), rejected=rejected))
    h.upsert()
    first = h.base()
    summary = first.current_snapshot().summary
    assert int(summary["total-position-deletes"]) > 0  # merge-on-read: the old versions hidden by delete files
    everything = read_base(h.catalog, "orders", include_deleted=True)
    assert any(everything.column(DELETED).to_pylist())
    figures = {"base after upserts": assert_engines_agree(first, everything, "base.orders after upserts with deletes")}

    rebucket(h.catalog, "orders", 32)
    h.write(changes(2, range(2, 201, 3), delete_every=4))
    h.upsert()
    two_specs = h.base()
    live_specs = set(two_specs.inspect.files().column("spec_id").to_pylist())
    assert len(live_specs) == 2, live_specs
    figures["base, two specs live"] = assert_engines_agree(
        two_specs, read_base(h.catalog, "orders", include_deleted=True), "base.orders with two partition specs live")

    compact(h.catalog, "base.orders", finalized_only=False)
    compacted = h.base()
    assert compacted.current_snapshot().snapshot_id != two_specs.current_snapshot().snapshot_id
    figures["base compacted"] = assert_engines_agree(
        compacted, read_base(h.catalog, "orders", include_deleted=True), "base.orders after compaction")
    figures["base at its first upsert's snapshot"] = assert_engines_agree(
        compacted, read_base(h.catalog, "orders", include_deleted=True, snapshot_id=first.current_snapshot().snapshot_id),
        "base.orders at an older snapshot", snapshot_id=first.current_snapshot().snapshot_id)

    h.writer.close()  # records the last checkpoints in the late-data ledger
    for identifier in ("cdc.orders", "cdc.orders__rejected", "base.orders__rejected"):
        table = h.catalog.load_table(identifier)
        figures[identifier] = assert_engines_agree(table, table.scan().to_arrow(), identifier)
    ledger = h.catalog.load_table("cdc.orders__ledger")
    figures["cdc.orders__ledger"] = assert_engines_agree(ledger, read_ledger(h.catalog, "cdc.orders").to_arrow(), "the late-data ledger")
    print(f"\nDuckDB and chdb agree with partfin's reader: {figures}")
