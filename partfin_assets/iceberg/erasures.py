"""The erasure registry `cdc.<table>__erasures` and the fence that makes every writer see it.

The registry holds one row per (privacy request, key): the request id, the key's salted SHA-256
(the salt is a random table property of the registry, model/erasure.py), the cutoff
`erased_before` and when it was registered. Its version is the sequence number of its current
snapshot; it only grows.

The fence: a privacy delete registers its keys first, then, before it deletes anything from a
table partfin writes (cdc, its rejected lines, base, its quarantine), raises that table's property
`partfin.privacy.erasures` to the registry's version in a commit of its own (an empty snapshot:
it moves the table's head, so any commit prepared before it fails its compare-and-set and is
rebuilt on the fresh metadata). A writer filters with the erasures it loaded (`load_erasures`)
and, in every commit attempt, checks the fresh table's fence against their version
(`erasures_are_current`): a writer that read before the request either commits before the fence
(and the delete, which scans after the fence, removes what it wrote) or sees the fence and
filters again. So no interleaving leaves an erased change in a table after the delete is done.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.partitioning import PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.types import NestedField, StringType, TimestamptzType

from partfin_assets.iceberg.commit import MANAGED_TABLE_PROPERTIES, commit_with_retry, new_transaction, snapshot_summary_with_commit_id
from partfin_assets.iceberg.tables import create_if_absent
from partfin_assets.model import summary_keys as K
from partfin_assets.model.erasure import Erasure, Erasures, key_hash
from partfin_assets.model.summary_keys import JobKind
from partfin_assets.model.tablespec import ERASURES_SUFFIX, TableSpec

ERASURES_SCHEMA = Schema(
    NestedField(1, "request_id", StringType(), required=True),
    NestedField(2, "key_hash", StringType(), required=True),  # sha256(salt, canonical key): never the key
    NestedField(3, "erased_before", TimestamptzType(), required=True),
    NestedField(4, "registered_at", TimestamptzType(), required=True),
)
UTC_US = pa.timestamp("us", tz="UTC")


def erasures_identifier(spec: TableSpec) -> str:
    return spec.cdc_identifier + ERASURES_SUFFIX


def fence_of(properties: dict[str, str]) -> int:
    """The registry version a table's writers must have filtered with (0: no request ever reached the table)."""
    return int(properties.get(K.PROP_ERASURES_FENCE) or 0)


def erasures_are_current(table: Table, erasures: Erasures) -> bool:
    """True if `erasures` is at least the version `table` (fresh metadata of a commit attempt) is fenced at."""
    return fence_of(table.properties) <= erasures.version


def load_erasures(catalog: Catalog, spec: TableSpec) -> Erasures:
    """The erasures in force for `spec`'s tables, at the registry's current version."""
    identifier = erasures_identifier(spec)
    if not catalog.table_exists(identifier):
        return Erasures(spec.primary_key)
    table = catalog.load_table(identifier)
    return _erasures_of(spec, table)


def _erasures_of(spec: TableSpec, table: Table) -> Erasures:
    snapshot = table.current_snapshot()
    if snapshot is None:
        return Erasures(spec.primary_key, 0, table.properties.get(K.PROP_ERASURES_SALT, ""))
    rows = table.scan().to_arrow()
    entries = tuple(
        Erasure(r, h, int(t))
        for r, h, t in zip(rows.column("request_id").to_pylist(), rows.column("key_hash").to_pylist(),
                           pa.compute.cast(rows.column("erased_before"), pa.int64()).to_pylist())
    )
    return Erasures(spec.primary_key, snapshot.sequence_number or 0, table.properties[K.PROP_ERASURES_SALT], entries)


def current_erasures(catalog: Catalog, spec: TableSpec, table: Table, erasures: Erasures) -> Erasures:
    """`erasures` if still current for `table` (a commit attempt's fresh metadata), else the registry read again."""
    return erasures if erasures_are_current(table, erasures) else load_erasures(catalog, spec)


def register_erasure(
    catalog: Catalog, spec: TableSpec, request_id: str, keys: Iterable[str], erased_before_us: int, registered_at_us: int,
) -> Erasures:
    """Record the request's keys (canonical texts) with their cutoff; a key the request already holds keeps its first
    cutoff (re-running a request resumes it). Returns the erasures in force after it."""
    identifier = erasures_identifier(spec)
    create_if_absent(catalog, identifier, ERASURES_SCHEMA, PartitionSpec(),
                     {**MANAGED_TABLE_PROPERTIES, K.PROP_ERASURES_SALT: secrets.token_hex(16)})
    keys = sorted(set(keys))

    def build(table: Table, commit_id: str):
        salt = table.properties[K.PROP_ERASURES_SALT]
        hashes = [key_hash(salt, k) for k in keys]
        held = set()
        if table.current_snapshot() is not None:
            there = table.scan(selected_fields=("request_id", "key_hash")).to_arrow()
            held = set(zip(there.column("request_id").to_pylist(), there.column("key_hash").to_pylist()))
        new = [h for h in hashes if (request_id, h) not in held]
        if not new:
            return None
        rows = pa.table({
            "request_id": pa.array([request_id] * len(new), pa.string()),
            "key_hash": pa.array(new, pa.string()),
            "erased_before": pa.array([erased_before_us] * len(new), pa.int64()).cast(UTC_US),
            "registered_at": pa.array([registered_at_us] * len(new), pa.int64()).cast(UTC_US),
        })
        tx = new_transaction(table)
        summary = snapshot_summary_with_commit_id({K.PRIVACY_REQUEST_ID: request_id}, commit_id, JobKind.INTO)
        tx.append(rows.cast(table.schema().as_arrow()), snapshot_properties=summary)
        return tx

    result = commit_with_retry(catalog, identifier, build)
    return _erasures_of(spec, result.table)


def raise_fence(catalog: Catalog, identifier: str, erasures: Erasures, request_id: str) -> None:
    """Fence `identifier` at `erasures.version` (never lowering it): an empty snapshot that moves the table's head, so
    every commit prepared before it is rebuilt on metadata that names the version."""

    def build(table: Table, commit_id: str):
        if fence_of(table.properties) >= erasures.version:
            return None
        tx = new_transaction(table)
        tx.set_properties({K.PROP_ERASURES_FENCE: str(erasures.version)})
        summary = snapshot_summary_with_commit_id({K.PRIVACY_REQUEST_ID: request_id}, commit_id, JobKind.UPDATE_DELETE)
        with tx.update_snapshot(snapshot_properties=summary).fast_append():
            pass
        return tx

    commit_with_retry(catalog, identifier, build)
