"""Bench: a finalization-sensor tick with 10 vs 10,000 hours of history.

A tick reads base.<table>'s metadata (watermark property, current snapshot), the sequence
number of the cdc snapshot it merged (cdc metadata), and the `finalized_<table>` events of
the hours it walks from the Dagster instance; it never lists partitions or files (the late-data
ledger is read only for cdc commits merged since the last tick). This bench builds real histories (CDC writer + upsert over N hours of synthetic
orders, N `finalized_orders` events in a SQLite Dagster instance), then times:

- steady tick:   cursor at the head, nothing new (what almost every tick is);
- finalize tick: one hour newly final (one run request + one finalization event);
- seeding tick:  no cursor yet (reads cdc manifests once to find the first hour).

    python bench/bench_sensor.py                 # 10 and 10000 hours
    python bench/bench_sensor.py --hours 10 1000 --ticks 100
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from _sizes import parse_sizes


def build_history(root: Path, hours: int) -> dict:
    from partfin_assets.defs.tables import TABLES
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets.iceberg.tables import ensure_base_table
    from partfin_assets.ingest.writer import CdcWriter
    from partfin_assets.jobs.upsert import run_upsert
    from partfin_assets.sources.synthetic import SyntheticSource

    spec = TABLES[0].spec
    catalog = load_partfin_catalog(root / "partfin")
    end = datetime(2026, 6, 1, tzinfo=UTC)
    start = end - timedelta(hours=hours)
    # a few events per hour, in about 40 checkpoints whatever N is
    rate = 4 / 3600
    source = SyntheticSource(seed=1, rate=rate, start=start, end=end, idle_every=None, late_fraction=0.0,
                             heartbeat_every=timedelta(hours=max(1, hours // 40)), key_space=10_000_000)
    writer = CdcWriter(catalog, spec, writer_id="bench",
                       heartbeat_interval_s=3600 * max(1, hours // 40))
    checkpoints = sum(1 for _ in writer.run(source, max_records=max(1, hours * 4 // 40)))
    writer.close()
    ensure_base_table(catalog, spec)
    run_upsert(catalog, spec.name)
    base = catalog.load_table(f"base.{spec.name}")
    return {"start": start, "checkpoints": checkpoints, "base": base}


def bench(hours: int, ticks: int, workdir: Path) -> dict:
    root = workdir / f"h{hours}"
    os.environ["PARTFIN_HOME"] = str(root / "partfin")
    os.environ["PARTFIN_PARTITIONS_START"] = "2024-01-01-00:00"
    t0 = time.perf_counter()
    history = build_history(root, hours)
    build_s = time.perf_counter() - t0

    from dagster import AssetMaterialization, DagsterInstance, build_sensor_context

    from partfin_assets.defs import build_definitions
    from partfin_assets.finalization.hours import FinalizationCursor, hour_key, newly_finalized
    from partfin_assets.iceberg.history import watermark_of
    from partfin_assets.model.timeutil import US_PER_HOUR, to_us

    defs = build_definitions()
    sensor = defs.resolve_sensor_def("finalize_orders_sensor")
    resources = defs.get_repository_def().get_top_level_resources()
    (root / "dagster").mkdir(parents=True, exist_ok=True)
    instance = DagsterInstance.local_temp(str(root / "dagster"))
    watermark = watermark_of(history["base"].properties)
    final_hours = newly_finalized(to_us(history["start"]), watermark)
    t0 = time.perf_counter()
    for hour in final_hours:  # the instance has seen every hour finalize already
        instance.report_runless_asset_event(AssetMaterialization(asset_key="finalized_orders", partition=hour_key(hour)))
    events_s = time.perf_counter() - t0
    head = FinalizationCursor(final_hours[-1] + US_PER_HOUR).encode()
    one_behind = FinalizationCursor(final_hours[-1]).encode()

    def timed(cursor: str | None, n: int) -> list[float]:
        out = []
        for _ in range(n):
            with build_sensor_context(instance=instance, cursor=cursor, resources=resources) as ctx:
                t = time.perf_counter()
                result = sensor(ctx)
                out.append(time.perf_counter() - t)
        return out, result

    timed(head, 3)  # warm up imports and caches
    steady, steady_result = timed(head, ticks)
    finalize, finalize_result = timed(one_behind, ticks)
    seeding, _ = timed(None, 3)
    assert not steady_result.run_requests
    assert len(finalize_result.run_requests) == 1
    metadata_file = history["base"].metadata_location.replace("file://", "")
    instance.dispose()
    return {
        "hours": hours,
        "finalized_hours": len(final_hours),
        "cdc_checkpoints": history["checkpoints"],
        "base_metadata_bytes": os.path.getsize(metadata_file),
        "build_s": build_s,
        "events_s": events_s,
        "steady_ms": statistics.median(steady) * 1000,
        "finalize_ms": statistics.median(finalize) * 1000,
        "seeding_ms": statistics.median(seeding) * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hours", type=int, nargs="+", default=[10, 10_000])
    parser.add_argument("--ticks", type=int, default=50)
    args = parse_sizes(parser, smoke=dict(hours=[2, 3], ticks=1), argv=argv)
    with tempfile.TemporaryDirectory(prefix="partfin-bench-sensor-") as tmp:
        rows = [bench(h, args.ticks, Path(tmp)) for h in args.hours]
    print(f"{'hours':>7} {'final':>6} {'ckpts':>5} {'meta KB':>8} {'steady ms':>10} {'ticks/s':>8} "
          f"{'finalize ms':>12} {'ticks/s':>8} {'seeding ms':>11} {'build s':>8}")
    for r in rows:
        print(f"{r['hours']:>7} {r['finalized_hours']:>6} {r['cdc_checkpoints']:>5} {r['base_metadata_bytes'] / 1024:>8.1f} "
              f"{r['steady_ms']:>10.2f} {1000 / r['steady_ms']:>8.1f} {r['finalize_ms']:>12.2f} {1000 / r['finalize_ms']:>8.1f} "
              f"{r['seeding_ms']:>11.1f} {r['build_s'] + r['events_s']:>8.1f}")
    if len(rows) >= 2:
        small, big = rows[0], rows[-1]
        for kind in ("steady", "finalize"):
            ratio = big[f"{kind}_ms"] / small[f"{kind}_ms"]
            verdict = "within" if ratio <= 2 else "OVER"
            print(f"{kind} tick: {big['hours']} h / {small['hours']} h = {ratio:.2f}x ({verdict} the 2x goal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
