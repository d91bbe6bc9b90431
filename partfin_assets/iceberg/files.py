"""The one file layer: which partition a data file is in, which files are live, their rows, writing and deleting them.

partfin writes copy-on-write (no delete files), so a snapshot's rows are exactly the rows of
its live data files. Every partfin module that lists, reads or writes data files does it here.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterable, Iterator, Set

import pyarrow as pa
from pyiceberg.expressions import AlwaysTrue
from pyiceberg.io import FileIO
from pyiceberg.io.pyarrow import ArrowScan, _dataframe_to_data_files
from pyiceberg.manifest import DataFile, ManifestContent
from pyiceberg.table import FileScanTask, Table
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Snapshot
from pyiceberg.transforms import HourTransform
from pyiceberg.typedef import Record

from partfin_assets.model.timeutil import US_PER_HOUR

WHOLE_TABLE = "*"  # the target / touched "partition" of an unpartitioned table, or "unknown: assume all"


# --------------------------------------------------------------------------- partitions


def partition_path(metadata: TableMetadata, data_file: DataFile) -> str:
    """The partition of a data file as PyIceberg names it in snapshot summaries (`event_time_hour=2026-11-01-00`)."""
    try:
        spec_id = data_file.spec_id
    except AttributeError:  # a file just written (not read from a manifest) belongs to the default spec
        spec_id = metadata.default_spec_id
    spec = metadata.specs().get(spec_id, metadata.spec())
    if spec.is_unpartitioned() or len(data_file.partition) == 0:
        return WHOLE_TABLE
    return spec.partition_to_path(data_file.partition, metadata.schema())


def partition_path_of_values(metadata: TableMetadata, values: Iterable) -> str:
    """The partition path of the current spec for already-transformed partition values."""
    spec = metadata.spec()
    if spec.is_unpartitioned():
        return WHOLE_TABLE
    return spec.partition_to_path(Record(*values), metadata.schema())


def hour_partition(metadata: TableMetadata, hour_us: int) -> str:
    """The partition path of the hour starting at `hour_us` in an hour(event time)-partitioned table."""
    spec = metadata.spec()
    hour_fields = [f for f in spec.fields if isinstance(f.transform, HourTransform)]
    if len(spec.fields) != 1 or not hour_fields:
        raise ValueError(f"table at {metadata.location} is not partitioned by one hour() field: {spec}")
    return partition_path_of_values(metadata, [hour_us // US_PER_HOUR])


# --------------------------------------------------------------------------- listing


def data_files(table: Table, snapshot: Snapshot | None, *, skip_manifests: Set[str] = frozenset()) -> list[DataFile]:
    """The live data files of `snapshot` (manifests only), except those of the manifests in `skip_manifests`.

    partfin tables hold data files only; a delete manifest (another engine's merge-on-read) is
    refused rather than ignored, since the rows of the data files would no longer be the table's.
    """
    if snapshot is None:
        return []
    out = []
    for manifest in snapshot.manifests(table.io):
        if manifest.manifest_path in skip_manifests:
            continue
        if manifest.content != ManifestContent.DATA:
            raise NotImplementedError(f"{table.name()}: {manifest.manifest_path} holds delete files, which partfin does not read")
        out += [entry.data_file for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True)]
    return out


def added_data_files(table: Table, previous: Snapshot, current: Snapshot) -> list[DataFile]:
    """Data files live at `current` but not at `previous` (manifests both share are not read)."""
    shared = {m.manifest_path for m in previous.manifests(table.io)} & {m.manifest_path for m in current.manifests(table.io)}
    added = {f.file_path: f for f in data_files(table, current, skip_manifests=shared)}
    if added:
        for data_file in data_files(table, previous, skip_manifests=shared):
            added.pop(data_file.file_path, None)
    return list(added.values())


def live_files(table: Table, snapshot_id: int | None = None, partitions: Iterable[str] | None = None) -> dict[str, list[DataFile]]:
    """Live data files of a snapshot (default: the current one) grouped by partition path (manifests only)."""
    metadata = table.metadata
    snapshot = metadata.snapshot_by_id(snapshot_id) if snapshot_id is not None else metadata.current_snapshot()
    wanted = set(partitions) if partitions is not None else None
    out: dict[str, list[DataFile]] = {}
    for data_file in data_files(table, snapshot):
        path = partition_path(metadata, data_file)
        if wanted is not None and path not in wanted and WHOLE_TABLE not in wanted:
            continue
        out.setdefault(path, []).append(data_file)
    return out


# --------------------------------------------------------------------------- reading, writing, deleting


def read_files(table: Table, files: Iterable[DataFile]) -> pa.Table:
    """The rows of some data files of `table`, read with its (pinned) metadata; no delete files: copy-on-write."""
    metadata = table.metadata
    tasks = [FileScanTask(f) for f in files]
    if not tasks:
        return metadata.schema().as_arrow().empty_table()
    return ArrowScan(metadata, table.io, metadata.schema(), AlwaysTrue()).to_table(tasks)


def write_data_files(table: Table, rows: pa.Table, *, target_file_size_bytes: int | None = None) -> Iterator[DataFile]:
    """Write rows as Parquet data files of `table` (partitioned by its spec), yielding each file as it is written.

    Files are not committed: the caller commits them, or deletes them (`delete_files`) if it will not.
    The one place partfin calls PyIceberg's private `_dataframe_to_data_files` (0.12 has no public
    API that writes files without committing them).
    """
    metadata = table.metadata
    if target_file_size_bytes is not None:
        metadata = metadata.model_copy(
            update={"properties": {**metadata.properties, "write.target-file-size-bytes": str(target_file_size_bytes)}}
        )
    yield from _dataframe_to_data_files(metadata, rows, table.io, write_uuid=uuid.uuid4(), counter=itertools.count())


def delete_files(io: FileIO, paths: list[str]) -> None:
    """Remove data files of a commit that will never land, so a failed job leaves nothing behind."""
    for path in paths:
        try:
            io.delete(path)
        except FileNotFoundError:
            pass
