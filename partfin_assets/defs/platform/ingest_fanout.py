"""`ingest_<table>_fanout`: the ingest fan-out protocol (ingest/fanout.py) as one Dagster run.

`plan_ingest_<table>` reads up to `max_checkpoints` batches of the table's source from the writer's
committed position (writer id `<table>-writer`, as `partfin ingest` and `sync_<table>`, so the
fence holds between all of them); one `write_share_<table>` step per share writes that share of
every batch (one step per share, not per share and batch: a step costs a process start);
`commit_ingest_<table>` commits the batches in order and tells the source each one that landed.
A failed share or commit fails the run, which is retried whole from a fresh plan.
"""

from dagster import Config, DynamicOut, DynamicOutput, Failure, OpExecutionContext, Out, Output, op

from partfin_assets.defs.platform.fanout import fanout_job
from partfin_assets.defs.platform.sync import report_checkpoint, report_ingest
from partfin_assets.defs.resources import CdcSourceResource, IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable
from partfin_assets.iceberg.history import watermark_of
from partfin_assets.ingest.fanout import IngestPlan, PlanNotCommitted, ShareOutcome, ShareTask, commit_plan, plan_ingest, write_share_task
from partfin_assets.ingest.session import IngestSession, close_source
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.model.faults import faults


class IngestFanoutConfig(Config):
    max_records: int = 20_000  # records per checkpoint (one Iceberg commit)
    max_checkpoints: int = 10  # checkpoints per run at most
    shares: int = 2  # write steps per checkpoint (records routed by key)


def build_ingest_fanout_job(table: PartfinTable, *, max_concurrent: int = 2):
    name = table.name

    @op(name=f"plan_ingest_{name}", out={"plan": Out(IngestPlan), "shares": DynamicOut(ShareTask)}, tags={"kind": "iceberg"})
    def plan(context: OpExecutionContext, config: IngestFanoutConfig, catalog: IcebergCatalogResource, cdc_source: CdcSourceResource):
        """Read up to `max_checkpoints` batches from the writer's committed position; one output per share (of every batch)."""
        # the ingest session of `partfin ingest` and sync_<table> (ingest/session.py), on the same writer id
        with cdc_source.redacted(), IngestSession(catalog.load(), table.spec, cdc_source.open(table),
                                                  heartbeat_interval_s=cdc_source.heartbeat_interval_seconds) as session:
            ingest_plan, tasks = plan_ingest(session, max_records=config.max_records, max_checkpoints=config.max_checkpoints,
                                             shares=config.shares)
        records = sum(c.records.num_rows for c in ingest_plan.checkpoints)
        context.log.info(f"{len(ingest_plan.checkpoints)} batch(es), {records} record(s) from the committed positions of "
                         f"{session.writer.writer_id}, in {len(tasks)} share(s) each")
        yield Output(ingest_plan, "plan")
        for task in tasks:
            yield DynamicOutput(task, output_name="shares", mapping_key=f"share_{task.share}")

    @op(name=f"write_share_{name}", tags={"kind": "iceberg"})
    def write(context: OpExecutionContext, catalog: IcebergCatalogResource, task: ShareTask) -> ShareOutcome:
        """Write this share of every batch: data files (not committed: the commit step commits or deletes them) and partials."""
        def at_share_written(index: int) -> None:
            faults().crash_point("share-written")
            faults().fail_point(f"share-written:{index}:{task.share}")

        outcome = write_share_task(catalog.load().load_table(table.spec.cdc_identifier), task, after_each=at_share_written)
        if outcome.error is not None:
            context.log.error(f"share {task.share} failed, the share's files deleted: {outcome.error}")
        else:
            files = sum(len(w.data_files) for w in outcome.written)
            context.log.info(f"share {task.share}: {sum(r.num_rows for r in task.records)} record(s) of {len(outcome.written)} "
                             f"batch(es) in {files} file(s)")
        return outcome

    @op(name=f"commit_ingest_{name}", tags={"kind": "iceberg"})
    def commit(context: OpExecutionContext, catalog: IcebergCatalogResource, cdc_source: CdcSourceResource, plan: IngestPlan,
               outcomes: list[ShareOutcome]) -> None:
        """Commit the batches in order, one Iceberg commit each, telling the source each one that landed; on a failed
        share, a fence or a failed commit, the files of every checkpoint not committed are deleted."""
        iceberg = catalog.load()
        # <table>-writer, as `partfin ingest` and sync_<table>: one committed position per table, fenced between them
        writer = CdcWriter(iceberg, table.spec, heartbeat_interval_s=cdc_source.heartbeat_interval_seconds)
        watermark_before = watermark_of(writer.table.properties)
        touched: set[int] = set()
        try:
            with cdc_source.redacted():
                source = cdc_source.open(table)  # told what landed (a replication slot moves now, not at the next plan)
                try:
                    committed = commit_plan(writer, source, plan, outcomes,
                                            on_landed=lambda result: touched.update(report_checkpoint(context, table, writer, result)),
                                            on_fenced=lambda fenced: context.log.warning(f"{fenced}; the next run reads on from there"))
                finally:
                    close_source(source)
        except PlanNotCommitted as exc:
            raise Failure(str(exc)) from None
        finally:
            writer.close()  # records the checkpoints in the ledger
        report_ingest(context, table, iceberg, writer.table, watermark_before, touched, committed)

    @fanout_job(
        f"ingest_{name}_fanout",
        f"CDC writer for cdc.{name} as steps: read batches, one write step per share (of every batch), then one committer "
        "step (one Iceberg commit per batch): the scale-out form of the sync job's ingest.",
        {"partfin/table": name, "partfin/writer": f"cdc.{name}"},
        max_concurrent=max_concurrent,
    )
    def ingest_job():
        plan_, shares = plan()
        commit(plan_, shares.map(write).collect())

    return ingest_job
