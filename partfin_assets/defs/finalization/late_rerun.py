"""Late data re-runs the downstream hour: the `rerun_late_<table>_sensor`.

Late records land in hours that already finalized (their event time is below the watermark),
so a downstream partition that ran before they came is stale; the late_data check WARNs until it
runs again. Each tick reads the late-data ledger and, for every hour whose latest downstream run
missed late commits (finalization/table_checks.py `open_late_hours`), requests that partition
again once base.<table> has merged those commits, with run_key `<table>:<hour>:late:<newest late
sequence number>`: one re-run per batch of late commits, whatever the ticks. Hours never run
yet are left to the finalization sensor (their first run sees the late records).
"""

from dagster import RunRequest, SensorEvaluationContext, SensorResult, SkipReason, sensor

from partfin_assets.defs.checks.watermark_checks import downstream_runs
from partfin_assets.defs.resources import IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable, sensor_default_status, sensor_interval
from partfin_assets.finalization import table_checks as tc
from partfin_assets.finalization.hours import hour_key, is_finalized
from partfin_assets.finalization.late_data import late_after_run, late_data
from partfin_assets.iceberg.catalog import load_table_if_exists
from partfin_assets.iceberg.history import watermark_of
from partfin_assets.model import summary_keys as K
from partfin_assets.model.timeutil import iso_z


def merged_sequence(iceberg, name: str) -> int | None:
    """The sequence number of the cdc.<name> snapshot base.<name> has merged up to (None if unknown)."""
    base = load_table_if_exists(iceberg, f"base.{name}")
    source = base.properties.get(K.PROP_SOURCE_SNAPSHOT_ID) if base is not None else None
    if not source:
        return None
    snapshot = iceberg.load_table(f"cdc.{name}").metadata.snapshot_by_id(int(source))
    return snapshot.sequence_number if snapshot is not None else None


def build_late_rerun_sensor(table: PartfinTable, downstream_job):
    name = table.name

    @sensor(
        name=f"rerun_late_{name}_sensor",
        job=downstream_job,
        minimum_interval_seconds=sensor_interval("rerun", table.finalization_interval_seconds),
        default_status=sensor_default_status("rerun"),
        description=f"Re-runs a partition of {table.activity_key.to_user_string()} once late records of its hour reached "
        f"base.{name} after it ran (the late_data check of cdc/{name} WARNs until then).",
    )
    def rerun_late(context: SensorEvaluationContext, catalog: IcebergCatalogResource):
        iceberg = catalog.load()
        base = load_table_if_exists(iceberg, f"base.{name}")
        if base is None:
            return SkipReason(f"base.{name} does not exist yet")
        late = late_data(iceberg, f"cdc.{name}")
        runs = downstream_runs(context.instance, table.activity_key)(sorted(late))
        stale = {h: n for h, n in tc.open_late_hours(late, runs).items() if h in runs}
        if not stale:
            return SkipReason("no late records after any downstream run")
        merged = merged_sequence(iceberg, name)
        watermark = watermark_of(base.properties)
        requests = []
        for hour in sorted(stale):
            run = runs[hour]
            missed = late_after_run(late, hour, run.sequence_number, run.ran_at_us)
            newest = max((c.sequence_number or 0) for c in missed)
            if not is_finalized(hour, watermark) or (merged is not None and merged < newest):
                continue  # base has not merged them yet: a run now would miss them again
            key = hour_key(hour)
            requests.append(RunRequest(
                run_key=f"{name}:{key}:late:{newest}",
                partition_key=key,
                tags={"partfin/table": name, "partfin/hour": iso_z(hour), "partfin/rerun": "late-data",
                      "partfin/late-records": str(stale[hour]), "dagster/max_retries": "2"},
            ))
        if not requests:
            return SkipReason(f"{len(stale)} hour(s) with late records wait for base.{name} to merge them")
        context.log.info(f"{name}: re-running {len(requests)} hour(s) for late data: {', '.join(r.partition_key for r in requests)}")
        return SensorResult(run_requests=requests)

    return rerun_late
