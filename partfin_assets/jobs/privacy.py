"""Privacy delete by primary key: one request erases the key from every table partfin writes for a table, for good.

The flow of one request (`privacy_delete`), each step idempotent, so re-running the same request
after a crash finishes it:

1. **register**: the keys (salted hashes) and the request's cutoff `erased_before` go into the
   erasure registry cdc.<table>__erasures (iceberg/erasures.py). From then on every writer leaves
   the key's changes up to the cutoff out (model/erasure.py `without_erased`): ingest, replay,
   upsert, quarantine. A change made at the source after the cutoff is new data and lands.
2. then, table by table -- cdc.<table>, cdc.<table>__rejected, base.<table>, base.<table>__rejected --
   **fence** the table at the registry's version (an empty commit: a writer that read before the
   request fails its compare-and-set and filters again, or commits before the fence and its rows
   are found by the next step) and **delete**: every data file holding a covered row (found by
   pruning on partition and column statistics, then reading only those files) is rewritten
   without it, in one UPDATE/DELETE commit, looping until a scan at the head finds none. Raw lines
   of cdc.<table>__rejected cannot be attributed to a key by parsing; those naming an erased key in
   JSON form keep their source position and lose their text.
3. **references**: `release_old_references`, the one place where refs that still point at
   snapshots from before the delete (and so keep the erased rows' files alive) are re-pointed or
   dropped.

Summaries record the request id and counts, never the keys. Older snapshots still reference the
old files until snapshot expiry and orphan-file removal (jobs/maintenance.py, `maintain_<table>`)
delete them: docs/privacy.md states when.
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
from pyiceberg.expressions import AlwaysTrue, And, BooleanExpression, In

from partfin_assets.finalization.tags import release_erased_tags
from partfin_assets.iceberg.catalog import load_existing_table
from partfin_assets.iceberg.erasures import raise_fence, register_erasure
from partfin_assets.iceberg.files import read_files
from partfin_assets.iceberg.position_deletes import positions_by_file, read_positions
from partfin_assets.iceberg.tables import EVENT_TIME, ensure_quarantine_table
from partfin_assets.jobs.conflicts import CommitConflictError
from partfin_assets.jobs.job import Hook, Job
from partfin_assets.model import summary_keys as K
from partfin_assets.model.erasure import Erasures, redact_raw_lines
from partfin_assets.model.record_keys import canonical_key, parse_key
from partfin_assets.model.summary_keys import JobKind
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.model.timeutil import now_utc, to_us

log = logging.getLogger(__name__)


MaskFn = Callable[[pa.Table], pa.Array]  # True for rows to delete
RedactFn = Callable[[pa.Table], pa.Table]  # the rows to delete as they are kept instead (their erased text removed)


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
    redact: RedactFn | None = None,
) -> DeleteResult:
    """One UPDATE/DELETE job: rewrite the files holding rows where `mask` is true (files found via `prune`).

    `prune` is an Iceberg expression true for (a superset of) the rows to delete: it only selects
    candidate files by partition and column statistics. With `redact`, those rows are rewritten as
    `redact` returns them instead of deleted. Raises CommitConflictError when a commit after the
    job's start touched one of the rewritten partitions.
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
            kept = rows.filter(pa.array(~hit & ~hidden))
            if redact is not None:
                kept = pa.concat_tables([kept, redact(rows.filter(pa.array(hit & ~hidden)))])
            add += job.write(kept)
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


def _up_to(mask: MaskFn, column: str, erased_before_us: int | None) -> MaskFn:
    """`mask`, and only rows whose `column` (an event time) is at or before the cutoff (None: any time)."""
    if erased_before_us is None:
        return mask
    cutoff = pa.scalar(erased_before_us, pa.int64())
    return lambda rows: pc.and_(mask(rows), pc.less_equal(pc.cast(rows.column(column), pa.int64()), cutoff))


def cdc_key_filter(keys: Iterable[Mapping[str, Any] | str], erased_before_us: int | None = None) -> tuple[BooleanExpression, MaskFn]:
    """Rows of cdc.<table> (or its quarantine, same columns) of these keys (canonical texts, or the key columns'
    values as the canonical key writes them), with an event time up to the cutoff."""
    texts = sorted({k if isinstance(k, str) else canonical_key(k) for k in keys})
    values = pa.array(texts, pa.string())
    return In("key", texts), _up_to(lambda rows: pc.is_in(rows.column("key"), value_set=values), "event_time", erased_before_us)


def base_key_filter(spec: TableSpec, keys: Iterable[Mapping[str, Any]], erased_before_us: int | None = None) -> tuple[BooleanExpression, MaskFn]:
    """Rows of base.<table> with these keys (the key columns' values as base holds them: `GivenKey.typed`), with an
    event time up to the cutoff."""
    pk = list(spec.primary_key)
    keys = list(keys)
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
    return prune, _up_to(mask, EVENT_TIME, erased_before_us)


def rejected_lines_filter(erasures: Erasures) -> tuple[BooleanExpression, MaskFn, RedactFn]:
    """Raw lines of cdc.<table>__rejected naming an erased key (the whole table is read: it holds only bad lines)."""

    def mask(rows: pa.Table) -> pa.Array:
        return pa.array([r is not None for r in erasures.naming_erased(rows.column("raw").to_pylist())], pa.bool_())

    return AlwaysTrue(), mask, lambda rows: redact_raw_lines(rows, erasures)[0]


def _until_gone(
    catalog: Catalog, identifier: str, prune: BooleanExpression, mask: MaskFn, request_id: str,
    max_rounds: int, before_commit: Hook | None, redact: RedactFn | None = None,
) -> list[DeleteResult]:
    """Delete until a pass finds nothing; conflicts re-run from a fresh snapshot (bounded by max_rounds)."""
    results: list[DeleteResult] = []
    conflicts = 0
    for _ in range(max_rounds):
        try:
            result = delete_where(catalog, identifier, prune, mask, request_id=request_id, before_commit=before_commit, redact=redact)
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


# the steps of one request, in order; `after_step` is called with each name once it is done
STEP_REGISTERED = "registered"
STEP_REFERENCES = "references"


@dataclass
class PrivacyDeleteResult:
    table: str
    request_id: str
    cdc: list[DeleteResult]
    base: list[DeleteResult]
    rejected: list[DeleteResult] = field(default_factory=list)  # cdc.<table>__rejected: raw lines whose text was removed
    quarantine: list[DeleteResult] = field(default_factory=list)  # base.<table>__rejected
    erased_before_us: int | None = None

    @property
    def cdc_deleted(self) -> int:
        return sum(r.deleted_records for r in self.cdc)

    @property
    def base_deleted(self) -> int:
        return sum(r.deleted_records for r in self.base)

    def by_table(self) -> dict[str, list[DeleteResult]]:
        return {f"cdc.{self.table}": self.cdc, f"cdc.{self.table}__rejected": self.rejected,
                f"base.{self.table}": self.base, f"base.{self.table}__rejected": self.quarantine}

    def deleted_by_table(self) -> dict[str, int]:
        """Records removed per table (raw lines whose text was removed, for the rejected lines)."""
        return {identifier: sum(r.deleted_records for r in results) for identifier, results in self.by_table().items()}


def privacy_delete(
    catalog: Catalog,
    name: str,
    keys: Iterable[Mapping[str, Any]],
    *,
    request_id: str | None = None,
    erased_before_us: int | None = None,
    max_rounds: int = 10,
    before_commit: Hook | None = None,
    after_step: Callable[[str], None] | None = None,
) -> PrivacyDeleteResult:
    """Erase the primary keys `keys` (e.g. [{"id": 42}]) from every table partfin writes for table `name` (see the module
    docstring): their changes with an event time up to `erased_before_us` (default: now, when the request is first
    registered; a re-run keeps the first cutoff).

    Each key is read against the key columns' declared types (model/record_keys.py `parse_key`): one that is not
    exactly one value of each raises InvalidInput before anything is written.

    Idempotent and resumable: re-running the same request after a crash finishes it. `after_step` (tests) is called
    with the name of each step once done: "registered", then each table's identifier, then "references".
    """
    request_id = request_id or uuid.uuid4().hex
    cdc = load_existing_table(catalog, f"cdc.{name}")
    spec = TableSpec.from_properties(name, cdc.properties)
    # a key that is not exactly one value of each key column's type would erase half a key, or another one:
    # refused before anything is read or recorded
    given = [parse_key(key, spec.primary_key, spec.columns, f"key #{i} for {spec.cdc_identifier}") for i, key in enumerate(keys, 1)]
    if not given:
        return PrivacyDeleteResult(name, request_id, [], [])
    step = after_step or (lambda _: None)
    now_us = to_us(now_utc())
    erasures = register_erasure(catalog, spec, request_id, [k.text for k in given],
                                erased_before_us if erased_before_us is not None else now_us, now_us)
    cutoff = max(e.erased_before_us for e in erasures.entries if e.request_id == request_id)
    # an upsert that read before the request may create the quarantine only now: it must exist to be fenced
    ensure_quarantine_table(catalog, spec)
    step(STEP_REGISTERED)

    cdc_prune, cdc_mask = cdc_key_filter([k.text for k in given], cutoff)
    base_prune, base_mask = base_key_filter(spec, [k.typed for k in given], cutoff)
    rejected_prune, rejected_mask, redact = rejected_lines_filter(erasures)
    result = PrivacyDeleteResult(name, request_id, [], [], erased_before_us=cutoff)
    for identifier, prune, mask, into, rewrite in (
        (spec.cdc_identifier, cdc_prune, cdc_mask, result.cdc, None),
        (spec.rejected_identifier, rejected_prune, rejected_mask, result.rejected, redact),
        (spec.base_identifier, base_prune, base_mask, result.base, None),
        (spec.quarantine_identifier, cdc_prune, cdc_mask, result.quarantine, None),
    ):
        if catalog.table_exists(identifier):
            raise_fence(catalog, identifier, erasures, request_id)  # from here on its writers filter the request
            into += _until_gone(catalog, identifier, prune, mask, request_id, max_rounds, before_commit, rewrite)
        step(identifier)
    release_old_references(catalog, spec, base_prune, base_mask)
    step(STEP_REFERENCES)
    return result


def release_old_references(catalog: Catalog, spec: TableSpec, base_prune: BooleanExpression, base_mask: MaskFn) -> None:
    """The one place a privacy delete re-points or drops refs (tags, branches) of the tables it rewrote that still
    point at a snapshot from before it: such a snapshot keeps the erased rows' files alive, past expiry.

    cdc.<table>'s `partfin-base-merged` tag is moved past the delete by the next upsert (every sync run upserts); the
    finalization tags of base.<table> (finalization/tags.py) whose snapshot still holds an erased row are dropped here:
    that hour is then read from the current snapshot.
    """
    if catalog.table_exists(spec.base_identifier):
        release_erased_tags(catalog, spec.base_identifier, base_prune, base_mask)
