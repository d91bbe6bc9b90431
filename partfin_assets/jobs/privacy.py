"""Privacy delete by primary key across cdc.<table> and base.<table>: UPDATE/DELETE jobs (DESIGN §6).

Iceberg commits one table at a time, so the two tables cannot change atomically
together. The delete is made **idempotent and resumable** instead:

1. cdc.<table> first: every data file that holds a row of the keys (found by
   pruning on partition and column statistics, then reading only those files)
   is rewritten without those rows, in one UPDATE/DELETE commit.
2. then base.<table>: the same for the rows of those primary keys (tombstones
   included) in the buckets that hold them.

cdc first, because the upsert feeds base from cdc: once the keys are gone from
cdc no later upsert can bring them back into base (an upsert planned before
step 1 that commits after step 2 conflicts on the key's bucket and recomputes).
A crash between the steps leaves the keys in base only; re-running the same
request skips cdc (nothing left to delete, no commit) and finishes base. Each
step loops until a scan at the head finds none of the keys (a concurrent append
into another partition may bring the key back after the step's start; a
conflict in a partition re-runs the step from a fresh snapshot, bounded).

Summaries record the request id and counts, never the keys. Older snapshots
still reference the old files until snapshot expiry and orphan-file removal
(jobs/maintenance.py) delete them; a hard erase runs those after the delete.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog
from pyiceberg.expressions import And, BooleanExpression, In

from partfin_assets.finalization.tags import release_erased_tags
from partfin_assets.iceberg.catalog import load_existing_table
from partfin_assets.iceberg.files import read_files
from partfin_assets.iceberg.position_deletes import positions_by_file, read_positions
from partfin_assets.jobs.conflicts import CommitConflictError
from partfin_assets.jobs.job import Hook, Job
from partfin_assets.model import summary_keys as K
from partfin_assets.model.errors import InvalidInput
from partfin_assets.model.record_keys import canonical_key
from partfin_assets.model.summary_keys import JobKind
from partfin_assets.model.tablespec import TableSpec

log = logging.getLogger(__name__)


MaskFn = Callable[[pa.Table], pa.Array]  # True for rows to delete


@dataclass
class DeleteResult:
    table: str
    job_id: str
    snapshot_id: int | None  # None: nothing matched, nothing committed
    deleted_records: int
    files_rewritten: int
    partitions: list[str] = field(default_factory=list)


def delete_where(
    catalog: Catalog,
    identifier: str,
    prune: BooleanExpression,
    mask: MaskFn,
    *,
    request_id: str | None = None,
    job_id: str | None = None,
    before_commit: Hook | None = None,
) -> DeleteResult:
    """One UPDATE/DELETE job: rewrite the files holding rows where `mask` is true (files found via `prune`).

    `prune` is an Iceberg expression true for (a superset of) the rows to delete: it only selects
    candidate files by partition and column statistics. Raises CommitConflictError when a commit
    after the job's start touched one of the rewritten partitions.
    """
    with Job.start(catalog, identifier, JobKind.UPDATE_DELETE, job_id=job_id, before_commit=before_commit) as job:
        table = job.table
        result = DeleteResult(identifier, job.job_id, None, 0, 0)
        if job.start_snapshot_id is None:
            job.abort()
            return result
        tasks = table.scan(row_filter=prune, snapshot_id=job.start_snapshot_id).plan_files()
        remove, add = [], []
        for task in tasks:
            # Every physical row of the key goes, old versions a position delete hides included:
            # erasure means not in any live file, not only invisible.
            rows = read_files(table, [task.file], deletes=[])
            hit = mask(rows).to_numpy(zero_copy_only=False)
            if not hit.any():
                continue
            hidden = np.zeros(rows.num_rows, dtype=bool)
            hidden[positions_by_file(read_positions(table.io, task.delete_files)).get(task.file.file_path, np.array([], np.int64))] = True
            remove.append(task.file)
            add += job.write(rows.filter(pa.array(~hit & ~hidden)))
            result.deleted_records += int((hit & ~hidden).sum())
        if not remove:
            job.abort()
            return result
        result.files_rewritten = len(remove)
        summary = {K.PRIVACY_DELETED_RECORDS: str(result.deleted_records)}
        if request_id:
            summary[K.PRIVACY_REQUEST_ID] = request_id
        committed = job.commit_replace(remove, add, summary)
        result.snapshot_id = committed.snapshot_id
        result.partitions = committed.partitions
        return result


# --------------------------------------------------------------------------- by primary key


def cdc_key_filter(keys: Iterable[Mapping[str, Any]]) -> tuple[BooleanExpression, MaskFn]:
    texts = sorted({canonical_key(k) for k in keys})
    values = pa.array(texts, pa.string())
    return In("key", texts), lambda rows: pc.is_in(rows.column("key"), value_set=values)


def base_key_filter(spec: TableSpec, keys: Iterable[Mapping[str, Any]]) -> tuple[BooleanExpression, MaskFn]:
    pk = list(spec.primary_key)
    keys = list(keys)
    for key in keys:
        if set(key) != set(pk):
            raise InvalidInput(f"key {dict(key)} does not name exactly the primary key {pk} of {spec.name}")
    columns = {c: pa.array([k[c] for k in keys], spec.columns.get(c)) for c in pk}
    prune: BooleanExpression | None = None
    for c in pk:
        expression = In(c, sorted(set(columns[c].to_pylist())))
        prune = expression if prune is None else And(prune, expression)
    wanted = pl.DataFrame({c: pl.from_arrow(columns[c]) for c in pk}).unique()

    def mask(rows: pa.Table) -> pa.Array:
        frame = pl.from_arrow(rows.select(pk))
        assert isinstance(frame, pl.DataFrame)
        frame = frame.with_row_index("__row")
        hits = frame.join(wanted.cast({c: frame.schema[c] for c in pk}), on=pk, how="semi").get_column("__row")
        out = pl.Series([False] * rows.num_rows)
        if hits.len():
            out = out.scatter(hits, True)
        return out.to_arrow()

    assert prune is not None
    return prune, mask


def _until_gone(
    catalog: Catalog, identifier: str, prune: BooleanExpression, mask: MaskFn, request_id: str,
    max_rounds: int, before_commit: Hook | None,
) -> list[DeleteResult]:
    """Delete until a pass finds nothing; conflicts re-run from a fresh snapshot (bounded by max_rounds)."""
    results: list[DeleteResult] = []
    conflicts = 0
    for _ in range(max_rounds):
        try:
            result = delete_where(catalog, identifier, prune, mask, request_id=request_id, before_commit=before_commit)
        except CommitConflictError as exc:
            conflicts += 1
            log.info("privacy delete %s: %s; re-running", request_id, exc)
            continue
        if result.snapshot_id is None:
            return results
        results.append(result)
    raise CommitConflictError(
        identifier, JobKind.UPDATE_DELETE, request_id, [], None,
        reason=f"privacy delete still finds rows after {max_rounds} rounds ({conflicts} conflict(s)); re-run it",
    )


@dataclass
class PrivacyDeleteResult:
    table: str
    request_id: str
    cdc: list[DeleteResult]
    base: list[DeleteResult]

    @property
    def cdc_deleted(self) -> int:
        return sum(r.deleted_records for r in self.cdc)

    @property
    def base_deleted(self) -> int:
        return sum(r.deleted_records for r in self.base)


def privacy_delete(
    catalog: Catalog,
    name: str,
    keys: Iterable[Mapping[str, Any]],
    *,
    request_id: str | None = None,
    max_rounds: int = 10,
    before_commit: Hook | None = None,
    between_tables: Callable[[], None] | None = None,
) -> PrivacyDeleteResult:
    """Delete every row of the primary keys `keys` (e.g. [{"id": 42}]) from cdc.<name>, then base.<name>.

    Idempotent and resumable: re-running the same request after a crash finishes it.
    """
    keys = [dict(k) for k in keys]
    request_id = request_id or uuid.uuid4().hex
    cdc = load_existing_table(catalog, f"cdc.{name}")
    spec = TableSpec.from_properties(name, cdc.properties)
    if not keys:
        return PrivacyDeleteResult(name, request_id, [], [])
    prune, mask = cdc_key_filter(keys)
    cdc_results = _until_gone(catalog, spec.cdc_identifier, prune, mask, request_id, max_rounds, before_commit)
    if between_tables is not None:
        between_tables()
    base_results: list[DeleteResult] = []
    if catalog.table_exists(spec.base_identifier):
        prune, mask = base_key_filter(spec, keys)
        base_results = _until_gone(catalog, spec.base_identifier, prune, mask, request_id, max_rounds, before_commit)
        release_erased_tags(catalog, spec.base_identifier, prune, mask)  # a tag would keep erased rows readable
    return PrivacyDeleteResult(name, request_id, cdc_results, base_results)
