"""No check reports an error the data does not have: every cdc and base check after every job kind.

One orders table under Dagster (ephemeral instance, real catalog and warehouse): after each job
kind (ingest + upsert: the sync; compaction; privacy delete; replay of an hour; rebucket; snapshot
expiry + orphan removal) and after the sync that follows it on the now idle source, the checks job
evaluates every check. A job that changes neither the records' event times nor the watermark
changes no check's verdict, and the base check (base watermark = the watermark in force at the
cdc snapshot base merged) passes every time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dagster import RunConfig

from partfin_assets.finalization.hours import hour_from_key
from partfin_assets.jobs.rebucket import current_buckets
from partfin_assets_tests.test_dagster_jobs import CDC, hour_rows, synced  # noqa: F401 - the fixture

BASE_CHECK = "watermark_matches_merged_cdc_snapshot"


def check_verdicts(defs, instance) -> dict[str, tuple[bool, str, str]]:
    """check name -> (passed, severity, description) as the checks job evaluates it now."""
    result = defs.resolve_job_def("checks_orders").execute_in_process(instance=instance)
    assert result.success
    out = {}
    for evaluation in result.get_asset_check_evaluations():
        out[evaluation.check_name] = (evaluation.passed, evaluation.severity.value, evaluation.description or "")
    return out


def test_every_check_after_every_job_kind(synced, tmp_path):  # noqa: F811 - the fixture
    defs, instance, catalog = synced
    sync = defs.resolve_job_def("sync_orders")
    baseline = check_verdicts(defs, instance)  # after the first sync: ingest + upsert
    assert {"watermark_monotonic", "late_data", "rejected_input", BASE_CHECK, "watermark_lag_vs_cdc",
            "quarantined_changes", "watermark_fresh"} <= set(baseline)
    assert baseline[BASE_CHECK][0] and baseline["watermark_monotonic"][0], baseline

    def verdicts_unchanged(after: str) -> None:
        now = check_verdicts(defs, instance)
        changed = {name: (baseline[name], now[name]) for name in baseline if baseline[name][:2] != now[name][:2]}
        assert not changed, f"after {after}: {changed}"
        assert now[BASE_CHECK][0], (after, now[BASE_CHECK])
        assert sync.execute_in_process(instance=instance).success  # the idle source: the upsert merges what the job did
        now = check_verdicts(defs, instance)
        changed = {name: (baseline[name], now[name]) for name in baseline if baseline[name][:2] != now[name][:2]}
        assert not changed, f"after {after} and a sync: {changed}"

    assert defs.resolve_job_def("compact_orders").execute_in_process(instance=instance).success
    verdicts_unchanged("compaction")

    key = json.loads(hour_rows(catalog, hour_from_key("2026-01-01-01:00"))[0][0])
    config = RunConfig(ops={"privacy_delete_orders_op": {"config": {"keys": [{"id": key["id"]}], "request_id": "req-checks"}}})
    assert defs.resolve_job_def("privacy_delete_orders").execute_in_process(instance=instance, run_config=config).success
    verdicts_unchanged("privacy delete")

    replay = defs.resolve_implicit_global_asset_job_def()
    assert replay.execute_in_process(instance=instance, partition_key="2026-01-01-03:00", asset_selection=[CDC]).success
    verdicts_unchanged("replay of an hour")

    buckets = current_buckets("base.orders", catalog.load_table("base.orders"))
    env = {k: v for k, v in os.environ.items() if k != "PARTFIN_SOURCE"}
    rebucketed = subprocess.run([sys.executable, "-m", "partfin_assets.cli", "base", "rebucket", "--table", "orders",
                                 "--buckets", str(buckets * 2)], env=env, capture_output=True, text=True, timeout=300)
    assert rebucketed.returncode == 0, rebucketed.stderr
    verdicts_unchanged("rebucket")
    assert defs.resolve_job_def("compact_orders").execute_in_process(instance=instance).success
    verdicts_unchanged("compaction into the new layout")

    config = {"keep_last": 1, "orphan_min_age_seconds": 0}
    maintained = defs.resolve_job_def("maintain_orders").execute_in_process(
        instance=instance, run_config=RunConfig(ops={"expire_snapshots_orders": {"config": config}, "remove_orphans_orders": {"config": config}}))
    assert maintained.success
    verdicts_unchanged("maintenance")
