"""A fast backlog of small checkpoints (`partfin ingest`, real process): the table keeps a bounded number
of snapshots whatever the commit rate, and the watermarks and late counts are those the policy gives over
the stream's whole history (the ledger), as if no snapshot had expired. Many progress streams (Kafka
partitions) share that bound, with the same watermarks as when every window is kept.

The default policy (late-budget, still on its 30-minute fallback window: too little history to learn from)
looks at every commit of the last 30 minutes of arrival; here that is ~50 checkpoints, each of which used
to be kept as a snapshot.
"""

from __future__ import annotations

import dataclasses
import gc

import numpy as np
import polars as pl
import pytest

from partfin_assets.iceberg import expiry
from partfin_assets.iceberg.streams import streams_of
from partfin_assets.ingest.session import IngestSession
from partfin_assets.ingest.writer import CdcWriter

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.iceberg.ledger import COMMIT_STATS_COLUMNS, ledger_commit_stats, read_ledger
from partfin_assets.model import summary_keys as K
from partfin_assets.model.tablespec import DEFAULT_WATERMARK_POLICY
from partfin_assets.model.timeutil import floor_hour_us
from partfin_assets.sources.synthetic import ORDERS_SPEC, SyntheticSource
from partfin_assets.watermark.late_budget import LATE_BUDGET
from partfin_assets.watermark.policy import WatermarkPolicy
from partfin_assets.watermark.registry import parse_policy
from partfin_assets.watermark.step import advance
from partfin_assets_tests.cdc_files import orders_lines, write_lines
from partfin_assets_tests.conftest import MINUTE_US, ORDERS, T0_US, change_batch
from partfin_assets_tests.scenario_helpers import ms, partfin

RECORDS, PER_CHECKPOINT = 1200, 4
SNAPSHOT_BOUND = 40  # keep_last + slack + a bounded window per stream, with room; below the ~50 commits of the window


def backlog(seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """Arrivals over 3 hours; event times a few minutes behind, one record in 40 nearly an hour more, and three
    records 4 hours behind: below the watermark when they come (late)."""
    rng = np.random.default_rng(seed)
    arrival = ms("2024-05-01T10:00:00Z") + np.arange(RECORDS, dtype=np.int64) * 9_000
    lag = rng.integers(0, 10 * 60_000, RECORDS)
    lag[rng.random(RECORDS) < 1 / 40] += 50 * 60_000
    lag[[900, 1000, 1100]] = 4 * 3_600_000
    return arrival - lag, arrival


def replayed_from_ledger(ledger: pl.DataFrame, policy: WatermarkPolicy) -> list[int | None]:
    """The watermark after each checkpoint, from the stream's whole recorded history (nothing expired)."""
    commits = ledger_commit_stats(ledger, 5 * 60_000_000)
    watermark, out = None, []
    for position, this in enumerate(commits):
        newest = this.arrival_clock_us
        window = [this]
        for older in reversed(commits[:position]):
            if not policy.window.holds(len(window), older.arrival_clock_us, newest):
                break
            window.append(older)
        candidate = policy.candidate_us(window)
        watermark = advance(watermark, None if candidate is None else min(candidate, floor_hour_us(this.clock_us)))
        out.append(watermark)
    return out


def test_fast_backlog_keeps_few_snapshots_and_the_same_watermarks(tmp_path):
    events, arrivals = backlog()
    path = tmp_path / "orders.jsonl"
    write_lines(path, orders_lines(events.tolist(), arrivals.tolist()))
    home = tmp_path / "home"
    # two runs: the second resumes mid-window, with the window's older commits only in the ledger
    for stop in (["--max-checkpoints", "150"], []):
        done = partfin(home, "ingest", "--table", "orders", "--source", f"debezium:{path}", "--primary-key", "id",
                       "--checkpoint-records", str(PER_CHECKPOINT), *stop, timeout=900)
        assert done.returncode == 0, done.stderr

    catalog = load_partfin_catalog(home, create=False)
    table = catalog.load_table("cdc.orders")
    policy = parse_policy(table.properties.get(K.PROP_WATERMARK_POLICY, DEFAULT_WATERMARK_POLICY))
    assert policy.kind == LATE_BUDGET and '"delay-s":null' in table.properties[K.PROP_LATE_BUDGET_LEARNED]  # on its fallback

    ledger = read_ledger(catalog, "cdc.orders").sort("checkpoint_id")
    checkpoints = ledger.group_by("checkpoint_id", maintain_order=True).agg(
        pl.col("watermark").first(), pl.col("late_records").sum(), pl.col("records").sum())
    assert checkpoints.height == RECORDS // PER_CHECKPOINT and int(checkpoints["records"].sum()) == RECORDS

    # the watermarks recorded are the policy's over the whole history ...
    expected = replayed_from_ledger(ledger.select(COMMIT_STATS_COLUMNS), policy)
    recorded = [None if w is None else int(w.timestamp() * 1_000_000) for w in checkpoints["watermark"].to_list()]
    assert recorded == expected
    assert len({w for w in expected if w is not None}) >= 2  # it moved across hours: the test can tell windows apart
    # ... and each checkpoint counted as late exactly its records below the watermark in force before it
    before = [None, *expected[:-1]]
    late = [int(np.sum(events[i * PER_CHECKPOINT:(i + 1) * PER_CHECKPOINT] * 1000 < w)) if w is not None else 0
            for i, w in enumerate(before)]
    assert checkpoints["late_records"].to_list() == late
    assert sum(late) > 0

    # ... while the table kept a bounded number of snapshots
    assert len(table.metadata.snapshots) <= SNAPSHOT_BOUND, len(table.metadata.snapshots)


def test_many_partition_streams_share_the_snapshot_bound_with_the_same_watermarks(catalog, monkeypatch):
    """30 partition streams on a count window (min-of-last:5): expiry used to keep each stream's last 5 commits
    (20 for longer windows: a 64-partition table kept 1,280 snapshots and a commit cost 14x a fresh table's).
    Now all streams' windows share TABLE_WINDOW_SNAPSHOTS, each keeping at least its newest commit, and the rest
    of a window comes from the ledger: the watermark and every stream's progress after each checkpoint are the
    same as on a table that keeps every window (the bound lifted)."""
    partitions, rounds = 30, 10
    rng = np.random.default_rng(11)
    batches = []
    for r in range(rounds):
        for p in range(partitions):
            # each partition's changes an hour apart per round, a few 3 hours behind: the window's minimum matters
            times = T0_US + (r * 60 + np.sort(rng.integers(0, 60, 4))) * MINUTE_US - rng.choice([0] * 15 + [180], 4) * MINUTE_US
            batches.append(dataclasses.replace(change_batch(times, offset=f"{r}", seq_start=r * 4), stream=f"topic-{p}"))

    def ingest(spec) -> tuple[list[tuple[str | None, int | None]], int]:
        writer = CdcWriter(catalog, dataclasses.replace(spec, watermark_policy="min-of-last:5"))
        seen = []
        for batch in batches:
            writer.write_checkpoint(batch)
            properties = writer.table.properties
            seen.append((properties.get(K.PROP_WATERMARK), streams_of(properties)[writer.stream_id(batch.stream)].progress_us))
        return seen, len(writer.table.metadata.snapshots)

    bounded, kept = ingest(ORDERS)
    with monkeypatch.context() as lifted:
        lifted.setattr(expiry, "TABLE_WINDOW_SNAPSHOTS", 10**6)
        every_window, kept_unbounded = ingest(dataclasses.replace(ORDERS, name="orders_all_windows"))

    assert bounded == every_window
    assert len({w for w, _ in bounded if w is not None}) >= 3  # the watermark moved: the windows made a difference
    retention = expiry.Retention()
    assert kept <= retention.keep_last + retention.slack + max(expiry.TABLE_WINDOW_SNAPSHOTS, partitions + 1) + 1, kept
    assert kept_unbounded >= partitions * 5  # what the bound saves here


def test_a_stream_reads_the_ledger_once_when_a_process_resumes_it_never_while_it_writes(catalog, monkeypatch):
    """The default policy's window (30 minutes of arrival) reaches past what expiry keeps, so a stream's older commits
    come from the ledger: read when a process first commits a stream that has a history, never for a stream's first
    checkpoint (nothing of it landed: a new 96-partition table used to read it 96 times in its first commits) nor
    again while the process goes on (its own commits are added as they land)."""
    from partfin_assets.ingest import watermark_processor

    reads: list[str] = []
    real_read = watermark_processor._ledger_commits  # a stream's rows (the policy's learning reads the ledger too)
    monkeypatch.setattr(watermark_processor, "_ledger_commits", lambda *a, **k: reads.append("read") or real_read(*a, **k))
    spec = dataclasses.replace(ORDERS, watermark_policy=None)  # the default policy
    batches = [dataclasses.replace(change_batch(T0_US + np.arange(4) * MINUTE_US + r * 10 * MINUTE_US, offset=str(r),
                                                seq_start=r * 4), stream=f"topic-{r % 4}") for r in range(16)]
    writer = CdcWriter(catalog, spec)
    for batch in batches[:12]:
        writer.write_checkpoint(batch)
    assert reads == []
    resumed = CdcWriter(catalog, spec)  # another process takes topic-0 and topic-1 over
    for batch in batches[12:14] + batches[12:14]:
        resumed.write_checkpoint(dataclasses.replace(batch, offset=batch.offset + "b"))
    assert len(reads) == 2  # once per stream it resumed


def test_an_ingest_session_keeps_the_collector_off_what_the_process_held_before_it_and_gives_it_back(catalog):
    """A session freezes what the process holds when it starts (modules, catalog, table metadata) so the cyclic
    collector's full collections walk only what comes after; it thaws at the end, also after an error, so a process
    that runs sessions one after another (a Dagster run, tests) collects its garbage as before."""
    source = SyntheticSource(seed=3, hours=1.0)
    with IngestSession(catalog, ORDERS_SPEC, source) as session:
        assert gc.get_freeze_count() > 10_000
        assert sum(1 for _ in session.run(max_records=500, max_checkpoints=2)) == 2
    assert gc.get_freeze_count() == 0

    with pytest.raises(RuntimeError, match="stopped"):
        with IngestSession(catalog, ORDERS_SPEC, SyntheticSource(seed=3, hours=1.0)):
            raise RuntimeError("stopped")
    assert gc.get_freeze_count() == 0
