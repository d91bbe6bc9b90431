"""`measure_policy_<table>` and its schedule: the table's watermark policy as its own watermark did.

The policy lab (jobs/policy_lab.py) replays the table's whole late-data ledger: the share of
records written after their hour was finalized, the median finalization lag, the lag against an
oracle. That costs a read of the ledger, so it runs on a schedule of its own (hourly, by default at
:45, PARTFIN_SCHEDULES kind `measure`), never on the sync path; each run records an observation
of cdc_<table> whose metadata Dagster plots over time.
"""

import math

from dagster import AssetObservation, OpExecutionContext, ScheduleDefinition, in_process_executor, job, op

from partfin_assets.defs.resources import IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable, schedule_default_status
from partfin_assets.iceberg.catalog import load_table_if_exists
from partfin_assets.jobs.policy_lab import Outcome, measured_policy
from partfin_assets.model.timeutil import format_duration


def policy_metadata(outcome: Outcome) -> dict:
    # ratios rounded, durations also as people read them ("6 h 0 min"); the numbers stay numbers for Dagster's plots
    measured = {"watermark_policy": outcome.name, "late_share_after_finalization": round(outcome.late_share, 5),
                "late_share_after_finalization_percent": f"{outcome.late_share:.3%}"}
    if math.isfinite(outcome.median_lag_s):
        measured["median_finalization_lag_seconds"] = round(outcome.median_lag_s)
        measured["median_finalization_lag"] = format_duration(outcome.median_lag_s)
    if math.isfinite(outcome.lag_ratio):
        measured["finalization_lag_vs_oracle"] = round(outcome.lag_ratio, 2)
    return measured


def build_policy_measurement_job(table: PartfinTable):
    """`measure_policy_<table>` (an observation of cdc_<table>) and its schedule (UTC)."""
    name = table.name

    @op(name=f"measure_policy_{name}_op")
    def measure(context: OpExecutionContext, catalog: IcebergCatalogResource) -> None:
        iceberg = catalog.load()
        measured = measured_policy(iceberg, name) if load_table_if_exists(iceberg, f"cdc.{name}") is not None else None
        if measured is None:
            context.log.info(f"cdc.{name}: no recorded hour to measure its watermark policy on yet")
            return
        context.log_event(AssetObservation(asset_key=table.cdc_key, metadata=policy_metadata(measured)))

    @job(name=f"measure_policy_{name}", executor_def=in_process_executor, tags={"partfin/table": name},
         description=f"The watermark policy of cdc.{name} as its own watermark did, over its late-data ledger: late share "
                     "after finalization, median finalization lag, lag vs an oracle (an observation of the cdc asset).")
    def measure_job():
        measure()

    schedule = ScheduleDefinition(
        name=f"measure_policy_{name}_schedule",
        job=measure_job,
        cron_schedule=table.policy_measurement_cron,
        execution_timezone="UTC",
        default_status=schedule_default_status("measure"),
        description=f"Measures cdc.{name}'s watermark policy hourly, off the sync path.",
    )
    return measure_job, schedule
