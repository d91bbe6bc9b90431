"""Event-time statistics: exact count/min/max, order-independent merge, t-digest accuracy."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pyarrow.compute as pc
import tdigest

from partfin_assets.ingest.event_time import EventTimeAccumulator
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.model import summary_keys as K
from partfin_assets.model.stats import EventTimeProfile, EventTimeStats
from partfin_assets.model.timeutil import floor_hour_us, iso_z
from partfin_assets_tests.conftest import HOUR_US, ORDERS, T0_US, change_batch


def heavy_tailed_times(rng: np.random.Generator, n: int) -> np.ndarray:
    """Mostly recent event times with a Pareto tail of late ones, in epoch us."""
    recent = T0_US + rng.integers(0, HOUR_US, n)
    lateness = (rng.pareto(1.5, n) * 30_000_000).astype(np.int64)
    return recent - lateness


def test_merge_is_identical_for_every_subtask_order():
    rng = np.random.default_rng(7)
    parts = [EventTimeAccumulator() for _ in range(4)]
    for accumulator in parts:
        accumulator.add(change_batch(heavy_tailed_times(rng, int(rng.integers(100, 5000))), offset="x").records)
    partials = [a.partial() for a in parts]
    summaries = {json.dumps(EventTimeAccumulator.summary(EventTimeAccumulator.merge(list(p))), sort_keys=True)
                 for p in itertools.permutations(partials)}
    assert len(summaries) == 1
    merged = EventTimeAccumulator.merge(partials).stats
    everything = np.concatenate([p.event_time_us for p in partials])
    assert merged.count == everything.size
    assert merged.min_us == everything.min() and merged.max_us == everything.max()


def test_empty_parts_do_not_change_the_merge():
    rng = np.random.default_rng(1)
    stats = EventTimeProfile.of(heavy_tailed_times(rng, 1000)).stats
    assert EventTimeStats.merge_all([EventTimeStats(), stats, EventTimeStats()]).to_summary() == stats.to_summary()
    assert EventTimeStats.merge_all([]).to_summary() == {K.EVENT_TIME_COUNT: "0"}


def test_committed_summary_matches_the_data_written(catalog):
    """count/min/max exact and p1/p50/p99 within 0.5% rank error, read back through the tdigest package."""
    rng = np.random.default_rng(42)
    times = heavy_tailed_times(rng, 200_000)
    writer = CdcWriter(catalog, ORDERS, subtasks=4)
    result = writer.write_checkpoint(change_batch(times, offset="1"))
    summary = result.summary

    written = catalog.load_table("cdc.orders").scan().to_arrow().column("event_time")
    written_us = np.sort(pc.cast(written, "int64").to_numpy())
    assert int(summary[K.EVENT_TIME_COUNT]) == written_us.size == times.size
    assert summary[K.EVENT_TIME_MIN] == iso_z(int(written_us[0]))
    assert summary[K.EVENT_TIME_MAX] == iso_z(int(written_us[-1]))

    stored = json.loads(summary[K.EVENT_TIME_TDIGEST])
    assert set(stored) == {"n", "delta", "K", "centroids"} and stored["n"] == times.size
    oracle = tdigest.TDigest().update_from_dict(stored)
    written_s = written_us / 1e6
    for q in (0.01, 0.5, 0.99):
        estimate = oracle.percentile(q * 100)
        rank = np.searchsorted(written_s, estimate) / written_s.size
        assert abs(rank - q) <= 0.005, f"p{q * 100:g}: rank error {abs(rank - q):.4%}"


def test_summary_round_trip():
    rng = np.random.default_rng(3)
    stats = EventTimeProfile.of(heavy_tailed_times(rng, 5000)).stats
    back = EventTimeStats.from_summary(stats.to_summary())
    assert (back.count, back.min_us, back.max_us) == (stats.count, stats.min_us, stats.max_us)
    assert back.to_summary() == stats.to_summary()
    assert EventTimeStats.from_summary({}) is None


def test_large_batches_digest_within_a_few_input_runs_of_fastdigest_fed_every_value():
    """Past DIGEST_INPUT_POINTS values the digest is fed runs of values as weighted means."""
    from fastdigest import TDigest

    from partfin_assets.model.stats import DIGEST_CENTROIDS, DIGEST_INPUT_POINTS

    rng = np.random.default_rng(11)
    for n in (DIGEST_INPUT_POINTS + 1, 20_000, 250_000):
        lateness = (rng.pareto(1.5, n) * 5_000_000).astype(np.int64).clip(0, 60_000_000)
        times = floor_hour_us(T0_US) + 60_000_000 + rng.integers(0, HOUR_US - 120_000_000, n) - lateness
        profile = EventTimeProfile.of(times)
        assert len(profile.by_hour) == 1  # one hour: the batch digest is that hour's, no merge involved
        ordered = np.sort(times) / 1e6
        every_value = TDigest.from_values(ordered.tolist(), max_centroids=DIGEST_CENTROIDS)
        quantiles = np.linspace(0.001, 0.999, 500)
        ours = np.searchsorted(ordered, [profile.stats.digest.quantile(q) for q in quantiles]) / n
        reference = np.searchsorted(ordered, [every_value.quantile(q) for q in quantiles]) / n
        assert np.max(np.abs(ours - reference)) <= 4 / DIGEST_INPUT_POINTS, n
