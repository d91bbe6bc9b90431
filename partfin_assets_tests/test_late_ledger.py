"""Late data must outlive snapshot expiry -- status, checks and Dagster metadata agree.

A table streams six on-time hours; their downstream partitions run. Then 24 late records for
hours that already ran arrive over three checkpoints, followed by 40 on-time checkpoints, so the
writer's own snapshot expiry removes the commits that carried the late records. Afterwards
`partfin status`, the `late_data` check, `late_data_after_run` (which names the hours to
re-run) and the metadata of the sync run must all still report those 24 late records.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime

import pytest
from dagster import AssetCheckSeverity, AssetKey, DagsterEventType, DagsterInstance, EventRecordsFilter

from partfin_assets_tests.cdc_files import HOUR_MS, orders_lines, partfin, stream_of, write_lines

pytestmark = pytest.mark.timeout(600)

T0_MS = int(datetime(2026, 11, 20, tzinfo=UTC).timestamp() * 1000)
LATE = 24


def _late_lines(count: int, hour_ms: int, seen: set[int]) -> list[str]:
    events = [hour_ms + 60_000 * (i + 1) for i in range(count)]
    return orders_lines(events, None, seed=99, seen=seen)


def test_late_records_outlive_snapshot_expiry_and_every_reader_agrees(tmp_path, monkeypatch):
    from partfin_assets.defs import build_definitions
    from partfin_assets.defs.tables import PartfinTable
    from partfin_assets.sources.synthetic import ORDERS_SPEC

    path = tmp_path / "orders.jsonl"
    seen: set[int] = set()
    write_lines(path, orders_lines(*stream_of(T0_MS, T0_MS + 6 * HOUR_MS, 3_000, seed=7), seed=7, seen=seen))
    home = tmp_path / "home"
    monkeypatch.setenv("PARTFIN_HOME", str(home))
    monkeypatch.setenv("PARTFIN_SOURCE", f"debezium:{path}")
    monkeypatch.setenv("PARTFIN_PARTITIONS_START", "2026-11-20-00:00")
    monkeypatch.setenv("PARTFIN_MAX_RECORDS", "250")
    monkeypatch.setenv("PARTFIN_MAX_CHECKPOINTS_PER_RUN", "500")
    monkeypatch.setenv("PARTFIN_MAX_SECONDS_PER_RUN", "600")
    monkeypatch.delenv("PARTFIN_CATALOG_URI", raising=False)
    monkeypatch.delenv("PARTFIN_CATALOG", raising=False)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    (tmp_path / "dagster").mkdir()
    table = PartfinTable(spec=dataclasses.replace(ORDERS_SPEC, watermark_policy="min-of-last:3"), source=f"debezium:{path}")
    defs = build_definitions([table])
    instance = DagsterInstance.ephemeral()
    sync, activity = defs.resolve_job_def("sync_orders"), defs.resolve_job_def("activity_orders_job")

    assert sync.execute_in_process(instance=instance).success
    ran = ["2026-11-20-01:00", "2026-11-20-02:00", "2026-11-20-03:00"]
    for key in ran:
        assert activity.execute_in_process(instance=instance, partition_key=key).success

    # 24 late records for hours 01:00 and 02:00 spread over three checkpoints, then 40 on-time checkpoints
    tail_events, tail_arrivals = stream_of(T0_MS + 6 * HOUR_MS, T0_MS + 9 * HOUR_MS, 10_000, seed=8)
    lines = orders_lines(tail_events, tail_arrivals, seed=8, seen=seen)
    late = _late_lines(LATE // 2, T0_MS + HOUR_MS, seen) + _late_lines(LATE // 2, T0_MS + 2 * HOUR_MS, seen)
    mixed = lines[:750]
    for i, line in enumerate(late):
        mixed.insert((i * 750) // LATE + i, line)
    write_lines(path, mixed + lines[750:], append=True)
    assert sync.execute_in_process(instance=instance).success
    from partfin_assets.iceberg.catalog import load_partfin_catalog

    retained = load_partfin_catalog(home).load_table("cdc.orders").metadata.snapshots
    assert not any(int(s.summary.additional_properties.get("partfin.late-records", "0")) for s in retained), \
        "the commits that brought the late records must have been expired for this test to mean anything"

    status = json.loads(partfin(home, "status", "--json").stdout)
    status_late = next(t for t in status["tables"] if t["name"] == "cdc.orders")["late_records"]
    checks = defs.resolve_job_def("checks_orders").execute_in_process(instance=instance)
    evaluations = {e.check_name: e for e in checks.get_asset_check_evaluations()}
    late_check = evaluations["late_data"]
    after_run = evaluations["late_data_after_run"]
    check_late = late_check.metadata["late_records"].value if "late_records" in late_check.metadata else 0
    observations = instance.get_event_records(
        EventRecordsFilter(event_type=DagsterEventType.ASSET_OBSERVATION, asset_key=AssetKey("cdc_orders")),
        limit=1, ascending=False)
    metadata = observations[0].event_log_entry.asset_observation.metadata if observations else {}
    metadata_late = metadata["late_records_total"].value if "late_records_total" in metadata else None
    print(f"after expiry: status late {status_late}, late_data check late {check_late} "
          f"(passed={late_check.passed}), late_data_after_run passed={after_run.passed}, metadata late {metadata_late}")

    assert status_late == LATE
    assert not late_check.passed and late_check.severity == AssetCheckSeverity.WARN and check_late == LATE
    assert late_check.metadata["by_partition"].value == {"2026-11-20-01:00": LATE // 2, "2026-11-20-02:00": LATE // 2}
    assert not after_run.passed and after_run.metadata["partitions_to_rerun"].value == ran[:2]
    assert metadata_late == LATE
