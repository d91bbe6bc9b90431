"""The durable late-data ledger of a cdc table: `<cdc table>__ledger`, one row per (stream, checkpoint, event hour).

Snapshot summaries carry each checkpoint's late records, but snapshots expire (a writer keeps
10-20 of them while one sync run commits hundreds of checkpoints). The ledger is a small
append-only Iceberg table beside the CDC table that keeps, for every checkpoint a stream
committed, the commit's clock and watermark and, per event hour it touched: records, late
records, event-time min/max, source arrival min/max, and t-digests (the `tdigest` package's
dict layout) of event time and of lateness (arrival - event time, seconds; arrival is the
record's `arrival_time`, else the commit's clock). A checkpoint without records (a heartbeat,
or only rejected lines) is one row with hour null and 0 records.

Exactly once per checkpoint: checkpoint ids count up per progress stream (column `stream`: a
Kafka partition's, else the writer's own; column `writer_id` is the writer). The ledger's table
property `partfin.ledger.<stream id>` holds the last checkpoint id recorded for the stream, and
moves in the same commit as the rows (a compare-and-set, like the stream's position); rows at or
below it are never appended again. (Before per-partition positions a Kafka writer's checkpoint
ids counted up per writer, recorded under `partfin.ledger.<writer id>`: that entry still bounds
its partition streams, whose ids go on above it.) Several processes may commit one stream's
checkpoints in turn (a partition moving between the members of a consumer group): a process whose
rows do not follow the recorded id leaves them to `reconcile`, which reads them from the history.
The writer records its checkpoints after its commits (many at a time, see LedgerAppender); a
crash in between is repaired by `reconcile`, which rebuilds the missing rows from the retained
CDC snapshots (their summaries and the data files they added) and runs when a writer starts,
before every snapshot expiry and before compaction. So a checkpoint always reaches the ledger
before its snapshot can expire, and the ledger outlives expiry and compaction.

Replays of an hour (jobs/replay.py, OVERWRITE commits) are recorded too, under the stream and
writer `partfin.replay` with the commit's sequence number as checkpoint id: records = the records new
to the hour, late_records as the replay counted them, no digests.

Readers (checks, `partfin status`, Dagster metadata, the policy lab) read rows with
`read_ledger` and per-hour totals with `hour_totals`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog
from pyiceberg.expressions import AlwaysTrue, BooleanExpression
from pyiceberg.manifest import DataFile, ManifestContent, ManifestEntryStatus
from pyiceberg.table import Table
from pyiceberg.table.snapshots import Snapshot

from partfin_assets.iceberg.catalog import load_table_if_exists
from partfin_assets.iceberg.commit import AttemptFiles, commit_with_retry, new_transaction, remove_snapshots, snapshot_summary_with_commit_id
from partfin_assets.iceberg.files import data_file_paths, data_files, delete_files, read_files
from partfin_assets.iceberg.history import commit_stream, lineage, summary_of, watermark_of
from partfin_assets.iceberg.row_delta import swap_files
from partfin_assets.iceberg.streams import REPLAY_STREAM
from partfin_assets.iceberg.tables import LEDGER_SCHEMA, ensure_ledger_table, ledger_identifier
from partfin_assets.model import summary_keys as K
from partfin_assets.model.records import ARRIVAL_TIME
from partfin_assets.model.stats import (
    CommitStats, EventTimeStats, commit_clock_us, compact_json, digest_from_dict, digest_of_sorted, hour_bounds, source_clock_us,
    suspect_future, tdigest_dict,
)
from partfin_assets.model.summary_keys import JobKind
from partfin_assets.model.timeutil import US_PER_HOUR, US_PER_SECOND, parse_iso, to_us

log = logging.getLogger(__name__)

LEDGER_ARROW_SCHEMA = LEDGER_SCHEMA.as_arrow()
UTC_US = pa.timestamp("us", tz="UTC")

__all__ = [
    "COMMIT_STATS_COLUMNS", "LEDGER_ARROW_SCHEMA", "REPLAY_STREAM", "Checkpoint", "LedgerAppender", "checkpoint_row_dicts", "checkpoint_rows", "hour_rows", "dotted_identifier",
    "ensure_ledger_table", "ledger_commit_stats",
    "hour_totals", "ledger_entry", "ledger_identifier", "read_ledger", "reconcile", "record_rows", "recorded_checkpoints",
    "retained_late_rows",
]


# --------------------------------------------------------------------------- building rows


@dataclass(frozen=True)
class Checkpoint:
    """What a committed checkpoint is, apart from its records."""

    writer_id: str
    stream: str  # the progress stream the checkpoint belongs to: a Kafka partition's, else its writer's
    checkpoint_id: int
    snapshot_id: int
    sequence_number: int | None
    commit_time_us: int  # the writer's clock for the commit
    watermark_us: int | None  # the watermark this commit recorded
    late_by_hour: Mapping[int, int]  # hour (us) -> records that came below the watermark before the commit
    heartbeat_us: int | None = None  # a commit without records: the source's heartbeat (its row's arrival range)
    source_clock_us: int | None = None  # its partfin.source-clock

    @classmethod
    def of_commit(cls, writer_id: str, checkpoint_id: int, snapshot: Snapshot, clock_us: int | None = None) -> Checkpoint:
        """A committed cdc snapshot as the ledger sees it (clock: the writer's, else the one its summary recorded)."""
        summary = summary_of(snapshot)
        stream = writer_id if writer_id == REPLAY_STREAM else commit_stream(summary) or writer_id
        if clock_us is None:
            clock_us = commit_clock_us(summary, snapshot.timestamp_ms)
        heartbeat = summary.get(K.EVENT_TIME_HEARTBEAT)
        if heartbeat is not None and "heartbeat" in suspect_future(summary):
            heartbeat = None  # from a clock ahead of ours: it claims nothing
        return cls(writer_id, stream, checkpoint_id, snapshot.snapshot_id, snapshot.sequence_number, clock_us, watermark_of(summary),
                   _late_by_hour(summary), to_us(parse_iso(heartbeat)) if heartbeat is not None else None, source_clock_us(summary))


def checkpoint_rows(checkpoint: Checkpoint, event_time_us: np.ndarray, arrival: pa.ChunkedArray | pa.Array | None = None) -> pa.Table:
    """The ledger rows of one checkpoint: one per event hour of its records (one row, hour null, without records;
    a heartbeat is that row's arrival range).

    `event_time_us`: the records' event times (int64 epoch us, any order); `arrival`: their
    `arrival_time` column in the same order (nulls, or None: the commit clock is the arrival).
    """
    return rows_table(checkpoint_row_dicts(checkpoint, event_time_us, arrival))


def checkpoint_row_dicts(checkpoint: Checkpoint, event_time_us: np.ndarray, arrival: pa.ChunkedArray | pa.Array | None = None,
                         sorted_event_time_us: np.ndarray | None = None, hours: list[dict] | None = None) -> list[dict]:
    """`checkpoint_rows` as dicts (a writer builds the table of many checkpoints at once, when it records them).

    `sorted_event_time_us`: the same event times ascending, when the caller has them already; `hours`: what
    `hour_rows` made of the records before the commit landed (the writer does it while the commit runs).
    """
    c = checkpoint
    if len(event_time_us) == 0:
        row = _row(c, None, 0, 0)
        row["arrival_min"] = row["arrival_max"] = c.heartbeat_us
        return [row]
    if hours is None:
        hours = hour_rows(event_time_us, arrival, c.commit_time_us, sorted_event_time_us)
        assert hours is not None
    return [{**_row(c, h["hour"], h["records"], int(c.late_by_hour.get(h["hour"], 0))), **h} for h in hours]


def hour_rows(event_time_us: np.ndarray, arrival: pa.ChunkedArray | pa.Array | None, commit_time_us: int | None,
              sorted_event_time_us: np.ndarray | None = None) -> list[dict] | None:
    """The part of a checkpoint's ledger rows its records alone decide, per event hour: records, event-time range
    and digest, arrival range, lateness digest. None when a record's lateness counts from the commit's clock (its
    arrival time is unknown) and `commit_time_us` is not known yet.

    `sorted_event_time_us`: the same event times ascending, when the caller has them already (the writer's
    event-time accumulator sorted them): each hour's event-time digest is then built from its slice.
    """
    event_time_us = np.asarray(event_time_us, dtype=np.int64)
    arrivals = known = None
    if arrival is not None and len(arrival) and pc.count(arrival).as_py():  # some arrival times known
        arrival_int = pc.cast(arrival, pa.int64())
        if arrival_int.null_count and commit_time_us is None:
            return None
        known = pc.is_valid(arrival_int).to_numpy(zero_copy_only=False)
        arrivals = pc.fill_null(arrival_int, commit_time_us or 0).to_numpy(zero_copy_only=False)
    elif commit_time_us is None:
        return None
    hour_of = event_time_us // US_PER_HOUR
    if sorted_event_time_us is None:
        hours = np.unique(hour_of).tolist()
    else:
        bounds = hour_bounds(sorted_event_time_us)
        hours = [int(sorted_event_time_us[start]) // US_PER_HOUR for start in bounds[:-1]]
    rows = []
    # a checkpoint touches a few hours: one mask per hour is cheaper than ordering the whole batch
    for index, hour in enumerate(hours):
        in_hour = hour_of == hour
        if sorted_event_time_us is None:
            hour_times = np.sort(event_time_us[in_hour])
        else:
            hour_times = sorted_event_time_us[bounds[index]:bounds[index + 1]]
        count = hour_times.size
        row = {"hour": hour * US_PER_HOUR, "records": count, "event_time_min": int(hour_times[0]), "event_time_max": int(hour_times[-1]),
               "event_time_digest": compact_json(tdigest_dict(digest_of_sorted(hour_times), count))}
        if arrivals is None:
            lateness = commit_time_us - hour_times[::-1]  # ascending already
        else:
            hour_arrivals = arrivals[in_hour]
            lateness = np.sort(hour_arrivals - event_time_us[in_hour])
            hour_known = hour_arrivals[known[in_hour]]
            if hour_known.size:
                row["arrival_min"], row["arrival_max"] = int(hour_known.min()), int(hour_known.max())
        row["lateness_digest"] = compact_json(tdigest_dict(digest_of_sorted(lateness), count))
        rows.append(row)
    return rows


def _row(c: Checkpoint, hour_us: int | None, records: int, late: int) -> dict:
    return {
        "stream": c.stream, "checkpoint_id": c.checkpoint_id, "snapshot_id": c.snapshot_id, "sequence_number": c.sequence_number,
        "commit_time": c.commit_time_us, "arrival_min": None, "arrival_max": None, "hour": hour_us, "records": records,
        "late_records": late, "event_time_min": None, "event_time_max": None, "event_time_digest": None,
        "lateness_digest": None, "watermark": c.watermark_us, "writer_id": c.writer_id, "source_clock": c.source_clock_us,
    }


def rows_table(rows: list[dict]) -> pa.Table:
    columns = {}
    for f in LEDGER_ARROW_SCHEMA:
        values = [r[f.name] for r in rows]
        columns[f.name] = pa.array(values, pa.int64()).cast(f.type) if pa.types.is_timestamp(f.type) else pa.array(values, f.type)
    return pa.Table.from_pydict(columns, schema=LEDGER_ARROW_SCHEMA)


# --------------------------------------------------------------------------- recording rows, exactly once


def recorded_checkpoints(properties: Mapping[str, str]) -> dict[str, int]:
    """stream id (an older Kafka table: also writer id) -> the last checkpoint id the ledger holds for it."""
    prefix = K.PROP_LEDGER_PREFIX
    return {k[len(prefix):]: int(v) for k, v in properties.items() if k.startswith(prefix)}


def _recorded_up_to(recorded: Mapping[str, int], stream: str, writer_id: str) -> int:
    """The last checkpoint id of `stream` the ledger holds (its writer's entry from before per-partition ids bounds it)."""
    return max(recorded.get(stream, 0), recorded.get(writer_id, 0))


def record_rows(catalog: Catalog, cdc_identifier: str, rows: pa.Table, *, contiguous: bool = True) -> set[str]:
    """Append the rows of checkpoints the ledger does not hold yet, in one commit; returns the streams left out.

    With `contiguous`, a stream whose rows do not begin right after its recorded checkpoint (an
    earlier one is missing: a crashed process, or another member of a consumer group, committed it)
    is left out; `reconcile` fills the gap from the CDC history.
    """
    if rows.num_rows == 0:
        return set()
    frame = pl.from_arrow(rows.select(["stream", "writer_id", "checkpoint_id"]))
    assert isinstance(frame, pl.DataFrame)
    left_out: set[str] = set()
    attempt = AttemptFiles()  # an attempt's file(s): removed if that attempt does not land

    def build(table: Table, commit_id: str):
        left_out.clear()
        recorded = recorded_checkpoints(table.properties)
        keep = np.zeros(rows.num_rows, dtype=bool)
        last: dict[str, int] = {}
        for (stream, writer), part in frame.with_row_index().group_by(["stream", "writer_id"]):
            done = _recorded_up_to(recorded, stream, writer)
            new = part.filter(pl.col("checkpoint_id") > done)
            if new.is_empty():
                continue
            if contiguous and done and new["checkpoint_id"].min() != done + 1:
                left_out.add(stream)
                continue
            keep[new["index"].to_numpy()] = True
            last[stream] = int(new["checkpoint_id"].max())
        if not last:
            return None
        summary = snapshot_summary_with_commit_id({K.LEDGER_CHECKPOINTS: compact_json(last)}, commit_id, JobKind.INTO)
        new = rows.filter(pa.array(keep))
        tx = new_transaction(table)
        tx.set_properties({K.PROP_LEDGER_PREFIX + stream: str(n) for stream, n in last.items()})
        current = table.current_snapshot()
        files = int(summary_of(current).get("total-data-files", "0")) if current is not None else 0
        small = [] if files < LEDGER_MAX_SMALL_FILES else [
            f for f in data_files(table, current) if f.file_size_in_bytes < LEDGER_SMALL_FILE_BYTES
        ]
        if len(small) < LEDGER_MAX_SMALL_FILES:
            attempt.append(tx, table, new, summary)
            return tx
        # one small file per commit would pile up (readers open every one): fold them into one with the new rows
        swap_files(tx, summary, small, attempt.write(table, pa.concat_tables([read_files(table, small, deletes=[]), new.cast(LEDGER_ARROW_SCHEMA)])))
        return tx

    if not catalog.table_exists(ledger_identifier(cdc_identifier)):  # created with the cdc table; a table older than the ledger
        ensure_ledger_table(catalog, cdc_identifier)
    result = commit_with_retry(catalog, ledger_identifier(cdc_identifier), build, files=attempt)
    if result.snapshot is not None:
        _expire_ledger_snapshots(result.table)
    return left_out


LEDGER_SMALL_FILE_BYTES = 8 * 1024 * 1024
LEDGER_MAX_SMALL_FILES = 32


LEDGER_KEEP_SNAPSHOTS = 5  # the ledger's rows are its live files: older snapshots only slow its commits down
LEDGER_EXPIRY_SLACK = 20


def _expire_ledger_snapshots(ledger: Table) -> None:
    snapshots = sorted(ledger.metadata.snapshots, key=lambda s: s.sequence_number)
    if len(snapshots) <= LEDGER_KEEP_SNAPSHOTS + LEDGER_EXPIRY_SLACK:
        return
    expired, kept = snapshots[:-LEDGER_KEEP_SNAPSHOTS], snapshots[-LEDGER_KEEP_SNAPSHOTS:]
    # small files folded since (most manifests are shared between snapshots: each is read once)
    folded = data_file_paths(ledger, expired) - data_file_paths(ledger, kept)
    if remove_snapshots(ledger, expired):
        delete_files(ledger.io, sorted(folded))


class LedgerAppender:
    """The writer's side: rows of each committed checkpoint, recorded many checkpoints at a time.

    One ledger commit costs about what a small checkpoint's commit does, so rows wait until
    `max_pending` checkpoints or `max_wait_s` seconds piled up (the next checkpoint, or an idle
    source's empty batch, records them), until a snapshot expiry would remove one of their
    snapshots (`flush_if_expiring`), and when the writer stops. A crash loses only pending rows,
    which `reconcile` rebuilds from the CDC history when the next writer starts.
    """

    def __init__(self, catalog: Catalog, cdc_identifier: str, *, max_pending: int = 100, max_wait_s: float = 5.0) -> None:
        self.catalog = catalog
        self.cdc_identifier = cdc_identifier
        self.max_pending = max_pending
        self.max_wait_s = max_wait_s
        self._pending: list[list[dict]] = []  # per checkpoint: its rows, made a table once, when recorded
        self._since: float | None = None

    @property
    def pending(self) -> int:
        return len(self._pending)

    def add(self, rows: list[dict]) -> None:
        self._pending.append(rows)
        if self._since is None:
            self._since = time.monotonic()
        self.flush_if_due()

    def flush_if_due(self) -> None:
        if self._pending and (len(self._pending) >= self.max_pending or time.monotonic() - self._since >= self.max_wait_s):
            self.flush()

    def flush_if_expiring(self, expired: list[Snapshot]) -> None:
        """Record the pending rows if a snapshot expiry is about to remove the snapshot of one of them (recorded from
        memory, not rebuilt by expiry's `reconcile` from the snapshot's files)."""
        ids = {s.snapshot_id for s in expired}
        if any(rows[0]["snapshot_id"] in ids for rows in self._pending):
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        rows = rows_table([row for rows in self._pending for row in rows])
        left_out = record_rows(self.catalog, self.cdc_identifier, rows)
        self._pending.clear()
        self._since = None
        if left_out:  # another process committed checkpoints of a stream in between: read them from the history
            reconcile(self.catalog, self.catalog.load_table(self.cdc_identifier))


# --------------------------------------------------------------------------- reconcile from CDC history


def ledger_entry(snapshot: Snapshot) -> tuple[str, int] | None:
    """(writer id, checkpoint id) of a cdc snapshot the ledger records: a writer's checkpoint or a replay; else None."""
    found = _stream_checkpoint(snapshot, summary_of(snapshot))
    return (found[0], found[2]) if found is not None else None


def _stream_checkpoint(snapshot: Snapshot, summary: Mapping[str, str]) -> tuple[str, str, int] | None:
    """(writer id, stream id, checkpoint id) of a snapshot the ledger records, else None."""
    kind = summary.get(K.JOB_KIND)
    if kind == JobKind.OVERWRITE and K.REPLAY_HOUR in summary:
        return REPLAY_STREAM, REPLAY_STREAM, int(snapshot.sequence_number or 0)
    if K.WRITER_ID in summary and K.CHECKPOINT_ID in summary and kind in (None, JobKind.INTO):
        return summary[K.WRITER_ID], commit_stream(summary) or summary[K.WRITER_ID], int(summary[K.CHECKPOINT_ID])
    return None


def reconcile(catalog: Catalog, cdc: Table, snapshots: list[Snapshot] | None = None) -> int:
    """Record every retained checkpoint (and replay) of `cdc` the ledger does not hold; returns the rows added.

    `snapshots`: only these (the ones an expiry is about to remove). Cheap when nothing is missing
    (table metadata only); rows of a missing checkpoint are rebuilt from the data files its
    snapshot added, so they equal the ones its writer would have recorded.

    Another process may expire snapshots of `cdc` meanwhile (it records them first) and delete their
    manifest lists: a history that is gone is read again from the table as it is now.
    """
    for attempt in range(RECONCILE_ATTEMPTS):
        try:
            return _reconcile(catalog, cdc, snapshots)
        except FileNotFoundError:
            if attempt == RECONCILE_ATTEMPTS - 1:
                raise
            cdc = catalog.load_table(dotted_identifier(cdc))
            if snapshots is not None:  # those another expiry removed were recorded by it
                snapshots = [s for s in snapshots if cdc.metadata.snapshot_by_id(s.snapshot_id) is not None]
    raise AssertionError("unreachable")


RECONCILE_ATTEMPTS = 5


def _reconcile(catalog: Catalog, cdc: Table, snapshots: list[Snapshot] | None) -> int:
    identifier = dotted_identifier(cdc)
    ledger = ensure_ledger_table(catalog, identifier)
    recorded = recorded_checkpoints(ledger.properties)
    missing: list[tuple[str, str, int, Snapshot]] = []  # (writer id, stream id, checkpoint id, its snapshot)
    for snapshot in lineage(cdc.metadata) if snapshots is None else snapshots:
        summary = summary_of(snapshot)
        found = _stream_checkpoint(snapshot, summary)
        if found is not None and found[2] > _recorded_up_to(recorded, found[1], found[0]):
            missing.append((*found, snapshot))
    if not missing:
        return 0
    missing.sort(key=lambda m: (m[1], m[2]))
    rows = pa.concat_tables([_rows_from_history(cdc, writer, checkpoint_id, snapshot) for writer, _, checkpoint_id, snapshot in missing])
    record_rows(catalog, identifier, rows, contiguous=False)
    log.info("%s: ledger reconciled %d checkpoint(s) from the CDC history", identifier, len(missing))
    return rows.num_rows


def _rows_from_history(cdc: Table, writer_id: str, checkpoint_id: int, snapshot: Snapshot) -> pa.Table:
    summary = summary_of(snapshot)
    checkpoint = Checkpoint.of_commit(writer_id, checkpoint_id, snapshot)
    if writer_id == REPLAY_STREAM:
        hour = to_us(parse_iso(summary[K.REPLAY_HOUR]))
        row = _row(checkpoint, hour, int(summary.get(K.REPLAY_ADDED_RECORDS, "0")), int(summary.get(K.LATE_RECORDS, "0")))
        return rows_table([row])
    records = read_files(cdc, _added_files(cdc, snapshot), deletes=[])
    event_time = pc.cast(records.column("event_time"), pa.int64()).to_numpy(zero_copy_only=False)
    arrival = records.column(ARRIVAL_TIME) if ARRIVAL_TIME in records.schema.names else None
    return checkpoint_rows(checkpoint, event_time, arrival)


def _added_files(table: Table, snapshot: Snapshot) -> list[DataFile]:
    """The data files `snapshot` itself added (its manifests' ADDED entries of its own id)."""
    out = []
    for manifest in snapshot.manifests(table.io):
        if manifest.content != ManifestContent.DATA or manifest.added_snapshot_id != snapshot.snapshot_id:
            continue
        for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
            if entry.status == ManifestEntryStatus.ADDED and entry.snapshot_id == snapshot.snapshot_id:
                out.append(entry.data_file)
    return out


def _late_by_hour(summary: Mapping[str, str]) -> dict[int, int]:
    text = summary.get(K.LATE_RECORDS_BY_HOUR)
    return {to_us(parse_iso(h)): int(n) for h, n in json.loads(text).items()} if text else {}


def dotted_identifier(table: Table) -> str:
    """`namespace.name` of a loaded table."""
    name = table.name()
    return name if isinstance(name, str) else ".".join(name)


# --------------------------------------------------------------------------- reading


def retained_late_rows(cdc: Table, *, after_sequence: int | None = None, up_to_sequence: int | None = None) -> pl.DataFrame:
    """Ledger rows of the late records of `cdc`'s retained checkpoints and replays (of sequence numbers in the
    window, if given), built from their snapshot summaries alone: the late-record columns (`snapshot_id`,
    `sequence_number`, `commit_time`, `hour`, `late_records`) as the ledger holds them or will once their writer
    (or `reconcile`) records them; `records` and the digests are not known here (0, null).

    A writer records its rows after its commits, a few at a time, and a crashed one only at the next
    `reconcile`: readers that must not miss a late record (finalization/late_data.py) add these to the
    ledger's rows. Commits that expired are in the ledger already (reconcile runs before every expiry).
    """
    rows = []
    for snapshot in lineage(cdc.metadata):
        sequence = snapshot.sequence_number
        if after_sequence is not None and sequence is not None and sequence <= after_sequence:
            break  # the lineage goes newest first
        if up_to_sequence is not None and sequence is not None and sequence > up_to_sequence:
            continue
        entry = ledger_entry(snapshot)
        if entry is None or K.LATE_RECORDS_BY_HOUR not in summary_of(snapshot):
            continue
        checkpoint = Checkpoint.of_commit(*entry, snapshot)
        rows += [_row(checkpoint, hour, 0, late) for hour, late in checkpoint.late_by_hour.items() if late > 0]
    frame = pl.from_arrow(rows_table(rows))
    assert isinstance(frame, pl.DataFrame)
    return frame



def read_ledger(
    catalog: Catalog, cdc_identifier: str, *, columns: tuple[str, ...] | None = None, row_filter: BooleanExpression = AlwaysTrue()
) -> pl.DataFrame:
    """The ledger's rows (all columns, or `columns`; those `row_filter` selects), oldest checkpoint first; empty when
    there is no ledger yet."""
    names = list(columns) if columns is not None else LEDGER_ARROW_SCHEMA.names
    ledger = load_table_if_exists(catalog, ledger_identifier(cdc_identifier))
    if ledger is None or ledger.current_snapshot() is None:
        data = LEDGER_ARROW_SCHEMA.empty_table().select(names)
    else:
        data = ledger.scan(row_filter=row_filter, selected_fields=tuple(names)).to_arrow()
    frame = pl.from_arrow(data)
    assert isinstance(frame, pl.DataFrame)
    order = [c for c in ("commit_time", "stream", "checkpoint_id", "hour") if c in names]
    return frame.sort(order, nulls_last=False) if order else frame


HOUR_TOTALS_SCHEMA = {
    "hour": pl.Datetime("us", "UTC"), "records": pl.Int64, "late_records": pl.Int64, "checkpoints": pl.UInt32,
    "event_time_min": pl.Datetime("us", "UTC"), "event_time_max": pl.Datetime("us", "UTC"),
    "p50": pl.Datetime("us", "UTC"), "p99": pl.Datetime("us", "UTC"),
    "first_arrival": pl.Datetime("us", "UTC"), "last_arrival": pl.Datetime("us", "UTC"),
    "first_commit": pl.Datetime("us", "UTC"), "last_commit": pl.Datetime("us", "UTC"),
    # arrival delay (lateness: arrival - event time) of the hour's records, seconds: p50, p99 and max (p100 of the digests)
    "arrival_delay_p50_s": pl.Float64, "arrival_delay_p99_s": pl.Float64, "arrival_delay_max_s": pl.Float64,
}


def hour_totals(ledger: pl.DataFrame) -> pl.DataFrame:
    """Per event hour: records, late records, checkpoints, event-time min/max/p50/p99, first/last arrival and commit,
    and the arrival delay's p50/p99/max.

    Arrival is the source's (`arrival_min/max`), else the commit's clock. p50/p99 merge the rows'
    event-time digests, the arrival delays their lateness digests (null when no row of the hour has
    one, as for replays alone).
    """
    rows = ledger.filter(pl.col("hour").is_not_null())
    if rows.is_empty():
        return pl.DataFrame(schema=HOUR_TOTALS_SCHEMA)
    totals = rows.group_by("hour").agg(
        pl.col("records").sum(),
        pl.col("late_records").sum(),
        pl.len().alias("checkpoints"),
        pl.col("event_time_min").min(),
        pl.col("event_time_max").max(),
        pl.coalesce("arrival_min", "commit_time").min().alias("first_arrival"),
        pl.coalesce("arrival_max", "commit_time").max().alias("last_arrival"),
        pl.col("commit_time").min().alias("first_commit"),
        pl.col("commit_time").max().alias("last_commit"),
        pl.col("event_time_digest").drop_nulls().alias("digests"),
        (pl.col("lateness_digest") if "lateness_digest" in rows.columns else pl.lit(None, pl.String)).drop_nulls().alias("delays"),
    )
    p50, p99 = [], []
    for digests, low, high in zip(totals["digests"].to_list(), totals["event_time_min"].to_list(), totals["event_time_max"].to_list()):
        quantiles = _merged_quantiles(digests, (0.5, 0.99))
        bound = (to_us(low), to_us(high)) if quantiles else (0, 0)
        p50.append(_clamped_us(quantiles[0], bound) if quantiles else None)
        p99.append(_clamped_us(quantiles[1], bound) if quantiles else None)
    delays = [_merged_quantiles(texts, (0.5, 0.99, 1.0)) for texts in totals["delays"].to_list()]
    return (
        totals.drop("digests", "delays")
        .with_columns(pl.Series("p50", p50, pl.Int64).cast(pl.Datetime("us", "UTC")),
                      pl.Series("p99", p99, pl.Int64).cast(pl.Datetime("us", "UTC")),
                      *(pl.Series(name, [d[i] if d else None for d in delays], pl.Float64)
                        for i, name in enumerate(("arrival_delay_p50_s", "arrival_delay_p99_s", "arrival_delay_max_s"))))
        .select(list(HOUR_TOTALS_SCHEMA))
        .sort("hour")
    )


def _merged_quantiles(digest_texts: list[str] | None, quantiles: tuple[float, ...]) -> tuple[float, ...] | None:
    """Quantiles of the merge of several t-digests (JSON text), or None when there are none."""
    if not digest_texts:
        return None
    merged = digest_from_dict(json.loads(digest_texts[0]))
    for text in digest_texts[1:]:
        merged = merged.merge(digest_from_dict(json.loads(text)))
    return tuple(float(merged.quantile(q)) for q in quantiles)


def _clamped_us(seconds: float, bound: tuple[int, int]) -> int:
    return min(max(int(round(seconds * US_PER_SECOND)), bound[0]), bound[1])


COMMIT_STATS_COLUMNS = ("stream", "checkpoint_id", "snapshot_id", "commit_time", "source_clock", "arrival_min", "arrival_max", "hour",
                        "records", "event_time_min", "event_time_max", "event_time_digest")


def ledger_commit_stats(rows: pl.DataFrame, tolerance_us: int, *, with_digest: bool = False) -> list[CommitStats]:
    """The stats-bearing checkpoints among ledger rows (COMMIT_STATS_COLUMNS), as the watermark policy sees
    them, in the order of the rows' first appearance (read_ledger: oldest first).

    The same as a retained snapshot's `commit_stats`: low = min event time (or the heartbeat of a
    checkpoint without records); event hours past the commit clock + `tolerance_us` are suspect and
    claim nothing (a checkpoint of only those, or one without records or heartbeat, is left out).
    Also the frontier a policy reading arrival sees: arrival = the latest source arrival (None: the commit
    clock), high = the latest plausible event time (to the hour's rows: capped at clock + tolerance)
    or heartbeat.
    """
    out: list[CommitStats] = []
    rows = rows.filter(pl.col("stream") != REPLAY_STREAM)  # an hour's replay is no checkpoint of a stream
    if rows.is_empty():
        return out
    frame = rows.with_columns(
        *(pl.col(c).dt.epoch("us") for c in ("commit_time", "source_clock", "arrival_min", "arrival_max", "hour", "event_time_min",
                                             "event_time_max"))
    )
    for part in frame.partition_by(["stream", "checkpoint_id"], maintain_order=True):
        clock = int(part["commit_time"][0])
        limit = clock + tolerance_us
        data = part.filter(pl.col("hour").is_not_null() & (pl.col("records") > 0))
        plausible = data.filter(pl.col("hour") <= limit)
        arrival_max = part["arrival_max"].drop_nulls()
        arrival = int(arrival_max.max()) if arrival_max.len() and arrival_max.max() <= limit else None
        snapshot_id = int(part["snapshot_id"][0])
        source_clock = part["source_clock"][0]
        if data.is_empty():
            if arrival is None:
                continue  # no records (only rejected lines) and no heartbeat: no progress
            out.append(CommitStats(snapshot_id, arrival, EventTimeStats(), clock, arrival, arrival, source_clock))
            continue
        if plausible.is_empty():
            continue  # all of it from a clock ahead of ours
        high = int(min(plausible["event_time_max"].max(), limit))
        stats = EventTimeStats(int(data["records"].sum()), int(data["event_time_min"].min()), int(data["event_time_max"].max()))
        if with_digest:
            digests = [digest_from_dict(json.loads(t)) for t in data.sort("hour")["event_time_digest"].to_list()]
            merged = digests[0]
            for digest in digests[1:]:
                merged = merged.merge(digest)
            stats = EventTimeStats(stats.count, stats.min_us, stats.max_us, merged)
        out.append(CommitStats(snapshot_id, stats.min_us, stats, clock, arrival, high, source_clock))
    return out
