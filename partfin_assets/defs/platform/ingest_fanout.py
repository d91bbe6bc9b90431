"""`ingest_<table>_fanout`: the CDC writer as one Dagster run, its subtasks as steps feeding one committer step.

The writer/committer split of Flink's Iceberg sink, for a table whose ingest outgrows one process:
`plan_ingest_<table>` reads up to `max_checkpoints` batches of the table's source from the writer's
committed position (writer id `<table>-writer`, as `partfin ingest` and `sync_<table>`, so the
fence holds between all of them) and routes each batch's records by key into `shares`; one
`write_share_<table>` step per share writes that share of every batch as data files on the table's
storage and runs the accumulators over it (ingest/writer.py `write_share`; one step per share, not
per share and batch: a step costs a process start); `commit_ingest_<table>` commits
the batches in order, one Iceberg commit each, through the writer's one commit path
(`CdcWriter.commit_checkpoint`: fence, watermark processors, summary, ledger, expiry).

Nothing written is left behind: a share step that fails deletes its own files and hands its error
to the commit step, which deletes every share's files and fails the run (retried whole from a fresh
plan); a fenced or failed commit deletes the files of every checkpoint not committed. A retried or
racing run cannot land a batch twice: each commit moves the writer's position by compare-and-set.
"""

from dataclasses import dataclass

import pyarrow as pa
from dagster import Config, DynamicOut, DynamicOutput, Failure, OpExecutionContext, Out, Output, op

from partfin_assets.defs.platform.fanout import fanout_job
from partfin_assets.defs.platform.sync import report_checkpoint, report_ingest
from partfin_assets.defs.resources import CdcSourceResource, IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable
from partfin_assets.iceberg.files import delete_files
from partfin_assets.iceberg.history import watermark_of
from partfin_assets.iceberg.streams import CommittedPosition
from partfin_assets.ingest.extensions import Accumulator
from partfin_assets.ingest.session import IngestSession
from partfin_assets.ingest.writer import CdcWriter, PreparedCheckpoint, WriterFenced, WrittenShare, write_share
from partfin_assets.model.errors import one_line
from partfin_assets.model.faults import faults


class IngestFanoutConfig(Config):
    max_records: int = 20_000  # records per checkpoint (one Iceberg commit)
    max_checkpoints: int = 10  # checkpoints per run at most
    shares: int = 2  # write steps per checkpoint (records routed by key)


@dataclass(frozen=True)
class IngestPlan:
    """The batches a run commits, in order, from the writer position they were read at."""

    start: CommittedPosition
    checkpoints: list[PreparedCheckpoint]


@dataclass(frozen=True)
class ShareTask:
    share: int
    records: list[pa.Table]  # this share of each batch of the plan, in order
    accumulators: tuple[type[Accumulator], ...]


@dataclass(frozen=True)
class ShareOutcome:
    """A share step's result: this share of each batch written, or (its own files deleted) the error it failed with."""

    share: int
    written: list[WrittenShare]
    error: str | None = None


def _writer(iceberg, table: PartfinTable, cdc_source: CdcSourceResource) -> CdcWriter:
    # <table>-writer, as `partfin ingest` and sync_<table>: one committed position per table, fenced between them
    return CdcWriter(iceberg, table.spec, heartbeat_interval_s=cdc_source.heartbeat_interval_seconds)


def _discard(writer: CdcWriter, outcomes: list[ShareOutcome]) -> None:
    delete_files(writer.table.io, [f.file_path for o in outcomes for w in o.written for f in w.data_files])


def build_ingest_fanout_job(table: PartfinTable, *, max_concurrent: int = 2):
    name = table.name

    @op(name=f"plan_ingest_{name}", out={"plan": Out(IngestPlan), "shares": DynamicOut(ShareTask)}, tags={"kind": "iceberg"})
    def plan(context: OpExecutionContext, config: IngestFanoutConfig, catalog: IcebergCatalogResource, cdc_source: CdcSourceResource):
        """Read up to `max_checkpoints` batches from the writer's committed position; one output per share (of every batch)."""
        # the ingest session of `partfin ingest` and sync_<table> (ingest/session.py), on the same writer id
        with cdc_source.redacted(), IngestSession(catalog.load(), table.spec, cdc_source.open(table),
                                                  heartbeat_interval_s=cdc_source.heartbeat_interval_seconds) as session:
            writer = session.writer
            start = writer.position
            checkpoints = session.read_checkpoints(max_records=config.max_records, max_checkpoints=config.max_checkpoints)
        records = sum(c.records.num_rows for c in checkpoints)
        context.log.info(f"{len(checkpoints)} batch(es), {records} record(s) from checkpoint {start.checkpoint_id} of "
                         f"{writer.writer_id}, in {config.shares} share(s) each")
        yield Output(IngestPlan(start, [c.for_commit() for c in checkpoints]), "plan")
        if not records:
            return  # nothing to write (heartbeats, rejects only): the committer alone
        by_share = zip(*(checkpoint.shares(config.shares) for checkpoint in checkpoints))
        for share, parts in enumerate(by_share):
            yield DynamicOutput(ShareTask(share, list(parts), tuple(writer.accumulators)), output_name="shares", mapping_key=f"share_{share}")

    @op(name=f"write_share_{name}", tags={"kind": "iceberg"})
    def write(context: OpExecutionContext, catalog: IcebergCatalogResource, task: ShareTask) -> ShareOutcome:
        """Write this share of every batch: data files (not committed: the commit step commits or deletes them) and partials."""
        cdc = catalog.load().load_table(table.spec.cdc_identifier)
        written: list[WrittenShare] = []
        try:
            for records in task.records:
                written.append(write_share(cdc, records, task.accumulators))
                faults().crash_point("share-written")
                faults().fail_point(f"share-written:{len(written) - 1}:{task.share}")
        except BaseException as exc:
            delete_files(cdc.io, [f.file_path for w in written for f in w.data_files])
            if not isinstance(exc, Exception):
                raise  # interrupted: the run stops here
            context.log.error(f"share {task.share} of batch {len(written)} failed, the share's files deleted: {one_line(exc)}")
            return ShareOutcome(task.share, [], one_line(exc))
        files = sum(len(w.data_files) for w in written)
        context.log.info(f"share {task.share}: {sum(r.num_rows for r in task.records)} record(s) of {len(written)} batch(es) in {files} file(s)")
        return ShareOutcome(task.share, written)

    @op(name=f"commit_ingest_{name}", tags={"kind": "iceberg"})
    def commit(context: OpExecutionContext, catalog: IcebergCatalogResource, cdc_source: CdcSourceResource, plan: IngestPlan,
               outcomes: list[ShareOutcome]) -> None:
        """Commit the batches in order, one Iceberg commit each; on a failed share, a fence or a failed commit, the files
        of every checkpoint not committed are deleted."""
        iceberg = catalog.load()
        writer = _writer(iceberg, table, cdc_source)
        failed = [o for o in outcomes if o.error is not None]
        if failed:
            _discard(writer, outcomes)
            writer.close()
            raise Failure(f"{len(failed)} share(s) failed, nothing committed, every share's files deleted: "
                          + "; ".join(f"share {o.share}: {o.error}" for o in failed))
        gone = [f.file_path for o in outcomes for w in o.written for f in w.data_files if not writer.table.io.new_input(f.file_path).exists()]
        if gone:  # an earlier attempt of this step deleted them (re-executed from a failure): only a fresh plan can commit
            _discard(writer, outcomes)
            writer.close()
            raise Failure(f"{len(gone)} file(s) of this plan were deleted by an earlier attempt (e.g. {gone[0]}): "
                          "nothing committed; re-execute the whole run")
        shares = sorted(outcomes, key=lambda o: o.share)
        by_checkpoint = {index: [o.written[index] for o in shares] for index in range(len(plan.checkpoints)) if shares}
        watermark_before = watermark_of(writer.table.properties)
        writer.expect_position(plan.start)  # where the plan read its batches: anyone committing since fences this run
        touched: set[int] = set()
        committed = 0
        try:
            for index, checkpoint in enumerate(plan.checkpoints):
                # a plan without records (heartbeats, rejects only) had no share step: its empty partials come from here
                written = by_checkpoint.pop(index, None) or writer.write_shares(checkpoint)
                try:
                    result = writer.commit_checkpoint(checkpoint, written)
                except WriterFenced as fenced:
                    context.log.warning(f"{fenced}; the next run reads on from there")
                    break
                if result.snapshot_id is not None:
                    committed += 1
                    touched.update(report_checkpoint(context, table, writer, result))
        finally:
            delete_files(writer.table.io, [f.file_path for rest in by_checkpoint.values() for w in rest for f in w.data_files])  # not committed
            writer.close()  # records the checkpoints in the ledger
        report_ingest(context, table, iceberg, writer, watermark_before, touched, committed)

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
