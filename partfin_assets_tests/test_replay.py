"""Replay / backfill of one hour (OVERWRITE): content, stats under its own keys, watermark, late accounting, idempotence."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from partfin_assets.finalization.late_data import late_data
from partfin_assets.finalization.partition_metadata import checkpoint_hours
from partfin_assets.iceberg.expiry import Retention
from partfin_assets.iceberg.history import late_records_total, recent_commit_stats, watermark_history
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.jobs.replay import replay_hour
from partfin_assets.model import summary_keys as K
from partfin_assets.model.summary_keys import JobKind
from partfin_assets_tests.conftest import HOUR_US, MINUTE_US, ORDERS, T0_US, change_batch


def hour_rows(catalog, hour_us):
    data = catalog.load_table("cdc.orders").scan().to_arrow()
    keep = [i for i, t in enumerate(data.column("event_time").to_pylist()) if hour_us <= int(t.timestamp() * 1e6) < hour_us + HOUR_US]
    return sorted((data.column("key")[i].as_py(), data.column("source_seq")[i].as_py()) for i in keep)


def setup(catalog):
    writer = CdcWriter(catalog, ORDERS, retention=Retention(keep_last=1000))
    batches = []
    for h in range(4):
        batch = change_batch(T0_US + h * HOUR_US + np.arange(10) * MINUTE_US, offset=f"o{h}", seq_start=h * 100)
        batches.append(batch)
        writer.write_checkpoint(batch)
    return writer, batches


def test_replay_replaces_the_hour_and_keeps_the_watermark(catalog):
    writer, batches = setup(catalog)
    table = catalog.load_table("cdc.orders")
    watermark = table.properties[K.PROP_WATERMARK]
    assert watermark == "2026-11-01T01:00:00Z"
    lookback_before = [c.snapshot_id for c in recent_commit_stats(table.metadata, 3)]
    # the hour's 10 records plus 2 the writer never got (lost, say), and the next hour's (ignored)
    missing = change_batch(T0_US + np.array([30, 31]) * MINUTE_US, offset="x", seq_start=500)
    records = pa.concat_tables([batches[0].records, batches[1].records, missing.records])
    result = replay_hour(catalog, "orders", T0_US, records)
    assert (result.records, result.replaced_records, result.added_records, result.removed_records) == (12, 10, 2, 0)
    assert result.ignored_outside_hour == 10
    assert hour_rows(catalog, T0_US) == sorted([(f'{{"id":{s % 50}}}', s) for s in range(10)] + [('{"id":0}', 500), ('{"id":1}', 501)])
    assert hour_rows(catalog, T0_US + HOUR_US) == sorted((f'{{"id":{s % 50}}}', s) for s in range(100, 110))

    table = catalog.load_table("cdc.orders")
    summary = table.current_snapshot().summary.additional_properties
    assert summary[K.JOB_KIND] == JobKind.OVERWRITE.value
    assert K.EVENT_TIME_COUNT not in summary and K.EVENT_TIME_MIN not in summary  # skipped by the policy
    assert summary[K.REPLAY_RECORDS] == "12" and summary[K.REPLAY_EVENT_TIME_MIN] == "2026-11-01T00:00:00Z"
    assert summary[K.WATERMARK] == watermark and table.properties[K.PROP_WATERMARK] == watermark
    assert [c.snapshot_id for c in recent_commit_stats(table.metadata, 3)] == lookback_before
    # the hour was below the watermark: the 2 new records are late data, counted like late CDC records
    assert summary[K.LATE_RECORDS] == "2"
    assert late_records_total(table.metadata) == 2
    assert late_data(catalog, "cdc.orders")[T0_US].records == 2
    # partition metadata for the replayed hour (Dagster materialization of cdc_orders at that hour)
    (hour,) = checkpoint_hours(summary)
    assert hour.hour_us == T0_US and hour.records == 12
    # the writer goes on; the watermark moves on from stats-bearing commits only, never back
    writer.write_checkpoint(change_batch(T0_US + 4 * HOUR_US + np.arange(5) * MINUTE_US, offset="o4", seq_start=900))
    table = catalog.load_table("cdc.orders")
    assert table.properties[K.PROP_WATERMARK] == "2026-11-01T02:00:00Z"
    assert late_records_total(table.metadata) == 2
    history = [w for _, w in watermark_history(table.metadata)]
    assert history == sorted(history)


def test_replay_of_an_open_hour_is_not_late_and_rewrites_are_not_late(catalog):
    _, batches = setup(catalog)
    result = replay_hour(catalog, "orders", T0_US + 3 * HOUR_US, batches[3].records)
    assert (result.added_records, result.removed_records, result.late_records) == (0, 0, 0)
    extra = change_batch(T0_US + 3 * HOUR_US + np.array([50]) * MINUTE_US, offset="e", seq_start=999).records
    result = replay_hour(catalog, "orders", T0_US + 3 * HOUR_US, pa.concat_tables([batches[3].records, extra]))
    assert (result.added_records, result.late_records) == (1, 0)  # hour 3 is above the watermark: not late


def test_replay_with_a_job_id_is_idempotent(catalog):
    _, batches = setup(catalog)
    first = replay_hour(catalog, "orders", T0_US + HOUR_US, batches[1].records, job_id="backfill-h1")
    snapshots = len(catalog.load_table("cdc.orders").metadata.snapshots)
    again = replay_hour(catalog, "orders", T0_US + HOUR_US, batches[1].records, job_id="backfill-h1")
    assert again.already_committed and again.snapshot_id == first.snapshot_id
    assert len(catalog.load_table("cdc.orders").metadata.snapshots) == snapshots


def test_records_outside_the_hour_are_ignored(catalog):
    _, batches = setup(catalog)
    result = replay_hour(catalog, "orders", T0_US + 2 * HOUR_US, batches[1].records, force=True)  # wrong hour's records
    assert result.ignored_outside_hour == 10 and result.records == 0
    assert hour_rows(catalog, T0_US + 2 * HOUR_US) == []
