"""The commit layer every partfin write goes through.

PyIceberg 0.12 retries failed commits itself and re-applies a stale
`set_properties` on top of newer metadata, which can move a watermark back.
partfin tables therefore set `commit.retry.num-retries=0` and this layer owns
the retry: on every attempt it reloads the table and calls `build` again, so
everything derived from the table (watermark, dedupe, conflict checks) is
recomputed on the metadata the commit will be validated against. The snapshot
requirement PyIceberg attaches (main must still be at the head we read) makes
each attempt a real compare-and-set.

An attempt whose outcome is unknown (the catalog call raised something other
than CommitFailedException) is resolved by looking for its commit id in the
snapshot history, never by guessing.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

import pyarrow as pa

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.io import FileIO
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table, Transaction
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Snapshot
from pyiceberg.table.update import (
    AssertRefSnapshotId,
    RemoveSnapshotRefUpdate,
    RemoveSnapshotsUpdate,
    TableUpdate,
    _apply_table_update,
    _TableMetadataUpdateContext,
    _update_table_metadata_log,
)
from pyiceberg.utils.datetime import datetime_to_millis

from partfin_assets.iceberg.files import conform_rows, delete_files, write_data_files
from partfin_assets.iceberg.history import find_commit
from partfin_assets.model import summary_keys as K
from partfin_assets.model.errors import PartfinError
from partfin_assets.model.summary_keys import JobKind

log = logging.getLogger(__name__)


# Table properties every partfin table carries (set at creation, re-asserted by writers).
MANAGED_TABLE_PROPERTIES = {
    "commit.retry.num-retries": "0",  # this layer retries, recomputing on fresh metadata
    # one metadata.json per commit would pile up forever in a streaming table
    "write.metadata.delete-after-commit.enabled": "true",
    "write.metadata.previous-versions-max": "20",
    # per-partition counts in each snapshot summary: partition metadata without reading manifests
    "write.summary.partition-limit": "200",
    # one manifest per checkpoint would make every commit re-list them all: merge as they pile up
    "commit.manifest-merge.enabled": "true",
}


class CommitRetriesExhausted(PartfinError, RuntimeError):
    """Every attempt to commit lost a race with another writer; nothing of this commit is visible."""


@dataclass(frozen=True)
class CommitResult:
    table: Table
    snapshot: Snapshot | None  # None when build decided there was nothing to commit
    attempts: int


BuildFn = Callable[[Table, str], Transaction | None]


@dataclass
class AttemptFiles:
    """The data files a commit's current attempt wrote (`commit_with_retry(files=...)` owns their fate).

    An attempt that loses its race, or fails, never lands: its files are deleted before the next
    attempt builds (which writes its own), so a retried commit leaves nothing behind.
    """

    written: list[DataFile] = field(default_factory=list)
    io: FileIO | None = None

    def append(self, tx: Transaction, table: Table, rows: pa.Table, snapshot_properties: dict[str, str]) -> None:
        """Stage `rows` as new data files of `table` in `tx`, as `Transaction.append` does, keeping track of the files."""
        self.write(table, rows)
        with tx.update_snapshot(snapshot_properties=snapshot_properties).merge_append() as append:
            for data_file in self.written:
                append.append_data_file(data_file)

    def write(self, table: Table, rows: pa.Table) -> list[DataFile]:
        """Write `rows` as data files of `table` for this attempt (staged by the caller)."""
        self.io = table.io
        files = list(write_data_files(table, conform_rows(table, rows))) if rows.num_rows else []
        self.written.extend(files)
        return files

    def discard(self) -> None:
        if self.written and self.io is not None:
            delete_files(self.io, [f.file_path for f in self.written])
        self.written = []

    def keep(self) -> None:
        self.written = []


def new_commit_id() -> str:
    return uuid.uuid4().hex


def updated_metadata(base: TableMetadata, updates: tuple[TableUpdate, ...], metadata_location: str | None = None) -> TableMetadata:
    """PyIceberg's `update_table_metadata` for an existing table, without its closing deep copy of the result.

    Every update PyIceberg applies copies what it changes and shares the rest (its models are frozen), so the deep
    copy only duplicates the retained snapshots and properties: about a third of a small checkpoint's commit, twice
    per commit (the transaction's view and the catalog's). partfin never mutates metadata in place either.
    """
    context = _TableMetadataUpdateContext()
    new = base
    for update in updates:
        new = _apply_table_update(update, new, context)
    if context.has_changes():
        if metadata_location:
            new = _update_table_metadata_log(new, metadata_location, base.last_updated_ms)
        if base.last_updated_ms == new.last_updated_ms:
            new = new.model_copy(update={"last_updated_ms": datetime_to_millis(datetime.now().astimezone())})
    new.spec().check_compatible(new.schema())
    new.sort_order().check_compatible(new.schema())
    return new


class PartfinTransaction(Transaction):
    """A PyIceberg Transaction that derives its pending metadata once per staged change.

    PyIceberg 0.12 rebuilds and deep-copies the whole table metadata on every read of
    `Transaction.table_metadata`, about 16 times per append; with partfin's event-time
    entries in every retained snapshot summary that was a fifth of each commit's time.
    The result depends only on the base metadata and the staged updates, so it is kept
    until either changes (both are replaced, never mutated, when something is staged).
    With nothing staged it is the base metadata itself, as `Table.metadata` hands it out.
    """

    _cached: tuple[TableMetadata, tuple[TableUpdate, ...], TableMetadata] | None = None

    @property
    def table_metadata(self) -> TableMetadata:
        base, updates = self._table.metadata, self._updates
        if not updates:
            return base
        if self._cached is None or self._cached[0] is not base or self._cached[1] is not updates:
            self._cached = (base, updates, updated_metadata(base, updates))
        return self._cached[2]


def new_transaction(table: Table) -> Transaction:
    """The transaction every partfin commit stages its changes in."""
    return PartfinTransaction(table)


def commit_with_retry(
    catalog: Catalog,
    identifier: str,
    build: BuildFn,
    *,
    commit_id: str | None = None,
    max_attempts: int = 50,
    base_wait_s: float = 0.02,
    max_wait_s: float = 1.0,
    files: AttemptFiles | None = None,
) -> CommitResult:
    """Commit the transaction `build(fresh_table, commit_id)` returns, retrying on concurrent commits.

    `build` must put `commit_id` into the snapshot summary (key partfin.commit-id) of the
    snapshot it produces, and may return None to commit nothing. Data files it writes through
    `files` are deleted when its attempt does not land.
    """
    commit_id = commit_id or new_commit_id()
    files = files or AttemptFiles()
    try:
        for attempt in range(1, max_attempts + 1):
            table = catalog.load_table(identifier)
            start_snapshot_id = table.metadata.current_snapshot_id
            transaction = build(table, commit_id)
            if transaction is None:
                files.discard()
                return CommitResult(table, None, attempt)
            try:
                committed = transaction.commit_transaction()
                files.keep()
                return CommitResult(committed, committed.current_snapshot(), attempt)
            except CommitFailedException:
                log.debug("commit %s on %s lost a race (attempt %d); retrying", commit_id, identifier, attempt)
                files.discard()
            except Exception:
                # Unknown outcome: the write may have landed. Only the history can tell.
                landed = find_commit(catalog.load_table(identifier), commit_id, start_snapshot_id)
                if landed is None:
                    raise
                log.warning("commit %s on %s reported an error but landed as snapshot %s", commit_id, identifier, landed.snapshot_id)
                files.keep()
                return CommitResult(catalog.load_table(identifier), landed, attempt)
            wait = min(max_wait_s, base_wait_s * 2 ** min(attempt, 10))
            time.sleep(random.uniform(0.5, 1.0) * wait)
    finally:
        files.discard()  # an attempt that raised (or the last one, when retries ran out) never landed
    raise CommitRetriesExhausted(f"{identifier}: gave up after {max_attempts} concurrent-commit retries (commit {commit_id})")


def set_table_properties(catalog: Catalog, identifier: str, properties: dict[str, str]) -> Table:
    """A property-only commit, retried like any other (the catalog applies it to the then current metadata)."""

    def build(table: Table, commit_id: str) -> Transaction:
        tx = new_transaction(table)
        tx.set_properties(properties)
        return tx

    return commit_with_retry(catalog, identifier, build).table


def ensure_managed_properties(catalog: Catalog, identifier: str) -> Table:
    """Re-assert partfin's table properties (a table created elsewhere, or an older partfin)."""
    table = catalog.load_table(identifier)
    missing = {k: v for k, v in MANAGED_TABLE_PROPERTIES.items() if table.properties.get(k) != v}
    if missing:
        with new_transaction(table) as tx:
            tx.set_properties(missing)
        table = catalog.load_table(identifier)
    return table


def snapshot_summary_with_commit_id(summary: dict[str, str], commit_id: str, kind: JobKind) -> dict[str, str]:
    return {**summary, K.COMMIT_ID: commit_id, K.JOB_KIND: kind.value}


def remove_snapshots(table: Table, expired: list[Snapshot], refs: tuple[str, ...] = ()) -> int:
    """Remove these snapshots and `refs` of `table` (a compare-and-set on its refs); returns how many snapshots,
    0 on a lost race."""
    # The catalog applies the removal to whatever metadata is current when it commits: a
    # concurrent expiry may have removed some of these snapshots already (PyIceberg then fails
    # the whole update), and a tag moved meanwhile (the upsert's) would be dropped with its
    # snapshot. So the removal is a compare-and-set on every ref as this view saw it; a lost
    # race just leaves expiry to the next checkpoint.
    unchanged = tuple(AssertRefSnapshotId(ref=name, snapshot_id=ref.snapshot_id) for name, ref in table.metadata.refs.items())
    updates: tuple[TableUpdate, ...] = tuple(RemoveSnapshotRefUpdate(ref_name=name) for name in refs)
    if expired:
        updates += (RemoveSnapshotsUpdate(snapshot_ids=[s.snapshot_id for s in expired]),)
    try:
        new_transaction(table)._apply(updates, unchanged).commit_transaction()
    except CommitFailedException:
        log.info("snapshot expiry on %s lost a race with a concurrent commit; retried next time", table.name())
        return 0
    # A manifest list belongs to exactly one snapshot: gone with it.
    delete_files(table.io, [s.manifest_list for s in expired])
    return len(expired)
