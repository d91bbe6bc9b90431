"""A source clock ahead of the host must not finalize the future or stall finalization.

The source streams valid changes for five hours; then its clock jumps three hours ahead (a
failover onto a host with a wrong clock, or local time stored as UTC). `partfin ingest`,
`partfin upsert`, then a real `dagster-daemon` runs the finalization sensor. Wanted: the
watermark never passes floor_hour(commit time), the sensor requests only partitions that exist
and keeps finalizing the valid hours.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from dagster import DagsterInstance, RunsFilter
from dagster._core.scheduler.instigation import TickStatus  # not exported at the top level in 1.13

from partfin_assets_tests.cdc_files import HOUR_MS, orders_lines, partfin, stream_of, write_lines

pytestmark = pytest.mark.timeout(600)


def _sensor_ticks(instance, name: str) -> list:
    for state in instance.all_instigator_state():
        if state.instigator_name == name:
            return instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=1000)
    return []


def test_a_source_clock_ahead_of_the_host_neither_finalizes_the_future_nor_stalls(tmp_path):
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets.finalization.hours import hour_key
    from partfin_assets.iceberg.history import watermark_of
    from partfin_assets.model.timeutil import floor_hour_us, iso_z, to_us
    from partfin_assets.testing import dagster_processes as devtools

    now = datetime.now(UTC)
    now_ms = int(now.timestamp() * 1000)
    first_hour_ms = (now_ms // HOUR_MS - 6) * HOUR_MS
    clock_jump_ms = now_ms - 20 * 60_000  # the source's clock jumps 3 h ahead 20 minutes ago
    valid_events, valid_arrivals = stream_of(first_hour_ms, clock_jump_ms, 3_000, seed=4)
    ahead = stream_of(clock_jump_ms, now_ms, 1_000, seed=5)[0]
    future_events = [t + 3 * HOUR_MS for t in ahead]  # source.ts_ms from the wrong clock
    path = tmp_path / "orders.jsonl"
    write_lines(path, orders_lines(valid_events + future_events, valid_arrivals + ahead, seed=4, wrapped=True))

    home, dagster_home = tmp_path / "home", tmp_path / "dagster"
    ingest = partfin(home, "ingest", "--table", "orders", "--source", f"debezium:{path}", "--primary-key", "id",
                     "--checkpoint-records", "250")
    assert ingest.returncode == 0, ingest.stderr
    upsert = partfin(home, "upsert", "--table", "orders")
    assert upsert.returncode == 0, upsert.stderr
    catalog = load_partfin_catalog(home)
    watermark = watermark_of(catalog.load_table("base.orders").properties)
    now_hour = floor_hour_us(to_us(now))
    print(f"source clock 3 h ahead: base watermark {iso_z(watermark)}, now {iso_z(to_us(now))}")

    env = devtools.dagster_env(home, dagster_home, PARTFIN_SENSORS="finalize", PARTFIN_FINALIZE_INTERVAL="2",
                               PARTFIN_PARTITIONS_START=hour_key(first_hour_ms * 1000))
    env.pop("PARTFIN_CATALOG_URI", None)
    env.pop("PARTFIN_CATALOG", None)
    instance = DagsterInstance.from_config(str(dagster_home))
    daemon = devtools.daemon(env, tmp_path / "daemon.log").start()
    try:
        devtools.wait_for(lambda: len([t for t in _sensor_ticks(instance, "finalize_orders_sensor")
                                       if t.status != TickStatus.STARTED]) >= 3,
                          240, "three finalization sensor ticks", on_timeout=daemon.log_tail)
    finally:
        daemon.stop()
    ticks = _sensor_ticks(instance, "finalize_orders_sensor")
    failed = [t for t in ticks if t.status == TickStatus.FAILURE]
    requested = sorted({r.tags.get("dagster/partition") for r in instance.get_runs(filters=RunsFilter(tags={"partfin/downstream": "orders"}))})
    print(f"finalization sensor: {len(failed)} of {len(ticks)} ticks failed "
          f"({failed[0].error.message.strip().splitlines()[0] if failed else '-'}); {len(requested)} hour(s) requested")
    instance.dispose()

    assert watermark <= now_hour, f"the watermark {iso_z(watermark)} is past the current hour"
    assert not failed, failed[0].error.message
    valid = [hour_key(h) for h in range(first_hour_ms * 1000, watermark, 3_600_000_000)]
    assert len(valid) >= 3 and requested == valid


def test_event_times_beyond_the_commit_clock_are_counted_and_never_drive_progress(catalog):
    import json

    from partfin_assets.iceberg.commit import set_table_properties
    from partfin_assets.ingest.writer import CdcWriter
    from partfin_assets.model import summary_keys as K
    from partfin_assets.model.timeutil import from_us, iso_z
    from partfin_assets_tests.conftest import HOUR_US, MINUTE_US, ORDERS, T0_US, change_batch

    now = [T0_US + 10 * HOUR_US + 30 * MINUTE_US]  # the writer's commit clock: 10:30
    writer = CdcWriter(catalog, ORDERS, clock=lambda: from_us(now[0]))

    def minutes(start: int, count: int) -> list[int]:
        return [T0_US + (start + i) * MINUTE_US for i in range(count)]

    # 08:00-09:59 plus 3 records from 13:00 (a clock 2.5 h ahead): those are suspect
    result = writer.write_checkpoint(change_batch(minutes(480, 120) + minutes(780, 3), offset="o1"))
    suspect = json.loads(result.summary[K.SUSPECT_FUTURE])
    assert suspect["records"] == 3 and suspect["by-hour"] == {iso_z(T0_US + 13 * HOUR_US): 3}
    assert suspect["clock"] == iso_z(now[0]) and suspect["tolerance-s"] == 300
    assert result.summary[K.WATERMARK] == iso_z(T0_US + 8 * HOUR_US)
    # every record from the future: the commit claims nothing, the watermark stays
    for i in range(3):
        result = writer.write_checkpoint(change_batch(minutes(800 + 60 * i, 60), offset=f"f{i}"))
        assert json.loads(result.summary[K.SUSPECT_FUTURE])["records"] == 60
        assert result.summary[K.WATERMARK] == iso_z(T0_US + 8 * HOUR_US)
    # 10:00-10:34 is within the 5-minute tolerance: plausible, and still the watermark stops at 10:00,
    # floor_hour of the commit clock, not at 11:00 or beyond
    for i in range(3):
        result = writer.write_checkpoint(change_batch(minutes(600 + 5 * i, 25), offset=f"p{i}"))
        assert K.SUSPECT_FUTURE not in result.summary
    now[0] += 2 * HOUR_US  # 12:30
    result = writer.write_checkpoint(change_batch(minutes(700, 10), offset="p3"))  # 11:40-11:49
    assert result.summary[K.WATERMARK] == iso_z(T0_US + 10 * HOUR_US)
    # a heartbeat from the future claims nothing either
    beat = writer.write_checkpoint(change_batch([], offset="hb", heartbeat=from_us(now[0] + 8 * HOUR_US)))
    assert json.loads(beat.summary[K.SUSPECT_FUTURE])["heartbeat"] == iso_z(now[0] + 8 * HOUR_US)
    assert beat.summary[K.WATERMARK] == iso_z(T0_US + 10 * HOUR_US)
    # a table that knows its source runs 3 h ahead raises the tolerance: no longer suspect, and
    # still never past floor_hour(commit clock)
    set_table_properties(catalog, "cdc.orders", {K.PROP_FUTURE_TOLERANCE: "4h"})
    for i in range(3):
        result = writer.write_checkpoint(change_batch(minutes(900 + 10 * i, 5), offset=f"q{i}"))  # 15:00
        assert K.SUSPECT_FUTURE not in result.summary
    assert result.summary[K.WATERMARK] == iso_z(T0_US + 12 * HOUR_US)


def test_the_finalization_sensor_requests_only_partitions_that_exist(tmp_path, monkeypatch):
    from dagster import DagsterInstance, build_sensor_context

    from partfin_assets.defs import build_definitions
    from partfin_assets.defs.tables import TABLES
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets.iceberg.commit import set_table_properties
    from partfin_assets.iceberg.tables import ensure_base_table
    from partfin_assets.ingest.writer import CdcWriter
    from partfin_assets.model import summary_keys as K
    from partfin_assets.model.timeutil import US_PER_HOUR, floor_hour_us, iso_z, now_utc, to_us
    from partfin_assets_tests.conftest import change_batch

    monkeypatch.setenv("PARTFIN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PARTFIN_CATALOG_URI", raising=False)
    monkeypatch.delenv("PARTFIN_CATALOG", raising=False)
    now_hour = floor_hour_us(to_us(now_utc()))
    start = now_hour - 5 * US_PER_HOUR
    from partfin_assets.finalization.hours import hour_key

    monkeypatch.setenv("PARTFIN_PARTITIONS_START", hour_key(start))
    catalog = load_partfin_catalog()
    spec = TABLES[0].spec
    CdcWriter(catalog, spec).write_checkpoint(change_batch([start + 60_000_000], offset="o"))
    ensure_base_table(catalog, spec)
    # a watermark 5 h in the future, as a table written before partfin capped it carries
    set_table_properties(catalog, f"base.{spec.name}", {K.PROP_WATERMARK: iso_z(now_hour + 5 * US_PER_HOUR)})

    defs = build_definitions()
    sensor = defs.resolve_sensor_def(f"finalize_{spec.name}_sensor")
    instance = DagsterInstance.ephemeral()
    with build_sensor_context(instance=instance, resources=defs.get_repository_def().get_top_level_resources()) as ctx:
        result = sensor(ctx)
    existing = set(TABLES[0].partitions_def().get_partition_keys())
    requested = [r.partition_key for r in result.run_requests]
    assert requested == [hour_key(start + i * US_PER_HOUR) for i in range(6)]  # up to the current hour, which exists
    assert set(requested) <= existing
    instance.dispose()
