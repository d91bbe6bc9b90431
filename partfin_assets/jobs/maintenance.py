"""Table maintenance jobs: snapshot expiry on demand, and orphan-file removal, of every table partfin keeps for a table.

Expiry keeps what the watermark policy and resumption need (iceberg/expiry.py; the writer also
expires as it goes). Orphan removal deletes regular files under a table's location that no retained
snapshot or metadata file references, and only those older than a safety age; it never
follows a link (to a folder or a file) out of the table's folder.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import time
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from pyarrow import fs as pafs
from pyiceberg.table import Table

from partfin_assets.iceberg.catalog import load_table_if_exists
from partfin_assets.iceberg.expiry import Retention, expire_snapshots
from partfin_assets.iceberg.files import WHOLE_TABLE, delete_files
from partfin_assets.iceberg.tables import ledger_identifier
from partfin_assets.jobs.conflicts import CommitConflictError
from partfin_assets.model import summary_keys as K
from partfin_assets.model.faults import faults
from partfin_assets.model.stats import CommitWindow
from partfin_assets.model.summary_keys import JobKind
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.watermark.registry import table_policy

log = logging.getLogger(__name__)


def policy_window(table: Table) -> CommitWindow:
    """The window of the table's watermark policy (the last commit for tables without one, e.g. base.<table>)."""
    if K.PROP_WATERMARK_POLICY not in table.properties:
        return CommitWindow(commits=1)
    return table_policy(table.properties).window


def expire_table_snapshots(catalog, identifier: str, retention: Retention | None = None) -> int:
    """Expire snapshots of one table now (no slack), keeping what the watermark policy and writers need."""
    table = catalog.load_table(identifier)
    retention = retention or Retention()
    return expire_snapshots(table, dataclasses.replace(retention, slack=0), policy_window(table))


@dataclass(frozen=True)
class MaintainedTable:
    identifier: str
    layer: str  # "cdc" | "base": the layer (and Dagster asset) it belongs to
    kind: str  # "rows" (cdc, base) | "ledger" | "rejected" (raw lines, quarantined changes)

    def retention(self, retention: Retention) -> Retention:
        """What expiry keeps of this table. Only cdc and base snapshots carry summaries read back later (checkpoints,
        policy windows); the rejected tables keep only their current snapshot (bad input nobody reads back in time), so
        the files a privacy request rewrote there go at the next maintenance."""
        if self.kind == "rejected":
            return Retention(keep_last=1, summaries=False)
        if self.kind == "ledger":
            return dataclasses.replace(retention, summaries=False)
        return retention


def maintained_tables(catalog, name: str) -> list[MaintainedTable]:
    """Every table partfin keeps for `name` that exists, in maintenance order: cdc.<name>, its late-data ledger
    and rejected lines, base.<name> and its quarantined changes (none when cdc.<name> does not exist)."""
    cdc = load_table_if_exists(catalog, f"cdc.{name}")
    if cdc is None:
        return []
    spec = TableSpec.from_properties(name, cdc.properties)
    candidates = [
        MaintainedTable(spec.cdc_identifier, "cdc", "rows"),
        MaintainedTable(ledger_identifier(spec.cdc_identifier), "cdc", "ledger"),
        MaintainedTable(spec.rejected_identifier, "cdc", "rejected"),
        MaintainedTable(spec.base_identifier, "base", "rows"),
        MaintainedTable(spec.quarantine_identifier, "base", "rejected"),
    ]
    return [t for t in candidates if catalog.table_exists(t.identifier)]


def _normalize(path: str) -> str:
    """A comparable form of a file location (`file:///x`, `/x` and `file:/x` all give `/x`)."""

    parsed = urlparse(path)
    if parsed.scheme in ("", "file"):
        return unquote(parsed.path) if parsed.scheme else path
    return f"{parsed.scheme}://{parsed.netloc}{parsed.path}"


def referenced_files(table: Table) -> set[str]:
    """Every file a retained snapshot or the metadata references (normalized paths).

    Metadata files (current and logged), statistics files, every retained snapshot's manifest
    list, its manifests and the data/delete files live in them. Read from metadata and
    manifests only.
    """
    metadata = table.metadata
    out = {_normalize(table.metadata_location)} if table.metadata_location else set()
    out |= {_normalize(entry.metadata_file) for entry in metadata.metadata_log}
    for stats in list(getattr(metadata, "statistics", []) or []) + list(getattr(metadata, "partition_statistics", []) or []):
        out.add(_normalize(stats.statistics_path))
    seen_manifests: set[str] = set()
    for snapshot in metadata.snapshots:
        out.add(_normalize(snapshot.manifest_list))
        for manifest in snapshot.manifests(table.io):
            if manifest.manifest_path in seen_manifests:
                continue
            seen_manifests.add(manifest.manifest_path)
            out.add(_normalize(manifest.manifest_path))
            for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
                out.add(_normalize(entry.data_file.file_path))
    return out


_REFERENCE_ATTEMPTS = 20


def _referenced_files_of_current(catalog, identifier: str, table: Table) -> set[str]:
    """`referenced_files` of the table as loaded, or of a fresher load when a commit expired snapshots meanwhile.

    A writer expires snapshots as it commits, deleting their manifest lists; a manifest list missing from the
    metadata in hand is such an expiry when the table's metadata has moved on since, and the fresh metadata (still
    loaded after the listing) no longer names it. A manifest list missing from the current metadata is not a race.
    """
    for _ in range(_REFERENCE_ATTEMPTS):
        try:
            return referenced_files(table)
        except FileNotFoundError:
            fresh = catalog.load_table(identifier)
            if fresh.metadata_location == table.metadata_location:
                raise
            log.info("%s: snapshots expired while their files were listed; listing them again on fresh metadata", identifier)
            table = fresh
    raise CommitConflictError(
        identifier, JobKind.MERGE, "orphan-removal", [WHOLE_TABLE], table.metadata.current_snapshot_id,
        reason=f"snapshots expired under each of {_REFERENCE_ATTEMPTS} reads of what the retained snapshots reference",
    )


@dataclass(frozen=True)
class StoredFile:
    path: str  # normalized
    size: int
    mtime_s: float


def list_table_files(location: str) -> list[StoredFile]:
    """Every regular file under a table location (any pyarrow filesystem: local, S3, GCS, HDFS...).

    Links are never followed, nor listed: a link to a folder or a file elsewhere is no file of the table.
    """

    filesystem, root = pafs.FileSystem.from_uri(location)
    if isinstance(filesystem, pafs.LocalFileSystem):
        return _list_local_files(root)  # pyarrow's recursive listing follows links to folders
    try:
        infos = filesystem.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    except FileNotFoundError:
        return []
    scheme_prefix = ""
    if "://" in location and not location.startswith("file:"):
        scheme_prefix = location.split("://", 1)[0] + "://"
    out = []
    for info in infos:
        if info.type != pafs.FileType.File:
            continue
        mtime = info.mtime.timestamp() if info.mtime is not None else 0.0
        out.append(StoredFile(_normalize(scheme_prefix + info.path), info.size or 0, mtime))
    return out


def _list_local_files(root: str) -> list[StoredFile]:
    out = []
    for folder, _, names in os.walk(root, followlinks=False):  # a link to a folder is never entered
        for name in names:
            path = os.path.join(folder, name)
            try:
                info = os.lstat(path)
            except FileNotFoundError:  # deleted meanwhile (a failed job cleaning up)
                continue
            if stat.S_ISREG(info.st_mode):  # a link (to a file anywhere) is not one
                out.append(StoredFile(path, info.st_size, info.st_mtime))
    return out


@dataclass
class OrphanReport:
    table: str
    scanned: int
    referenced: int
    orphans: list[str]  # deleted (or that would be, on a dry run)
    too_young: list[str]  # unreferenced but younger than the safety age: kept
    dry_run: bool = False
    bytes_orphaned: int = 0


DEFAULT_ORPHAN_AGE_S = 3600.0


def remove_orphan_files(
    catalog, identifier: str, *, older_than_s: float = DEFAULT_ORPHAN_AGE_S, dry_run: bool = False, now_s: float | None = None
) -> OrphanReport:
    """Delete files under the table location that no retained snapshot or metadata references.

    A file younger than `older_than_s` is never deleted: it may belong to a job still writing
    (its files exist before its commit references them). Files are listed first and the
    metadata is loaded afterwards, so a commit landing during the scan only adds references.
    """

    table = catalog.load_table(identifier)
    files = list_table_files(table.metadata.location)
    table = catalog.load_table(identifier)  # after listing: anything committed meanwhile is referenced
    faults().pause_point("orphans-after-load")
    referenced = _referenced_files_of_current(catalog, identifier, table)
    now_s = time.time() if now_s is None else now_s
    report = OrphanReport(identifier, len(files), len(referenced), [], [], dry_run)
    for stored in files:
        if stored.path in referenced:
            continue
        if now_s - stored.mtime_s < older_than_s:
            report.too_young.append(stored.path)
            continue
        report.orphans.append(stored.path)
        report.bytes_orphaned += stored.size
    if not dry_run:
        delete_files(table.io, report.orphans)
    log.info("%s: %d orphan file(s) %s, %d too young to judge", identifier, len(report.orphans),
             "found" if dry_run else "deleted", len(report.too_young))
    return report
