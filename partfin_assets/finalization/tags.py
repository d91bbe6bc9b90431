"""Finalized hours as Iceberg tags on base.<table>: what any engine can read, not only Dagster.

Each finalization of hour H tags the base snapshot its `finalized_<table>` event names
`finalized-YYYY-MM-DD-HH` (UTC); each amendment of H (late records reached H after it was final) tags
the snapshot that carries them `finalized-YYYY-MM-DD-HH-amend-N`, N = 1, 2, ... So
`SELECT ... FROM base.t FOR VERSION AS OF 'finalized-2026-12-03-06'` (Spark, Trino) reads H exactly as
it was final, tomorrow as today, and the newest `-amend-N` tag of H is its newest final state.

Tagging is idempotent: a tag of H that already points at the snapshot is kept, and the first
finalization's tag of H never moves (its event is recorded once too). Every tag carries
`max-ref-age-ms` (table property `partfin.finalized-tag.max-age`, default 7 days): snapshot expiry
drops older tags (iceberg/expiry.py) and keeps what younger ones point at. Each kept tag keeps its
snapshot, and so its files, and PyIceberg's commit cost grows with the snapshots a table's metadata
holds: hence days, not months, by default.

A privacy delete drops the tags whose snapshot still holds one of the erased keys
(release_erased_tags): otherwise those snapshots, never expired, would keep the erased rows readable.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.expressions import BooleanExpression
from pyiceberg.table import Table, Transaction
from pyiceberg.table.refs import SnapshotRefType
from pyiceberg.table.update.snapshot import ManageSnapshots

from partfin_assets.iceberg.commit import commit_with_retry, new_transaction
from partfin_assets.iceberg.files import read_files
from partfin_assets.model.table_options import FINALIZED_TAG_MAX_AGE
from partfin_assets.model.timeutil import floor_hour_us, from_us, to_us

log = logging.getLogger(__name__)

TAG_PREFIX = "finalized-"
_TAG_HOUR_FORMAT = "%Y-%m-%d-%H"  # UTC
_TAG = re.compile(r"^finalized-(\d{4}-\d{2}-\d{2}-\d{2})(?:-amend-(\d+))?$")
DEFAULT_TAG_MAX_AGE = timedelta(microseconds=FINALIZED_TAG_MAX_AGE.default_value)


@dataclass(frozen=True)
class FinalizedTag:
    name: str
    hour_us: int
    amendment: int  # 0: the finalization, N: its N-th amendment
    snapshot_id: int


def tag_name(hour_us: int, amendment: int = 0) -> str:
    name = TAG_PREFIX + from_us(floor_hour_us(hour_us)).strftime(_TAG_HOUR_FORMAT)
    return f"{name}-amend-{amendment}" if amendment else name


def parse_tag(name: str, snapshot_id: int) -> FinalizedTag | None:
    match = _TAG.match(name)
    if match is None:
        return None
    hour, amendment = match.groups()
    return FinalizedTag(name, to_us(datetime.strptime(hour, _TAG_HOUR_FORMAT).replace(tzinfo=UTC)), int(amendment or 0), snapshot_id)


def finalized_tags(table: Table) -> list[FinalizedTag]:
    """The finalization tags of a base table, by hour, then amendment."""
    tags = [parse_tag(name, ref.snapshot_id) for name, ref in table.metadata.refs.items() if ref.snapshot_ref_type == SnapshotRefType.TAG]
    return sorted((t for t in tags if t is not None), key=lambda t: (t.hour_us, t.amendment))


def tag_max_age_ms(table: Table) -> int:
    return FINALIZED_TAG_MAX_AGE.read(table.properties) // 1000


@dataclass(frozen=True)
class Finalization:
    hour_us: int
    snapshot_id: int
    amendment: bool


def _new_tags(table: Table, finalizations: Iterable[Finalization]) -> list[FinalizedTag]:
    """The tags these finalizations still need on `table`."""
    tags = finalized_tags(table)
    new: list[FinalizedTag] = []
    for f in finalizations:
        if table.metadata.snapshot_by_id(f.snapshot_id) is None:
            # expired before it could be tagged (maintenance beside the sensor): nothing left to point at
            log.warning("%s: snapshot %s of %s expired before it was tagged", ".".join(table.name()), f.snapshot_id, tag_name(f.hour_us))
            continue
        of_hour = [t for t in tags if t.hour_us == f.hour_us]
        if any(t.snapshot_id == f.snapshot_id for t in of_hour):
            continue  # tagged already (a repeated tick)
        if not f.amendment and any(t.amendment == 0 for t in of_hour):
            continue  # the first finalization's tag never moves
        amendment = 1 + max((t.amendment for t in of_hour), default=0) if f.amendment else 0
        tag = FinalizedTag(tag_name(f.hour_us, amendment), f.hour_us, amendment, f.snapshot_id)
        tags.append(tag)
        new.append(tag)
    return new


def tag_finalizations(catalog: Catalog, identifier: str, finalizations: Iterable[Finalization]) -> list[str]:
    """Tag each finalization (or amendment) of `identifier` (a base table) in one metadata commit; returns the new tags."""
    finalizations = list(finalizations)
    created: list[str] = []

    def build(table: Table, commit_id: str) -> Transaction | None:
        new = _new_tags(table, finalizations)
        created[:] = [t.name for t in new]
        if not new:
            return None
        tx = new_transaction(table)
        max_age = tag_max_age_ms(table)
        with ManageSnapshots(tx) as refs:
            for tag in new:
                refs.create_tag(tag.snapshot_id, tag.name, max_ref_age_ms=max_age)
        return tx

    commit_with_retry(catalog, identifier, build)
    if created:
        log.info("%s: tagged %s", identifier, ", ".join(created))
    return created


MaskFn = Callable[[pa.Table], pa.Array]  # True for rows of the erased keys


def release_erased_tags(catalog: Catalog, identifier: str, prune: BooleanExpression, mask: MaskFn) -> list[str]:
    """Drop the finalization tags of `identifier` whose snapshot holds a row where `mask` is true (hidden by a
    delete file or not: the bytes are there); `prune` selects candidate files by statistics. Returns the dropped tags.

    Called by the privacy delete after it erased keys from base: a tag keeps its snapshot (and its files) from
    expiry, so a tag holding an erased key would keep it readable for good.
    """
    table = catalog.load_table(identifier)
    holding: dict[str, int] = {}
    checked: dict[int, bool] = {}
    for tag in finalized_tags(table):
        if tag.snapshot_id not in checked:
            tasks = table.scan(row_filter=prune, snapshot_id=tag.snapshot_id).plan_files()
            checked[tag.snapshot_id] = any(bool(mask(read_files(table, [t.file], deletes=[])).to_numpy(zero_copy_only=False).any())
                                           for t in tasks)
        if checked[tag.snapshot_id]:
            holding[tag.name] = tag.snapshot_id
    if not holding:
        return []

    def build(head: Table, commit_id: str) -> Transaction | None:
        still = [name for name, snapshot_id in holding.items()
                 if (ref := head.metadata.refs.get(name)) is not None and ref.snapshot_id == snapshot_id]
        if not still:
            return None
        tx = new_transaction(head)
        with ManageSnapshots(tx) as refs:
            for name in still:
                refs.remove_tag(name)
        return tx

    commit_with_retry(catalog, identifier, build)
    log.info("%s: dropped tag(s) %s: their snapshots hold erased keys", identifier, ", ".join(sorted(holding)))
    return sorted(holding)
