"""Acknowledging late data: the late_data WARN stays until the hours are re-run *or acknowledged*.

A table streams three hours; then late records reach hour 01:00 and 02:00, and 00:00, before the downstream
partitions start (01:00): no downstream run exists to redo there, so it never needs attention. Acknowledged on the
command line (`partfin late-data ack`, a subprocess), hour 01:00 is listed as acknowledged by
`partfin status` and by the late_data check, which WARNs about 02:00 only; acknowledged by the Dagster
job `acknowledge_late_orders` (run config `all: true`), the check passes. New late records for 01:00
after that raise the WARN again for 01:00 alone. The acknowledgements live in the Iceberg catalog.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime

import pytest
from dagster import AssetCheckSeverity, DagsterInstance, RunConfig

from partfin_assets_tests.cdc_files import HOUR_MS, orders_lines, partfin, stream_of, write_lines

pytestmark = pytest.mark.timeout(600)

T0_MS = int(datetime(2026, 11, 20, tzinfo=UTC).timestamp() * 1000)
H1, H2 = "2026-11-20-01:00", "2026-11-20-02:00"
H1_ISO, H2_ISO = "2026-11-20T01:00:00Z", "2026-11-20T02:00:00Z"
H0_ISO = "2026-11-20T00:00:00Z"  # before the partitions


def _late_lines(count: int, hour_ms: int, seen: set[int], seed: int) -> list[str]:
    return orders_lines([hour_ms + 60_000 * (i + 1) for i in range(count)], None, seed=seed, seen=seen)


def _late_check(defs, instance):
    result = defs.resolve_job_def("checks_orders").execute_in_process(instance=instance)
    return {e.check_name: e for e in result.get_asset_check_evaluations()}["late_data"]


def _status(home) -> dict:
    done = partfin(home, "status", "--json", PARTFIN_PARTITIONS_START=H1)  # the code location's environment
    assert done.returncode == 0, done.stderr
    return next(t for t in json.loads(done.stdout)["tables"] if t["name"] == "cdc.orders")


def test_acknowledged_late_hours_pass_the_check_until_new_late_records_arrive(tmp_path, monkeypatch):
    from partfin_assets.defs import build_definitions
    from partfin_assets.defs.tables import PartfinTable
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets.sources.synthetic import ORDERS_SPEC

    path = tmp_path / "orders.jsonl"
    seen: set[int] = set()
    write_lines(path, orders_lines(*stream_of(T0_MS, T0_MS + 4 * HOUR_MS, 2_000, seed=7), seed=7, seen=seen))
    home = tmp_path / "home"
    for key, value in {"PARTFIN_HOME": str(home), "PARTFIN_SOURCE": f"debezium:{path}", "PARTFIN_PARTITIONS_START": H1,
                       "PARTFIN_MAX_RECORDS": "250", "PARTFIN_MAX_CHECKPOINTS_PER_RUN": "500", "PARTFIN_MAX_SECONDS_PER_RUN": "600",
                       "DAGSTER_HOME": str(tmp_path / "dagster")}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("PARTFIN_CATALOG_URI", raising=False)
    monkeypatch.delenv("PARTFIN_CATALOG", raising=False)
    (tmp_path / "dagster").mkdir()
    table = PartfinTable(spec=dataclasses.replace(ORDERS_SPEC, watermark_policy="min-of-last:3"), source=f"debezium:{path}")
    defs = build_definitions([table])
    instance = DagsterInstance.ephemeral()
    sync = defs.resolve_job_def("sync_orders")
    assert sync.execute_in_process(instance=instance).success

    def late_into(hours_ms: list[int], seed: int) -> None:
        tail = orders_lines(*stream_of(T0_MS + 4 * HOUR_MS, T0_MS + 5 * HOUR_MS, 1_000, seed=seed), seed=seed, seen=seen)
        late = [line for hour_ms in hours_ms for line in _late_lines(6, hour_ms, seen, seed)]
        write_lines(path, tail[:300] + late + tail[300:], append=True)
        assert sync.execute_in_process(instance=instance).success

    late_into([T0_MS, T0_MS + HOUR_MS, T0_MS + 2 * HOUR_MS], seed=8)
    check = _late_check(defs, instance)
    assert not check.passed and check.severity == AssetCheckSeverity.WARN
    assert check.metadata["partitions_to_rerun"].value == [H1, H2]  # not 00:00: before the partitions, nothing to re-run
    assert check.metadata["late_records"].value == 18 and check.metadata["late_records_before_partitions"].value == 6
    assert _status(home)["late_hours_needing_attention"] == {H1: 6, H2: 6} and _status(home)["late_records"] == 18

    # refused in one line: an hour without late records, no reason, both --hour and --all
    refused = partfin(home, "late-data", "ack", "--table", "orders", "--hour", "2026-11-20-03:00", "--reason", "known")
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0 and "no late records in hour(s) 2026-11-20-03:00" in refused.stderr
    assert partfin(home, "late-data", "ack", "--table", "orders", "--hour", H1, "--reason", " ").returncode == 2
    assert partfin(home, "late-data", "ack", "--table", "orders", "--hour", H1, "--all", "--reason", "x").returncode == 2
    assert _late_check(defs, instance).metadata["partitions_to_rerun"].value == [H1, H2]  # nothing was recorded

    # the command line: hour 01:00, by whom and why
    done = partfin(home, "late-data", "ack", "--table", "orders", "--hour", H1_ISO, "--reason", "replayed upstream already",
                   "--by", "alice")
    assert done.returncode == 0, done.stderr
    assert f"hour {H1_ISO}" in done.stdout and "acknowledged by alice" in done.stdout
    status = _status(home)
    (ack,) = status["acknowledged_late_hours"]
    assert ack["hour"] == H1_ISO and ack["by"] == "alice" and ack["reason"] == "replayed upstream already" and ack["late_records"] == 6
    assert status["late_hours_needing_attention"] == {H2: 6}
    check = _late_check(defs, instance)
    assert not check.passed and check.metadata["partitions_to_rerun"].value == [H2]
    assert list(check.metadata["acknowledged_partitions"].value) == [H1]
    text = partfin(home, "status", PARTFIN_PARTITIONS_START=H1).stdout
    assert f"hour {H1_ISO}: 6 late record(s) acknowledged by alice" in text
    assert f"late records neither re-run downstream nor acknowledged in hour(s) {H2} (6)" in text  # the check's words

    # the Dagster job: every late hour; the run re-evaluates late_data, which passes
    run = defs.resolve_job_def("acknowledge_late_orders").execute_in_process(
        instance=instance, run_config=RunConfig(ops={"ack_late_orders": {"config": {"all": True, "reason": "audited"}}}))
    assert run.success
    in_run = {e.check_name: e for e in run.get_asset_check_evaluations()}["late_data"]
    assert in_run.passed and sorted(in_run.metadata["acknowledged_partitions"].value) == ["2026-11-20-00:00", H1, H2]
    assert _late_check(defs, instance).passed
    status = _status(home)
    assert [a["hour"] for a in status["acknowledged_late_hours"]] == [H0_ISO, H1_ISO, H2_ISO] and status["late_hours_needing_attention"] == {}
    assert all(a["by"] == f"dagster run {run.run_id}" and a["reason"] == "audited" for a in status["acknowledged_late_hours"])
    # durably in the catalog: a property of cdc.orders per hour
    properties = load_partfin_catalog(home).load_table("cdc.orders").properties
    assert {k for k in properties if k.startswith("partfin.late-data.ack.")} == {f"partfin.late-data.ack.{h}" for h in (H0_ISO, H1_ISO, H2_ISO)}

    # new late records for 01:00 after the acknowledgement: the WARN is back, for 01:00 only
    late_into([T0_MS + HOUR_MS], seed=9)
    check = _late_check(defs, instance)
    assert not check.passed and check.severity == AssetCheckSeverity.WARN
    assert check.metadata["partitions_to_rerun"].value == [H1] and check.metadata["open_late_records"].value == 6
    assert list(check.metadata["acknowledged_partitions"].value) == ["2026-11-20-00:00", H2]
    status = _status(home)
    assert [a["hour"] for a in status["acknowledged_late_hours"]] == [H0_ISO, H2_ISO] and status["late_hours_needing_attention"] == {H1: 6}
    # a bad config of the job fails in one line
    bad = defs.resolve_job_def("acknowledge_late_orders").execute_in_process(
        instance=instance, raise_on_error=False,
        run_config=RunConfig(ops={"ack_late_orders": {"config": {"hours": [H1], "all": True, "reason": "x"}}}))
    assert not bad.success
