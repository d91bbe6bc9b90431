"""The sink: one atomic commit per checkpoint, subtask routing, extension points, dedupe, cleanup, retention."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from partfin_assets.iceberg.expiry import Retention
from partfin_assets.iceberg.history import last_writer_position
from partfin_assets.ingest.extensions import Accumulator, CommitProcessor
from partfin_assets.iceberg.streams import CommittedPosition, retire_stream
from partfin_assets.ingest.writer import CdcWriter, WriterFenced
from partfin_assets.model import summary_keys as K
from partfin_assets.model.records import REJECTED_RECORD_SCHEMA, ChangeBatch
from partfin_assets_tests.conftest import HOUR_US, MINUTE_US, ORDERS, T0_US, change_batch


def minutes(start_min: int, n: int) -> np.ndarray:
    return T0_US + (start_min + np.arange(n)) * MINUTE_US


def data_files_on_disk(home: Path) -> set[str]:
    """cdc.orders's Parquet files (its ledger, cdc.orders__ledger, is a table of its own)."""
    return {str(p) for p in (home / "warehouse" / "cdc" / "orders").rglob("*.parquet")}


def test_a_checkpoint_is_one_commit_with_data_stats_and_properties(catalog):
    writer = CdcWriter(catalog, ORDERS, subtasks=3)
    before = catalog.load_table("cdc.orders").metadata
    result = writer.write_checkpoint(change_batch(minutes(0, 500), offset="o1"))
    after = catalog.load_table("cdc.orders").metadata
    assert len(after.snapshots) == len(before.snapshots) + 1
    assert len(after.metadata_log) == len(before.metadata_log) + 1  # one new metadata file
    snapshot = after.current_snapshot()
    assert snapshot.snapshot_id == result.snapshot_id
    summary = snapshot.summary.additional_properties
    assert summary["added-records"] == "500"
    assert summary[K.EVENT_TIME_COUNT] == "500"
    assert summary[K.CHECKPOINT_ID] == "1" and summary[K.SOURCE_OFFSET] == "o1"
    assert after.properties[K.PROP_WATERMARK] == summary[K.WATERMARK]


def test_subtasks_route_each_key_to_one_subtask(catalog, tmp_path):
    writer = CdcWriter(catalog, ORDERS, subtasks=4)
    rng = np.random.default_rng(5)
    keys = rng.integers(0, 200, 4000)
    writer.write_checkpoint(change_batch(minutes(0, 4000) % (2 * HOUR_US) + T0_US, offset="x", keys=keys))
    table = catalog.load_table("cdc.orders")
    subtask_of_key: dict[str, set[str]] = defaultdict(set)
    files = [task.file.file_path for task in table.scan().plan_files()]
    assert len({Path(f).name.split("-", 2)[2] for f in files}) == 4  # one write id per subtask
    for path in files:
        write_id = Path(path).name.split("-", 2)[2]
        for key in pq.read_table(path.removeprefix("file://"), columns=["key"]).column("key").to_pylist():
            subtask_of_key[key].add(write_id)
    assert len(subtask_of_key) == 200
    assert all(len(ids) == 1 for ids in subtask_of_key.values())


class DeleteCounter(Accumulator):
    name = "deletes"

    def __init__(self) -> None:
        self.count = 0

    def add(self, records: pa.Table) -> None:
        self.count += pc.sum(pc.equal(records.column("op"), "d")).as_py() or 0

    def partial(self) -> int:
        return self.count

    @classmethod
    def merge(cls, partials) -> int:
        return sum(partials)

    @classmethod
    def summary(cls, merged: int) -> dict[str, str]:
        return {"team.deletes": str(merged)}


class Recorder(CommitProcessor):
    def __init__(self) -> None:
        self.committed = []

    def pre_commit(self, ctx) -> None:
        ctx.summary["team.accumulated-deletes"] = str(ctx.accumulated["deletes"])
        ctx.properties["team.last-checkpoint"] = str(ctx.checkpoint_id)

    def post_commit(self, ctx, snapshot) -> None:
        self.committed.append(snapshot.snapshot_id)


def test_custom_accumulators_and_processors_join_the_same_commit(catalog):
    recorder = Recorder()
    writer = CdcWriter(catalog, ORDERS, subtasks=2, accumulators=[DeleteCounter], processors=[recorder])
    ops = ["d" if i % 10 == 0 else "u" for i in range(300)]
    result = writer.write_checkpoint(change_batch(minutes(0, 300), offset="x", ops=ops))
    assert result.summary["team.deletes"] == "30" and result.summary["team.accumulated-deletes"] == "30"
    assert recorder.committed == [result.snapshot_id]
    assert catalog.load_table("cdc.orders").properties["team.last-checkpoint"] == "1"
    # no event-time accumulator, no watermark processor registered: none of their keys
    assert K.EVENT_TIME_COUNT not in result.summary and K.WATERMARK not in result.summary


def test_a_twin_that_lost_the_position_cannot_commit_and_goes_on_from_the_winners(catalog, tmp_path):
    first = CdcWriter(catalog, ORDERS, writer_id="w")
    twin = CdcWriter(catalog, ORDERS, writer_id="w")  # e.g. a restart that read the position too early
    first.write_checkpoint(change_batch(minutes(0, 100), offset="o1"))
    files_before = data_files_on_disk(tmp_path / "home")
    # the twin's batch started at the position before the first writer's commit: refused in the commit
    with pytest.raises(WriterFenced, match="another process committed checkpoint 1 of stream 'w'") as fenced:
        twin.write_checkpoint(change_batch(minutes(0, 150), offset="o1.5"))
    assert fenced.value.position == CommittedPosition(1, "o1") and twin.position == CommittedPosition(1, "o1")
    table = catalog.load_table("cdc.orders")
    assert table.scan().to_arrow().num_rows == 100
    assert data_files_on_disk(tmp_path / "home") == files_before  # the twin's files were removed
    assert twin.write_checkpoint(change_batch(minutes(100, 10), offset="o2")).checkpoint_id == 2
    # and now the first writer is the stale one
    with pytest.raises(WriterFenced):
        first.write_checkpoint(change_batch(minutes(100, 10), offset="o2"))
    assert catalog.load_table("cdc.orders").scan().to_arrow().num_rows == 110


class Explodes(CommitProcessor):
    def pre_commit(self, ctx) -> None:
        raise RuntimeError("processor failed")


class ExplodingAccumulator(Accumulator):
    name = "explodes"

    def add(self, records: pa.Table) -> None:
        raise ValueError("accumulator failed")

    def partial(self):
        return None

    @classmethod
    def merge(cls, partials):
        return None


@pytest.mark.parametrize("subtasks", [1, 3])
def test_a_failed_checkpoint_leaves_no_data_and_no_files(catalog, tmp_path, subtasks):
    writer = CdcWriter(catalog, ORDERS)
    writer.write_checkpoint(change_batch(minutes(0, 50), offset="o1"))
    files_before = data_files_on_disk(tmp_path / "home")
    failing = CdcWriter(catalog, ORDERS, writer_id="other", processors=[Explodes()], subtasks=subtasks)
    with pytest.raises(RuntimeError, match="processor failed"):
        failing.write_checkpoint(change_batch(minutes(60, 50), offset="o2"))
    # an accumulator fails while the subtask's files are being written beside it
    broken = CdcWriter(catalog, ORDERS, writer_id="third", accumulators=[ExplodingAccumulator], processors=[], subtasks=subtasks)
    with pytest.raises(ValueError, match="accumulator failed"):
        broken.write_checkpoint(change_batch(minutes(120, 50), offset="o3"))
    assert data_files_on_disk(tmp_path / "home") == files_before
    table = catalog.load_table("cdc.orders")
    assert table.scan().to_arrow().num_rows == 50 and len(table.metadata.snapshots) == 1


def test_retention_bounds_history_but_keeps_policy_window_and_resume_position(catalog, tmp_path):
    writer = CdcWriter(catalog, ORDERS, retention=Retention(keep_last=4, slack=4))
    other = CdcWriter(catalog, ORDERS, writer_id="quiet-writer", retention=Retention(keep_last=4, slack=4))
    other.write_checkpoint(change_batch(minutes(0, 10), offset="quiet-1"))
    retire_stream(catalog, "cdc.orders", "quiet-writer")  # done: its minute-0 data must not hold the watermark
    for i in range(60):
        writer.write_checkpoint(change_batch(minutes(i * 30, 20), offset=f"o{i}", seq_start=i * 20))
    table = catalog.load_table("cdc.orders")
    assert len(table.metadata.snapshots) <= 4 + 4 + 2
    # expired snapshots' manifest lists are gone, retained ones are there
    lists = {str(p) for p in (tmp_path / "home" / "warehouse" / "cdc" / "orders").rglob("snap-*.avro")}
    assert lists == {s.manifest_list.removeprefix("file://") for s in table.metadata.snapshots}
    assert last_writer_position(table.metadata, "quiet-writer").source_offset == "quiet-1"
    assert CdcWriter(catalog, ORDERS).position.source_offset == "o59"
    assert table.scan().to_arrow().num_rows == 60 * 20 + 10
    # the policy still sees its 3 commits: min of checkpoints 57..59 (minutes 1710..)
    assert table.properties[K.PROP_WATERMARK] == result_hour(1710)


def result_hour(minute: int) -> str:
    from partfin_assets.model.timeutil import floor_hour_us, iso_z

    return iso_z(floor_hour_us(T0_US + minute * MINUTE_US))


def test_rejected_records_land_once_with_their_reason(catalog):
    rejected = pa.table(
        {"source_seq": [7, 9], "raw": ["{bad json", '{"op":"x"}'], "reason": ["line 7: invalid JSON", "line 9: unknown op 'x'"]},
        schema=REJECTED_RECORD_SCHEMA,
    )
    batch = ChangeBatch(change_batch(minutes(0, 5), offset="o1").records, offset="o1", rejected=rejected)
    result = CdcWriter(catalog, ORDERS, writer_id="w").write_checkpoint(batch)
    assert result.summary[K.REJECTED_RECORDS] == "2"
    # a twin that read the position before that commit re-reads the same lines: its rejects are
    # found there already (by source position), its records are refused in the commit
    twin = CdcWriter(catalog, ORDERS, writer_id="w")
    twin.expect_positions({"w": CommittedPosition(0, None)})
    with pytest.raises(WriterFenced):
        twin.write_checkpoint(batch)
    # cut differently (one more reject), the next batch commits only what is new
    more = pa.concat_tables([rejected, pa.table({"source_seq": [11], "raw": ["{"], "reason": ["line 11: invalid JSON"]},
                                                schema=REJECTED_RECORD_SCHEMA)])
    twin.write_checkpoint(ChangeBatch(change_batch(minutes(5, 5), offset="o2").records, offset="o2", rejected=more))
    stored = catalog.load_table("cdc.orders__rejected").scan().to_arrow()
    assert sorted(stored.column("reason").to_pylist()) == ["line 11: invalid JSON", "line 7: invalid JSON", "line 9: unknown op 'x'"]
    assert catalog.load_table("cdc.orders").scan().to_arrow().num_rows == 10


def test_bad_batch_schema_is_refused_with_a_clear_error(catalog):
    writer = CdcWriter(catalog, ORDERS)
    bad = pa.table({"key": ['{"id":1}'], "event_time": pa.array([T0_US], pa.timestamp("us", tz="UTC"))})
    with pytest.raises(ValueError, match="not the CDC record schema"):
        writer.write_checkpoint(ChangeBatch(bad, offset="o"))


def test_a_processor_without_its_accumulator_is_refused_up_front(catalog):
    from partfin_assets.ingest.watermark_processor import WatermarkProcessor

    with pytest.raises(ValueError, match=r"WatermarkProcessor needs accumulator\(s\) \['event-time'\]"):
        CdcWriter(catalog, ORDERS, accumulators=[], processors=[WatermarkProcessor()])
