"""Table maintenance: snapshot expiry that keeps what the watermark policy and resumption need.

Commit cost in PyIceberg grows with the snapshots kept in table metadata, so a
streaming writer expires old snapshots as it goes. Never expired: the newest
`keep_last` snapshots of main, the last `lookback` stats-bearing commits (the
policy's window), the newest checkpoint of every writer (its resume position),
and anything a branch or tag points at (the upsert tags the CDC snapshot it
merged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pyiceberg.exceptions import CommitFailedException
from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata

from partfin_assets.core import summary_keys as K
from partfin_assets.core.commit import delete_files
from partfin_assets.core.history import commit_stats, lineage, summary_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retention:
    keep_last: int = 10  # newest snapshots of main always kept
    slack: int = 10  # expire only once this many more piled up: one expiry commit per `slack` checkpoints

    def __post_init__(self) -> None:
        if self.keep_last < 1 or self.slack < 0:
            raise ValueError(f"retention needs keep_last >= 1 and slack >= 0, got {self}")


def protected_snapshot_ids(metadata: TableMetadata, keep_last: int, lookback: int) -> set[int]:
    keep: set[int] = {ref.snapshot_id for ref in metadata.refs.values()}
    stats_seen = 0
    writers_seen: set[str] = set()
    for position, snapshot in enumerate(lineage(metadata)):
        summary = summary_of(snapshot)
        if position < keep_last:
            keep.add(snapshot.snapshot_id)
        if stats_seen < lookback and commit_stats(summary) is not None:
            stats_seen += 1
            keep.add(snapshot.snapshot_id)
        writer = summary.get(K.WRITER_ID)
        if writer is not None and writer not in writers_seen:
            writers_seen.add(writer)
            keep.add(snapshot.snapshot_id)
    return keep


def expire_snapshots(table: Table, retention: Retention, lookback: int) -> int:
    """Expire what retention allows once enough piled up; returns how many snapshots were expired.

    `table` is the caller's freshly committed view of the table.
    """
    snapshots = table.metadata.snapshots
    if len(snapshots) <= retention.keep_last + retention.slack:
        return 0
    keep = protected_snapshot_ids(table.metadata, retention.keep_last, lookback)
    expired = [s for s in snapshots if s.snapshot_id not in keep]
    if not expired:
        return 0
    try:
        # Removing old snapshot ids commutes with any concurrent commit (those only add newer
        # snapshots), so this metadata-only commit needs no retry loop: a lost race just
        # leaves expiry to the next checkpoint.
        table.maintenance.expire_snapshots().by_ids([s.snapshot_id for s in expired]).commit()
    except CommitFailedException:
        log.info("snapshot expiry on %s lost a race with a concurrent commit; retried next time", table.name())
        return 0
    # A manifest list belongs to exactly one snapshot: gone with it.
    delete_files(table.io, [s.manifest_list for s in expired])
    return len(expired)


# --------------------------------------------------------------------------- standalone maintenance jobs


def policy_lookback(table: Table) -> int:
    """X of the table's watermark policy (1 for tables without one, e.g. base.<table>)."""
    from partfin_assets.core.watermark import WatermarkPolicy

    if K.PROP_WATERMARK_POLICY not in table.properties:
        return 1
    return WatermarkPolicy.parse(table.properties.get(K.PROP_WATERMARK_POLICY)).lookback


def expire_table_snapshots(catalog, identifier: str, retention: Retention | None = None) -> int:
    """Expire snapshots of one table now (no slack), keeping what the watermark policy and writers need."""
    table = catalog.load_table(identifier)
    retention = retention or Retention()
    return expire_snapshots(table, Retention(keep_last=retention.keep_last, slack=0), policy_lookback(table))


def _normalize(path: str) -> str:
    """A comparable form of a file location (`file:///x`, `/x` and `file:/x` all give `/x`)."""
    from urllib.parse import unquote, urlparse

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


@dataclass(frozen=True)
class StoredFile:
    path: str  # normalized
    size: int
    mtime_s: float


def list_table_files(location: str) -> list[StoredFile]:
    """Every file under a table location (any pyarrow filesystem: local, S3, GCS, HDFS...)."""
    from pyarrow import fs as pafs

    filesystem, root = pafs.FileSystem.from_uri(location)
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
    import time as _time

    table = catalog.load_table(identifier)
    files = list_table_files(table.metadata.location)
    table = catalog.load_table(identifier)  # after listing: anything committed meanwhile is referenced
    referenced = referenced_files(table)
    now_s = _time.time() if now_s is None else now_s
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
