"""partfin_assets/finalization: partition metadata, finalization and late data from summaries (no Dagster)."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa
import pytest

from partfin_assets.finalization.hours import FinalizationCursor, hour_from_key, hour_key, is_finalized, newly_finalized
from partfin_assets.finalization.late_data import late_after_run, late_data, watermark_regressions
from partfin_assets.finalization.hour_truth import checkpoint_facts, finalization_times, hour_truths, newly_final_hours
from partfin_assets.finalization.partition_metadata import checkpoint_hours, partition_counts
from partfin_assets.iceberg.ledger import read_ledger
from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.history import summary_of, watermark_history, watermark_of
from partfin_assets.ingest.event_time import EventTimeAccumulator
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.model import summary_keys as K
from partfin_assets.model.stats import EventTimeProfile, decode_by_hour
from partfin_assets.model.timeutil import US_PER_HOUR, format_duration, iso_z, to_us
from partfin_assets.sources.synthetic import ORDERS_SPEC, SyntheticSource
from partfin_assets_tests.conftest import change_batch

H0 = to_us(datetime(2026, 1, 1, 10, tzinfo=UTC))
MIN = 60_000_000


def test_hour_keys_round_trip_in_dagster_format():
    assert hour_key(H0 + 5 * MIN) == "2026-01-01-10:00"
    assert hour_from_key("2026-01-01-10:00") == H0


def test_finalized_when_hour_plus_one_is_at_most_watermark():
    assert not is_finalized(H0, None)
    assert not is_finalized(H0, H0 + US_PER_HOUR - 1)
    assert is_finalized(H0, H0 + US_PER_HOUR)


def test_newly_finalized_in_order_and_bounded():
    assert newly_finalized(H0, H0) == []
    assert newly_finalized(H0, H0 + 3 * US_PER_HOUR) == [H0, H0 + US_PER_HOUR, H0 + 2 * US_PER_HOUR]
    assert newly_finalized(H0, H0 + 3 * US_PER_HOUR, limit=2) == [H0, H0 + US_PER_HOUR]
    assert newly_finalized(H0, None) == []
    cursor = FinalizationCursor(H0 + US_PER_HOUR)
    assert FinalizationCursor.decode(cursor.encode()) == cursor
    assert FinalizationCursor.decode(None) is None
    with_sequence = FinalizationCursor(H0 + US_PER_HOUR, merged_sequence=42)
    assert FinalizationCursor.decode(with_sequence.encode()) == with_sequence
    # a cursor stored before partfin kept the merged cdc sequence: no late-data window yet
    assert FinalizationCursor.decode('{"next_hour": "2026-01-01T01:00:00Z"}').merged_sequence is None


def test_hour_stats_are_exact_per_hour():
    times = np.array([H0 + 20 * MIN, H0 + US_PER_HOUR + MIN, H0 + 30 * MIN, H0 + 10 * MIN])
    stats = EventTimeProfile.of(times).by_hour
    assert [s.hour_us for s in stats] == [H0, H0 + US_PER_HOUR]
    first = stats[0]
    assert (first.records, first.min_us, first.max_us, first.p50_us) == (3, H0 + 10 * MIN, H0 + 30 * MIN, H0 + 20 * MIN)
    accumulator = EventTimeAccumulator()
    accumulator.add(change_batch(times, offset="1").records)
    summary = EventTimeAccumulator.summary(EventTimeAccumulator.merge([accumulator.partial()]))
    decoded = decode_by_hour(summary[K.EVENT_TIME_BY_HOUR])
    assert decoded[H0].records == 3 and decoded[H0].p99_us == H0 + 30 * MIN
    assert decoded[H0 + US_PER_HOUR].records == 1 and summary[K.EVENT_TIME_COUNT] == "4"


def test_partition_counts_parse_pyiceberg_entries():
    summary = {
        "partitions.event_time_hour=2026-01-01-10": "added-data-files=1,added-files-size=10,added-records=7",
        "partitions.event_time_hour=2026-01-01-11": "added-records=2,added-data-files=1",
        K.LATE_RECORDS_BY_HOUR: '{"2026-01-01T10:00:00Z":3}',
    }
    assert partition_counts(summary) == {H0: 7, H0 + US_PER_HOUR: 2}
    hours = checkpoint_hours(summary)
    assert [(h.hour_us, h.records, h.late_records) for h in hours] == [(H0, 7, 3), (H0 + US_PER_HOUR, 2, 0)]


@pytest.fixture
def written(tmp_path):
    """cdc.orders written by the real writer with the per-hour accumulator: 6 hours, late data on."""
    catalog = load_partfin_catalog(tmp_path / "home")
    start = datetime(2026, 1, 1, tzinfo=UTC)
    source = SyntheticSource(seed=3, rate=0.5, start=start, end=start + timedelta(hours=6), late_fraction=0.05, idle_every=None)
    spec = dataclasses.replace(ORDERS_SPEC, watermark_policy="percentile:0.05:last:2")
    writer = CdcWriter(catalog, spec)
    results = list(writer.run(source, max_records=400))
    return catalog, results


def test_hour_truths_show_the_whole_hour_from_the_ledger(written):
    """A partition shows the hour's totals over every checkpoint, not the last commit's share."""
    catalog, results = written
    table = catalog.load_table("cdc.orders")
    ledger = read_ledger(catalog, "cdc.orders")
    per_commit: dict[int, int] = {}
    for result in results:
        for h in checkpoint_hours(result.summary):
            per_commit[h.hour_us] = per_commit.get(h.hour_us, 0) + h.records
    watermark = watermark_of(table.properties)
    truths = hour_truths(ledger, per_commit, watermark)
    assert {t.hour_us: t.records for t in truths} == per_commit
    assert sum(t.late_records for t in truths) == sum(int(r.summary.get(K.LATE_RECORDS, "0")) for r in results)
    assert any(per_commit[t.hour_us] > max(h.records for r in results for h in checkpoint_hours(r.summary) if h.hour_us == t.hour_us)
               for t in truths), "some hour spans several checkpoints"
    final = [t for t in truths if t.finalized]
    assert final and all(is_finalized(t.hour_us, watermark) for t in final)
    for t in truths:
        meta = t.metadata()
        assert meta["hour"] == iso_z(t.hour_us) and meta["records"] == t.records
        assert t.hour_us <= t.event_time_min_us <= t.p50_us <= t.p99_us <= t.event_time_max_us < t.hour_us + US_PER_HOUR
        # how late the hour's records arrived: a distribution, shown as durations, and the late share
        p50, p99, most = t.arrival_delay_s
        assert 0 <= p50 <= p99 <= most and meta["arrival_delay_max"] == format_duration(most)
        assert meta["late_share"] == f"{t.late_records / t.records:.2%}"
    for t in final:  # finalized at the commit clock of the first checkpoint whose watermark passed the hour's end
        first = min(r.summary[K.COMMIT_CLOCK] for r in results
                    if r.snapshot_id is not None and watermark_of(r.summary) is not None and watermark_of(r.summary) >= t.hour_us + US_PER_HOUR)
        assert iso_z(t.finalized_at_us) == first
        assert t.finalization_lag_seconds == pytest.approx((t.finalized_at_us - t.hour_us - US_PER_HOUR) / 1e6, abs=1e-3)
    open_hours = [t for t in truths if not t.finalized]
    assert all(t.metadata()["finalized_at"] is None and t.finalization_lag_seconds is None for t in open_hours)
    # an override (base: the upsert that carried the watermark past the hour) wins
    first_final = final[0].hour_us
    (overridden,) = hour_truths(ledger, [first_final], watermark, {first_final: first_final + 2 * US_PER_HOUR})
    assert overridden.finalization_lag_seconds == 3600.0 and overridden.metadata()["finalization_lag"] == "1 h 0 min"
    assert finalization_times(ledger, [watermark]) == {}  # the open hour has not finalized
    assert watermark_regressions(watermark_history(table.metadata)) == []
    facts = checkpoint_facts(results[0].summary, to_us(datetime(2026, 1, 1, 0, 30, tzinfo=UTC)))
    assert facts["checkpoint_id"] == results[0].summary[K.CHECKPOINT_ID] and facts["records"] == results[0].records


def test_newly_final_hours_between_two_watermarks():
    assert newly_final_hours(H0, H0 + 3 * US_PER_HOUR, 0) == [H0, H0 + US_PER_HOUR, H0 + 2 * US_PER_HOUR]
    assert newly_final_hours(None, H0 + US_PER_HOUR, H0) == [H0]
    assert newly_final_hours(H0, H0, 0) == [] and newly_final_hours(H0, None, 0) == []


def test_late_data_per_hour_names_commits(written):
    catalog, results = written
    table = catalog.load_table("cdc.orders")
    late = late_data(catalog, "cdc.orders")
    assert late, "a 5% late fraction produces late records"
    expected = sum(int(r.summary.get(K.LATE_RECORDS, "0")) for r in results)  # every checkpoint: the ledger keeps them all
    assert sum(h.records for h in late.values()) == expected
    hour, entry = next(iter(late.items()))
    first = entry.commits[0]
    assert late_after_run(late, hour, ran_with_sequence=first.sequence_number - 1, ran_at_us=0) == list(entry.commits)
    assert late_after_run(late, hour, ran_with_sequence=10**9, ran_at_us=0) == []


def test_watermark_regressions_found():
    assert watermark_regressions([(1, 10), (2, 20), (3, 15)])[0][1].snapshot_id == 3


def test_rewrites_and_replays_are_not_counted_as_new_records(written):
    """Compaction, privacy delete and replay commits of cdc add files too; only INTO records are new.

    PyIceberg's `partitions.*` added-records of a compaction (or a delete's rewritten files, or a
    replayed hour's whole content) must not show up as new records of an hour.
    """
    from partfin_assets.jobs.compaction import compact
    from partfin_assets.jobs.privacy import privacy_delete
    from partfin_assets.jobs.replay import replay_hour
    from partfin_assets.model.records import CDC_RECORD_SCHEMA

    catalog, results = written
    ingested = sum(r.records for r in results)
    into = [r.summary for r in results if r.snapshot_id is not None]
    assert sum(s.records for summary in into for s in checkpoint_hours(summary)) == ingested

    assert compact(catalog, "cdc.orders").snapshot_id is not None
    table = catalog.load_table("cdc.orders")
    compaction = summary_of(table.current_snapshot())
    assert compaction[K.JOB_KIND] == "MERGE" and any(k.startswith("partitions.") for k in compaction)
    assert sum(h.records for h in checkpoint_hours(compaction)) > 0  # PyIceberg counts the rewritten records

    # a replay of the first hour with its own records plus 2 new ones: 2 new records, in that hour only
    rows = table.scan().to_arrow()
    first_hour = min(int(t.timestamp() * 1_000_000) // US_PER_HOUR * US_PER_HOUR for t in rows.column("event_time").to_pylist())
    in_hour = rows.filter(
        np.array([first_hour <= int(t.timestamp() * 1_000_000) < first_hour + US_PER_HOUR for t in rows.column("event_time").to_pylist()])
    ).select(CDC_RECORD_SCHEMA.names)
    extra = in_hour.slice(0, 2).to_pylist()
    for i, row in enumerate(extra):
        row["source_seq"] = 10**9 + i
    records = in_hour.cast(CDC_RECORD_SCHEMA).to_pylist() + extra
    replayed = replay_hour(catalog, "orders", first_hour, pa.Table.from_pylist(records, CDC_RECORD_SCHEMA))
    assert replayed.added_records == 2 and replayed.records == in_hour.num_rows + 2
    replay = summary_of(catalog.load_table("cdc.orders").current_snapshot())
    assert replay[K.JOB_KIND] == "OVERWRITE"
    assert partition_counts(replay)[first_hour] == in_hour.num_rows + 2  # PyIceberg counts the whole hour
    # the replay's partition metadata shows the hour's content; only 2 records are new
    assert [(h.hour_us, h.records) for h in checkpoint_hours(replay)] == [(first_hour, in_hour.num_rows + 2)]

    key = json.loads(in_hour.column("key")[0].as_py())
    deleted = privacy_delete(catalog, "orders", [key], request_id="r1")
    assert deleted.cdc_deleted > 0
    delete = summary_of(catalog.load_table("cdc.orders").current_snapshot())
    assert delete[K.JOB_KIND] == "UPDATE/DELETE"

    # the hours' totals come from the ledger: checkpoints and replays, never compactions or deletes
    ledger = read_ledger(catalog, "cdc.orders")
    hours = {h.hour_us for r in results for h in checkpoint_hours(r.summary)}
    assert sum(t.records for t in hour_truths(ledger, hours, None)) == ingested + 2


def test_not_finalized_reason_names_hour_and_watermark():
    from partfin_assets.finalization.hours import not_finalized_reason

    hour = to_us(datetime(2026, 11, 1, 5, tzinfo=UTC))
    assert not_finalized_reason(hour, hour + US_PER_HOUR, "base.orders") is None
    reason = not_finalized_reason(hour + 60_000_000, hour - US_PER_HOUR, "base.orders")
    assert reason == (
        "hour 2026-11-01T05:00:00Z of base.orders is not finalized: its watermark is 2026-11-01T04:00:00Z "
        "(needs >= 2026-11-01T06:00:00Z)"
    )
    assert "its watermark is not set" in not_finalized_reason(hour, None, "cdc.orders")


@pytest.mark.parametrize("seconds, shown", [(21598.995, "5 h 59 min"), (21600, "6 h 0 min"), (53660.756, "14 h 54 min"), (45, "45 s"),
                                            (150, "2 min 30 s"), (1500, "25 min"), (90061, "1 d 1 h"), (-30, "-30 s"), (None, None)])
def test_durations_read_as_durations(seconds, shown):
    """Lags once shown as `finalization_lag_seconds 21598.995` read as "5 h 59 min" beside the number."""
    assert format_duration(seconds) == shown
