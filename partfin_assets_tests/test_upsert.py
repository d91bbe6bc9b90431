"""The base-table upsert: incremental, exactly-once, last writer wins, watermark with the data."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pytest

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.expiry import Retention
from partfin_assets.iceberg.history import summary_of, watermark_history
from partfin_assets.iceberg.tables import DELETED, EVENT_TIME, ORDER_TIME, SOURCE_LOG, SOURCE_SEQ, ensure_base_table, read_base
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.jobs.conflicts import CommitConflictError
from partfin_assets.jobs.maintenance import list_table_files, referenced_files
from partfin_assets.jobs.retry import retry_on_conflict
from partfin_assets.jobs.upsert import run_upsert
from partfin_assets.model import summary_keys as K
from partfin_assets.model.records import CDC_RECORD_SCHEMA_WITHOUT_ARRIVAL, ChangeBatch
from partfin_assets.model.summary_keys import JobKind
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.model.timeutil import parse_iso, to_us

SPEC = TableSpec(
    name="orders",
    primary_key=("id",),
    columns={"id": pa.int64(), "amount": pa.float64(), "status": pa.string()},
)
T0 = datetime(2024, 5, 1, 10, tzinfo=UTC)

# A change: (id, op, minutes after T0, source_seq, amount)
Change = tuple[int, str, int, int, float | None]


def records(changes: Sequence[Change], payload=None) -> pa.Table:
    def after_image(c: Change) -> str | None:
        if c[1] == "d":
            return None
        if payload is not None:
            return payload(c)
        return json.dumps({"id": c[0], "amount": c[4], "status": f"s{c[3]}"})

    return pa.table(
        {
            "key": [json.dumps({"id": c[0]}, separators=(",", ":")) for c in changes],
            "op": [c[1] for c in changes],
            "event_time": [T0 + timedelta(minutes=c[2]) for c in changes],
            "source_seq": [c[3] for c in changes],
            "payload": [after_image(c) for c in changes],
        },
        schema=CDC_RECORD_SCHEMA_WITHOUT_ARRIVAL,
    )


class Harness:
    def __init__(self, home: Path, spec: TableSpec = SPEC, **writer_args) -> None:
        self.catalog = load_partfin_catalog(home)
        self.spec = spec
        self.writer = CdcWriter(self.catalog, spec, **writer_args)
        self.offset = 0

    def write(self, changes: Sequence[Change] = (), *, table: pa.Table | None = None, heartbeat: datetime | None = None):
        self.offset += 1
        batch = ChangeBatch(table if table is not None else records(changes), str(self.offset), heartbeat=heartbeat)
        return self.writer.write_checkpoint(batch)

    def upsert(self):
        return run_upsert(self.catalog, self.spec.name)

    def rows(self, include_deleted: bool = False) -> dict[int, dict]:
        data = read_base(self.catalog, self.spec.name, include_deleted=include_deleted)
        return {row["id"]: row for row in data.to_pylist()}

    def live(self) -> dict[int, tuple[float | None, int]]:
        return {k: (r["amount"], r[SOURCE_SEQ]) for k, r in self.rows().items()}

    def base(self):
        return self.catalog.load_table(self.spec.base_identifier)

    def cdc(self):
        return self.catalog.load_table(self.spec.cdc_identifier)


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path)


def test_insert_update_delete_and_counts(h: Harness):
    h.write([(1, "c", 0, 1, 1.0), (2, "c", 1, 2, 2.0), (3, "r", 2, 3, 3.0)])
    first = h.upsert()
    assert (first.inserted, first.updated, first.deleted) == (3, 0, 0)
    assert h.live() == {1: (1.0, 1), 2: (2.0, 2), 3: (3.0, 3)}

    h.write([(1, "u", 70, 4, 10.0), (2, "d", 75, 5, None), (4, "c", 80, 6, 4.0)])
    second = h.upsert()
    assert (second.inserted, second.updated, second.deleted) == (1, 1, 1)
    assert h.live() == {1: (10.0, 4), 3: (3.0, 3), 4: (4.0, 6)}
    # hours: 10:00 (old rows of 1 and 2 left it) and 11:00 (new rows of 1 and 4)
    assert second.hours_touched == ["2024-05-01T10:00:00Z", "2024-05-01T11:00:00Z"]
    assert second.cdc_snapshot_id == h.cdc().current_snapshot().snapshot_id
    assert "1 inserted, 1 updated, 1 deleted" in second.describe()
    row = h.rows()[1]
    assert row["status"] == "s4" and row[EVENT_TIME] == T0 + timedelta(minutes=70)
    assert DELETED not in read_base(h.catalog, "orders").column_names


def test_second_run_without_new_data_commits_nothing(h: Harness):
    h.write([(1, "c", 0, 1, 1.0)])
    h.upsert()
    snapshots = len(h.base().metadata.snapshots)
    again = h.upsert()
    assert again.base_snapshot_id is None and again.cdc_snapshot_ids_merged == []
    assert len(h.base().metadata.snapshots) == snapshots
    assert "nothing merged" in again.describe()


def test_late_older_update_after_newer_delete_does_not_resurrect(h: Harness):
    h.write([(1, "c", 0, 1, 1.0)])
    h.upsert()
    h.write([(1, "d", 30, 3, None)])
    h.upsert()
    h.write([(1, "u", 20, 2, 5.0)])  # older than the delete, arrives after it
    late = h.upsert()
    assert h.live() == {}
    assert late.stale == 1 and (late.inserted, late.updated, late.deleted) == (0, 0, 0)
    assert h.rows(include_deleted=True)[1][DELETED] is True
    h.write([(1, "u", 40, 4, 7.0)])  # newer: comes back
    h.upsert()
    assert h.live() == {1: (7.0, 4)}


def test_source_seq_breaks_event_time_ties_and_redelivery_is_idempotent(h: Harness):
    h.write([(1, "c", 0, 5, 1.0), (1, "u", 0, 6, 2.0), (1, "u", 0, 4, 3.0)])
    h.upsert()
    assert h.live() == {1: (2.0, 6)}
    h.write([(1, "u", 0, 6, 2.0), (1, "c", 0, 5, 1.0)])  # re-delivered changes
    again = h.upsert()
    assert again.stale == 1 and h.live() == {1: (2.0, 6)}  # one key, its newest re-delivered change lost to base


def test_position_and_watermark_in_the_same_commit(h: Harness):
    h.write([(1, "c", 0, 1, 1.0)])
    h.write([(2, "c", 125, 2, 2.0)])
    cdc_snapshot = h.cdc().current_snapshot()
    result = h.upsert()
    base = h.base()
    snapshot = base.current_snapshot()
    summary = summary_of(snapshot)
    assert snapshot.snapshot_id == result.base_snapshot_id
    assert summary[K.PROP_SOURCE_SNAPSHOT_ID] == str(cdc_snapshot.snapshot_id)
    assert summary[K.PROP_SOURCE_TABLE] == "cdc.orders"
    assert summary[K.WATERMARK] == summary_of(cdc_snapshot)[K.WATERMARK] == result.watermark
    assert base.properties[K.PROP_SOURCE_SNAPSHOT_ID] == str(cdc_snapshot.snapshot_id)
    assert base.properties[K.PROP_WATERMARK] == result.watermark
    assert summary[K.JOB_KIND] == "UPDATE/DELETE" and K.COMMIT_ID in summary
    assert result.cdc_snapshot_ids_merged == [s.snapshot_id for s in h.cdc().metadata.snapshots]
    # the merged CDC snapshot is tagged so expiry keeps the next run's starting point
    assert h.cdc().metadata.refs[K.MERGED_TAG].snapshot_id == cdc_snapshot.snapshot_id


def test_heartbeat_only_snapshots_advance_position_and_watermark(h: Harness):
    h.write([(1, "c", 0, 1, 1.0)])
    h.upsert()
    before = h.base().properties[K.PROP_WATERMARK]
    for hours in (5, 6, 7):  # min-of-last:3 needs three commits past the first one
        h.write(heartbeat=T0 + timedelta(hours=hours))
    result = h.upsert()
    assert result.base_snapshot_id is not None and (result.inserted, result.updated, result.deleted) == (0, 0, 0)
    after = h.base().properties[K.PROP_WATERMARK]
    assert to_us(parse_iso(after)) > to_us(parse_iso(before))
    assert after == summary_of(h.cdc().current_snapshot())[K.WATERMARK]
    history = [wm for _, wm in watermark_history(h.base().metadata)]
    assert history == sorted(history)


def test_an_update_appends_its_version_and_deletes_the_old_one_by_position(h: Harness):
    """Merge-on-read: one new data file and one position-delete file in the key's bucket; nothing rewritten."""
    h.write([(i, "c", 0, i, float(i)) for i in range(1, 201)])
    h.upsert()
    files_before = {task.file.file_path for task in h.base().scan().plan_files()}
    h.write([(7, "u", 10, 1000, 70.0)])
    result = h.upsert()
    assert result.buckets_rewritten == 1 and result.files_removed == 0 and result.files_added == 2
    assert result.files_scanned == 1  # the key columns of the one file of key 7's bucket
    tasks = h.base().scan().plan_files()
    files_after = {task.file.file_path for task in tasks}
    assert files_before < files_after and len(files_after - files_before) == 1
    [deletes] = {d for task in tasks for d in task.delete_files}
    assert deletes.record_count == 1 and deletes.partition == next(t.file.partition for t in tasks if t.file.file_path not in files_before)
    assert len(h.live()) == 200 and h.live()[7] == (70.0, 1000)


def quarantined(h: Harness) -> list[dict]:
    return h.catalog.load_table(h.spec.quarantine_identifier).scan().to_arrow().sort_by("source_seq").to_pylist()


def test_bad_payload_is_quarantined_naming_key_column_and_reason_and_the_rest_merges(h: Harness):
    h.write([(1, "c", 0, 1, 1.0)])
    h.upsert()
    h.write([(2, "c", 1, 2, 2.0)])  # good, in the same run as the bad one below
    h.write(table=records([(3, "c", 2, 3, 3.0)], payload=lambda c: json.dumps({"id": 3, "amount": "lots", "status": "x"})))
    result = h.upsert()
    assert h.live() == {1: (1.0, 1), 2: (2.0, 2)}
    assert h.base().properties[K.PROP_SOURCE_SNAPSHOT_ID] == str(h.cdc().current_snapshot().snapshot_id)
    assert result.quarantined == 1 and "quarantined in base.orders__rejected: 1" in result.describe()
    assert summary_of(h.base().current_snapshot())[K.UPSERT_QUARANTINED] == "1"
    (row,) = quarantined(h)
    assert (row["key"], row["op"], row["source_seq"], row["column"]) == ('{"id":3}', "c", 3, "amount")
    assert row["event_time"] == T0 + timedelta(minutes=2) and row["cdc_snapshot_id"] == h.cdc().current_snapshot().snapshot_id
    assert "string" in row["reason"] and json.loads(row["payload"])["amount"] == "lots"

    h.write([(3, "u", 5, 4, 30.0)])  # a later good change of the key merges as usual
    h.upsert()
    assert h.live()[3] == (30.0, 4) and len(quarantined(h)) == 1


@pytest.mark.parametrize(
    ("payload", "column", "reason"),
    [
        ({"id": 3, "status": "x"}, "amount", "missing"),
        ({"id": 3, "amount": 1.0, "status": 5}, "status", "string"),
        ({"id": 4, "amount": 1.0, "status": "x"}, "id", "disagrees"),
        ({"id": None, "amount": 1.0, "status": "x"}, "id", "null"),
        ({"id": 3, "amount": "NaN", "status": "x", "note": 1}, None, None),  # NaN is a double: it merges
    ],
)
def test_payload_errors_name_the_column(h: Harness, payload, column, reason):
    h.write(table=records([(3, "c", 0, 1, 1.0), (5, "c", 0, 2, 5.0)], payload=lambda c: json.dumps(payload if c[0] == 3 else {"id": 5, "amount": 5.0, "status": "y"})))
    h.upsert()
    if column is None:
        assert str(h.live()[3][0]) == "nan" and not h.catalog.table_exists(h.spec.quarantine_identifier)
        return
    (row,) = quarantined(h)
    assert row["column"] == column and row["key"] == '{"id":3}' and reason in row["reason"]
    assert h.live() == {5: (5.0, 2)}


def test_every_unfit_change_is_found_and_quarantined_once(h: Harness):
    def payload(c: Change) -> str:
        return json.dumps({"id": c[0], "amount": "x" if c[0] % 10 == 0 else c[4], "status": "s"})

    h.write(table=records([(i, "c", i, i, float(i)) for i in range(1, 101)], payload=payload))
    h.write(table=records([(0, "x", 0, 0, None)]))  # an unknown op
    h.upsert()
    assert [r["key"] for r in quarantined(h)] == ['{"id":0}', *[f'{{"id":{i}}}' for i in range(10, 101, 10)]]
    assert quarantined(h)[0]["column"] == "op"
    assert len(h.live()) == 90
    # a full re-merge reads every CDC file again: nothing is quarantined twice
    with h.catalog.load_table(h.spec.base_identifier).transaction() as tx:
        tx.remove_properties(K.PROP_SOURCE_SNAPSHOT_ID)
    again = h.upsert()
    assert again.quarantined == 11 and again.changes_read == 101  # found again,
    assert len(quarantined(h)) == 11  # held once


def test_explicit_null_is_a_value(h: Harness):
    h.write(table=records([(3, "c", 0, 1, 1.0)], payload=lambda c: json.dumps({"id": 3, "amount": None, "status": None})))
    h.upsert()
    assert h.live() == {3: (None, 1)}


def test_typed_columns_and_composite_key(tmp_path: Path):
    spec = TableSpec(
        name="events",
        primary_key=("region", "n"),
        columns={
            "region": pa.string(),
            "n": pa.int32(),
            "at": pa.timestamp("us", tz="UTC"),
            "day": pa.date32(),
            "price": pa.decimal128(10, 2),
            "ok": pa.bool_(),
        },
    )
    h = Harness(tmp_path, spec)
    payload = {"region": "eu", "n": 7, "at": "2024-05-01T12:00:00+02:00", "day": "2024-05-01", "price": "12.30", "ok": True}
    table = pa.table(
        {
            "key": ['{"n":7,"region":"eu"}', '{"n":8,"region":"eu"}', '{"n":8,"region":"eu"}'],
            "op": ["c", "c", "d"],
            "event_time": [T0, T0, T0 + timedelta(seconds=1)],
            "source_seq": [1, 2, 3],
            "payload": [json.dumps(payload), json.dumps({**payload, "n": 8}), None],
        },
        schema=CDC_RECORD_SCHEMA_WITHOUT_ARRIVAL,
    )
    h.write(table=table)
    h.upsert()
    rows = read_base(h.catalog, "events").to_pylist()
    assert len(rows) == 1
    row = rows[0]
    assert row["region"] == "eu" and row["n"] == 7 and row["ok"] is True
    assert row["at"] == datetime(2024, 5, 1, 10, tzinfo=UTC)
    assert row["price"] == Decimal("12.30") and str(row["day"]) == "2024-05-01"
    schema = h.base().schema()
    assert [schema.find_field(i).name for i in schema.identifier_field_ids] == ["region", "n"]


def test_expired_merge_position_falls_back_to_full_remerge(h: Harness):
    h.write([(1, "c", 0, 1, 1.0), (2, "c", 0, 2, 2.0)])
    h.upsert()
    h.write([(2, "d", 5, 3, None)])
    h.upsert()
    # Remove the tag and expire the merged snapshot anyway: the next run must still be right.
    cdc = h.cdc()
    merged = int(h.base().properties[K.PROP_SOURCE_SNAPSHOT_ID])
    with cdc.manage_snapshots() as manage:
        manage.remove_tag(K.MERGED_TAG)
    h.write([(3, "c", 6, 4, 3.0)])
    h.cdc().maintenance.expire_snapshots().by_ids([merged]).commit()
    result = h.upsert()
    assert result.full_remerge
    assert h.live() == {1: (1.0, 1), 3: (3.0, 4)}
    assert (result.inserted, result.updated, result.deleted) == (1, 0, 0)
    assert h.cdc().metadata.refs[K.MERGED_TAG].snapshot_id == h.cdc().current_snapshot().snapshot_id


def test_tag_protects_merge_position_from_expiry(tmp_path: Path):
    h = Harness(tmp_path, retention=Retention(keep_last=2, slack=0))
    h.write([(1, "c", 0, 1, 1.0)])
    h.upsert()
    merged = int(h.base().properties[K.PROP_SOURCE_SNAPSHOT_ID])
    for i in range(2, 8):
        h.write([(i, "c", i, i, float(i))])
    assert h.cdc().metadata.snapshot_by_id(merged) is not None
    result = h.upsert()
    assert not result.full_remerge and result.changes_read == 6
    assert len(h.live()) == 7


def test_an_upsert_that_loses_to_another_upsert_commits_nothing_and_its_rerun_finds_the_work_done(h: Harness):
    h.write([(1, "c", 0, 1, 1.0)])
    h.upsert()
    h.write([(2, "c", 1, 2, 2.0)])
    fired = []

    def meddle(phase: str) -> None:
        # Another upsert lands between this run's read and its commit.
        if phase == "after-files" and not fired:
            fired.append(run_upsert(h.catalog, "orders"))
            assert fired[0].inserted == 1

    with pytest.raises(CommitConflictError) as lost:
        run_upsert(h.catalog, "orders", crash_hook=meddle)
    assert lost.value.kind is JobKind.UPDATE_DELETE and lost.value.table == "base.orders"
    assert lost.value.conflicting_snapshot_id == fired[0].base_snapshot_id
    assert K.PROP_SOURCE_SNAPSHOT_ID in lost.value.reason
    rerun = retry_on_conflict(lambda: run_upsert(h.catalog, "orders"))  # the policy the CLI and the op follow
    assert rerun.base_snapshot_id is None and rerun.cdc_snapshot_ids_merged == []  # found it merged
    assert h.live() == {1: (1.0, 1), 2: (2.0, 2)}
    upserts = [s for s in h.base().metadata.snapshots if summary_of(s).get(K.PROP_SOURCE_SNAPSHOT_ID)]
    assert len({summary_of(s)[K.PROP_SOURCE_SNAPSHOT_ID] for s in upserts}) == len(upserts)  # nothing applied twice
    stray = {f.path for f in list_table_files(h.base().location())} - referenced_files(h.base())
    assert not stray  # the loser's data files are gone


def test_failed_run_leaves_no_files(h: Harness):
    h.write([(1, "c", 0, 1, 1.0)])

    def fail(phase: str) -> None:
        if phase == "after-files":
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        run_upsert(h.catalog, "orders", crash_hook=fail)
    data_dir = Path(h.base().location().removeprefix("file://")) / "data"
    assert h.base().current_snapshot() is None
    assert not list(data_dir.rglob("*.parquet"))
    h.upsert()
    assert h.live() == {1: (1.0, 1)}


def test_ensure_base_table_layout(tmp_path: Path):
    catalog = load_partfin_catalog(tmp_path)
    table = ensure_base_table(catalog, SPEC, buckets=8)
    assert str(table.spec().fields[0].transform) == "bucket[8]"
    assert [f.name for f in table.schema().fields] == ["id", "amount", "status", EVENT_TIME, SOURCE_SEQ, DELETED, SOURCE_LOG, ORDER_TIME]
    assert ensure_base_table(catalog, SPEC).metadata.table_uuid == table.metadata.table_uuid


def test_tables_from_before_change_logs_get_the_columns_and_rank_their_rows_by_event_time(h: Harness):
    """A base table (and CDC table) written before partfin kept change logs: the next upsert adds `_source_log` /
    `_order_time`; its old rows (no known log) rank by event time as before, and once a key's row came from a log,
    that log's next change wins by position even when its clock stepped back."""
    h.write([(1, "c", 30, 1, 1.0), (2, "c", 30, 2, 2.0)])
    h.upsert()
    with h.base().update_schema() as update:  # what a base table from before looks like
        update.delete_column(SOURCE_LOG)
        update.delete_column(ORDER_TIME)
    h.write([(1, "u", 20, 3, 3.0)])  # the clock stepped back: against an old row it still ranks by event time
    h.upsert()
    assert {SOURCE_LOG, ORDER_TIME} <= {f.name for f in h.base().schema().fields}
    assert h.live() == {1: (1.0, 1), 2: (2.0, 2)}
    assert h.rows()[1][SOURCE_LOG] is None and h.rows()[1][ORDER_TIME] is None
    h.write([(1, "u", 35, 4, 4.0)])  # newer by event time: the row now names its log
    h.upsert()
    assert h.rows()[1][SOURCE_LOG] == "orders-writer"
    h.write([(1, "u", 10, 5, 5.0), (2, "u", 5, 6, 6.0)])  # the clock stepped back further: the log's order decides
    h.upsert()
    assert h.live() == {1: (5.0, 5), 2: (2.0, 2)}  # key 2's row is still from before: event time
    assert h.rows()[1][ORDER_TIME] == T0 + timedelta(minutes=35) and h.rows()[1][EVENT_TIME] == T0 + timedelta(minutes=10)


def test_a_cdc_table_from_before_change_logs_merges_as_unknown_logs(h: Harness):
    h.write([(1, "c", 30, 1, 1.0)])
    with h.cdc().update_schema() as update:  # a CDC table (and its files) from before `source_log`
        update.delete_column("source_log")
    h.upsert()
    assert h.live() == {1: (1.0, 1)} and h.rows()[1][SOURCE_LOG] is None
