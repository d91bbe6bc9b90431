"""`acknowledge_late_<table>`: acknowledge late records in Dagster, as `partfin late-data ack` does on the command line.

Run config (op `ack_late_<table>`): `hours` (partition keys such as 2026-01-01-05:00) or `all: true`, a `reason`, and
optionally `by` (who; default the run's `dagster/user` tag when the deployment sets one, else the
run id). The acknowledgement is stored in the Iceberg catalog (finalization/late_acks.py); the run
then evaluates the cdc checks again, so late_data shows the acknowledged hours at once.
"""

from dagster import Config, Failure, OpExecutionContext, job, op

from partfin_assets.defs.checks.watermark_checks import sync_check_evaluations
from partfin_assets.defs.resources import IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable
from partfin_assets.finalization.hours import parse_hour
from partfin_assets.finalization.late_acks import acknowledge_late_hours
from partfin_assets.model.errors import PartfinError, first_line


class AcknowledgeConfig(Config):
    hours: list[str] = []  # hours holding late records: partition keys (2026-01-01-05:00) or ISO (2026-01-01T05:00:00Z)
    all: bool = False  # every hour holding late records
    reason: str  # why they need no re-run
    by: str = ""  # who acknowledges (default: the run's dagster/user tag, else the run id)


def build_acknowledge_job(table: PartfinTable):
    name = table.name

    @op(name=f"ack_late_{name}", tags={"kind": "iceberg"})  # not the job's name: Dagster wants them distinct
    def acknowledge(context: OpExecutionContext, config: AcknowledgeConfig, catalog: IcebergCatalogResource) -> None:
        if bool(config.hours) == config.all:
            raise Failure(description="name the hours (hours: [...]) or set all: true, not both", allow_retries=False)
        by = config.by or context.run.tags.get("dagster/user") or f"dagster run {context.run_id}"
        iceberg = catalog.load()
        try:
            acks = acknowledge_late_hours(iceberg, name, None if config.all else [parse_hour(h) for h in config.hours],
                                          config.reason, by)
        except PartfinError as exc:
            raise Failure(description=first_line(str(exc)), allow_retries=False) from None
        for ack in acks:
            context.log.info(f"cdc.{name}: hour {ack.as_dict()['hour']}: {ack.late_records} late record(s) acknowledged by {by}")
        for evaluation in sync_check_evaluations(table, iceberg, context.instance, "cdc"):
            context.log_event(evaluation)

    @job(name=f"acknowledge_late_{name}", tags={"partfin/table": name},
         description=f"Acknowledge late records of cdc.{name} that need no re-run (run config: hours or all, reason, by); "
         "late records arriving later raise the late_data WARN again.")
    def acknowledge_job():
        acknowledge()

    return acknowledge_job
