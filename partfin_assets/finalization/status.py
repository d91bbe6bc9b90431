"""What `partfin status` reports: read from table metadata only, never from data files."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchNamespaceError
from pyiceberg.table import Table

from partfin_assets.finalization.hours import finalized_through, hour_key
from partfin_assets.finalization.late_acks import acknowledged_hours, acks_of
from partfin_assets.finalization.late_data import late_data
from partfin_assets.finalization.read_points import base_position
from partfin_assets.finalization.table_checks import DownstreamRun, open_late_hours
from partfin_assets.finalization.tags import finalized_tags
from partfin_assets.iceberg.catalog import load_table_if_exists
from partfin_assets.iceberg.history import lineage, summary_of, total_records, watermark_of
from partfin_assets.iceberg.tables import bucket_load
from partfin_assets.iceberg.streams import idle_timeout_us, stream_position, streams_of, writer_clocks
from partfin_assets.model import summary_keys as K
from partfin_assets.model.table_options import WATERMARK_POLICY
from partfin_assets.model.errors import BrokenTable
from partfin_assets.model.tablespec import COMPANION_SUFFIXES, REJECTED_SUFFIX
from partfin_assets.model.timeutil import iso_z, now_utc, to_us


@dataclass(frozen=True)
class TableStatus:
    name: str  # full identifier, e.g. cdc.orders
    layer: str  # cdc | base
    watermark: str | None
    policy: str | None
    checkpoint_id: int | None  # newest checkpoint on the table (any writer)
    finalized_through: str | None  # the last finalized hour (finalization/hours.py)
    late_records: int  # cdc tables: every late record of the table's history (its late-data ledger); base: 0
    snapshots: int
    source_snapshot_id: int | None = None  # base tables: the CDC snapshot merged
    # cdc tables: lines the writer could not read (cdc.<t>__rejected); base tables: changes the
    # upsert could not decode (base.<t>__rejected, the quarantine)
    rejected: int = 0
    quarantined: int = 0
    streams: list[dict] | None = None  # cdc tables: the progress streams (stream_status)
    # cdc tables: writers whose clock was found ahead of another writer's (iceberg/streams.py WriterClock.as_dict)
    clocks: list[dict] | None = None
    # cdc tables: hours holding late records whose every late record is acknowledged (finalization/late_acks.py),
    # each {"hour", "late_records", "by", "at", "reason"}, and the hours that need attention: late records neither
    # re-run downstream nor acknowledged (hour -> such records), the late_data check's `partitions_to_rerun`
    acknowledged_late_hours: list[dict] | None = None
    late_hours_needing_attention: dict[str, int] | None = None
    # base tables: bucket count, live bytes per bucket, and the command to grow it once buckets outgrow their target
    buckets: int | None = None
    bytes_per_bucket: int | None = None
    rebucket: str | None = None
    broken: str | None = None  # why the table (or its __rejected table) cannot be loaded: the missing metadata file
    # base tables: the Iceberg tags of finalized hours (finalization/tags.py): how many, the oldest and newest
    finalized_tags: int | None = None
    oldest_finalized_tag: str | None = None
    newest_finalized_tag: str | None = None
    metadata_location: str | None = None  # the current metadata file: what DuckDB's iceberg_scan or ClickHouse read

    def as_dict(self) -> dict:
        return asdict(self)


def table_status(identifier: str, table: Table, rejected: Table | None = None, first_hour_us: int | None = None) -> TableStatus:
    """The status of cdc.<t> or base.<t>; `rejected` is its __rejected table, if it has one; `first_hour_us` the
    downstream's first hour partition (late records before it need no re-run, as the late_data check says)."""
    properties = table.properties
    watermark = properties.get(K.PROP_WATERMARK)
    checkpoint_id = None
    for snapshot in lineage(table.metadata):
        value = summary_of(snapshot).get(K.CHECKPOINT_ID)
        if value is not None:
            checkpoint_id = int(value)
            break
    source_snapshot = properties.get(K.PROP_SOURCE_SNAPSHOT_ID)
    is_cdc = identifier.startswith("cdc.")
    late = late_data(table.catalog, identifier) if is_cdc else {}
    acks = acks_of(properties)
    acknowledged = acknowledged_hours(late, acks)
    runs = downstream_read_points(table.catalog, identifier.split(".", 1)[1], sorted(late)) if late else {}
    attention = open_late_hours(late, runs, acks, first_hour_us) if late else {}
    load = bucket_load(table) if not is_cdc else None
    grow = load.recommended_buckets if load is not None else None
    tags = finalized_tags(table) if not is_cdc else []
    return TableStatus(
        name=identifier,
        layer=identifier.split(".")[0],
        watermark=watermark,
        policy=WATERMARK_POLICY.text(properties),
        checkpoint_id=checkpoint_id,
        finalized_through=iso_z(finalized_through(watermark_of(properties))) if watermark else None,
        late_records=sum(h.records for h in late.values()),
        snapshots=len(table.metadata.snapshots),
        source_snapshot_id=int(source_snapshot) if source_snapshot else None,
        rejected=total_records(rejected) if rejected is not None and identifier.startswith("cdc.") else 0,
        quarantined=total_records(rejected) if rejected is not None and identifier.startswith("base.") else 0,
        streams=stream_status(table) if is_cdc else None,
        clocks=[c.as_dict() for _, c in sorted(writer_clocks(properties).items())] if is_cdc else None,
        acknowledged_late_hours=[a.as_dict() for _, a in sorted(acknowledged.items())] if is_cdc else None,
        late_hours_needing_attention={hour_key(h): n for h, n in sorted(attention.items())} if is_cdc else None,
        buckets=load.buckets if load is not None else None,
        bytes_per_bucket=load.bytes_per_bucket if load is not None else None,
        rebucket=f"partfin base rebucket --table {identifier.split('.', 1)[1]} --buckets {grow}" if grow else None,
        finalized_tags=len(tags) if not is_cdc else None,
        oldest_finalized_tag=tags[0].name if tags else None,
        newest_finalized_tag=tags[-1].name if tags else None,
        metadata_location=table.metadata_location,
    )


def downstream_read_points(catalog: Catalog, name: str, hours: list[int]) -> dict[int, DownstreamRun]:
    """hour -> what the downstream (re-)runs of the hour read, from Iceberg alone: the base snapshot of the hour's newest
    finalization tag (finalization/tags.py), with the cdc sequence number it merged. The finalization sensor tags
    each finalization and amendment and requests one downstream run for it, which reads that snapshot; the late_data
    check asks Dagster for the run itself (it counts an amendment from when its run succeeded, seconds later)."""
    base = load_table_if_exists(catalog, f"base.{name}")
    if base is None:
        return {}
    wanted = set(hours)
    newest = {t.hour_us: t for t in finalized_tags(base) if t.hour_us in wanted}  # sorted: the newest amendment last
    out = {}
    for hour, tag in newest.items():
        position = base_position(catalog, base, tag.snapshot_id)
        snapshot = base.metadata.snapshot_by_id(tag.snapshot_id)
        out[hour] = DownstreamRun(position.cdc_sequence_number, snapshot.timestamp_ms * 1000 if snapshot else 0)
    return out


def stream_status(table: Table, now_us: int | None = None) -> list[dict]:
    """The progress streams of a cdc table, as `partfin streams list` shows them.

    state: `active` (holds the watermark), `idle` (committed nothing within the idle timeout of
    now, on this host's clock; it holds the watermark again from its next checkpoint) or `retired`.
    The writers themselves judge silence each on its own clock (iceberg/streams.py).
    """
    now_us = to_us(now_utc()) if now_us is None else now_us
    timeout = idle_timeout_us(table.properties)
    rows = []
    for stream_id, stream in sorted(streams_of(table.properties).items()):
        state = "retired" if stream.retired else "idle" if stream.idle(None, now_us, timeout) else "active"
        position = stream_position(table.metadata, stream.writer_id, stream_id)
        rows.append({
            "stream": stream_id,
            "writer": stream.writer_id,
            "state": state,
            "progress": iso_z(stream.progress_us) if stream.progress_us is not None else None,
            "seen": iso_z(stream.seen_us),
            "checkpoint": position.checkpoint_id or None,
        })
    return rows


def all_table_status(catalog: Catalog, first_hour_us: int | None = None) -> list[TableStatus]:
    out = []
    for namespace in ("cdc", "base"):
        try:
            identifiers = catalog.list_tables(namespace)
        except NoSuchNamespaceError:
            continue
        names = {".".join(ident) for ident in identifiers}
        for name in sorted(names):
            if name.endswith(COMPANION_SUFFIXES):
                continue
            try:
                rejected = catalog.load_table(f"{name}{REJECTED_SUFFIX}") if f"{name}{REJECTED_SUFFIX}" in names else None
                out.append(table_status(name, catalog.load_table(name), rejected, first_hour_us))
            except BrokenTable as exc:  # reported, and every other table still is
                out.append(TableStatus(name, namespace, None, None, None, None, 0, 0, broken=str(exc)))
    return out
