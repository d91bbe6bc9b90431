"""Data files of a table: the partition each one belongs to, the live ones of a snapshot, their rows, deletion.

partfin writes copy-on-write (no delete files), so a snapshot's rows are exactly the rows of
its live data files.
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa
from pyiceberg.expressions import AlwaysTrue
from pyiceberg.io import FileIO
from pyiceberg.io.pyarrow import ArrowScan
from pyiceberg.manifest import DataFile
from pyiceberg.table import FileScanTask, Table
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.transforms import HourTransform
from pyiceberg.typedef import Record


def delete_files(io: FileIO, paths: list[str]) -> None:
    """Remove data files of a commit that will never land, so a failed job leaves nothing behind."""
    for path in paths:
        try:
            io.delete(path)
        except FileNotFoundError:
            pass


WHOLE_TABLE = "*"  # the target / touched "partition" of an unpartitioned table, or "unknown: assume all"


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
    return partition_path_of_values(metadata, [hour_us // 3_600_000_000])


def live_files(table: Table, snapshot_id: int | None = None, partitions: Iterable[str] | None = None) -> dict[str, list[DataFile]]:
    """Live data files of a snapshot (default: the current one) grouped by partition path (manifests only)."""
    metadata = table.metadata
    snapshot = metadata.snapshot_by_id(snapshot_id) if snapshot_id is not None else metadata.current_snapshot()
    wanted = set(partitions) if partitions is not None else None
    out: dict[str, list[DataFile]] = {}
    if snapshot is None:
        return out
    for manifest in snapshot.manifests(table.io):
        for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
            data_file = entry.data_file
            path = partition_path(metadata, data_file)
            if wanted is not None and path not in wanted and WHOLE_TABLE not in wanted:
                continue
            out.setdefault(path, []).append(data_file)
    return out


def read_files(table: Table, files: Iterable[DataFile]) -> pa.Table:
    """The rows of some data files (no delete files: partfin writes copy-on-write)."""
    metadata = table.metadata
    tasks = [FileScanTask(f) for f in files]
    if not tasks:
        return metadata.schema().as_arrow().empty_table()
    return ArrowScan(metadata, table.io, metadata.schema(), AlwaysTrue()).to_table(tasks)
