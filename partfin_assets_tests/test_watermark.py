"""Watermark policies in real checkpoint commits: semantics, late data, idle sources, monotonicity."""

from __future__ import annotations

import json
import multiprocessing
import re

import numpy as np
import pyarrow as pa
import pytest

from partfin_assets.iceberg.expiry import Retention
from partfin_assets.iceberg.files import conform_rows
from partfin_assets.iceberg.history import watermark_history
from partfin_assets.iceberg.streams import retire_stream
from partfin_assets.ingest.extensions import CommitProcessor
from partfin_assets.ingest.watermark_processor import WatermarkProcessor
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.model import summary_keys as K
from partfin_assets.model.records import cdc_records
from partfin_assets.model.stats import CommitWindow
from partfin_assets.model.tablespec import DEFAULT_WATERMARK_POLICY, TableSpec
from partfin_assets.model.timeutil import from_us, iso_z
from partfin_assets.watermark.late_budget import LateBudget
from partfin_assets.watermark.min_of_last import MinOfLast
from partfin_assets.watermark.percentile import Percentile
from partfin_assets.watermark.policy import PolicyError
from partfin_assets.watermark.registry import parse_policy, table_policy
from partfin_assets_tests.conftest import HOUR_US, MINUTE_US, ORDERS, T0_US, change_batch


def hour_batch(hour: int, offset: int, n: int = 100, extra_us=()) -> object:
    """n records spread over [T0 + hour, T0 + hour + 59 min], plus any extra event times."""
    times = T0_US + hour * HOUR_US + np.linspace(0, 59 * MINUTE_US, n).astype(np.int64)
    return change_batch(np.concatenate([times, np.asarray(extra_us, dtype=np.int64)]), offset=str(offset), seq_start=offset * 1000)


def wm(hours: int) -> str:
    return iso_z(T0_US + hours * HOUR_US)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("min-of-last:3", MinOfLast(CommitWindow(commits=3))),
        ("min-of-last:30m", MinOfLast(CommitWindow(span_us=30 * MINUTE_US))),
        ("percentile:0.001:last:3", Percentile(CommitWindow(commits=3), quantile=0.001)),
        ("percentile:0.001:last:2h", Percentile(CommitWindow(span_us=2 * HOUR_US), quantile=0.001)),
        ("late-budget:0.001", LateBudget(budget=0.001)),
        ("late-budget:0.001:feedback", LateBudget(budget=0.001)),
        ("late-budget:0.001:open-loop", LateBudget(budget=0.001, feedback=False)),
    ],
)
def test_policy_parses(text, expected):
    assert parse_policy(text) == expected
    assert parse_policy(str(expected)) == expected


def test_a_table_without_a_policy_property_runs_the_default():
    assert table_policy({}) == parse_policy(DEFAULT_WATERMARK_POLICY)
    assert table_policy({K.PROP_WATERMARK_POLICY: "min-of-last:3"}) == MinOfLast(CommitWindow(commits=3))


@pytest.mark.parametrize("text", ["min-of-last", "min-of-last:0", "percentile:2:last:3", "max-of-last:3", "percentile:0.1:3",
                                  "min-of-last:0m", "min-of-last:soon", "late-budget:0", "late-budget:1.5", "late-budget",
                                  "late-budget:0.001:pid"])
def test_bad_policy_names_the_problem(text):
    with pytest.raises(PolicyError, match=re.escape(repr(text))):
        parse_policy(text)


def test_min_of_last_three(catalog):
    writer = CdcWriter(catalog, ORDERS)
    watermarks = [writer.write_checkpoint(hour_batch(h, h + 1)).summary[K.WATERMARK] for h in range(6)]
    # hour-aligned min over the last 3 stats-bearing commits
    assert watermarks == [wm(0), wm(0), wm(0), wm(1), wm(2), wm(3)]
    table = catalog.load_table("cdc.orders")
    assert table.properties[K.PROP_WATERMARK] == wm(3)


def test_late_records_are_written_counted_and_alerted(catalog):
    alerts = []
    writer = CdcWriter(catalog, ORDERS, processors=[WatermarkProcessor(alert_hooks=[alerts.append])])
    for h in range(5):
        writer.write_checkpoint(hour_batch(h, h + 1))
    assert catalog.load_table("cdc.orders").properties[K.PROP_WATERMARK] == wm(2)

    late = [T0_US + 30 * MINUTE_US, T0_US + 90 * MINUTE_US, T0_US + 95 * MINUTE_US]
    result = writer.write_checkpoint(hour_batch(5, 6, extra_us=late))
    assert result.summary[K.LATE_RECORDS] == "3"
    assert json.loads(result.summary[K.LATE_RECORDS_BY_HOUR]) == {wm(0): 1, wm(1): 2}
    assert result.summary[K.WATERMARK] == wm(2)  # late data never moves it back
    assert result.summary[K.LATE_RECORDS_TOTAL] == "3"
    assert len(alerts) == 1 and alerts[0].late_records == 3 and alerts[0].snapshot_id == result.snapshot_id
    assert catalog.load_table("cdc.orders").scan().to_arrow().num_rows == 6 * 100 + 3


def test_percentile_policy_tolerates_a_few_stragglers(catalog):
    spec = TableSpec("events", ("id",), {"id": pa.int64()}, watermark_policy="percentile:0.01:last:2")
    strict = TableSpec("events_strict", ("id",), {"id": pa.int64()}, watermark_policy="min-of-last:2")
    results = {}
    for table in (spec, strict):
        writer = CdcWriter(catalog, table)
        for h in range(4):
            straggler = [T0_US + (h - 3) * HOUR_US] if h == 3 else []  # 1 of 101 records, hours late
            last = writer.write_checkpoint(hour_batch(h + 5, h + 1, extra_us=straggler))
        results[table.name] = last.summary[K.WATERMARK]
    assert results["events"] == wm(7)  # 1% quantile of the last 2 commits ignores the straggler
    assert results["events_strict"] == wm(6)  # min-of-last sees the straggler and stays where it was


def test_idle_source_advances_by_heartbeat_and_heartbeats_are_rate_limited(catalog):
    writer = CdcWriter(catalog, ORDERS, heartbeat_interval_s=600)
    writer.write_checkpoint(hour_batch(0, 1))
    committed = []
    for i in range(1, 40):  # 10 hours of idle source, a heartbeat every 15 minutes of source time
        beat = from_us(T0_US + HOUR_US + i * 15 * MINUTE_US)
        result = writer.write_checkpoint(change_batch([], offset=f"hb{i}", heartbeat=beat))
        if result.snapshot_id is not None:
            committed.append(result)
            assert result.summary[K.EVENT_TIME_COUNT] == "0"
            assert result.summary[K.EVENT_TIME_HEARTBEAT] == iso_z(beat)
    assert len(committed) == 39  # each 15 min apart >= 10 min interval
    history = [w for _, w in watermark_history(catalog.load_table("cdc.orders").metadata)]
    assert history == sorted(history)
    last_beat = T0_US + HOUR_US + 39 * 15 * MINUTE_US
    # min of the last 3 heartbeats, floored to the hour
    assert catalog.load_table("cdc.orders").properties[K.PROP_WATERMARK] == iso_z((last_beat - 30 * MINUTE_US) // HOUR_US * HOUR_US)

    too_soon = writer.write_checkpoint(change_batch([], offset="hb-soon", heartbeat=from_us(last_beat + MINUTE_US)))
    assert too_soon.snapshot_id is None  # within the heartbeat interval: nothing committed


def test_commits_without_stats_are_skipped_by_the_lookback(catalog):
    writer = CdcWriter(catalog, ORDERS)
    writer.write_checkpoint(hour_batch(0, 1))
    writer.write_checkpoint(hour_batch(1, 2))
    table = catalog.load_table("cdc.orders")
    for _ in range(3):  # e.g. a replay or maintenance commit: no event-time stats
        table.append(conform_rows(table, cdc_records(hour_batch(9, 0).records)))
        table = catalog.load_table("cdc.orders")
    result = writer.write_checkpoint(hour_batch(2, 3))
    assert result.summary[K.WATERMARK] == wm(0)  # window = hours 2, 1, 0: the stat-less commits do not count
    result = writer.write_checkpoint(hour_batch(3, 4))
    assert result.summary[K.WATERMARK] == wm(1)


class RaceOnce(CommitProcessor):
    """Lets a second writer commit a higher watermark between our metadata read and our commit."""

    def __init__(self, rival: CdcWriter, batch) -> None:
        self.rival, self.batch, self.calls = rival, batch, 0

    def pre_commit(self, ctx) -> None:
        self.calls += 1
        if self.calls == 1:
            self.rival.write_checkpoint(self.batch)


def test_watermark_update_is_compare_and_set(catalog):
    rival = CdcWriter(catalog, ORDERS, writer_id="rival")
    for h in range(3):
        rival.write_checkpoint(hour_batch(10 + h, h + 1))
    race = RaceOnce(rival, hour_batch(13, 4))
    slow = CdcWriter(catalog, ORDERS, writer_id="slow", processors=[race, WatermarkProcessor()])
    # registered, "slow" would hold the watermark until its first commit (test_streams.py); retired,
    # it lets the rival move the watermark between its metadata read and its commit
    retire_stream(catalog, "cdc.orders", "slow")
    # the slow writer carries old data: alone it would compute an old candidate
    result = slow.write_checkpoint(hour_batch(1, 1))
    assert race.calls == 2  # the first attempt lost the race and was rebuilt on fresh metadata
    table = catalog.load_table("cdc.orders")
    assert table.properties[K.PROP_WATERMARK] == wm(11) == result.summary[K.WATERMARK]
    assert result.summary[K.LATE_RECORDS] == "100"  # judged against the rival's watermark, not the stale one
    history = [w for _, w in watermark_history(table.metadata)]
    assert history == sorted(history)


def _concurrent_writer(home: str, writer_id: str, seed: int, checkpoints: int) -> None:
    from partfin_assets.iceberg.catalog import load_partfin_catalog

    rng = np.random.default_rng(seed)
    # keep every snapshot so the test can read the whole watermark history
    writer = CdcWriter(load_partfin_catalog(home), ORDERS, writer_id=writer_id, retention=Retention(keep_last=1000))
    for i in range(checkpoints):
        # event times move forward with jitter; some batches carry records hours late
        hour = i // 2 + int(rng.integers(-3, 2))
        writer.write_checkpoint(hour_batch(max(hour, 0), i + 1, n=50))


def test_concurrent_writers_never_move_the_watermark_back(catalog, tmp_path):
    home = str(tmp_path / "home")
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_concurrent_writer, args=(home, f"w{i}", i, 25)) for i in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=600)
        assert worker.exitcode == 0
    table = catalog.load_table("cdc.orders")
    assert len(table.metadata.snapshots) == 75  # every checkpoint of every writer landed
    history = [w for _, w in watermark_history(table.metadata)]
    # a commit records a watermark once every registered writer has committed stats (streams hold it
    # until then); from then on every commit records one
    recorded = [K.WATERMARK in s.summary.additional_properties for s in sorted(table.metadata.snapshots, key=lambda s: s.sequence_number)]
    assert recorded == sorted(recorded) and len(history) == sum(recorded) > 0
    assert history == sorted(history)
    assert table.properties[K.PROP_WATERMARK] == iso_z(history[-1])
    assert table.scan().to_arrow().num_rows == 75 * 50


def test_a_longer_window_declared_on_a_young_table_runs_over_the_commits_it_has(catalog):
    """min-of-last:3 -> min-of-last:10 after two checkpoints: the new window reaches back past the stream's first
    commit, which the ledger holds (a checkpoint used to fail here on a name left undefined)."""
    writer = CdcWriter(catalog, ORDERS)
    for h in range(2):
        writer.write_checkpoint(hour_batch(h, h + 1))
    longer = CdcWriter(catalog, TableSpec(ORDERS.name, ORDERS.primary_key, dict(ORDERS.columns), "min-of-last:10"))
    result = longer.write_checkpoint(hour_batch(2, 3))
    assert result.summary[K.WATERMARK] == wm(0)  # the min over the three commits there are
    change = json.loads(catalog.load_table("cdc.orders").properties[K.PROP_WATERMARK_POLICY_CHANGE])
    assert (change["from"], change["to"]) == ("min-of-last:3", "min-of-last:10") and change["effective-at"] is not None


def test_a_table_the_version_before_ran_records_the_feedback_as_a_policy_change(catalog):
    """A table on late-budget:0.001 from before the feedback (its checkpoints recorded the short text) gets the
    feedback with the next writer, and its first checkpoint under it records the change, effective at once."""

    class VersionBefore(WatermarkProcessor):  # what a writer of the version before recorded it ran
        def pre_commit(self, ctx):
            super().pre_commit(ctx)
            ctx.summary[K.WATERMARK_POLICY_APPLIED] = "late-budget:0.001"

    spec = TableSpec(ORDERS.name, ORDERS.primary_key, ORDERS.columns, watermark_policy="late-budget:0.001")
    old = CdcWriter(catalog, spec, processors=[VersionBefore()])
    old.write_checkpoint(hour_batch(0, 1))
    old.close()
    assert K.PROP_WATERMARK_POLICY_CHANGE not in catalog.load_table("cdc.orders").properties
    from partfin_assets.iceberg.commit import set_table_properties

    set_table_properties(catalog, "cdc.orders", {K.PROP_WATERMARK_POLICY: "late-budget:0.001"})  # its text then
    writer = CdcWriter(catalog, TableSpec(ORDERS.name, ORDERS.primary_key, ORDERS.columns))  # keeps the table's policy
    result = writer.write_checkpoint(hour_batch(1, 2))
    writer.close()
    assert result.summary[K.WATERMARK_POLICY_APPLIED] == "late-budget:0.001:feedback"
    change = json.loads(catalog.load_table("cdc.orders").properties[K.PROP_WATERMARK_POLICY_CHANGE])
    assert change["from"] == "late-budget:0.001" and change["to"] == "late-budget:0.001:feedback"
    assert change["effective-at"] == change["requested-at"]
    assert parse_policy(change["from"]) == parse_policy(change["to"]) == LateBudget(budget=0.001)
