"""partfin's tables (docs/contracts.md): the Iceberg schema, partitioning and creation of each.

- `cdc.<table>`: the append-only change ledger (the CDC record schema), hidden partitioning
  `hour(event_time)`; `cdc.<table>__rejected`: records a source could not parse, with the reason;
  `cdc.<table>__ledger`: the late-data ledger, per checkpoint and event hour (iceberg/ledger.py).
- `base.<table>`: the current state: the declared typed columns plus `_event_time`,
  `_source_seq`, `_tombstone`, `_source_log` and `_order_time` (the version's place in
  last-writer-wins, jobs/upsert/decode.py), partitioned `bucket(N, first primary-key column)`.

No column name is one an engine reserves for Iceberg metadata columns (iceberg/reserved_names.py);
base tables from before, whose tombstone column was `_deleted`, are renamed in place by the next upsert.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException, TableAlreadyExistsError
from pyiceberg.expressions import AlwaysTrue, BooleanExpression
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.transforms import BucketTransform, HourTransform
from pyiceberg.types import (
    BinaryType,
    BooleanType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IcebergType,
    IntegerType,
    LongType,
    NestedField,
    StringType,
    StructType,
    TimestampType,
    TimestamptzType,
    TimeType,
)

from partfin_assets.iceberg.catalog import ensure_namespaces, load_existing_table
from partfin_assets.iceberg.commit import MANAGED_TABLE_PROPERTIES, ensure_managed_properties, new_transaction, set_table_properties
from partfin_assets.iceberg.history import lineage, summary_of
from partfin_assets.iceberg.reserved_names import is_reserved
from partfin_assets.model import summary_keys as K
from partfin_assets.model.defaults import DEFAULT_TARGET_FILE_SIZE
from partfin_assets.model.table_options import WATERMARK_POLICY
from partfin_assets.model.errors import InvalidInput, SnapshotUnavailable
from partfin_assets.model.tablespec import LEDGER_SUFFIX, TableSpec

log = logging.getLogger(__name__)

CDC_SCHEMA = Schema(
    NestedField(1, "key", StringType(), required=True),
    NestedField(2, "op", StringType(), required=True),
    NestedField(3, "event_time", TimestamptzType(), required=True),
    NestedField(4, "source_seq", LongType(), required=True),
    NestedField(5, "payload", StringType(), required=False),
    NestedField(6, "arrival_time", TimestamptzType(), required=False),  # source processing time; null: the commit's clock
    NestedField(7, "source_log", StringType(), required=False),  # the change log source_seq is a position in; null: unknown
)
CDC_PARTITION_SPEC = PartitionSpec(
    PartitionField(source_id=3, field_id=1000, transform=HourTransform(), name="event_time_hour")
)
REJECTED_SCHEMA = Schema(
    NestedField(1, "writer_id", StringType(), required=True),
    NestedField(2, "checkpoint_id", LongType(), required=True),
    NestedField(3, "source_seq", LongType(), required=True),
    NestedField(4, "raw", StringType(), required=True),
    NestedField(5, "reason", StringType(), required=True),
    # the change log source_seq is a position in, as in cdc.<table>: the writer's progress stream (its writer id,
    # or `<writer id>/<topic>-<partition>` for a Kafka partition); null only before a table's rows were migrated
    NestedField(6, "source_log", StringType(), required=False),
)
# The rejected table's position before `source_log`: a Kafka message's topic, partition and offset (the offset is
# its source_seq). A table created then is migrated once (`migrate_rejected_position`), nothing lost.
LEGACY_REJECTED_POSITION = ("kafka_topic", "kafka_partition", "kafka_offset")

# <cdc table>__ledger: the durable late-data ledger (iceberg/ledger.py), one row per (stream, checkpoint, event hour)
LEDGER_SCHEMA = Schema(
    NestedField(1, "stream", StringType(), required=True),
    NestedField(2, "checkpoint_id", LongType(), required=True),
    NestedField(3, "snapshot_id", LongType(), required=True),
    NestedField(4, "sequence_number", LongType(), required=False),
    NestedField(5, "commit_time", TimestamptzType(), required=True),
    NestedField(6, "arrival_min", TimestamptzType(), required=False),
    NestedField(7, "arrival_max", TimestamptzType(), required=False),
    NestedField(8, "hour", TimestamptzType(), required=False),
    NestedField(9, "records", LongType(), required=True),
    NestedField(10, "late_records", LongType(), required=True),
    NestedField(11, "event_time_min", TimestamptzType(), required=False),
    NestedField(12, "event_time_max", TimestamptzType(), required=False),
    NestedField(13, "event_time_digest", StringType(), required=False),
    NestedField(14, "lateness_digest", StringType(), required=False),
    NestedField(15, "watermark", TimestamptzType(), required=False),
    # the writer whose checkpoint ids these are (`stream` is its progress stream: a Kafka partition's, or its own)
    NestedField(16, "writer_id", StringType(), required=False),
    # the checkpoint's partfin.source-clock: the source's processing time (windows in arrival time read it)
    NestedField(17, "source_clock", TimestamptzType(), required=False),
)


def ledger_identifier(cdc_identifier: str) -> str:
    return cdc_identifier + LEDGER_SUFFIX


def ensure_ledger_table(catalog: Catalog, cdc_identifier: str) -> Table:
    identifier = ledger_identifier(cdc_identifier)
    create_if_absent(catalog, identifier, LEDGER_SCHEMA, PartitionSpec(), dict(MANAGED_TABLE_PROPERTIES))
    _add_missing_columns(catalog, identifier, LEDGER_SCHEMA)
    return catalog.load_table(identifier)


def ensure_cdc_tables(catalog: Catalog, spec: TableSpec) -> Table:
    ensure_namespaces(catalog, "cdc")
    create_if_absent(
        catalog,
        spec.cdc_identifier,
        CDC_SCHEMA,
        CDC_PARTITION_SPEC,
        {**MANAGED_TABLE_PROPERTIES, WATERMARK_POLICY.key: WATERMARK_POLICY.default, **spec.to_properties()},  # the declared policy, else the default
    )
    create_if_absent(catalog, spec.rejected_identifier, REJECTED_SCHEMA, PartitionSpec(), {**MANAGED_TABLE_PROPERTIES, **NO_COLUMN_BOUNDS})
    ensure_ledger_table(catalog, spec.cdc_identifier)
    _add_missing_columns(catalog, spec.cdc_identifier, CDC_SCHEMA)
    _add_missing_columns(catalog, spec.rejected_identifier, REJECTED_SCHEMA)
    migrate_rejected_position(catalog, spec.rejected_identifier)
    _ensure_properties(catalog, spec.rejected_identifier, NO_COLUMN_BOUNDS)
    return ensure_managed_properties(catalog, spec.cdc_identifier)


# The rejected tables hold raw lines and payloads a privacy request may have to erase: their manifests keep no
# column bounds (which would copy the first bytes of a line), and nothing prunes on them (they are read whole).
NO_COLUMN_BOUNDS = {"write.metadata.metrics.default": "none"}


def _ensure_properties(catalog: Catalog, identifier: str, properties: dict[str, str]) -> None:
    """A table created before these properties existed gets them (its files written from now on follow them)."""
    table = catalog.load_table(identifier)
    if any(table.properties.get(k) != v for k, v in properties.items()):
        set_table_properties(catalog, identifier, properties)


def migrate_rejected_position(catalog: Catalog, identifier: str) -> None:
    """A rejected table with the legacy Kafka position columns: each row's `source_log` is filled from them
    (`<writer id>/<topic>-<partition>`; rows of other sources: the writer's own stream), then the columns go.

    Lossless: a Kafka row's offset is its source_seq (checked; a table where it is not keeps the columns). Idempotent:
    a run interrupted between the rewrite and the column drop redoes nothing but the drop.
    """
    table = catalog.load_table(identifier)
    legacy = [f.name for f in table.schema().fields if f.name in LEGACY_REJECTED_POSITION]
    if not legacy:
        return
    rows = table.scan().to_arrow()
    if set(legacy) == set(LEGACY_REJECTED_POSITION) and rows.num_rows:
        kafka = pc.is_valid(rows.column("kafka_topic"))
        if not pc.all(pc.or_(pc.invert(kafka), pc.equal(rows.column("kafka_offset"), rows.column("source_seq")))).as_py():
            log.warning("%s: a Kafka offset differs from its source_seq; the legacy position columns are kept", identifier)
            return
        text = [pc.cast(rows.column(name), pa.large_string()) for name in ("writer_id", "kafka_topic", "kafka_partition")]
        partition_log = pc.binary_join_element_wise(text[0], pc.binary_join_element_wise(text[1], text[2], pa.scalar("-", pa.large_string())),
                                                   pa.scalar("/", pa.large_string()))
        derived = pc.if_else(kafka, partition_log, text[0])
        filled = pc.cast(pc.coalesce(pc.cast(rows.column("source_log"), pa.large_string()), derived), rows.schema.field("source_log").type)
        if not filled.equals(rows.column("source_log")):
            table.overwrite(rows.set_column(rows.schema.get_field_index("source_log"), rows.schema.field("source_log"), filled))
    elif rows.num_rows:
        log.warning("%s: only some legacy position columns (%s) are there; kept", identifier, legacy)
        return
    try:
        with catalog.load_table(identifier).update_schema() as update:
            for name in legacy:
                update.delete_column(name)
    except CommitFailedException:
        pass  # another writer migrated it at the same moment (or evolves it): the next start finishes the drop


def _add_missing_columns(catalog: Catalog, identifier: str, schema: Schema) -> None:
    """A table created before a nullable column existed (cdc: `arrival_time`; rejected: `source_log`)
    gets it: its old rows read null."""
    table = catalog.load_table(identifier)
    names = {f.name for f in table.schema().fields}
    missing = [f for f in schema.fields if f.name not in names and not f.required]
    if not missing:
        return
    try:
        with table.update_schema() as update:
            for nested in missing:
                update.add_column(nested.name, nested.field_type, doc=nested.doc)
    except CommitFailedException:
        # another writer evolved it at the same moment: fine if the columns are there now
        names = {f.name for f in catalog.load_table(identifier).schema().fields}
        if any(f.name not in names for f in missing):
            raise


def create_if_absent(catalog: Catalog, identifier: str, schema: Schema, partition_spec: PartitionSpec, properties: dict) -> None:
    if catalog.table_exists(identifier):
        return
    try:
        catalog.create_table(identifier, schema=schema, partition_spec=partition_spec, properties=properties)
    except TableAlreadyExistsError:
        pass  # another writer created it first


# base.<table>__rejected: CDC changes the upsert could not decode, each once (by change log, position and
# key: model/records.py RECORD_IDENTITY), with the column and reason and the CDC snapshot it was found at.
QUARANTINE_SCHEMA = Schema(
    NestedField(1, "key", StringType(), required=True),
    NestedField(2, "op", StringType(), required=True),
    NestedField(3, "event_time", TimestamptzType(), required=True),
    NestedField(4, "source_seq", LongType(), required=True),
    NestedField(5, "payload", StringType(), required=False),
    NestedField(6, "column", StringType(), required=False),
    NestedField(7, "reason", StringType(), required=True),
    NestedField(8, "cdc_snapshot_id", LongType(), required=True),
    NestedField(9, "source_log", StringType(), required=False),  # the change log source_seq is a position in; null: unknown
)


def ensure_quarantine_table(catalog: Catalog, spec: TableSpec) -> Table:
    ensure_namespaces(catalog, "base")
    create_if_absent(catalog, spec.quarantine_identifier, QUARANTINE_SCHEMA, PartitionSpec(), {**MANAGED_TABLE_PROPERTIES, **NO_COLUMN_BOUNDS})
    _add_missing_columns(catalog, spec.quarantine_identifier, QUARANTINE_SCHEMA)
    _ensure_properties(catalog, spec.quarantine_identifier, NO_COLUMN_BOUNDS)
    return catalog.load_table(spec.quarantine_identifier)


# Metadata columns of base.<table>.
EVENT_TIME = "_event_time"  # event time of the change that wrote the row (its hour is the row's base partition)
SOURCE_SEQ = "_source_seq"  # its position in its change log
# tombstone: the winning change was a delete. Not Iceberg's `_deleted` (a metadata column: "removed by a delete
# file"), whose name Spark refuses in a table's columns, nor `is_deleted` (a common soft-delete column of sources).
DELETED = "_tombstone"
LEGACY_DELETED = "_deleted"  # its name in base tables from before: renamed in place by their next upsert
SOURCE_LOG = "_source_log"  # the change log it came from (cdc `source_log`); null: unknown (a row written before partfin kept it)
ORDER_TIME = "_order_time"  # its event time as its log orders it: never before an earlier change of the key in that log; null: _event_time
META_COLUMNS = (EVENT_TIME, SOURCE_SEQ, DELETED, SOURCE_LOG, ORDER_TIME)
# the ordering columns came later than the first base tables: nullable, added to an older table on its next upsert
ORDER_FIELDS = Schema(
    NestedField(1, SOURCE_LOG, StringType(), required=False),
    NestedField(2, ORDER_TIME, TimestamptzType(), required=False),
)


DEFAULT_BUCKETS = 16
# What one bucket should hold at most: the file size compaction aims at (this property, else DEFAULT_TARGET_FILE_SIZE).
TARGET_FILE_SIZE_PROPERTY = "write.target-file-size-bytes"


@dataclass(frozen=True)
class BucketLoad:
    """How full base.<table>'s buckets are: the rule for `partfin base rebucket` (partfin status)."""

    buckets: int
    bytes_per_bucket: int  # the live files' bytes (snapshot summary `total-files-size`) over the bucket count
    target_bytes: int

    @property
    def recommended_buckets(self) -> int | None:
        """Twice the count once the average bucket holds more than the target: else None.

        Past the target a compacted bucket is several files and every key group's upsert reads and
        folds more; doubling keeps the keys of an old bucket in one group (bucket(2N) mod N == bucket(N)).
        """
        return 2 * self.buckets if self.bytes_per_bucket > self.target_bytes else None


def bucket_load(table: Table) -> BucketLoad | None:
    """The bucket load of a partfin base table, from metadata only; None for any other table or an empty one."""
    buckets = table.properties.get(K.PROP_BASE_BUCKETS)
    snapshot = table.current_snapshot()
    if not buckets or snapshot is None:
        return None
    total = int(summary_of(snapshot).get("total-files-size", "0") or 0)
    target = int(table.properties.get(TARGET_FILE_SIZE_PROPERTY, DEFAULT_TARGET_FILE_SIZE))
    return BucketLoad(int(buckets), total // int(buckets), target)


def _iceberg_type(data_type: pa.DataType, next_id: Callable[[], int] | None = None) -> IcebergType:
    """The Iceberg type of a declared column; `next_id` numbers the fields of a struct (geometry)."""
    if pa.types.is_struct(data_type):
        if next_id is None:
            raise TypeError(f"column type {data_type}: struct fields need field ids")
        children = [data_type.field(i) for i in range(data_type.num_fields)]
        return StructType(
            *[NestedField(next_id(), child.name, _iceberg_type(child.type, next_id), required=False) for child in children]
        )
    if pa.types.is_boolean(data_type):
        return BooleanType()
    if pa.types.is_int32(data_type):
        return IntegerType()
    if pa.types.is_int64(data_type):
        return LongType()
    if pa.types.is_float32(data_type):
        return FloatType()
    if pa.types.is_float64(data_type):
        return DoubleType()
    if pa.types.is_string(data_type):
        return StringType()
    if pa.types.is_binary(data_type):
        return BinaryType()
    if pa.types.is_date32(data_type):
        return DateType()
    if pa.types.is_time64(data_type):
        return TimeType()
    if pa.types.is_timestamp(data_type):
        return TimestamptzType() if data_type.tz else TimestampType()
    if pa.types.is_decimal(data_type):
        return DecimalType(data_type.precision, data_type.scale)
    raise TypeError(f"column type {data_type} has no Iceberg mapping")


def base_columns(spec: TableSpec) -> dict[str, pa.DataType]:
    if not spec.columns:
        raise InvalidInput(f"table {spec.name!r} declares no columns: the base table needs typed columns")
    for name in spec.columns:
        if name in META_COLUMNS or name.startswith("__"):
            raise InvalidInput(f"table {spec.name!r}: column name {name!r} is reserved for base-table metadata")
        if is_reserved(name):
            raise InvalidInput(f"table {spec.name!r}: column name {name!r} is reserved for Iceberg metadata columns by query engines")
    return dict(spec.columns)


def base_schema(spec: TableSpec) -> Schema:
    columns = base_columns(spec)
    n = len(columns)
    nested_ids = itertools.count(n + 4)  # after the columns and the first three metadata columns
    fields = [
        NestedField(i, name, _iceberg_type(t, lambda: next(nested_ids)), required=name in spec.primary_key)
        for i, (name, t) in enumerate(columns.items(), start=1)
    ]
    fields += [
        NestedField(n + 1, EVENT_TIME, TimestamptzType(), required=True),
        NestedField(n + 2, SOURCE_SEQ, LongType(), required=True),
        NestedField(n + 3, DELETED, BooleanType(), required=True),
    ]
    fields += [NestedField(next(nested_ids), f.name, f.field_type, required=False) for f in ORDER_FIELDS.fields]
    ids = [f.field_id for f in fields if f.name in spec.primary_key]
    return Schema(*fields, identifier_field_ids=ids)


_BUCKETABLE = (IntegerType, LongType, DecimalType, DateType, TimeType, TimestampType, TimestamptzType, StringType, BinaryType)


def base_partition_spec(spec: TableSpec, schema: Schema, buckets: int) -> PartitionSpec:
    """bucket(N, first bucketable primary-key column); unpartitioned if no key column can be bucketed."""
    for name in spec.primary_key:
        nested = schema.find_field(name)
        if isinstance(nested.field_type, _BUCKETABLE):
            return PartitionSpec(
                PartitionField(source_id=nested.field_id, field_id=1000, transform=BucketTransform(buckets), name=f"{name}_bucket")
            )
    return PartitionSpec()


def ensure_base_table(catalog: Catalog, spec: TableSpec, *, buckets: int | None = None) -> Table:
    """Create base.<name> from the declaration if it does not exist; return it."""
    identifier = spec.base_identifier
    if catalog.table_exists(identifier):
        _rename_legacy_tombstone(catalog, identifier)
        _add_missing_columns(catalog, identifier, ORDER_FIELDS)
        return _with_delta_columns(catalog, catalog.load_table(identifier), spec)
    buckets = buckets or DEFAULT_BUCKETS
    if buckets < 1:
        raise InvalidInput(f"bucket count must be at least 1, got {buckets}")
    ensure_namespaces(catalog, "base")
    schema = base_schema(spec)
    properties = {
        **MANAGED_TABLE_PROPERTIES, K.PROP_BASE_BUCKETS: str(buckets), K.PROP_SOURCE_TABLE: spec.cdc_identifier,
        K.PROP_DELTA_COLUMNS: ",".join(lookup_columns(spec)),
    }
    try:
        catalog.create_table(identifier, schema=schema, partition_spec=base_partition_spec(spec, schema, buckets), properties=properties)
    except TableAlreadyExistsError:
        pass  # a concurrent run created it
    return catalog.load_table(identifier)


def tombstone_column(schema: Schema) -> str:
    """The tombstone column's name in `schema`: DELETED, or LEGACY_DELETED in a table (or an old snapshot) from before."""
    names = {f.name for f in schema.fields}
    return LEGACY_DELETED if LEGACY_DELETED in names and DELETED not in names else DELETED


def _rename_legacy_tombstone(catalog: Catalog, identifier: str) -> None:
    """Rename a base table's `_deleted` to DELETED: an Iceberg column rename (a new schema version; metadata only,
    the field id and data files stay, so every snapshot reads as before)."""
    table = catalog.load_table(identifier)
    if tombstone_column(table.schema()) == DELETED:
        return
    try:
        with table.update_schema() as update:
            update.rename_column(LEGACY_DELETED, DELETED)
    except CommitFailedException:
        # another run renamed it (or changed the table) at the same moment: fine if it is renamed now
        if tombstone_column(catalog.load_table(identifier).schema()) != DELETED:
            raise
    log.info("%s: column %s renamed to %s (Iceberg reserves %s for a metadata column)", identifier, LEGACY_DELETED, DELETED, LEGACY_DELETED)


def lookup_columns(spec: TableSpec) -> list[str]:
    """The columns an upsert reads to find old versions: the primary key and the ordering columns (delta-encoded on write)."""
    return [*spec.primary_key, EVENT_TIME, SOURCE_SEQ, ORDER_TIME]


def _with_delta_columns(catalog: Catalog, table: Table, spec: TableSpec) -> Table:
    """A base table made before partfin delta-encoded its lookup columns (or all of today's) gets the property
    (files written from now on)."""
    if table.properties.get(K.PROP_DELTA_COLUMNS) == ",".join(lookup_columns(spec)):
        return table
    try:
        with new_transaction(table) as tx:
            tx.set_properties({K.PROP_DELTA_COLUMNS: ",".join(lookup_columns(spec))})
    except CommitFailedException:
        pass  # another run set it (or changed the table) meanwhile: the next run tries again
    return catalog.load_table(spec.base_identifier)


def snapshot_unavailable_reason(table: Table, snapshot_id: int) -> str | None:
    """Why `table` may not be read as of `snapshot_id`, or None.

    The snapshot expired (PyIceberg would silently read no rows), or a privacy delete committed
    after it: its files still hold the erased rows until expiry and orphan removal, and a read
    there would bring them back.
    """
    identifier = ".".join(table.name())
    if table.metadata.snapshot_by_id(snapshot_id) is None:
        return f"{identifier} no longer holds snapshot {snapshot_id} (expired by snapshot expiry)"
    erased = []
    for snapshot in lineage(table.metadata):
        if snapshot.snapshot_id == snapshot_id:
            break
        summary = summary_of(snapshot)
        if K.PRIVACY_DELETED_RECORDS in summary:
            erased.append(summary.get(K.PRIVACY_REQUEST_ID) or f"in snapshot {snapshot.snapshot_id}")
    if erased:
        return (f"privacy delete {', '.join(reversed(erased))} on {identifier} ran after snapshot {snapshot_id}: "
                "reading it would bring erased rows back")
    return None


def read_base(
    catalog: Catalog,
    name: str,
    *,
    include_deleted: bool = False,
    row_filter: str | BooleanExpression = AlwaysTrue(),
    snapshot_id: int | None = None,
    selected_fields: tuple[str, ...] = ("*",),
) -> pa.Table:
    """The rows of base.<name>, now or at `snapshot_id` (tombstones and DELETED hidden unless include_deleted).

    `row_filter` is a PyIceberg filter, e.g. on `_event_time` for one hour. A snapshot that may not
    be read (snapshot_unavailable_reason) raises SnapshotUnavailable with the reason. A table (or a
    snapshot) from before the tombstone column's rename reads with the column named DELETED too.
    """
    table = load_existing_table(catalog, f"base.{name}", f"run `partfin upsert --table {name}` first")
    reason = snapshot_unavailable_reason(table, snapshot_id) if snapshot_id is not None else None
    if reason:
        raise SnapshotUnavailable(reason)
    scan = table.scan(row_filter=row_filter, snapshot_id=snapshot_id)
    stored = tombstone_column(scan.projection())  # the schema of the snapshot read
    wanted = tuple(stored if f == DELETED else f for f in selected_fields)
    fields = wanted if include_deleted or "*" in wanted else (*wanted, stored)
    data = scan.update(selected_fields=fields).to_arrow()
    if stored != DELETED:
        data = data.rename_columns([DELETED if n == stored else n for n in data.column_names])
    if include_deleted:
        return data
    return data.filter(pc.invert(data.column(DELETED))).drop_columns([DELETED])
