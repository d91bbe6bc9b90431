"""One snapshot that adds and removes data files and position-delete files (Iceberg's RowDelta).

PyIceberg 0.12 reads position deletes but has no public way to commit them: its snapshot
producers write every added file into a data manifest. `RowDelta` is a snapshot producer that
writes added data files into a data manifest and added delete files into a delete manifest
(content = deletes, as the spec requires), carries the parent's manifests over, rewriting only
those that hold a removed file (kept entries as EXISTING, with their sequence numbers), and
records removed files as DELETED entries. Summary (including `partitions.<path>` entries for
delete files, which the conflict layer reads), manifest list, snapshot and the main-branch
requirement come from PyIceberg's snapshot producer, so a RowDelta commits like any other
PyIceberg snapshot inside a partfin transaction.

Added files keep their own partition spec: after partition evolution (a rebucketed base table) a
position-delete file of a partition of an older spec goes into a manifest of that spec, and the
summary names its partition as that spec does (PyIceberg's producer assumes the default spec for
every added file, which would misfile it and hide the partition from the conflict check).
"""

from __future__ import annotations

from collections import defaultdict

from pyiceberg.exceptions import ValidationException
from pyiceberg.manifest import (
    DataFile,
    DataFileContent,
    ManifestContent,
    ManifestEntry,
    ManifestEntryStatus,
    ManifestFile,
    ManifestWriter,
    ManifestWriterV2,
)
from pyiceberg.partitioning import PartitionSpec
from pyiceberg.table import TableProperties
from pyiceberg.table.snapshots import Operation, Summary, SnapshotSummaryCollector, update_snapshot_summaries
from pyiceberg.table.update.snapshot import _SnapshotProducer
from pyiceberg.utils.concurrent import ExecutorFactory

from partfin_assets.iceberg.files import spec_id_of


class _DeleteManifestWriter(ManifestWriterV2):
    """A v2 manifest of delete files (PyIceberg writes data manifests only)."""

    def content(self) -> ManifestContent:
        return ManifestContent.DELETES

    @property
    def _meta(self) -> dict[str, str]:
        return {**super()._meta, "content": "deletes"}


def _content(data_file: DataFile) -> ManifestContent:
    return ManifestContent.DATA if data_file.content == DataFileContent.DATA else ManifestContent.DELETES


class RowDelta(_SnapshotProducer["RowDelta"]):
    """Add and remove data and position-delete files in one snapshot.

    `add_file` / `remove_file` take either kind (`DataFile.content` tells). Removed files must be
    live in the parent snapshot (ValidationException otherwise).
    """

    def add_file(self, data_file: DataFile) -> RowDelta:
        if data_file.content == DataFileContent.EQUALITY_DELETES:
            raise ValueError("partfin writes position deletes only")
        self._added_data_files.append(data_file)
        return self

    def remove_file(self, data_file: DataFile) -> RowDelta:
        self._deleted_data_files.add(data_file)
        return self

    def _summary(self, snapshot_properties: dict[str, str] | None = None) -> Summary:
        """PyIceberg's summary, with every added file counted under its own partition spec."""
        metadata = self._transaction.table_metadata
        schema, specs = metadata.schema(), metadata.specs()
        limit = int(metadata.properties.get(TableProperties.WRITE_PARTITION_SUMMARY_LIMIT, TableProperties.WRITE_PARTITION_SUMMARY_LIMIT_DEFAULT))
        collector = SnapshotSummaryCollector(partition_summary_limit=limit)
        for data_file in self._added_data_files:
            collector.add_file(data_file=data_file, partition_spec=specs[spec_id_of(metadata, data_file)], schema=schema)
        for data_file in self._deleted_data_files:
            collector.remove_file(data_file=data_file, partition_spec=specs[data_file.spec_id], schema=schema)
        parent = metadata.snapshot_by_id(self._parent_snapshot_id) if self._parent_snapshot_id is not None else None
        return update_snapshot_summaries(
            summary=Summary(operation=self._operation, **collector.build(), **(snapshot_properties or {})),
            previous_summary=parent.summary if parent is not None else None,
        )

    # the abstract hooks of _SnapshotProducer; _manifests below does the work
    def _deleted_entries(self) -> list[ManifestEntry]:
        return []

    def _existing_manifests(self) -> list[ManifestFile]:
        return []

    def _writer(self, spec: PartitionSpec, content: ManifestContent) -> ManifestWriter:
        if content == ManifestContent.DATA:
            return self.new_manifest_writer(spec)
        if self._transaction.table_metadata.format_version != 2:
            raise ValueError("position deletes need an Iceberg v2 table")
        return _DeleteManifestWriter(spec, self.schema(), self.new_manifest_output(), self._snapshot_id, self._compression)

    def _manifests(self) -> list[ManifestFile]:
        metadata = self._transaction.table_metadata
        removed = {f.file_path for f in self._deleted_data_files}
        parent = metadata.snapshot_by_id(self._parent_snapshot_id) if self._parent_snapshot_id is not None else None
        parent_manifests = parent.manifests(self._io) if parent is not None else []

        def carry(manifest: ManifestFile) -> tuple[ManifestFile | None, list[ManifestEntry]]:
            """The manifest as it goes into this snapshot (None: nothing live left) and its removed entries."""
            if not (manifest.has_added_files() or manifest.has_existing_files()):
                return None, []  # only DELETED entries of an older snapshot: not carried over
            if not removed:
                return manifest, []
            entries = manifest.fetch_manifest_entry(self._io, discard_deleted=True)
            gone = [e for e in entries if e.data_file.file_path in removed]
            if not gone:
                return manifest, []
            kept = [e for e in entries if e.data_file.file_path not in removed]
            if not kept:
                return None, gone
            with self._writer(self.spec(manifest.partition_spec_id), manifest.content) as writer:
                for entry in kept:
                    writer.existing(entry)
            return writer.to_manifest_file(), gone

        carried = list(ExecutorFactory.get_or_create().map(carry, parent_manifests))
        gone = [entry for _, entries in carried for entry in entries]
        missing = removed - {e.data_file.file_path for e in gone}
        if missing:
            raise ValidationException(f"Missing required files to delete: {', '.join(sorted(missing))}")

        out = [manifest for manifest, _ in carried if manifest is not None]
        added: dict[tuple[int, ManifestContent], list[DataFile]] = defaultdict(list)
        for data_file in self._added_data_files:
            added[(spec_id_of(metadata, data_file), _content(data_file))].append(data_file)
        for (spec_id, content), files in sorted(added.items(), key=lambda kv: (kv[0][0], kv[0][1].value)):
            with self._writer(self.spec(spec_id), content) as writer:
                for data_file in files:
                    writer.add(ManifestEntry.from_args(status=ManifestEntryStatus.ADDED, snapshot_id=self._snapshot_id, data_file=data_file))
            out.append(writer.to_manifest_file())
        by_group: dict[tuple[int, ManifestContent], list[ManifestEntry]] = defaultdict(list)
        for entry in gone:
            by_group[(entry.data_file.spec_id, _content(entry.data_file))].append(entry)
        for (spec_id, content), entries in by_group.items():
            with self._writer(self.spec(spec_id), content) as writer:
                for entry in entries:
                    writer.delete(entry)
            out.append(writer.to_manifest_file())
        return out


def row_delta(transaction, snapshot_properties: dict[str, str]) -> RowDelta:
    """A RowDelta on the transaction's main branch; commit it with `with ... as delta:` (or `.commit()`)."""
    return RowDelta(
        operation=Operation.OVERWRITE,
        transaction=transaction,
        io=transaction._table.io,
        snapshot_properties=snapshot_properties,
    )


def swap_files(transaction, snapshot_properties: dict[str, str], remove: list[DataFile], add: list[DataFile]) -> None:
    """Stage one snapshot that removes `remove` and adds `add` (data or delete files), whole files only."""
    with row_delta(transaction, snapshot_properties) as delta:
        for data_file in remove:
            delta.remove_file(data_file)
        for data_file in add:
            delta.add_file(data_file)
