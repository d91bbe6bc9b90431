"""`ingest_<table>_members`: N consumer-group members ingesting one partitioned source (Kafka) as N steps.

Each `consume_<table>` step is one member of the source's consumer group, in a process of its own
(the multiprocess executor here; the k8s or celery executor in production puts each on a machine of
its own): it reads the partitions the group gives it from the positions the table recorded and
commits checkpoints of them to cdc.<table>, concurrently with the other members (the
per-partition compare-and-set keeps every message once, ingest/writer.py). A step ends when its
partitions are read to their end, or after the sync's time budget (`max_seconds_per_run`);
`report_ingest_<table>` then reports the hours they touched, as a sync run does.

Sizing: members beyond the topic's partition count read nothing (the group gives each partition to
one member); each member costs about one core while it has messages to decode and write.
"""

from typing import Optional

from dagster import Config, DynamicOut, DynamicOutput, Failure, OpExecutionContext, Out, Output, op

from partfin_assets.defs.platform.fanout import fanout_job
from partfin_assets.defs.platform.sync import commit_and_report, report_ingest
from partfin_assets.defs.resources import CdcSourceResource, IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable
from partfin_assets.iceberg.catalog import load_table_if_exists
from partfin_assets.iceberg.history import watermark_of
from partfin_assets.ingest.session import IngestSession
from partfin_assets.model.records import ReadsPartitions
from partfin_assets.sources.registry import SourceSpec


class MembersConfig(Config):
    members: int = 2  # consumer-group members, one step each (at most the topic's partitions do any work)


def build_ingest_members_job(table: PartfinTable, *, max_concurrent: int = 4):
    name = table.name

    @op(name=f"members_{name}", out={"before": Out(Optional[int]), "members": DynamicOut(int)}, tags={"kind": "kafka"})
    def members(context: OpExecutionContext, config: MembersConfig, catalog: IcebergCatalogResource, cdc_source: CdcSourceResource):
        """The watermark before the members run (for the report), and one output per member."""
        spec = SourceSpec.parse(cdc_source.source or table.source)
        if config.members > 1 and not issubclass(spec.kind.source, ReadsPartitions):
            raise Failure(f"ingest_{name}_members: a {spec.kind.name} source has one position, which one process commits at a "
                          f"time; several members would only fence each other. Run sync_{name}, or ingest_{name}_fanout to "
                          "spread the writing of each batch")
        cdc = load_table_if_exists(catalog.load(), table.spec.cdc_identifier)
        yield Output(watermark_of(cdc.properties) if cdc is not None else None, "before")
        for member in range(config.members):
            yield DynamicOutput(member, output_name="members", mapping_key=f"member_{member}")

    @op(name=f"consume_{name}", tags={"kind": "kafka"})
    def consume(context: OpExecutionContext, catalog: IcebergCatalogResource, cdc_source: CdcSourceResource,
                member: int) -> tuple[int, list[int]]:
        """One group member: commit checkpoints of the partitions the group gives it; how many, and the hours they touched."""
        # <table>-writer, as `partfin ingest` and sync_<table>: the members share it, each committing its own partitions
        with cdc_source.redacted(), IngestSession(catalog.load(), table.spec, cdc_source.open(table), subtasks=cdc_source.subtasks,
                                                  heartbeat_interval_s=cdc_source.heartbeat_interval_seconds) as session:
            checkpoints, touched = commit_and_report(context, table, session, cdc_source)
        context.log.info(f"member {member}: {checkpoints} checkpoint(s)")
        return checkpoints, sorted(touched)

    @op(name=f"report_ingest_{name}", tags={"kind": "iceberg"})
    def report(context: OpExecutionContext, catalog: IcebergCatalogResource, before: Optional[int],
               consumed: list[tuple[int, list[int]]]) -> None:
        """The hours the members touched or finalized, the table's watermark and the cdc checks, as a sync run."""
        iceberg = catalog.load()
        hours = {h for _, touched in consumed for h in touched}
        checkpoints = sum(n for n, _ in consumed)
        report_ingest(context, table, iceberg, iceberg.load_table(table.spec.cdc_identifier), before, hours, checkpoints)

    @fanout_job(
        f"ingest_{name}_members",
        f"CDC writer for cdc.{name} as consumer-group members: one step per member, each committing the partitions the "
        "group gives it (config `members`), then one report step: the scale-out form of the sync job's ingest for a "
        "partitioned source (Kafka).",
        {"partfin/table": name, "partfin/writer": f"cdc.{name}"},
        max_concurrent=max_concurrent,
    )
    def members_job():
        before, each = members()
        report(before, each.map(consume).collect())

    return members_job
