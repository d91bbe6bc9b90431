"""Replay / backfill of one hour of cdc.<table> from the source: an OVERWRITE job (DESIGN §6).

The replay writes the hour's records as read again from the source and commits an
overwrite that replaces *whatever the hour holds at the head it lands on*: it
never fails for concurrency; a concurrent append into the same hour that
finished first is replaced (the matrix: "both succeed; later replaces").

Watermark and stats semantics (decided here, see DESIGN §4 "commits that carry no
stats ... overwrites"):

- The replay commit carries **no** `partfin.event-time.*` entries, so the
  watermark policy skips it when looking back X commits and snapshot expiry does
  not count it as one of those X. Its own stats go under `partfin.replay.*`
  (records, min/max event time, records added / removed compared with the hour it
  replaced) plus the per-hour entry `partfin.event-time.by-hour` that partition
  metadata reads.
- It never sets `partfin.watermark`: the watermark cannot move, back or forward.
  The summary records the watermark in force (`partfin.watermark`) unchanged, so
  the watermark history stays monotonic.
- Late-data accounting: records the replay adds to an hour that is already below
  the watermark (finalized, or partly so) are late data exactly like late CDC
  records: counted in `partfin.late-records`, `partfin.late-records.by-hour` and
  the running `partfin.late-records.total`, so the late-data check and
  `late_after_run` flag the downstream hour. Records merely rewritten (same key and
  source position as before) are not late. All of this is re-derived on every
  commit attempt against the head the commit lands on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog
from pyiceberg.table import Table

from partfin_assets.iceberg.files import hour_partition, live_files, read_files
from partfin_assets.iceberg.history import late_records_total, watermark_of
from partfin_assets.jobs.job import Hook, Job
from partfin_assets.model import summary_keys as K
from partfin_assets.model.records import CDC_RECORD_SCHEMA, CdcSource
from partfin_assets.model.stats import EventTimeProfile, compact_json, encode_by_hour
from partfin_assets.model.summary_keys import JobKind
from partfin_assets.model.timeutil import US_PER_HOUR, floor_hour_us, iso_z

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplayResult:
    table: str
    hour: str  # ISO Z
    job_id: str
    snapshot_id: int | None
    records: int  # the hour after the replay
    replaced_records: int  # the hour before, at the head the replay replaced
    added_records: int  # not there before (key + source_seq)
    removed_records: int
    late_records: int  # added records below the watermark
    ignored_outside_hour: int  # records given that were not in the hour
    already_committed: bool = False
    attempts: int = 1

    def metadata(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def records_for_hour(source: CdcSource, hour_us: int, *, start_offset: str | None = None, max_records: int = 100_000, max_batches: int | None = None) -> pa.Table:
    """The CDC records of one hour, read from the source from `start_offset` (None: its beginning).

    Reads until the source is exhausted (or `max_batches`): a following source needs max_batches.
    """
    hour_us = floor_hour_us(hour_us)
    parts = []
    for i, batch in enumerate(source.batches(start_offset, max_records)):
        if max_batches is not None and i >= max_batches:
            break
        parts.append(_in_hour(batch.records, hour_us))
    if not parts:
        return CDC_RECORD_SCHEMA.empty_table()
    return pa.concat_tables(parts)


def _in_hour(records: pa.Table, hour_us: int) -> pa.Table:
    times = pc.cast(records.column("event_time"), pa.int64())
    mask = pc.and_(pc.greater_equal(times, hour_us), pc.less(times, hour_us + US_PER_HOUR))
    return records.filter(mask)


def _identities(rows: pa.Table) -> pl.DataFrame:
    frame = pl.from_arrow(rows.select(["key", "source_seq"]))
    assert isinstance(frame, pl.DataFrame)
    return frame


def replay_hour(
    catalog: Catalog,
    name: str,
    hour_us: int,
    records: pa.Table,
    *,
    job_id: str | None = None,
    before_commit: Hook | None = None,
) -> ReplayResult:
    """Replace hour `hour_us` of cdc.<name> by `records` (CDC record schema; rows outside the hour are ignored).

    With a caller-chosen `job_id` the replay is idempotent: a re-run after an unknown outcome
    that finds the job in the history returns it without committing again.
    """
    identifier = f"cdc.{name}"
    hour_us = floor_hour_us(hour_us)
    if not records.schema.equals(CDC_RECORD_SCHEMA, check_metadata=False):
        records = records.select(CDC_RECORD_SCHEMA.names).cast(CDC_RECORD_SCHEMA)
    rows = _in_hour(records, hour_us)
    ignored = records.num_rows - rows.num_rows
    with Job.start(catalog, identifier, JobKind.OVERWRITE, job_id=job_id, before_commit=before_commit) as job:
        partition = hour_partition(job.table.metadata, hour_us)
        if job_id is not None and (landed := job.landed_before()) is not None:
            summary = landed.summary.additional_properties
            job.abort()
            return ReplayResult(
                identifier, iso_z(hour_us), job.job_id, landed.snapshot_id, int(summary.get(K.REPLAY_RECORDS, "0")),
                int(summary.get(K.REPLAY_REPLACED_RECORDS, "0")), int(summary.get(K.REPLAY_ADDED_RECORDS, "0")),
                int(summary.get(K.REPLAY_REMOVED_RECORDS, "0")), int(summary.get(K.LATE_RECORDS, "0")), ignored, True,
            )
        job.target([partition])
        new_files = job.write(rows)
        new_ids = _identities(rows)
        times = pc.cast(rows.column("event_time"), pa.int64()).to_numpy()
        facts: dict[str, int] = {}

        def summary_at(head: Table) -> dict[str, str]:
            old = read_files(head, [f for fs in live_files(head, None, [partition]).values() for f in fs])
            old_ids = _identities(old)
            added = new_ids.join(old_ids, on=["key", "source_seq"], how="anti").height
            removed = old_ids.join(new_ids, on=["key", "source_seq"], how="anti").height
            watermark = watermark_of(head.properties)
            late = added if watermark is not None and hour_us < watermark else 0
            facts.update(replaced=old.num_rows, added=added, removed=removed, late=late)
            out = {
                K.REPLAY_HOUR: iso_z(hour_us),
                K.REPLAY_RECORDS: str(rows.num_rows),
                K.REPLAY_REPLACED_RECORDS: str(old.num_rows),
                K.REPLAY_ADDED_RECORDS: str(added),
                K.REPLAY_REMOVED_RECORDS: str(removed),
                K.LATE_RECORDS: str(late),
                K.LATE_RECORDS_TOTAL: str(late_records_total(head.metadata) + late),
            }
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
        result = ReplayResult(
            identifier, iso_z(hour_us), job.job_id, committed.snapshot_id, rows.num_rows, facts.get("replaced", 0),
            facts.get("added", 0), facts.get("removed", 0), facts.get("late", 0), ignored, attempts=committed.attempts,
        )
        log.info("%s: replayed hour %s (%d records, %d added, %d removed, %d late)", identifier, result.hour,
                 result.records, result.added_records, result.removed_records, result.late_records)
        return result


def replay_hour_from_source(catalog: Catalog, name: str, hour_us: int, source: CdcSource, **kwargs) -> ReplayResult:
    """Read hour `hour_us` again from `source` and replay it (see records_for_hour for bounds)."""
    read_options = {k: kwargs.pop(k) for k in ("start_offset", "max_records", "max_batches") if k in kwargs}
    return replay_hour(catalog, name, hour_us, records_for_hour(source, hour_us, **read_options), **kwargs)


def hours_of(records: pa.Table) -> Iterable[int]:
    times = pc.cast(records.column("event_time"), pa.int64()).to_numpy()
    return sorted({int(h) for h in np.unique(times // US_PER_HOUR * US_PER_HOUR)})
