"""Replay / backfill of one hour of cdc.<table>: an OVERWRITE job (docs/concurrency.md) that reproduces, never invents.

What a replay reads (`replay_hour_from_history`): the history the table's writers read, as
their checkpoints recorded it (`partfin.source`, model/source_identity.py), from its start up to
each writer's committed position at the replay's start snapshot. Not the configured source, and
not what a writer has not committed yet: the synthetic generator is rebuilt from its recorded
seed, options and anchor; a Debezium file is read again only if it is the same file (first line)
and the bytes up to the offset have the recorded crc32. A source that cannot read its history
again (a replication slot holds only what was not ingested yet) is refused with
`ReplayNotPossible`; so is a changed file. `replay_hour` takes the records from the caller.
Every writer id is a change log of its own: the replay reads each writer's history and writes its
records under that log, so an hour several logs wrote comes back with every record of each.

What a replay replaces: what the hour held when the replay started, re-derived on the head
its commit lands on (Job.commit_overwrite): records that writers appended to the hour after
the start are kept, never dropped (CommitConflictError if they can no longer be told apart).
A replay that would leave the hour with far fewer records than it held (a net loss above
`MAX_NET_LOSS_FRACTION` of them) is refused with `ReplayRefused` unless forced: a replay of
recorded history removes nothing, so such a loss means its input is not that history.

Watermark and stats semantics (the policy skips commits without event-time stats, overwrites among them):

- The replay commit carries **no** `partfin.event-time.*` entries, so the
  watermark policy skips it when looking back X commits and snapshot expiry does
  not count it as one of those X. Its own stats go under `partfin.replay.*`
  (records, min/max event time, records added / removed / kept compared with the
  hour it replaced, the same per change log, the history it read) plus the per-hour entry
  `partfin.event-time.by-hour` that partition metadata reads.
- It never sets `partfin.watermark`: the watermark cannot move, back or forward.
  The summary records the watermark in force (`partfin.watermark`) unchanged, so
  the watermark history stays monotonic.
- Late-data accounting: records the replay adds to an hour that is already below
  the watermark (finalized, or partly so) are late data exactly like late CDC
  records: counted in `partfin.late-records`, `partfin.late-records.by-hour` and
  the running `partfin.late-records.total`, so the late-data check and
  `late_after_run` flag the downstream hour. Records merely rewritten (the same record:
  same change log, position and key, model/records.py RECORD_IDENTITY) are not late. All of this is re-derived on every
  commit attempt against the head the commit lands on.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog
from pyiceberg.table import Table

from partfin_assets.iceberg.erasures import load_erasures
from partfin_assets.iceberg.files import hour_partition, read_files
from partfin_assets.iceberg.history import late_records_total, watermark_of, writer_positions
from partfin_assets.iceberg.ledger import reconcile
from partfin_assets.jobs.job import Hook, Job
from partfin_assets.model import summary_keys as K
from partfin_assets.model.erasure import without_erased
from partfin_assets.model.errors import PartfinError
from partfin_assets.model.ids import id_text
from partfin_assets.model.records import (
    CDC_RECORD_SCHEMA, RECORD_IDENTITY, SOURCE_LOG, cdc_records, records_by_log, records_not_in, with_source_log,
)
from partfin_assets.model.source_identity import ReplayNotPossible, SourceChanged
from partfin_assets.model.stats import EventTimeProfile, compact_json, encode_by_hour
from partfin_assets.model.summary_keys import JobKind
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.model.timeutil import US_PER_HOUR, floor_hour_us, iso_z
from partfin_assets.sources.registry import open_history

log = logging.getLogger(__name__)

MAX_NET_LOSS_FRACTION = 0.1  # a replay may leave an hour with at most 10% fewer records than it held, unless forced


class ReplayRefused(PartfinError, ValueError):
    """A replay that would remove far more records than it adds; nothing was committed."""


@dataclass(frozen=True)
class ReplayResult:
    table: str
    hour: str  # ISO Z
    job_id: str
    snapshot_id: int | None
    records: int  # the hour after the replay
    replaced_records: int  # records the replay replaced (what the hour held when it started, at the head it landed on)
    added_records: int  # not there before (a record is its log and its position in it: records.py RECORD_IDENTITY)
    removed_records: int
    late_records: int  # added records below the watermark
    ignored_outside_hour: int  # records given that were not in the hour
    kept_records: int = 0  # appended to the hour by writers after the replay started: kept as they are
    history: str | None = None  # JSON [{"source", "until"}]: the recorded history read (None: records given)
    already_committed: bool = False
    attempts: int = 1
    by_log: dict[str, dict[str, int]] | None = None  # change log -> {"records", "added", "removed"} of the replayed hour

    def metadata(self) -> dict:
        return {k: id_text(v) if k == "snapshot_id" else v for k, v in self.__dict__.items()}


def replay_hour(
    catalog: Catalog,
    name: str,
    hour_us: int,
    records: pa.Table,
    *,
    job_id: str | None = None,
    force: bool = False,
    before_commit: Hook | None = None,
) -> ReplayResult:
    """Replace hour `hour_us` of cdc.<name> by `records` (CDC record schema; rows outside the hour are ignored).

    With a caller-chosen `job_id` the replay is idempotent: a re-run after an unknown outcome
    that finds the job in the history returns it without committing again.
    """
    with Job.start(catalog, f"cdc.{name}", JobKind.OVERWRITE, job_id=job_id, before_commit=before_commit) as job:
        return _replay(job, floor_hour_us(hour_us), lambda: (records, None), force)


def replay_hour_from_history(
    catalog: Catalog,
    name: str,
    hour_us: int,
    *,
    job_id: str | None = None,
    force: bool = False,
    max_records: int = 100_000,
    before_commit: Hook | None = None,
) -> ReplayResult:
    """Replay hour `hour_us` of cdc.<name> from the history its writers read, up to what they had committed
    when the replay started (see the module docstring); ReplayNotPossible if that history cannot be read again."""
    with Job.start(catalog, f"cdc.{name}", JobKind.OVERWRITE, job_id=job_id, before_commit=before_commit) as job:
        hour_us = floor_hour_us(hour_us)
        return _replay(job, hour_us, lambda: _recorded_history(job.table, name, hour_us, max_records), force)


def _recorded_history(table: Table, name: str, hour_us: int, max_records: int) -> tuple[pa.Table, str]:
    """The records of the hour in every writer's recorded history, up to its committed offset at `table`.

    Each writer id is a change log of its own: its records are the hour's records of that log, whatever
    positions other logs hold (two files' line 7 are two records)."""
    refusal = f"cannot replay hour {iso_z(hour_us)} of cdc.{name}"
    positions = [p for p in writer_positions(table.metadata) if p.source_offset is not None]
    if not positions:
        raise ReplayNotPossible(f"{refusal}: no writer has committed a source position yet; there is nothing to read again")
    spec = TableSpec.from_properties(name, table.properties)
    parts, read = [], []
    for position in positions:
        identity = position.source
        if identity is None:
            raise ReplayNotPossible(
                f"{refusal}: writer {position.writer_id} committed before partfin recorded which history it reads; "
                "run its ingest (or sync) once more, which records it, then replay"
            )
        if identity.cannot_replay:
            raise ReplayNotPossible(
                f"{refusal}: it reads {identity.spec}, and {identity.cannot_replay}. The hour's changes that were ingested "
                f"are in cdc.{name} already; to read the table's past again, ingest a snapshot export of it (for example "
                "Debezium's initial snapshot written to a file) into a new table"
            )
        source = open_history(identity, spec)
        try:
            why = identity.mismatch(source.identity(position.source_offset))
            if why is not None:
                raise SourceChanged(f"{identity.spec} is no longer the history its writer read ({why})")
            for records in source.history(position.source_offset, max_records):
                parts.append(with_source_log(_in_hour(records, hour_us), position.writer_id))  # its change log
        except SourceChanged as exc:
            raise ReplayNotPossible(f"{refusal}: {exc}; restore what the writer read to replay it") from None
        read.append({"source": identity.spec, "until": position.source_offset})
    rows = pa.concat_tables(parts) if parts else with_source_log(CDC_RECORD_SCHEMA.empty_table(), None)
    return rows, compact_json(read)


def _in_hour(records: pa.Table, hour_us: int) -> pa.Table:
    times = pc.cast(records.column("event_time"), pa.int64())
    mask = pc.and_(pc.greater_equal(times, hour_us), pc.less(times, hour_us + US_PER_HOUR))
    return records.filter(mask)


def _cdc_rows(records: pa.Table) -> pa.Table:
    """Records (in the CDC record schema, read back from cdc.<table>, a history without arrival times) as
    cdc.<table> rows; their change log is kept where they carry one, else unknown (null)."""
    names = [n for n in CDC_RECORD_SCHEMA.names if n in records.schema.names]
    rows = cdc_records(records.select(names).cast(pa.schema([CDC_RECORD_SCHEMA.field(n) for n in names])))
    log = records.column(SOURCE_LOG).cast(pa.string()) if SOURCE_LOG in records.schema.names else pa.nulls(rows.num_rows, pa.string())
    return rows.append_column(pa.field(SOURCE_LOG, pa.string()), log)


def _identities(rows: pa.Table) -> pl.DataFrame:
    frame = pl.from_arrow(rows.select(list(RECORD_IDENTITY)))
    assert isinstance(frame, pl.DataFrame)
    return frame


def _by_log(new: pl.DataFrame, added: pl.DataFrame, removed: pl.DataFrame) -> dict[str, dict[str, int]]:
    """Per change log: the records the replay wrote, and those it added and removed."""
    figures = {"records": records_by_log(new), "added": records_by_log(added), "removed": records_by_log(removed)}
    logs = sorted(set().union(*figures.values()))
    return {log: {name: counts.get(log, 0) for name, counts in figures.items()} for log in logs}


def _replay(job: Job, hour_us: int, read: Callable[[], tuple[pa.Table, str | None]], force: bool) -> ReplayResult:
    identifier = job.identifier
    if (landed := job.landed_before()) is not None:  # a re-run of a job id that landed: idempotent
        summary = landed.summary.additional_properties
        job.abort()
        return ReplayResult(
            identifier, iso_z(hour_us), job.job_id, landed.snapshot_id, int(summary.get(K.REPLAY_RECORDS, "0")),
            int(summary.get(K.REPLAY_REPLACED_RECORDS, "0")), int(summary.get(K.REPLAY_ADDED_RECORDS, "0")),
            int(summary.get(K.REPLAY_REMOVED_RECORDS, "0")), int(summary.get(K.LATE_RECORDS, "0")), 0,
            int(summary.get(K.REPLAY_KEPT_RECORDS, "0")), summary.get(K.REPLAY_SOURCE), already_committed=True,
            by_log=json.loads(summary[K.REPLAY_BY_LOG]) if K.REPLAY_BY_LOG in summary else None,
        )
    records, history = read()
    records = _cdc_rows(records)
    rows = _in_hour(records, hour_us)
    ignored = records.num_rows - rows.num_rows
    # what a privacy request erased stays erased, however often the history is read again
    erasures = load_erasures(job.catalog, TableSpec.from_properties(identifier.split(".", 1)[1], job.table.properties))
    rows, erased = without_erased(rows, erasures)
    job.expect_erasures(erasures.version)
    partition = hour_partition(job.table.metadata, hour_us)
    job.target([partition])
    new_files = job.write(rows)
    new_ids = _identities(rows)
    times = pc.cast(rows.column("event_time"), pa.int64()).to_numpy()
    facts: dict[str, int] = {}
    logs: dict[str, dict[str, int]] = {}

    def summary_at(head: Table) -> dict[str, str]:
        replaced, kept = job.overwrite_split(head)
        old = read_files(head, replaced)
        old_ids = _identities(old)
        added_ids, removed_ids = records_not_in(new_ids, old_ids), records_not_in(old_ids, new_ids)
        added, removed = added_ids.height, removed_ids.height
        by_log = _by_log(new_ids, added_ids, removed_ids)
        kept_records = sum(f.record_count for f in kept)
        if not force and removed - added > MAX_NET_LOSS_FRACTION * old.num_rows:
            raise ReplayRefused(
                f"replay of hour {iso_z(hour_us)} of {identifier} would remove {removed:,} records and add {added:,} "
                f"(the hour holds {old.num_rows:,}): refused, nothing committed. A replay of the recorded history "
                "removes nothing; to replace the hour anyway, force it (Dagster: run config force: true)"
            )
        watermark = watermark_of(head.properties)
        late = added if watermark is not None and hour_us < watermark else 0
        facts.update(replaced=old.num_rows, added=added, removed=removed, late=late, kept=kept_records)
        logs.clear()
        logs.update(by_log)
        out = {
            K.REPLAY_HOUR: iso_z(hour_us),
            K.REPLAY_RECORDS: str(rows.num_rows + kept_records),
            K.REPLAY_REPLACED_RECORDS: str(old.num_rows),
            K.REPLAY_ADDED_RECORDS: str(added),
            K.REPLAY_REMOVED_RECORDS: str(removed),
            K.REPLAY_BY_LOG: compact_json(by_log),
            K.REPLAY_KEPT_RECORDS: str(kept_records),
            K.LATE_RECORDS: str(late),
            K.LATE_RECORDS_TOTAL: str(late_records_total(head.metadata) + late),
        }
        if history is not None:
            out[K.REPLAY_SOURCE] = history
        if erased:
            out[K.PRIVACY_ERASED_RECORDS] = str(erased)
        if late:
            out[K.LATE_RECORDS_BY_HOUR] = compact_json({iso_z(hour_us): late})
        if watermark is not None:
            out[K.WATERMARK] = iso_z(watermark)
        if times.size:
            out[K.REPLAY_EVENT_TIME_MIN] = iso_z(int(times.min()))
            out[K.REPLAY_EVENT_TIME_MAX] = iso_z(int(times.max()))
            out[K.EVENT_TIME_BY_HOUR] = encode_by_hour(EventTimeProfile.of(np.asarray(times)).by_hour)
        return out

    committed = job.commit_overwrite(new_files, summary=summary_at)
    reconcile(job.catalog, job.catalog.load_table(identifier))  # its late records reach the ledger now
    result = ReplayResult(
        identifier, iso_z(hour_us), job.job_id, committed.snapshot_id, rows.num_rows + facts.get("kept", 0),
        facts.get("replaced", 0), facts.get("added", 0), facts.get("removed", 0), facts.get("late", 0), ignored,
        facts.get("kept", 0), history, attempts=committed.attempts, by_log=dict(logs),
    )
    log.info("%s: replayed hour %s (%d records, %d added, %d removed, %d kept, %d late; per log %s)", identifier, result.hour,
             result.records, result.added_records, result.removed_records, result.kept_records, result.late_records, result.by_log)
    return result
