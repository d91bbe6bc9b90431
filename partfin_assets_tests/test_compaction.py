"""Small-file compaction (MERGE): per hour, finalized hours by default, target size, stats-free commit."""

from __future__ import annotations

import numpy as np
import pytest

from partfin_assets.iceberg.expiry import Retention
from partfin_assets.iceberg.files import hour_partition, live_files
from partfin_assets.iceberg.history import recent_commit_stats, watermark_history
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.jobs.compaction import compact
from partfin_assets.jobs.conflicts import CommitConflictError
from partfin_assets.model import summary_keys as K
from partfin_assets.model.summary_keys import JobKind
from partfin_assets_tests.conftest import HOUR_US, MINUTE_US, ORDERS, T0_US, change_batch
from partfin_assets_tests.table_helpers import files_per_partition


def rows(catalog):
    data = catalog.load_table("cdc.orders").scan().to_arrow()
    return sorted(zip(*(data.column(c).to_pylist() for c in data.column_names)))


def ingest(catalog, checkpoints: int, hours: int = 3, per: int = 40, subtasks: int = 2):
    writer = CdcWriter(catalog, ORDERS, subtasks=subtasks, retention=Retention(keep_last=1000))
    for i in range(checkpoints):
        times = T0_US + (np.arange(per) % hours) * HOUR_US + (np.arange(per) + i) * MINUTE_US % HOUR_US
        writer.write_checkpoint(change_batch(times, offset=str(i), seq_start=i * 1000))
    return writer


def test_compacts_finalized_hours_only_and_keeps_every_row(catalog):
    writer = ingest(catalog, 5)
    # three more checkpoints of the same writer, far ahead, move the watermark past hours 0 and 1
    # (another writer id could not: it is a progress stream of its own, and the watermark is the
    # minimum over the active streams, so the first writer's 00:00 would hold it)
    for i in range(3):
        writer.write_checkpoint(change_batch(T0_US + 2 * HOUR_US + 30 * MINUTE_US + np.arange(3) * MINUTE_US, offset=f"a{i}", seq_start=90_000 + i * 10))
    table = catalog.load_table("cdc.orders")
    watermark = table.properties[K.PROP_WATERMARK]
    assert watermark == "2026-11-01T02:00:00Z"
    before_rows = rows(catalog)
    before = files_per_partition(catalog, "cdc.orders")
    h0, h1, h2 = (hour_partition(table.metadata, T0_US + i * HOUR_US) for i in range(3))
    assert before[h0] == 10 and before[h1] == 10

    result = compact(catalog, "cdc.orders")
    after = files_per_partition(catalog, "cdc.orders")
    assert {p.partition for p in result.partitions} == {h0, h1}
    assert h2 in result.skipped_not_finalized
    assert after[h0] == 1 and after[h1] == 1 and after[h2] == before[h2]
    assert result.files_before == 20 and result.files_after == 2
    assert rows(catalog) == before_rows
    snapshot = catalog.load_table("cdc.orders").current_snapshot()
    summary = snapshot.summary.additional_properties
    assert summary[K.JOB_KIND] == JobKind.MERGE.value
    assert K.EVENT_TIME_COUNT not in summary and K.WATERMARK not in summary
    assert summary[K.COMPACTION_FILES_BEFORE] == "20" and summary[K.COMPACTION_FILES_AFTER] == "2"
    # the policy looks past it; the watermark did not move
    table = catalog.load_table("cdc.orders")
    assert table.properties[K.PROP_WATERMARK] == watermark
    assert all(c.snapshot_id != snapshot.snapshot_id for c in recent_commit_stats(table.metadata, 3))
    # nothing left to do
    assert compact(catalog, "cdc.orders").snapshot_id is None


def test_target_file_size_splits_output(catalog):
    ingest(catalog, 6, hours=1, per=400, subtasks=1)
    table = catalog.load_table("cdc.orders")
    part = hour_partition(table.metadata, T0_US)
    total = sum(f.file_size_in_bytes for f in live_files(table)[part])
    result = compact(catalog, "cdc.orders", finalized_only=False, target_file_size_bytes=total // 2)
    (report,) = result.partitions
    assert report.files_before == 6 and 2 <= report.files_after < 6
    assert report.records == 2400


def test_explicit_partitions_and_conflict_names_the_winner(catalog):
    ingest(catalog, 3)
    table = catalog.load_table("cdc.orders")
    h1 = hour_partition(table.metadata, T0_US + HOUR_US)

    def append_into_h1(job):
        CdcWriter(catalog, ORDERS, writer_id="racer").write_checkpoint(
            change_batch(T0_US + HOUR_US + np.arange(2) * MINUTE_US, offset="r", seq_start=77_000))

    with pytest.raises(CommitConflictError) as info:
        compact(catalog, "cdc.orders", hours=[T0_US + HOUR_US], finalized_only=False, before_commit=append_into_h1)
    error = info.value
    assert error.partitions == [h1] and error.conflicting_kind == JobKind.INTO.value
    assert "cdc.orders" in str(error) and h1 in str(error)
    # the racer's append into another hour does not stop a compaction of hour 0
    def append_into_h2(job):
        CdcWriter(catalog, ORDERS, writer_id="racer").write_checkpoint(
            change_batch(T0_US + 2 * HOUR_US + np.arange(2) * MINUTE_US, offset="r2", seq_start=78_000))

    result = compact(catalog, "cdc.orders", hours=[T0_US], finalized_only=False, before_commit=append_into_h2)
    assert result.snapshot_id is not None
    assert [p.partition for p in result.partitions] == [hour_partition(table.metadata, T0_US)]
    history = [w for _, w in watermark_history(catalog.load_table("cdc.orders").metadata)]
    assert history == sorted(history)
