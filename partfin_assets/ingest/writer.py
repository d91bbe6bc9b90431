"""The CDC writer: writer subtasks, Accumulators, CommitProcessors, one Iceberg commit per checkpoint.

A checkpoint is one Iceberg commit on cdc.<table> that holds the data files of
every subtask, the merged accumulator results and processor entries in the
snapshot summary, and any table-property updates: one new metadata file, all or
nothing. The snapshot also records writer id, checkpoint id and source offset,
so a restarted writer resumes exactly after what was committed.

Fencing: the same commit moves the position of the batch's progress stream
(`partfin.writer.<stream id>`: the writer's own, or a Kafka partition's) from the one the batch
started at to the one after it, and only if the fresh metadata still holds the start
(compare-and-set, checked on every attempt). So whatever runs at once under one writer id -- a
CLI run beside the scheduled sync, a restarted twin, the members of one consumer group reading
their partitions -- each source position is committed once: a writer that lost the race cannot
commit its batch; it deletes its files and goes on from the positions the table holds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import closing
from dataclasses import dataclass, replace
from datetime import datetime
from itertools import islice
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog
from pyiceberg.expressions import And, EqualTo, GreaterThanOrEqual, LessThanOrEqual
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table, Transaction
from pyiceberg.table.snapshots import Snapshot

from partfin_assets.iceberg.commit import AttemptFiles, commit_with_retry, new_transaction, snapshot_summary_with_commit_id
from partfin_assets.iceberg.erasures import current_erasures, fence_of, load_erasures
from partfin_assets.iceberg.expiry import Retention, expire_snapshots
from partfin_assets.iceberg.files import delete_files, write_data_files
from partfin_assets.iceberg.history import commit_stream, lineage, recorded_source, summary_of
from partfin_assets.iceberg.ledger import Checkpoint, LedgerAppender, checkpoint_row_dicts, hour_rows, reconcile
from partfin_assets.iceberg.streams import (
    CommittedPosition, SteadyReading, Stream, StreamClock, StreamClockReading, check_clocks, first_sights, idle_timeout_us, position_in,
    positions_of, register_stream, steady_now, stream_position, stream_property, streams_of, trusted_clock_us, writer_clocks,
)
from partfin_assets.iceberg.tables import ensure_cdc_tables
from partfin_assets.ingest.event_time import EventTimeAccumulator, EventTimes
from partfin_assets.ingest.extensions import Accumulator, CommitContext, CommitProcessor
from partfin_assets.ingest.watermark_processor import WatermarkProcessor, future_tolerance_us
from partfin_assets.model import summary_keys as K
from partfin_assets.model.erasure import Erasures, redact_raw_lines, without_erased
from partfin_assets.model.errors import InvalidInput, PartfinError
from partfin_assets.model.records import (
    ARRIVAL_TIME,
    AcknowledgesCommits,
    CdcSource,
    ChangeBatch,
    SOURCE_LOG,
    ReadsPartitions,
    cdc_records,
    with_source_log,
)
from partfin_assets.model.source_identity import SourceChanged, SourceIdentity, check_source
from partfin_assets.model.stats import CommitWindow, EventTimeStats, source_clock_us, suspect_future
from partfin_assets.model.stream_names import check_writer_id
from partfin_assets.model.summary_keys import JobKind
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.model.timeutil import iso_z, now_utc, parse_iso, to_us
from partfin_assets.model.defaults import DEFAULT_COMMIT_INTERVAL_S
from partfin_assets.model.faults import faults
from partfin_assets.watermark.registry import declare_policy, parse_policy, table_policy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointResult:
    checkpoint_id: int
    snapshot_id: int | None  # None: nothing committed (an empty batch)
    records: int
    rejected: int
    summary: dict[str, str]
    attempts: int = 1  # attempts of the commit it landed in: more than one when other processes' commits came first
    # False for the checkpoints after the first of one commit that landed several (run groups partitions' checkpoints)
    first_of_commit: bool = True


@dataclass(frozen=True)
class PreparedCheckpoint:
    """A source batch read and ready to write and commit; picklable, so its shares may be written in other processes.

    It commits as the checkpoint after its stream's position as the committing writer knows it
    (`CdcWriter.expect_positions`: the positions its batches were read from, or the checkpoint before
    it), and only if the table still holds that position (the fence).
    """

    records: pa.Table  # the batch's CDC records, with their change log (source_log)
    offset: str
    rejected: pa.Table
    heartbeat_us: int | None
    partition: str | None  # the batch's source partition (ChangeBatch.stream)
    stream_id: str  # its progress stream
    source_identity: SourceIdentity | None
    source_streams: tuple[str, ...]  # the partitions the source read then, as stream ids
    erasures_version: int = 0  # the erasure registry version records and rejects were filtered with
    erased: int = 0  # records left out: changes of keys a privacy request erased

    def shares(self, count: int) -> list[pa.Table]:
        """The records split by key into `count` shares (one key always in one share)."""
        return route_by_key(self.records, count)

    def for_commit(self) -> PreparedCheckpoint:
        """The checkpoint as its committer needs it once the shares are written elsewhere: of the records, only what
        the commit reads (their count, event and arrival times), not the payloads it would otherwise be handed."""
        read = [c for c in ("event_time", ARRIVAL_TIME) if c in self.records.column_names]
        return replace(self, records=self.records.select(read))


@dataclass(frozen=True)
class WrittenShare:
    """One share of a checkpoint written: its data files (not committed) and its accumulators' partial results; picklable."""

    data_files: list[DataFile]
    partials: dict[str, Any]


@dataclass
class _StagedCheckpoint:
    """A checkpoint with its files written and its rejects committed, waiting for its commit (maybe with others')."""

    prepared: PreparedCheckpoint  # its records: only what the commit reads (key, event and arrival times)
    data_files: list[DataFile]
    start: CommittedPosition  # its stream's position it goes on from: the commit lands only if the table still holds it
    checkpoint_id: int
    accumulated: dict[str, Any]
    ledger_hours: Future | None
    rejected: int
    base_summary: dict[str, str]
    arrival_max: int | None
    # what the last commit attempt found or made of it
    context: CommitContext | None = None
    source_clock: int | None = None
    fenced: CommittedPosition | None = None  # its stream's position when another process had moved it
    erased_meanwhile: bool = False


class WriterFenced(PartfinError):
    """Another process committed the batch's stream since this one read its position: this batch is void.

    The writer has deleted the batch's files and taken the committed positions; it must read the
    source again from them (CdcWriter.run does).
    """

    def __init__(self, table: str, stream_id: str, expected: CommittedPosition, position: CommittedPosition) -> None:
        self.position = position
        super().__init__(
            f"{table}: another process committed checkpoint {position.checkpoint_id} of stream {stream_id!r} "
            f"(this one expected {expected.checkpoint_id}); its batch is void, going on from offset {position.source_offset}"
        )


class ErasedMeanwhile(WriterFenced):
    """A privacy request was registered after this batch was filtered: the batch is void (nothing committed, its files
    deleted) and is read again from the same position, filtered with the request."""

    def __init__(self, table: str, position: CommittedPosition) -> None:
        self.position = position
        PartfinError.__init__(self, f"{table}: a privacy request was registered while this batch was written; "
                                     f"reading it again from offset {position.source_offset}, without the erased keys")


class CdcWriter:
    """Writes change batches into cdc.<table>, one checkpoint commit per batch."""

    def __init__(
        self,
        catalog: Catalog,
        spec: TableSpec,
        *,
        writer_id: str | None = None,
        subtasks: int = 1,
        accumulators: Sequence[type[Accumulator]] | None = None,
        processors: Sequence[CommitProcessor] | None = None,
        retention: Retention | None = None,
        heartbeat_interval_s: float = 60.0,
        clock: Callable[[], datetime] = now_utc,
        steady_clock: Callable[[], SteadyReading] = steady_now,
    ) -> None:
        if subtasks < 1:
            raise InvalidInput(f"subtasks must be at least 1, got {subtasks}")
        self.catalog = catalog
        self.spec = spec
        self.writer_id = check_writer_id(writer_id) if writer_id is not None else f"{spec.name}-writer"
        self.subtasks = subtasks
        self.accumulators = list(accumulators) if accumulators is not None else [EventTimeAccumulator]
        self.processors = list(processors) if processors is not None else [WatermarkProcessor()]
        self.retention = retention if retention is not None else Retention()
        registered = {acc.name for acc in self.accumulators}
        for processor in self.processors:
            missing = [name for name in processor.required_accumulators if name not in registered]
            if missing:
                raise ValueError(f"{type(processor).__name__} needs accumulator(s) {missing}; register them with the writer")
        self.heartbeat_interval_us = int(heartbeat_interval_s * 1_000_000)
        self.clock = clock
        # what progress streams' silence is measured on: the host's monotonic clock `steady_clock`, not `clock`'s steps
        self.stream_clock = StreamClock(self.writer_id, lambda: to_us(clock()), steady_clock)
        if spec.watermark_policy is not None:  # a bad declaration is refused before any table is created
            spec = replace(spec, watermark_policy=str(parse_policy(spec.watermark_policy)))
        ensure_cdc_tables(catalog, spec)
        # the policy in force: the table's, or the declared one that differs, taking effect now as a recorded change
        self.spec = replace(spec, watermark_policy=declare_policy(catalog, spec.cdc_identifier, spec.watermark_policy))
        # the writer's progress stream holds the watermark from now on (iceberg/streams.py)
        self.table = register_stream(catalog, spec.cdc_identifier, self.writer_id, to_us(clock()), self.stream_clock)
        self._positions = positions_of(self.table.metadata, self.writer_id)
        # checkpoints a crashed run committed but never recorded reach the late-data ledger first
        reconcile(catalog, self.table)
        self._ledger = LedgerAppender(catalog, spec.cdc_identifier)
        self.source_identity: SourceIdentity | None = None  # the history run() reads, recorded with every offset
        self._source_clocks: dict[str, int | None] = {}  # per progress stream, read from the history when first needed
        self._source_streams: tuple[str, ...] = ()  # the partitions the source reads now (Kafka), as stream ids
        self._erasures: Erasures | None = None  # loaded when first needed, again once the table is fenced past them
        self._pool = ThreadPoolExecutor(max_workers=subtasks) if subtasks > 1 else None
        # with accumulators registered, each subtask's files are written on a thread of their own
        self._file_pool = ThreadPoolExecutor(max_workers=subtasks) if self.accumulators else None

    def close(self) -> None:
        try:
            self._ledger.flush()
        finally:
            for pool in (self._pool, self._file_pool):
                if pool is not None:
                    pool.shutdown()

    @property
    def position(self) -> CommittedPosition:
        """The committed position the writer's own stream goes on from (a source without partitions)."""
        return self.position_of(self.writer_id)

    @property
    def positions(self) -> dict[str, CommittedPosition]:
        """Stream id -> the committed position its next batch starts from, as far as this writer knows."""
        return dict(self._positions)

    def position_of(self, stream_id: str) -> CommittedPosition:
        return position_in(self._positions, self.writer_id, stream_id)

    def start_offset(self, source: CdcSource) -> str | None:
        """Where `source` is read from: the writer's offset, or (partitions) each partition's own."""
        own = self._positions[self.writer_id].source_offset
        partitions = [p.source_offset for sid, p in sorted(self._positions.items()) if sid != self.writer_id and p.source_offset]
        if not partitions or not isinstance(source, ReadsPartitions):
            return own
        return source.joined_offset([o for o in (own, *partitions) if o])

    # ---- one checkpoint

    def write_checkpoint(self, batch: ChangeBatch) -> CheckpointResult:
        """Read, write and commit one batch: `prepare`, `write_shares`, `commit_checkpoint`, in this process."""
        prepared = self.prepare(batch)
        return self.commit_checkpoint(prepared, self.write_shares(prepared))

    def prepare(self, batch: ChangeBatch) -> PreparedCheckpoint:
        """A batch as a checkpoint, its records carrying their change log."""
        stream_id = self.stream_id(batch.stream)
        try:
            records = with_source_log(cdc_records(batch.records), stream_id)  # the stream is the records' change log
        except ValueError as exc:
            raise ValueError(f"{self.spec.name}: {exc}") from None
        heartbeat_us = to_us(batch.heartbeat) if batch.heartbeat is not None else None
        erasures = self.erasures()
        records, erased = without_erased(records, erasures)  # a change a privacy request erased never lands again
        return PreparedCheckpoint(records, batch.offset, batch.rejected, heartbeat_us, batch.stream, stream_id,
                                  self.source_identity, self._source_streams, erasures.version, erased)

    def _erases_some(self, prepared: PreparedCheckpoint, table: Table) -> bool:
        """Whether the erasures `table` (a commit attempt's fresh metadata) is fenced at cover a record of `prepared`
        (True when its records no longer carry their keys: a fanned-out commit step)."""
        self._erasures = current_erasures(self.catalog, self.spec, table, self.erasures())
        records = prepared.records
        return "key" not in records.column_names or bool(self._erasures.erased(records.column("key"), records.column("event_time")).any())

    def erasures(self) -> Erasures:
        """The erasures in force, as of this writer's view of the table (every commit attempt checks the fresh one)."""
        if self._erasures is None or fence_of(self.table.properties) > self._erasures.version:
            self._erasures = load_erasures(self.catalog, self.spec)
        return self._erasures

    def _refresh_positions(self, source: CdcSource) -> str | None:
        """The committed positions as the table holds them now (other processes commit partitions too): taken, and
        returned as the offset to read `source` from."""
        self._positions = positions_of(self.catalog.load_table(self.spec.cdc_identifier).metadata, self.writer_id)
        return self.start_offset(source)

    def expect_positions(self, start: dict[str, CommittedPosition]) -> None:
        """The next checkpoints go on from `start` (where their batches were read, maybe by another process): if anyone
        committed one of their streams since, its commit is fenced."""
        self._positions = dict(start)

    def write_shares(self, prepared: PreparedCheckpoint) -> list[WrittenShare]:
        """Write a checkpoint's shares on this writer's subtasks (threads); if one fails, every share's files are deleted."""
        parts = prepared.shares(self.subtasks)
        if self._pool is None:
            return [write_share(self.table, part, self.accumulators, self._file_pool) for part in parts]
        futures = [self._pool.submit(write_share, self.table, part, self.accumulators, self._file_pool) for part in parts]
        wait(futures)  # every subtask settles before a failure propagates, so none writes after the cleanup
        failures = [f.exception() for f in futures if f.exception() is not None]
        if failures:
            delete_files(self.table.io, [d.file_path for f in futures if f.exception() is None for d in f.result().data_files])
            raise failures[0]
        return [f.result() for f in futures]

    def commit_checkpoint(self, prepared: PreparedCheckpoint, written: Sequence[WrittenShare]) -> CheckpointResult:
        """Commit a checkpoint's written shares as one Iceberg commit (the only way a checkpoint commits).

        A record-less checkpoint commits only its rejects or a due heartbeat. If the commit is fenced
        (WriterFenced) or fails, the shares' files are deleted.
        """
        staged = self._stage(prepared, written)
        if staged is None:
            return CheckpointResult(self.position_of(prepared.stream_id).checkpoint_id + 1, None, 0, 0, {})
        return self._commit_group([staged])[0]

    def _stage(self, prepared: PreparedCheckpoint, written: Sequence[WrittenShare]) -> _StagedCheckpoint | None:
        """A written checkpoint made ready to commit (its rejects committed first); None: nothing to commit. If this
        fails, the shares' files are deleted."""
        data_files = [f for share in written for f in share.data_files]
        try:
            return self._staged(prepared, data_files, written)
        except BaseException:
            delete_files(self.table.io, [f.file_path for f in data_files])
            raise

    def _staged(self, prepared: PreparedCheckpoint, data_files: list[DataFile], written: Sequence[WrittenShare]) -> _StagedCheckpoint | None:
        records, stream_id, heartbeat_us = prepared.records, prepared.stream_id, prepared.heartbeat_us
        start = self.position_of(stream_id)
        checkpoint_id = start.checkpoint_id + 1  # counts up per stream
        if records.num_rows == 0 and prepared.rejected.num_rows == 0 and not prepared.erased and not self._heartbeat_due(stream_id, heartbeat_us):
            self._ledger.flush_if_due()  # an idle source: what waits goes to the ledger now
            return None

        faults().crash_point("after-files")
        accumulated = {acc.name: acc.merge([share.partials[acc.name] for share in written]) for acc in self.accumulators}
        ledger_hours = self._ledger_hours(records, accumulated.get(EventTimeAccumulator.name))
        rejected = self._commit_rejected(prepared.rejected, checkpoint_id, prepared.stream_id)

        base_summary = {
            K.WRITER_ID: self.writer_id,
            K.CHECKPOINT_ID: str(checkpoint_id),
            K.SOURCE_OFFSET: prepared.offset,
        }
        if prepared.partition is not None:
            base_summary[K.STREAM] = stream_id
        if prepared.source_identity is not None:
            base_summary[K.SOURCE] = prepared.source_identity.to_json()
        for acc in self.accumulators:
            base_summary.update(acc.summary(accumulated[acc.name]))
        if records.num_rows == 0 and heartbeat_us is not None:
            base_summary[K.EVENT_TIME_HEARTBEAT] = iso_z(heartbeat_us)
        if rejected:
            base_summary[K.REJECTED_RECORDS] = str(rejected)
        if prepared.erased:
            base_summary[K.PRIVACY_ERASED_RECORDS] = str(prepared.erased)
        arrival_max = None
        if records.num_rows and ARRIVAL_TIME in records.schema.names:
            arrival_max = pc.max(pc.cast(records.column(ARRIVAL_TIME), pa.int64())).as_py()
        kept = [c for c in ("key", "event_time", ARRIVAL_TIME) if c in records.column_names]  # what the commit still reads
        return _StagedCheckpoint(replace(prepared, records=records.select(kept)), data_files, start, checkpoint_id, accumulated,
                                 ledger_hours, rejected, base_summary, arrival_max)

    def _stage_in(self, tx: Transaction, table: Table, staged: _StagedCheckpoint, commit_id: str) -> bool:
        """Stage one checkpoint's snapshot and property updates in `tx` on `table` (the fresh metadata with what `tx`
        staged before); False when its stream's position moved or a privacy request came after its filter."""
        prepared, stream_id = staged.prepared, staged.prepared.stream_id
        committed = stream_position(table.metadata, self.writer_id, stream_id)
        if committed != staged.start:  # compare-and-set on the committed source position
            staged.fenced = committed
            return False
        if fence_of(table.properties) > prepared.erasures_version and self._erases_some(prepared, table):
            staged.erased_meanwhile = True  # a privacy request came after the filter
            return False
        clock_us = to_us(self.clock())
        properties = table.properties
        streams = streams_of(properties)
        stream_clock = self.stream_clock.read(streams)
        stream = streams.get(stream_id) or Stream(stream_id, self.writer_id, None, clock_us)
        # the checkpoints this commit is the first of this writer to find: their silence is measured from here on
        # its stream clock, and the other writers' clocks are checked against this commit's (iceberg/streams.py, "Clocks")
        tolerance = future_tolerance_us(properties)
        sighted = first_sights(streams, self.writer_id, stream_clock.us)
        clocks = writer_clocks(properties)
        findings = check_clocks(sighted, clocks, self.writer_id, clock_us, tolerance)
        trusted_us = trusted_clock_us(findings.apply(clocks), self.writer_id, clock_us)
        partition_streams = (self._partition_streams(streams, prepared.source_streams, clock_us, stream_clock)
                             if prepared.partition is not None else {})
        changed = {**sighted, **partition_streams}
        observed = self._source_clock_of(staged.arrival_max, prepared.heartbeat_us, staged.accumulated.get(EventTimeAccumulator.name),
                                         trusted_us, tolerance)
        source_clock = max((t for t in (self._source_clock(stream_id), observed) if t is not None), default=None)
        staged.source_clock = source_clock
        ctx = CommitContext(table, self.spec.name, staged.checkpoint_id, prepared.heartbeat_us, staged.accumulated, self.writer_id,
                            clock_us, stream_progress_us=stream.progress_us, stream_id=stream_id, arrival_us=staged.arrival_max,
                            source_clock_us=source_clock, streams={**streams, **changed},
                            idle_timeout_us=idle_timeout_us(properties), stream_clock_us=stream_clock.us, trusted_clock_us=trusted_us,
                            flush_ledger=self._ledger.flush)
        for processor in self.processors:
            processor.pre_commit(ctx)
        staged.context = ctx
        source_summary = {K.SOURCE_CLOCK: iso_z(source_clock)} if source_clock is not None else {}
        summary = snapshot_summary_with_commit_id({**staged.base_summary, **ctx.summary, **source_summary, K.COMMIT_CLOCK: iso_z(clock_us)},
                                                  commit_id, JobKind.INTO)
        with tx.update_snapshot(snapshot_properties=summary).merge_append() as append:
            for data_file in staged.data_files:
                append.append_data_file(data_file)
        stream = stream.checkpointed(ctx.stream_progress_us, clock_us, stream_clock)
        changed_streams = {k: v for s in changed.values() for k, v in stream_property(s).items()}
        position_property = {K.PROP_WRITER_PREFIX + stream_id: CommittedPosition(staged.checkpoint_id, prepared.offset).encode()}
        tx.set_properties({**ctx.properties, **position_property, **changed_streams, **findings.properties(), **stream_property(stream)})
        if findings.cleared:
            tx.remove_properties(*findings.removals())
        return True

    def _commit_group(self, group: list[_StagedCheckpoint]) -> list[CheckpointResult]:
        """Commit staged checkpoints of distinct streams in one Iceberg commit, one snapshot each, in order: all or none.

        If the commit is fenced (WriterFenced: every checkpoint of the group is void) or fails, their files are deleted.
        """
        data_files = [f for staged in group for f in staged.data_files]
        self._commit_stage = "committing"
        try:
            return self._committed_group(group)
        except BaseException as exc:
            # Only files no snapshot can name are deleted. Once the commit landed (an interrupt or error in the
            # post-commit work: ledger, expiry), or while its outcome is unknown (an interrupt inside the commit),
            # they are kept: orphan removal deletes them if no snapshot names them.
            unknown = self._commit_stage == "committing" and not isinstance(exc, Exception)
            if self._commit_stage != "landed" and not unknown:
                delete_files(self.table.io, [f.file_path for f in data_files])
            raise

    def _committed_group(self, group: list[_StagedCheckpoint]) -> list[CheckpointResult]:
        def build(table: Table, commit_id: str):
            tx = new_transaction(table)
            for position, staged in enumerate(group):
                # a later checkpoint sees the fresh metadata with what the ones before it staged, as if they had landed
                view = Table(table.name(), tx.table_metadata, table.metadata_location, table.io, table.catalog) if position else table
                staged.fenced, staged.erased_meanwhile = None, False
                if not self._stage_in(tx, view, staged, commit_id):
                    return None
            return tx

        result = commit_with_retry(self.catalog, self.spec.cdc_identifier, build)
        fenced = next((staged for staged in group if staged.fenced is not None), None)
        if fenced is not None:
            self.table = result.table
            self._positions = positions_of(result.table.metadata, self.writer_id)
            raise WriterFenced(self.spec.cdc_identifier, fenced.prepared.stream_id, fenced.start, fenced.fenced)
        erased = next((staged for staged in group if staged.erased_meanwhile), None)
        if erased is not None:
            self.table = result.table
            raise ErasedMeanwhile(self.spec.cdc_identifier, erased.start)
        self._commit_stage = "landed"
        faults().crash_point("after-commit")
        self.table = result.table
        snapshots = list(islice(lineage(result.table.metadata, result.snapshot), len(group)))[::-1]  # the group's, oldest first
        results = []
        for staged, snapshot in zip(group, snapshots, strict=True):
            prepared, ctx = staged.prepared, staged.context
            assert ctx is not None and summary_of(snapshot).get(K.CHECKPOINT_ID) == str(staged.checkpoint_id)
            self._positions[prepared.stream_id] = CommittedPosition(staged.checkpoint_id, prepared.offset)
            self._source_clocks[prepared.stream_id] = staged.source_clock
            for processor in self.processors:
                processor.post_commit(ctx, snapshot)
            self._record_in_ledger(staged.checkpoint_id, snapshot, ctx.clock_us, prepared.records, staged.ledger_hours)
            results.append(CheckpointResult(staged.checkpoint_id, snapshot.snapshot_id, prepared.records.num_rows, staged.rejected,
                                            summary_of(snapshot), result.attempts, first_of_commit=not results))
        expire_snapshots(result.table, self.retention, self._policy_window(), before_removal=self._ledger.flush_if_expiring)
        return results

    def _ledger_hours(self, records: pa.Table, event_times: EventTimes | None) -> Future | None:
        """The ledger's figures of the records per hour (digests of event time and lateness), made on the file pool
        while the commit runs: what the rows need of the commit itself is added once it landed."""
        if self._file_pool is None or records.num_rows == 0:
            return None
        event_time = records.column("event_time").to_numpy().view(np.int64)
        sorted_times = event_times.event_time_us if event_times is not None and event_times.event_time_us.size == event_time.size else None
        return self._file_pool.submit(hour_rows, event_time, records.column(ARRIVAL_TIME), None, sorted_times)

    def _record_in_ledger(self, checkpoint_id: int, snapshot: Snapshot, clock_us: int, records: pa.Table, hours: Future | None) -> None:
        checkpoint = Checkpoint.of_commit(self.writer_id, checkpoint_id, snapshot, clock_us)
        event_time = records.column("event_time").to_numpy().view(np.int64) if records.num_rows else np.empty(0, np.int64)
        self._ledger.add(checkpoint_row_dicts(checkpoint, event_time, records.column(ARRIVAL_TIME),
                                              hours=hours.result() if hours is not None else None))

    def _commit_rejected(self, rejected: pa.Table, checkpoint_id: int, source_log: str) -> int:
        """Rejected records land in cdc.<table>__rejected once per source position, however batches are cut.

        They commit before the checkpoint (so a landed checkpoint always has its rejects); a batch that
        then loses its commit, or a run that crashes before it, leaves them there, and whoever reads
        those positions again finds them already in (by writer id and source_seq) and skips them.
        """
        count = rejected.num_rows
        if count == 0:
            return 0
        marker = {K.WRITER_ID: self.writer_id, K.CHECKPOINT_ID: str(checkpoint_id)}
        rows = rejected.append_column("writer_id", pa.array([self.writer_id] * count, pa.string())).append_column(
            "checkpoint_id", pa.array([checkpoint_id] * count, pa.int64())
        )
        rows = rows.append_column(SOURCE_LOG, pa.array([source_log] * count, pa.string()))  # the log source_seq is in
        rows = rows.select(["writer_id", "checkpoint_id", "source_seq", "raw", "reason", SOURCE_LOG])
        first, last = pc.min_max(rows.column("source_seq")).values()
        files = AttemptFiles()
        erasures = self.erasures()

        def build(table: Table, commit_id: str):
            in_range = And(GreaterThanOrEqual("source_seq", first.as_py()), LessThanOrEqual("source_seq", last.as_py()))
            position = ("source_seq", SOURCE_LOG)  # a position within its change log (a Kafka partition's offsets)
            there = table.scan(row_filter=And(EqualTo("writer_id", self.writer_id), in_range), selected_fields=position).to_arrow()
            seen = set(zip(*(there.column(c).to_pylist() for c in position)))
            new = rows.filter(pa.array([p not in seen for p in zip(*(rows.column(c).to_pylist() for c in position))], pa.bool_()))
            if new.num_rows == 0:
                return None
            # a line naming an erased key keeps its position, never its text (its event time is unknown)
            new, redacted = redact_raw_lines(new, current_erasures(self.catalog, self.spec, table, erasures))
            summary = {**marker, K.PRIVACY_REDACTED_LINES: str(redacted)} if redacted else marker
            tx = new_transaction(table)
            files.append(tx, table, new, snapshot_summary_with_commit_id(summary, commit_id, JobKind.INTO))
            return tx

        commit_with_retry(self.catalog, self.spec.rejected_identifier, build, files=files)
        return count

    # ---- progress streams of a partitioned source

    def stream_id(self, partition: str | None) -> str:
        """The progress stream of a batch: the writer's own, or `<writer id>/<partition>` (a Kafka topic partition)."""
        return self.writer_id if partition is None else f"{self.writer_id}/{partition}"

    def _partition_streams(self, streams: dict[str, Stream], source_streams: tuple[str, ...], clock_us: int,
                           stream_clock: StreamClockReading) -> dict[str, Stream]:
        """Streams a partition's checkpoint changes: every partition the source reads now holds the watermark
        from its first checkpoint on (one that delivers nothing holds it until it is idle), and the writer's
        own stream, which its partitions replace, is retired (the checkpoint's watermark already without it)."""
        changed: dict[str, Stream] = {}
        for stream_id in source_streams:
            known = streams.get(stream_id)
            if known is None or known.retired:
                changed[stream_id] = (known or Stream(stream_id, self.writer_id, None, clock_us)).checkpointed(
                    known.progress_us if known else None, clock_us, stream_clock)
        own = streams.get(self.writer_id)
        if own is not None and not own.retired:
            changed[self.writer_id] = replace(own, retired=True)
        return changed

    # ---- idle sources: heartbeats follow the source's processing time (per progress stream)

    def _source_clock(self, stream_id: str) -> int | None:
        if stream_id not in self._source_clocks:
            self._source_clocks[stream_id] = self._committed_source_clock_us(stream_id)
        return self._source_clocks[stream_id]

    def _heartbeat_due(self, stream_id: str, heartbeat_us: int | None) -> bool:
        """A heartbeat commits once the source's clock moved a heartbeat interval past the last checkpoint's.

        Compared with the source's processing time (heartbeats, arrival times), never with event
        times: one event from a clock days ahead must not silence the heartbeats of an idle source.
        """
        if heartbeat_us is None:
            return False
        source_clock = self._source_clock(stream_id)
        return source_clock is None or heartbeat_us - source_clock >= self.heartbeat_interval_us

    @staticmethod
    def _source_clock_of(arrival_max: int | None, heartbeat_us: int | None, event_times: EventTimes | None, clock_us: int,
                         tolerance_us: int) -> int | None:
        """The source's processing time as of a checkpoint: its heartbeat, else its records' latest arrival,
        else their latest plausible event time; a time beyond the commit's (trusted) clock + tolerance never counts."""
        limit = clock_us + tolerance_us
        for candidate in (heartbeat_us, arrival_max):
            if candidate is not None and candidate <= limit:
                return candidate
        if event_times is not None and event_times.event_time_us.size:
            plausible = int(np.searchsorted(event_times.event_time_us, limit, side="right"))
            if plausible:
                return int(event_times.event_time_us[plausible - 1])
        return None

    def _committed_source_clock_us(self, stream_id: str) -> int | None:
        """The source clock the stream's newest checkpoint recorded (older tables: its heartbeat or plausible max)."""
        for snapshot in lineage(self.table.metadata):
            summary = summary_of(snapshot)
            if summary.get(K.WRITER_ID) != self.writer_id or commit_stream(summary) != stream_id:
                continue
            recorded = source_clock_us(summary)
            if recorded is not None:
                return recorded
            if K.EVENT_TIME_HEARTBEAT in summary and not suspect_future(summary):
                return to_us(parse_iso(summary[K.EVENT_TIME_HEARTBEAT]))
            stats = EventTimeStats.from_summary(summary, with_digest=False)
            if stats is not None and not stats.is_empty and not suspect_future(summary):
                return stats.max_us
        return None

    def _policy_window(self) -> CommitWindow:
        return table_policy(self.table.properties).window

    # ---- running a source

    def run(
        self,
        source: CdcSource,
        *,
        max_records: int = 10_000,
        max_checkpoints: int | None = None,
        on_checkpoint: Callable[[CheckpointResult], None] | None = None,
        commit_interval_s: float = DEFAULT_COMMIT_INTERVAL_S,
    ) -> Iterator[CheckpointResult]:
        """Commit one checkpoint per source batch, resuming after the last committed offset.

        A source that `AcknowledgesCommits` (e.g. a replication slot that may only
        move past committed changes) is told each offset once its checkpoint commit landed,
        before the next batch is asked for. Empty batches are not reported. When another process
        commits one of the batches' streams meanwhile (WriterFenced), the source is read again from
        the positions the table holds.

        The checkpoints of a partitioned source's partitions (Kafka) that come within `commit_interval_s` of
        each other land in one Iceberg commit, one snapshot each (`_checkpoint_groups`); 0: a commit per checkpoint.

        The source must read the history the table recorded (its identity, checked first:
        SourceMismatch names the table's current source); each checkpoint records it again.
        """
        committed = 0
        on_committed = source.on_committed if isinstance(source, AcknowledgesCommits) else None
        self._check_source(source)
        grouped = commit_interval_s > 0 and isinstance(source, ReadsPartitions)

        def room() -> int:
            return max_checkpoints - committed if max_checkpoints is not None else 1 << 62

        while True:
            with closing(self._batches(source, max_records)) as batches, \
                    closing(self._checkpoint_groups(batches, commit_interval_s if grouped else 0.0, room)) as groups:
                for group in groups:
                    try:
                        results = self._commit_group([staged for staged, _ in group])
                    except WriterFenced as fenced:
                        log.warning("%s", fenced)
                        break  # read again from the positions the other process committed
                    if on_committed is not None:
                        for _, offset in group:
                            on_committed(offset)
                    for result in results:
                        committed += 1
                        if on_checkpoint is not None:
                            on_checkpoint(result)
                        yield result
                        if max_checkpoints is not None and committed >= max_checkpoints:
                            return
                else:
                    self._ledger.flush()
                    return  # the source is exhausted

    def _checkpoint_groups(self, batches: Iterator[ChangeBatch], commit_interval_s: float,
                           room: Callable[[], int]) -> Iterator[list[tuple[_StagedCheckpoint, str]]]:
        """The batches written and staged as checkpoints, in groups to commit at once (with each its batch's offset).

        One commit for the checkpoints of many partitions instead of one each: on a topic of many partitions, each
        commit costs about as much CPU as writing a few thousand records, and the processes of a consumer group that
        commit at once lose races to each other (a retry redoes the commit). A group is handed on once the source has
        nothing ready (an empty batch: a Kafka source yields one once a poll found nothing), before a batch of a
        stream already in it (its position follows the group's), once it is `commit_interval_s` old (0: at once),
        once it fills the `room()` left, and at the source's end; so no checkpoint waits longer than the interval.
        The caller commits each group before the next batch is staged. A group never handed on is deleted.
        """
        group: list[tuple[_StagedCheckpoint, str]] = []
        started = 0.0
        try:
            for batch in batches:
                prepared = self.prepare(batch)
                if any(staged.prepared.stream_id == prepared.stream_id for staged, _ in group):
                    handed, group = group, []
                    yield handed
                staged = self._stage(prepared, self.write_shares(prepared))
                if staged is None:  # nothing to commit now: the source is idle
                    if group:
                        handed, group = group, []
                        yield handed
                    continue
                if not group:
                    started = time.monotonic()
                group.append((staged, batch.offset))
                if len(group) >= room() or time.monotonic() - started >= commit_interval_s:
                    handed, group = group, []
                    yield handed
            if group:
                handed, group = group, []
                yield handed
        finally:
            if group:  # staged, never committed
                delete_files(self.table.io, [f.file_path for staged, _ in group for f in staged.data_files])

    def read_checkpoints(self, source: CdcSource, *, max_records: int, max_checkpoints: int) -> list[PreparedCheckpoint]:
        """Up to `max_checkpoints` batches of the source from this writer's position, prepared for other processes to
        write (`write_share`) and a writer to commit in order after `expect_positions(self.positions)`.

        Batches with nothing to commit (no record, no reject, no heartbeat) are left out, as `run` skips them. A source
        that `AcknowledgesCommits` is first told what is committed (`run` tells it after each commit).
        """
        self._check_source(source)
        committed = self.start_offset(source)
        if isinstance(source, AcknowledgesCommits) and committed is not None:
            source.on_committed(committed)  # e.g. a replication slot may move to what is committed
        prepared: list[PreparedCheckpoint] = []
        with closing(self._batches(source, max_records)) as batches:
            for batch in batches:
                if batch.records.num_rows or batch.rejected.num_rows or batch.heartbeat is not None:
                    prepared.append(self.prepare(batch))
                if len(prepared) >= max_checkpoints:
                    break
        return prepared

    def _check_source(self, source: CdcSource) -> None:
        """The source must read the history the table recorded for this writer (SourceMismatch names the table's)."""
        recorded = recorded_source(self.table.metadata, self.writer_id)  # each writer id reads a source of its own
        # the writer's own offset: a partitioned source's identity does not depend on its partitions' offsets
        self.source_identity = check_source(self.spec.cdc_identifier, recorded, source, self.position.source_offset)

    def _batches(self, source: CdcSource, max_records: int) -> Iterator[ChangeBatch]:
        """The source's batches from this writer's position, each noting the identity and partitions recorded with it."""
        assigned_streams = source.assigned_streams if isinstance(source, ReadsPartitions) else None
        if isinstance(source, ReadsPartitions):  # a partition assigned later resumes where the table stands then
            source.resume_assigned_from(lambda: self._refresh_positions(source))
        batches = source.batches(self.start_offset(source), max_records)
        try:
            for batch in batches:
                self.source_identity = source.identity(batch.offset)  # a file's first line may only now be known
                if assigned_streams is not None:  # the partitions it reads now: each a progress stream
                    self._source_streams = tuple(self.stream_id(p) for p in assigned_streams())
                yield batch
        except SourceChanged as exc:
            raise SourceChanged(
                f"{self.spec.cdc_identifier} cannot go on reading {self.source_identity.spec}: {exc}. Restore what it was "
                "reading, or ingest the new source into a new table"
            ) from None
        finally:
            close = getattr(batches, "close", None)  # a generator: run its cleanup now, not at garbage collection
            if close is not None:
                close()


def write_share(table: Table, share: pa.Table, accumulators: Sequence[type[Accumulator]],
                file_pool: ThreadPoolExecutor | None = None) -> WrittenShare:
    """Write one share of a checkpoint as data files of `table` (not committed) and run the accumulators over it.

    Runs in any process that can load the table (a writer subtask's thread, a Dagster step). With a
    `file_pool`, PyIceberg's Parquet write (mostly outside the GIL) runs on it beside the accumulators.
    If anything fails, the files written are deleted before the error propagates.
    """
    if not share.num_rows:
        return WrittenShare([], _accumulate(share, accumulators))
    if not accumulators:
        return WrittenShare(list(write_data_files(table, share)), {})
    written = file_pool.submit(_written_files, table, share) if file_pool is not None else None
    try:
        partials = _accumulate(share, accumulators)
        data_files = written.result() if written is not None else list(write_data_files(table, share))
    except BaseException:
        if written is not None and written.exception() is None:  # this share will not commit: remove what was written beside
            delete_files(table.io, [f.file_path for f in written.result()])
        raise
    return WrittenShare(data_files, partials)


def _written_files(table: Table, share: pa.Table) -> list[DataFile]:
    return list(write_data_files(table, share))


def _accumulate(share: pa.Table, accumulators: Sequence[type[Accumulator]]) -> dict[str, Any]:
    instances = [acc() for acc in accumulators]
    for accumulator in instances:
        accumulator.add(share)
    return {a.name: a.partial() for a in instances}


def route_by_key(records: pa.Table, subtasks: int) -> list[pa.Table]:
    """Split a batch across subtasks by primary key, so one key always goes to one subtask."""
    if subtasks == 1:
        return [records]
    frame = pl.from_arrow(records)
    assert isinstance(frame, pl.DataFrame)
    route = frame.get_column("key").hash(seed=0) % subtasks
    return [frame.filter(route == i).to_arrow().cast(records.schema) for i in range(subtasks)]
