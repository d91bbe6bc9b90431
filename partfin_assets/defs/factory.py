"""One table declaration -> its assets, checks, jobs and sensors."""

from __future__ import annotations

from dagster import Definitions

from partfin_assets.defs.checks.late_data_ack import build_acknowledge_job
from partfin_assets.defs.checks.policy_measurement import build_policy_measurement_job
from partfin_assets.defs.checks.watermark_checks import build_checks, build_checks_sensor
from partfin_assets.defs.downstream.activity import build_activity_asset
from partfin_assets.defs.finalization.sensor import build_finalization_sensor, finalized_spec
from partfin_assets.defs.maintenance.jobs import build_compaction_job, build_maintenance_job, build_privacy_job
from partfin_assets.defs.platform.compaction_fanout import build_compaction_fanout_job
from partfin_assets.defs.platform.ingest_fanout import build_ingest_fanout_job
from partfin_assets.defs.platform.ingest_members import build_ingest_members_job
from partfin_assets.defs.platform.sync import build_platform_assets, build_sync_job, build_sync_sensor, report_spec
from partfin_assets.defs.platform.upsert_fanout import build_upsert_job
from partfin_assets.defs.tables import PartfinTable


def table_definitions(table: PartfinTable) -> Definitions:
    sync_job = build_sync_job(table)
    activity, activity_job = build_activity_asset(table)
    checks, checks_job = build_checks(table)
    compaction_job, compaction_schedule = build_compaction_job(table)
    maintenance_job, maintenance_schedule = build_maintenance_job(table)
    measurement_job, measurement_schedule = build_policy_measurement_job(table)
    return Definitions(
        assets=[build_platform_assets(table), finalized_spec(table), report_spec(table), activity],
        asset_checks=checks,
        jobs=[
            sync_job, build_ingest_fanout_job(table), build_ingest_members_job(table), build_upsert_job(table), activity_job,
            checks_job, compaction_job,
            build_compaction_fanout_job(table), build_privacy_job(table), maintenance_job, build_acknowledge_job(table),
            measurement_job,
        ],
        schedules=[compaction_schedule, maintenance_schedule, measurement_schedule],
        sensors=[
            build_sync_sensor(table, sync_job),
            build_finalization_sensor(table, activity_job),
            build_checks_sensor(table, checks_job),
        ],
    )
