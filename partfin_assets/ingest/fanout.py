"""The ingest fan-out protocol: plan, write shares elsewhere, commit in order (Flink's Iceberg sink split).

1. `plan_ingest`: an ingest session reads up to `max_checkpoints` batches from the writer's committed
   position and routes each batch's records by key into `shares` (`IngestPlan` + one `ShareTask` per share);
2. `write_share_task`, in any process that can load the table: this share of every batch as data files
   (not committed) with the accumulators' partials; on failure its own files are deleted and the error
   returned (`ShareOutcome.error`), never raised, so the committer can clean up every share;
3. `commit_plan`: the batches in order, one Iceberg commit each, through the writer's one commit path
   (`CdcWriter.commit_checkpoint`: fence, watermark processors, summary, ledger, expiry); after each
   landed commit the source is told (`AcknowledgesCommits.on_committed`: a replication slot moves in this
   run, not the next). Files of checkpoints not committed (a failed share, a fence, a failed commit) are deleted.

A retried or racing run cannot land a batch twice: each commit moves the writer's position by compare-and-set.
The Dagster wiring (steps, executor, reports) is defs/platform/ingest_fanout.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
from pyiceberg.table import Table

from partfin_assets.iceberg.files import delete_files
from partfin_assets.iceberg.streams import CommittedPosition
from partfin_assets.ingest.extensions import Accumulator
from partfin_assets.ingest.session import IngestSession
from partfin_assets.ingest.writer import CdcWriter, CheckpointResult, PreparedCheckpoint, WriterFenced, WrittenShare, write_share
from partfin_assets.model.errors import one_line
from partfin_assets.model.records import AcknowledgesCommits, CdcSource


@dataclass(frozen=True)
class IngestPlan:
    """The batches a run commits, in order, from the stream positions they were read at."""

    start: dict[str, CommittedPosition]
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


class PlanNotCommitted(Exception):
    """Nothing of the plan was committed and every share's files are deleted: the run is retried from a fresh plan."""


def plan_ingest(session: IngestSession, *, max_records: int, max_checkpoints: int, shares: int) -> tuple[IngestPlan, list[ShareTask]]:
    """Up to `max_checkpoints` batches from the writer's committed position; one task per share (of every batch),
    none when the batches hold no record (heartbeats, rejects only: the committer alone)."""
    start = session.writer.positions
    checkpoints = session.read_checkpoints(max_records=max_records, max_checkpoints=max_checkpoints)
    plan = IngestPlan(start, [c.for_commit() for c in checkpoints])
    if not any(c.records.num_rows for c in checkpoints):
        return plan, []
    by_share = zip(*(checkpoint.shares(shares) for checkpoint in checkpoints))
    accumulators = tuple(session.writer.accumulators)
    return plan, [ShareTask(share, list(parts), accumulators) for share, parts in enumerate(by_share)]


def write_share_task(cdc: Table, task: ShareTask, *, after_each: Callable[[int], None] | None = None) -> ShareOutcome:
    """This share of every batch as data files of `cdc` (uncommitted) and partials; `after_each(index)` runs after each
    batch's share is written (fault injection in tests). Any error: the share's files deleted, the error returned."""
    written: list[WrittenShare] = []
    try:
        for records in task.records:
            written.append(write_share(cdc, records, task.accumulators))
            if after_each is not None:
                after_each(len(written) - 1)
    except BaseException as exc:
        delete_files(cdc.io, [f.file_path for w in written for f in w.data_files])
        if not isinstance(exc, Exception):
            raise  # interrupted: the run stops here
        return ShareOutcome(task.share, [], one_line(exc))
    return ShareOutcome(task.share, written)


def _discard(writer: CdcWriter, outcomes: list[ShareOutcome]) -> None:
    delete_files(writer.table.io, [f.file_path for o in outcomes for w in o.written for f in w.data_files])


def commit_plan(writer: CdcWriter, source: CdcSource | None, plan: IngestPlan, outcomes: list[ShareOutcome], *,
                on_landed: Callable[[CheckpointResult], None], on_fenced: Callable[[WriterFenced], None]) -> int:
    """Commit the plan's batches in order, one Iceberg commit each; the number that landed.

    After each landed commit `on_landed` reports it and the source (when it `AcknowledgesCommits`) is told its offset.
    A fence stops the run quietly (`on_fenced`: another writer landed these batches; the next run reads on from
    there). A failed share or a file an earlier attempt deleted raises PlanNotCommitted, every share's files deleted.
    The writer is not closed here (its caller closes it: pending checkpoints reach the ledger).
    """
    failed = [o for o in outcomes if o.error is not None]
    if failed:
        _discard(writer, outcomes)
        raise PlanNotCommitted(f"{len(failed)} share(s) failed, nothing committed, every share's files deleted: "
                               + "; ".join(f"share {o.share}: {o.error}" for o in failed))
    gone = [f.file_path for o in outcomes for w in o.written for f in w.data_files if not writer.table.io.new_input(f.file_path).exists()]
    if gone:  # an earlier attempt of this step deleted them (re-executed from a failure): only a fresh plan can commit
        _discard(writer, outcomes)
        raise PlanNotCommitted(f"{len(gone)} file(s) of this plan were deleted by an earlier attempt (e.g. {gone[0]}): "
                               "nothing committed; re-execute the whole run")
    shares = sorted(outcomes, key=lambda o: o.share)
    by_checkpoint = {index: [o.written[index] for o in shares] for index in range(len(plan.checkpoints)) if shares}
    writer.expect_positions(plan.start)  # where the plan read its batches: anyone committing since fences this run
    acknowledge = source.on_committed if isinstance(source, AcknowledgesCommits) else None
    committed = 0
    try:
        for index, checkpoint in enumerate(plan.checkpoints):
            # a plan without records (heartbeats, rejects only) had no share step: its empty partials come from here
            written = by_checkpoint.pop(index, None) or writer.write_shares(checkpoint)
            try:
                result = writer.commit_checkpoint(checkpoint, written)
            except WriterFenced as fenced:
                on_fenced(fenced)
                break
            if result.snapshot_id is None:
                continue
            committed += 1
            if acknowledge is not None:
                acknowledge(checkpoint.offset)  # e.g. the replication slot moves past what is now in the table
            on_landed(result)
    finally:
        delete_files(writer.table.io, [f.file_path for rest in by_checkpoint.values() for w in rest for f in w.data_files])
    return committed
