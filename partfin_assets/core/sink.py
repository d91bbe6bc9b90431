"""The Iceberg sink: writer subtasks, Accumulators, CommitProcessors, one commit per checkpoint.

A checkpoint is one Iceberg commit on cdc.<table> that holds the data files of
every subtask, the merged accumulator results and processor entries in the
snapshot summary, and any table-property updates: one new metadata file, all or
nothing. The snapshot also records writer id, checkpoint id and source offset,
so a restarted writer resumes exactly after what was committed and a checkpoint
that already landed is never committed twice.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import TableAlreadyExistsError
from pyiceberg.io.pyarrow import _dataframe_to_data_files
from pyiceberg.manifest import DataFile
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.table.snapshots import Snapshot
from pyiceberg.transforms import HourTransform
from pyiceberg.types import LongType, NestedField, StringType, TimestamptzType

from partfin_assets.core import summary_keys as K
from partfin_assets.core.catalog import ensure_namespaces
from partfin_assets.core.commit import (
    MANAGED_TABLE_PROPERTIES,
    JobKind,
    commit_with_retry,
    delete_files,
    ensure_managed_properties,
    new_transaction,
    snapshot_summary_with_commit_id,
)
from partfin_assets.core.history import last_writer_position, lineage, summary_of
from partfin_assets.core.maintenance import Retention, expire_snapshots
from partfin_assets.core.stats import EventTimeProfile, EventTimeStats
from partfin_assets.core.tablespec import TableSpec
from partfin_assets.core.timeutil import iso_z, parse_iso, to_us
from partfin_assets.sources.base import CDC_RECORD_SCHEMA, ChangeBatch, CdcSource

log = logging.getLogger(__name__)

CDC_SCHEMA = Schema(
    NestedField(1, "key", StringType(), required=True),
    NestedField(2, "op", StringType(), required=True),
    NestedField(3, "event_time", TimestamptzType(), required=True),
    NestedField(4, "source_seq", LongType(), required=True),
    NestedField(5, "payload", StringType(), required=False),
)
CDC_PARTITION_SPEC = PartitionSpec(
    PartitionField(source_id=3, field_id=1000, transform=HourTransform(), name="event_time_hour")
)
REJECTED_SCHEMA = Schema(
    NestedField(1, "writer_id", StringType(), required=True),
    NestedField(2, "checkpoint_id", LongType(), required=True),
    NestedField(3, "source_seq", LongType(), required=True),
    NestedField(4, "raw", StringType(), required=True),
    NestedField(5, "reason", StringType(), required=True),
)


# --------------------------------------------------------------------------- extension points


class Accumulator(ABC):
    """Per-subtask metric over the records between two checkpoints, merged at commit time.

    `merge` must not depend on the order of the partials: subtasks finish in any order.
    """

    name: ClassVar[str]

    @abstractmethod
    def add(self, records: pa.Table) -> None: ...

    @abstractmethod
    def partial(self) -> Any: ...

    @classmethod
    @abstractmethod
    def merge(cls, partials: Sequence[Any]) -> Any: ...

    @classmethod
    def summary(cls, merged: Any) -> dict[str, str]:
        return {}


@dataclass(frozen=True)
class EventTimes:
    profile: EventTimeProfile
    event_time_us: np.ndarray  # ascending; kept for exact late-record counts against the watermark at commit time
    summary: dict[str, str]  # encoded with the rest, while the subtask's files are written

    @property
    def stats(self) -> EventTimeStats:
        return self.profile.stats


class EventTimeAccumulator(Accumulator):
    """The DESIGN §4 event-time stats of a checkpoint, and the same per hour (partfin.event-time.by-hour)."""

    name = "event-time"

    def __init__(self) -> None:
        self._chunks: list[np.ndarray] = []

    def add(self, records: pa.Table) -> None:
        self._chunks.append(records.column("event_time").to_numpy().view(np.int64))  # no copy for one chunk

    def partial(self) -> EventTimes:
        return _event_times(self._chunks)

    @classmethod
    def merge(cls, partials: Sequence[EventTimes]) -> EventTimes:
        if len(partials) == 1:
            return partials[0]
        # rebuilt from all values: exact per-hour figures, and one result however the keys were split
        return _event_times([p.event_time_us for p in partials])

    @classmethod
    def summary(cls, merged: EventTimes) -> dict[str, str]:
        return merged.summary


def _event_times(chunks: Sequence[np.ndarray]) -> EventTimes:
    times = np.concatenate(chunks) if chunks else np.empty(0, dtype=np.int64)  # a copy of its own
    times.sort()
    profile = EventTimeProfile.of_sorted(times)
    return EventTimes(profile, times, profile.to_summary())


@dataclass
class CommitContext:
    """What a CommitProcessor sees; rebuilt on fresh table metadata for every commit attempt."""

    table: Table
    table_name: str
    checkpoint_id: int
    heartbeat_us: int | None
    accumulated: dict[str, Any]
    summary: dict[str, str] = field(default_factory=dict)  # add snapshot-summary entries here
    properties: dict[str, str] = field(default_factory=dict)  # add table-property updates here


class CommitProcessor:
    """Custom logic around each checkpoint commit.

    pre_commit runs on every attempt, against the metadata that attempt will be validated
    against, and may add summary entries and property updates to the same commit.
    post_commit runs once, after the commit landed.
    """

    # names of the accumulators whose merged results pre_commit reads
    required_accumulators: ClassVar[tuple[str, ...]] = ()

    def pre_commit(self, ctx: CommitContext) -> None:
        pass

    def post_commit(self, ctx: CommitContext, snapshot: Snapshot) -> None:
        pass


# --------------------------------------------------------------------------- tables


def ensure_cdc_tables(catalog: Catalog, spec: TableSpec) -> Table:
    ensure_namespaces(catalog, "cdc")
    _create_if_absent(
        catalog,
        spec.cdc_identifier,
        CDC_SCHEMA,
        CDC_PARTITION_SPEC,
        {**MANAGED_TABLE_PROPERTIES, K.PROP_WATERMARK_POLICY: spec.watermark_policy, **spec.to_properties()},
    )
    _create_if_absent(catalog, spec.rejected_identifier, REJECTED_SCHEMA, PartitionSpec(), dict(MANAGED_TABLE_PROPERTIES))
    return ensure_managed_properties(catalog, spec.cdc_identifier)


def _create_if_absent(catalog: Catalog, identifier: str, schema: Schema, partition_spec: PartitionSpec, properties: dict) -> None:
    if catalog.table_exists(identifier):
        return
    try:
        catalog.create_table(identifier, schema=schema, partition_spec=partition_spec, properties=properties)
    except TableAlreadyExistsError:
        pass  # another writer created it first


# --------------------------------------------------------------------------- the writer


@dataclass(frozen=True)
class CheckpointResult:
    checkpoint_id: int
    snapshot_id: int | None  # None: nothing committed (empty, or already committed before)
    records: int
    rejected: int
    summary: dict[str, str]
    duplicate: bool = False


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
    ) -> None:
        from partfin_assets.core.watermark_processor import WatermarkProcessor  # deferred: it builds on this module

        if subtasks < 1:
            raise ValueError(f"subtasks must be at least 1, got {subtasks}")
        self.catalog = catalog
        self.spec = spec
        self.writer_id = writer_id or f"{spec.name}-writer"
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
        self.table = ensure_cdc_tables(catalog, spec)
        position = last_writer_position(self.table.metadata, self.writer_id)
        self.last_checkpoint_id = position.checkpoint_id if position else 0
        self.resume_offset = position.source_offset if position else None
        self._last_progress_us = self._last_committed_event_time_us()
        self._pool = ThreadPoolExecutor(max_workers=subtasks) if subtasks > 1 else None
        # with accumulators registered, each subtask's files are written on a thread of their own
        self._file_pool = ThreadPoolExecutor(max_workers=subtasks) if self.accumulators else None

    def close(self) -> None:
        for pool in (self._pool, self._file_pool):
            if pool is not None:
                pool.shutdown()

    # ---- one checkpoint

    def write_checkpoint(self, batch: ChangeBatch) -> CheckpointResult:
        checkpoint_id = self.last_checkpoint_id + 1
        records = batch.records
        if not records.schema.equals(CDC_RECORD_SCHEMA):
            raise ValueError(f"{self.spec.name}: source batch schema {records.schema} is not the CDC record schema")
        heartbeat_us = to_us(batch.heartbeat) if batch.heartbeat is not None else None
        if records.num_rows == 0 and batch.rejected.num_rows == 0 and not self._heartbeat_due(heartbeat_us):
            return CheckpointResult(checkpoint_id, None, 0, 0, {})

        data_files, partials = self._write_subtasks(records)
        crash_point("after-files")
        accumulated = {acc.name: acc.merge(partials[acc.name]) for acc in self.accumulators}
        rejected = self._commit_rejected(batch, checkpoint_id)

        base_summary = {
            K.WRITER_ID: self.writer_id,
            K.CHECKPOINT_ID: str(checkpoint_id),
            K.SOURCE_OFFSET: batch.offset,
        }
        for acc in self.accumulators:
            base_summary.update(acc.summary(accumulated[acc.name]))
        if records.num_rows == 0 and heartbeat_us is not None:
            base_summary[K.EVENT_TIME_HEARTBEAT] = iso_z(heartbeat_us)
        if rejected:
            base_summary[K.REJECTED_RECORDS] = str(rejected)

        contexts: list[CommitContext] = []
        already_committed = False

        def build(table: Table, commit_id: str):
            nonlocal already_committed
            position = last_writer_position(table.metadata, self.writer_id)
            if position is not None and position.checkpoint_id >= checkpoint_id:
                already_committed = True  # landed before (unknown outcome, or a restarted twin)
                return None
            ctx = CommitContext(table, self.spec.name, checkpoint_id, heartbeat_us, accumulated)
            for processor in self.processors:
                processor.pre_commit(ctx)
            contexts.append(ctx)
            summary = snapshot_summary_with_commit_id({**base_summary, **ctx.summary}, commit_id, JobKind.INTO)
            tx = new_transaction(table)
            with tx.update_snapshot(snapshot_properties=summary).merge_append() as append:
                for data_file in data_files:
                    append.append_data_file(data_file)
            if ctx.properties:
                tx.set_properties(ctx.properties)
            return tx

        try:
            result = commit_with_retry(self.catalog, self.spec.cdc_identifier, build)
        except BaseException:
            delete_files(self.table.io, [f.file_path for f in data_files])
            raise
        if already_committed:
            delete_files(self.table.io, [f.file_path for f in data_files])
            self.last_checkpoint_id = checkpoint_id
            return CheckpointResult(checkpoint_id, None, records.num_rows, rejected, {}, duplicate=True)
        crash_point("after-commit")
        self.table = result.table
        self.last_checkpoint_id = checkpoint_id
        self.resume_offset = batch.offset
        snapshot = result.snapshot
        for processor in self.processors:
            processor.post_commit(contexts[-1], snapshot)
        self._note_progress(records, heartbeat_us, accumulated)
        expire_snapshots(result.table, self.retention, self._policy_lookback())
        return CheckpointResult(checkpoint_id, snapshot.snapshot_id, records.num_rows, rejected, summary_of(snapshot))

    def _write_subtasks(self, records: pa.Table) -> tuple[list[DataFile], dict[str, list[Any]]]:
        parts = route_by_key(records, self.subtasks)
        if self._pool is None:
            results = [self._run_subtask(part) for part in parts]
        else:
            futures = [self._pool.submit(self._run_subtask, part) for part in parts]
            wait(futures)  # every subtask settles before a failure propagates, so none writes after the cleanup
            failures = [f.exception() for f in futures if f.exception() is not None]
            if failures:
                delete_files(self.table.io, [d.file_path for f in futures if f.exception() is None for d in f.result()[0]])
                raise failures[0]
            results = [f.result() for f in futures]
        data_files = [f for files, _ in results for f in files]
        partials = {acc.name: [p[acc.name] for _, p in results] for acc in self.accumulators}
        return data_files, partials

    def _run_subtask(self, part: pa.Table) -> tuple[list[DataFile], dict[str, Any]]:
        if not part.num_rows:
            return [], self._accumulate(part)
        if self._file_pool is None:
            return self._write_files(part), {}
        # PyIceberg's Parquet write spends most of its time outside the GIL: the accumulators run beside it
        written = self._file_pool.submit(self._write_files, part)
        try:
            partials = self._accumulate(part)
        except BaseException:
            if written.exception() is None:  # this checkpoint will not commit: remove what was written beside
                delete_files(self.table.io, [f.file_path for f in written.result()])
            raise
        return written.result(), partials

    def _write_files(self, part: pa.Table) -> list[DataFile]:
        return list(_dataframe_to_data_files(self.table.metadata, part, self.table.io, write_uuid=uuid.uuid4(), counter=itertools.count()))

    def _accumulate(self, part: pa.Table) -> dict[str, Any]:
        accumulators = [acc() for acc in self.accumulators]
        for accumulator in accumulators:
            accumulator.add(part)
        return {a.name: a.partial() for a in accumulators}

    def _commit_rejected(self, batch: ChangeBatch, checkpoint_id: int) -> int:
        """Rejected records land in cdc.<table>__rejected, once per checkpoint even across restarts."""
        count = batch.rejected.num_rows
        if count == 0:
            return 0
        marker = {K.WRITER_ID: self.writer_id, K.CHECKPOINT_ID: str(checkpoint_id)}
        rows = batch.rejected.append_column("writer_id", pa.array([self.writer_id] * count, pa.string())).append_column(
            "checkpoint_id", pa.array([checkpoint_id] * count, pa.int64())
        )
        rows = rows.select(["writer_id", "checkpoint_id", "source_seq", "raw", "reason"])

        def build(table: Table, commit_id: str):
            position = last_writer_position(table.metadata, self.writer_id)
            if position is not None and position.checkpoint_id >= checkpoint_id:
                return None
            tx = new_transaction(table)
            tx.append(rows.cast(table.schema().as_arrow()), snapshot_properties=snapshot_summary_with_commit_id(marker, commit_id, JobKind.INTO))
            return tx

        commit_with_retry(self.catalog, self.spec.rejected_identifier, build)
        return count

    # ---- idle sources

    def _heartbeat_due(self, heartbeat_us: int | None) -> bool:
        if heartbeat_us is None:
            return False
        return self._last_progress_us is None or heartbeat_us - self._last_progress_us >= self.heartbeat_interval_us

    def _note_progress(self, records: pa.Table, heartbeat_us: int | None, accumulated: dict[str, Any]) -> None:
        candidates = [t for t in (self._last_progress_us, heartbeat_us) if t is not None]
        if records.num_rows:
            event_times = accumulated.get(EventTimeAccumulator.name)  # its stats hold the max already
            if event_times is not None:
                candidates.append(event_times.stats.max_us)
            else:
                candidates.append(pc.max(pc.cast(records.column("event_time"), pa.int64())).as_py())
        self._last_progress_us = max(candidates) if candidates else None

    def _last_committed_event_time_us(self) -> int | None:
        for snapshot in lineage(self.table.metadata):
            summary = summary_of(snapshot)
            if summary.get(K.WRITER_ID) != self.writer_id:
                continue
            stats = EventTimeStats.from_summary(summary)
            if stats is not None and not stats.is_empty:
                return stats.max_us
            if K.EVENT_TIME_HEARTBEAT in summary:
                return to_us(parse_iso(summary[K.EVENT_TIME_HEARTBEAT]))
        return None

    def _policy_lookback(self) -> int:
        from partfin_assets.core.watermark import WatermarkPolicy

        return WatermarkPolicy.parse(self.table.properties.get(K.PROP_WATERMARK_POLICY)).lookback

    # ---- running a source

    def run(
        self,
        source: CdcSource,
        *,
        max_records: int = 10_000,
        max_checkpoints: int | None = None,
        on_checkpoint: Callable[[CheckpointResult], None] | None = None,
    ) -> Iterator[CheckpointResult]:
        """Commit one checkpoint per source batch, resuming after the last committed offset.

        A source with an `on_committed(offset)` method (e.g. a replication slot that may only
        move past committed changes) is told each offset once its checkpoint commit landed,
        before the next batch is asked for. Skipped and duplicate batches are not reported.
        """
        committed = 0
        on_committed = getattr(source, "on_committed", None)
        for batch in source.batches(self.resume_offset, max_records):
            result = self.write_checkpoint(batch)
            if result.snapshot_id is None and not result.duplicate:
                continue
            if on_committed is not None and result.snapshot_id is not None:
                on_committed(batch.offset)
            committed += 1
            if on_checkpoint is not None:
                on_checkpoint(result)
            yield result
            if max_checkpoints is not None and committed >= max_checkpoints:
                return


def route_by_key(records: pa.Table, subtasks: int) -> list[pa.Table]:
    """Split a batch across subtasks by primary key, so one key always goes to one subtask."""
    if subtasks == 1:
        return [records]
    frame = pl.from_arrow(records)
    assert isinstance(frame, pl.DataFrame)
    route = frame.get_column("key").hash(seed=0) % subtasks
    return [frame.filter(route == i).to_arrow().cast(records.schema) for i in range(subtasks)]


def crash_point(name: str) -> None:
    """Fault injection for crash tests: PARTFIN_CRASH_AT=<name>:<n> kills the process at the n-th pass."""
    spec = os.environ.get("PARTFIN_CRASH_AT")
    if not spec or not spec.startswith(name + ":"):
        return
    remaining = int(spec.split(":", 1)[1]) - 1
    if remaining <= 0:
        os.kill(os.getpid(), signal.SIGKILL)
    os.environ["PARTFIN_CRASH_AT"] = f"{name}:{remaining}"
