"""The writer's extension points (plain Python): Accumulator and CommitProcessor.

An Accumulator computes a metric over each subtask's records, merged at commit time; a
CommitProcessor adds summary entries and property updates to the checkpoint commit itself
(pre_commit, on every attempt) and reacts once it landed (post_commit).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pyarrow as pa
from pyiceberg.table import Table
from pyiceberg.table.snapshots import Snapshot

from partfin_assets.iceberg.streams import Stream


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


@dataclass
class CommitContext:
    """What a CommitProcessor sees; rebuilt on fresh table metadata for every commit attempt."""

    table: Table
    table_name: str
    checkpoint_id: int
    heartbeat_us: int | None
    accumulated: dict[str, Any]
    writer_id: str
    clock_us: int  # the commit attempt's clock (the writer's wall clock): what "now" means for this commit
    summary: dict[str, str] = field(default_factory=dict)  # add snapshot-summary entries here
    properties: dict[str, str] = field(default_factory=dict)  # add table-property updates here
    # the writer's progress stream (iceberg/streams.py): its watermark candidate after this commit;
    # comes in as the stream's current one, the watermark processor sets it
    stream_progress_us: int | None = None
    # the progress stream this checkpoint belongs to: the writer's own, or a source partition's
    # (`<writer id>/<topic>-<partition>`); None: the writer's own
    stream_id: str | None = None
    # the latest source arrival time (processing time, e.g. Debezium's envelope ts_ms) among the
    # checkpoint's records; None when the source gives none
    arrival_us: int | None = None
    # the source's processing time as of this checkpoint (partfin.source-clock, see the writer)
    source_clock_us: int | None = None
    # the table's progress streams as this commit leaves them (its own stream with the progress it had;
    # iceberg/streams.py), and the idle timeout they are judged by; None: as the table's properties say
    streams: Mapping[str, Stream] | None = None
    idle_timeout_us: int | None = None
    # the writer's stream clock at this commit (streams.StreamClock): what the streams' silence is measured
    # on, which no step of the host's clock lengthens; None: the commit clock
    stream_clock_us: int | None = None
    # the commit clock checked against the other writers' (streams.trusted_clock_us): what event times
    # are capped with; None: the commit clock
    trusted_clock_us: int | None = None

    @property
    def stream(self) -> str:
        return self.stream_id or self.writer_id

    @property
    def stream_clock(self) -> int:
        return self.clock_us if self.stream_clock_us is None else self.stream_clock_us

    @property
    def trusted_clock(self) -> int:
        return self.clock_us if self.trusted_clock_us is None else self.trusted_clock_us


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
