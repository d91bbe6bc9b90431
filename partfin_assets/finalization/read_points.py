"""Which base snapshot the downstream run of hour H reads: the one H's newest finalization event names.

The finalization sensor records one `finalized_<table>` event per hour when it finalizes, naming the
base snapshot current then; when late records for an hour that was already final reach base, it
records an *amendment* of that hour naming the base snapshot that carries them (`amendment: true`,
`late_records`) and requests a re-run. A downstream run of H reads base at the snapshot of H's newest
such event (Iceberg time travel), so a retry or a later run of H gives the same result; rows that
changed after that snapshot (an update moving a row to a later hour) do not change H.

A sensor-requested run carries the snapshot id as run tag `partfin/base-snapshot-id` (a retry keeps
its run's tags); a run without it (launched by hand) reads the newest event of H when it starts and
pins that id as its own tag. No event at all (the hour is not final, or the sensor never ran): the
current snapshot, recorded as such. This module is the Dagster-free part: the tags and event
metadata are plain mappings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pyiceberg.catalog import Catalog
from pyiceberg.expressions import EqualTo
from pyiceberg.table import Table

from partfin_assets.finalization.late_data import LateHour
from partfin_assets.iceberg.catalog import load_table_if_exists
from partfin_assets.iceberg.history import recorded_value, recorded_watermark
from partfin_assets.iceberg.ledger import read_ledger
from partfin_assets.model import summary_keys as K
from partfin_assets.model.ids import id_text
from partfin_assets.model.timeutil import iso_z

BASE_SNAPSHOT_TAG = "partfin/base-snapshot-id"  # run tag: the base snapshot the run reads
AMENDMENT_TAG = "partfin/amendment"  # run tag: "true" on a re-run requested for late data
RUN_FOR_TAG = "partfin/run-for"  # run tag: "finalization" or "amendment" (which event of the hour the run is for)
REASON_TAG = "partfin/reason"  # run tag: why the run was requested, in words (the Runs list shows it)


@dataclass(frozen=True)
class BasePosition:
    """What one base snapshot holds: its id, the watermark and the cdc snapshot it merged up to."""

    snapshot_id: int | None
    watermark_us: int | None
    cdc_snapshot_id: int | None
    cdc_sequence_number: int | None


def cdc_sequence_number(catalog: Catalog, cdc_identifier: str, snapshot_id: int | None) -> int | None:
    """The sequence number of a cdc snapshot: from the table's metadata, else (expired) from the late-data ledger."""
    if snapshot_id is None:
        return None
    cdc = load_table_if_exists(catalog, cdc_identifier)
    snapshot = cdc.metadata.snapshot_by_id(snapshot_id) if cdc is not None else None
    if snapshot is not None:
        return snapshot.sequence_number
    rows = read_ledger(catalog, cdc_identifier, columns=("sequence_number",), row_filter=EqualTo("snapshot_id", snapshot_id))
    known = rows["sequence_number"].drop_nulls()
    return int(known[0]) if len(known) else None


def base_position(catalog: Catalog, base: Table, snapshot_id: int | None = None) -> BasePosition:
    """The position of base at `snapshot_id` (default: its current snapshot), from snapshot summaries."""
    snapshot = base.current_snapshot() if snapshot_id is None else base.metadata.snapshot_by_id(snapshot_id)
    if snapshot is None:
        return BasePosition(None, None, None, None)
    cdc_id = recorded_value(base.metadata, K.PROP_SOURCE_SNAPSHOT_ID, snapshot)
    cdc_snapshot_id = int(cdc_id) if cdc_id else None
    cdc_identifier = base.properties.get(K.PROP_SOURCE_TABLE)
    sequence = cdc_sequence_number(catalog, cdc_identifier, cdc_snapshot_id) if cdc_identifier else None
    return BasePosition(snapshot.snapshot_id, recorded_watermark(base.metadata, snapshot), cdc_snapshot_id, sequence)


def finalization_metadata(hour_us: int, watermark_us: int, position: BasePosition, late: LateHour | None = None) -> dict[str, Any]:
    """Metadata of a `finalized_<table>` event of hour H (an amendment when `late` names H's late records)."""
    out: dict[str, Any] = {
        "hour": iso_z(hour_us),
        "watermark": iso_z(watermark_us),
        "base_snapshot_id": id_text(position.snapshot_id),
        "cdc_snapshot_id": id_text(position.cdc_snapshot_id),
        "cdc_sequence_number": id_text(position.cdc_sequence_number),
        "amendment": late is not None,
    }
    if late is not None:
        out["late_records"] = late.records
        out["late_commits"] = [id_text(c.snapshot_id) for c in late.commits]
    return out


def run_reason_tags(hour_us: int, late: LateHour | None) -> dict[str, str]:
    """Run tags saying which event of the hour a downstream run is for and why: the hour became final (its
    finalization) or late records reached it after (an amendment)."""
    if late is None:
        return {RUN_FOR_TAG: "finalization", REASON_TAG: f"hour {iso_z(hour_us)} became final"}
    return {RUN_FOR_TAG: "amendment",
            REASON_TAG: f"late data: {late.records} record(s) reached hour {iso_z(hour_us)} after it was final"}


def amendments(late: Mapping[int, LateHour], seen_sequence: Mapping[int, int | None]) -> dict[int, LateHour]:
    """The hours to amend: each hour of `seen_sequence` with late commits after the cdc sequence number its newest
    event saw (None: every late commit in `late` is new to it), and just those commits."""
    out = {}
    for hour, seen in seen_sequence.items():
        entry = late.get(hour)
        commits = tuple(c for c in entry.commits if seen is None or (c.sequence_number or 0) > seen) if entry else ()
        if commits:
            out[hour] = LateHour(hour, sum(c.records for c in commits), commits)
    return out


@dataclass(frozen=True)
class ReadPoint:
    snapshot_id: int | None  # None: no event names one, read the current snapshot
    origin: str  # what named it, for the run's metadata and messages
    amendment: bool = False  # named by an amendment (a re-run for late data)


def read_point(run_tags: Mapping[str, str], newest_event: Mapping[str, Any] | None) -> ReadPoint:
    """The base snapshot a run of hour H reads: its run tag, else H's newest finalization event's (metadata values)."""
    tagged = run_tags.get(BASE_SNAPSHOT_TAG)
    if tagged:
        return ReadPoint(int(tagged), f"run tag {BASE_SNAPSHOT_TAG}", run_tags.get(AMENDMENT_TAG) == "true")
    event = newest_event or {}
    if event.get("base_snapshot_id") is not None:
        amendment = bool(event.get("amendment"))
        return ReadPoint(int(event["base_snapshot_id"]), "amendment event" if amendment else "finalization event", amendment)
    return ReadPoint(None, "current snapshot (no finalization event)")


def read_tags(snapshot_id: int | None, *, amendment: bool = False) -> dict[str, str]:
    """Run tags that make a run (and its retries, which keep their run's tags) read base at `snapshot_id`."""
    if snapshot_id is None:
        return {}
    return {BASE_SNAPSHOT_TAG: str(snapshot_id), **({AMENDMENT_TAG: "true"} if amendment else {})}
