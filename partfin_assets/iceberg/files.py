"""The one file layer: which partition a data file is in, which files are live, their rows, writing and deleting them.

cdc.<table> is append-only: its rows are the rows of its live data files. base.<table> is
merge-on-read: position-delete files (iceberg/position_deletes.py) remove rows of its data files,
and `read_files` always applies the deletes live at the table's (pinned) snapshot, so no partfin
module can read a deleted row back by accident. Every partfin module that lists, reads or writes
data files does it here.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterable, Iterator, Set

import pyarrow as pa
from pyiceberg.expressions import AlwaysTrue
from pyiceberg.io import FileIO
from pyiceberg.io.pyarrow import ArrowScan, _dataframe_to_data_files
from pyiceberg.manifest import DataFile, DataFileContent, ManifestContent
from pyiceberg.table import FileScanTask, Table
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Snapshot
from pyiceberg.transforms import HourTransform
from pyiceberg.typedef import Record

from partfin_assets.iceberg import parquet_layout  # noqa: F401 - installs the per-table column encodings
from partfin_assets.iceberg import position_deletes  # noqa: F401 - installs the fast position-delete reader
from partfin_assets.model.timeutil import US_PER_HOUR

WHOLE_TABLE = "*"  # the target / touched "partition" of an unpartitioned table, or "unknown: assume all"


# --------------------------------------------------------------------------- partitions


def partition_path(metadata: TableMetadata, data_file: DataFile) -> str:
    """The partition of a data file as PyIceberg names it in snapshot summaries (`event_time_hour=2026-11-01-00`)."""
    spec = metadata.specs().get(spec_id_of(metadata, data_file), metadata.spec())
    if spec.is_unpartitioned() or len(data_file.partition) == 0:
        return WHOLE_TABLE
    return spec.partition_to_path(data_file.partition, metadata.schema())


def spec_id_of(metadata: TableMetadata, data_file: DataFile) -> int:
    """The partition spec of a file: from its manifest, else (a file just written) the default spec."""
    try:
        return data_file.spec_id
    except AttributeError:
        data_file.spec_id = metadata.default_spec_id
        return data_file.spec_id


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
    """The live data files of `snapshot` (manifests only), except those of the manifests in `skip_manifests`."""
    return _live_entries(table, snapshot, ManifestContent.DATA, skip_manifests)


def position_delete_files(table: Table, snapshot: Snapshot | None) -> list[DataFile]:
    """The live position-delete files of `snapshot` (base.<table> writes them; cdc.<table> has none)."""
    return _live_entries(table, snapshot, ManifestContent.DELETES)


def _live_entries(table: Table, snapshot: Snapshot | None, content: ManifestContent, skip_manifests: Set[str] = frozenset()) -> list[DataFile]:
    if snapshot is None:
        return []
    out = []
    for manifest in snapshot.manifests(table.io):
        if manifest.manifest_path in skip_manifests or manifest.content != content:
            continue
        for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
            if entry.data_file.content == DataFileContent.EQUALITY_DELETES:
                raise NotImplementedError(f"{table.name()}: {entry.data_file.file_path} is an equality-delete file, which partfin does not read")
            out.append(entry.data_file)
    return out


def data_file_paths(table: Table, snapshots: Iterable[Snapshot]) -> set[str]:
    """Paths of the data files live in any of `snapshots`, each manifest read once however many snapshots share it."""
    manifests = {m.manifest_path: m for s in snapshots for m in s.manifests(table.io) if m.content == ManifestContent.DATA}
    return {entry.data_file.file_path for m in manifests.values() for entry in m.fetch_manifest_entry(table.io, discard_deleted=True)}


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


def read_files(table: Table, files: Iterable[DataFile], *, deletes: Iterable[DataFile] | None = None) -> pa.Table:
    """The rows of some data files of `table`, read with its (pinned) metadata, less the rows its position deletes remove.

    `deletes`: the delete files to apply; by default those live at the table's current snapshot
    (for a job's table: its start snapshot). Only the ones of a file's partition are attached to it.
    """
    metadata = table.metadata
    files = list(files)
    if not files:
        return metadata.schema().as_arrow().empty_table()
    if deletes is None:
        deletes = position_delete_files(table, table.current_snapshot())
    by_partition: dict[tuple[int, tuple], set[DataFile]] = {}
    for delete_file in deletes:
        by_partition.setdefault(partition_key_of(metadata, delete_file), set()).add(delete_file)
    tasks = [FileScanTask(f, delete_files=by_partition.get(partition_key_of(metadata, f), set())) for f in files]
    return ArrowScan(metadata, table.io, metadata.schema(), AlwaysTrue()).to_table(tasks)


def partition_key_of(metadata: TableMetadata, data_file: DataFile) -> tuple[int, tuple]:
    """(spec id, partition values): the files of one partition, delete files included, share it."""
    return spec_id_of(metadata, data_file), tuple(data_file.partition)


def conform_rows(table: Table, rows: pa.Table) -> pa.Table:
    """`rows` in the table's current schema: an optional column the rows lack (one added to the table
    after the writer's code was written, e.g. by schema evolution) is nulls; a missing required one
    is a ValueError naming it, and so is a column the table does not have (never dropped)."""
    schema = table.schema().as_arrow()
    missing = [f for f in schema if f.name not in rows.column_names]
    required = [f.name for f in missing if not f.nullable]
    unknown = [c for c in rows.column_names if c not in schema.names]
    if required or unknown:
        raise ValueError(f"rows for {'.'.join(table.name())}: required column(s) missing {required}, unknown column(s) {unknown}")
    for column in missing:
        rows = rows.append_column(column, pa.nulls(rows.num_rows, column.type))
    return rows.select(schema.names).cast(schema)


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
