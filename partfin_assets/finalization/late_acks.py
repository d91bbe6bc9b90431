"""Acknowledged late data: an hour's late records that its owners decided need no re-run.

The late_data check WARNs while an hour holds late records its downstream run has not seen. Besides
re-running the hour, its owners may acknowledge them (`partfin late-data ack`, or the Dagster job
`acknowledge_late_<table>`): who, when and why, durably in the Iceberg catalog, as one table
property of cdc.<table> per hour, `partfin.late-data.ack.<hour>` (one key per hour, so two
acknowledgements of different hours never overwrite each other), set through the commit layer.

An acknowledgement covers exactly the late records it was shown: the hour's late commits up to the
newest one then (its cdc sequence number), of which it records the count. It is shown every late
commit up to that one, whether or not its writer has recorded it in the ledger yet (`late_data`
reads the commits the ledger does not hold yet from their snapshots), so no late commit with a lower
sequence number can turn up after it. Late records that reach the hour afterwards are not covered,
and raise the WARN again until the hour is re-run or acknowledged again; the finalization sensor
requests no re-run for late records an acknowledgement covers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pyiceberg.catalog import Catalog

from partfin_assets.finalization.hours import hour_key
from partfin_assets.finalization.late_data import LateCommit, LateHour, late_data
from partfin_assets.iceberg.catalog import load_existing_table
from partfin_assets.iceberg.commit import set_table_properties
from partfin_assets.model import summary_keys as K
from partfin_assets.model.errors import InvalidInput
from partfin_assets.model.timeutil import iso_z, now_utc, parse_iso, to_us


@dataclass(frozen=True)
class LateAck:
    hour_us: int
    through_sequence: int | None  # the newest late commit of the hour it covers (cdc sequence number)
    through_commit_us: int  # ... and its commit clock (for ledger rows without a sequence number)
    late_records: int  # the hour's late records it covers
    by: str
    at_us: int
    reason: str

    def covers(self, commit: LateCommit) -> bool:
        if commit.sequence_number is not None and self.through_sequence is not None:
            return commit.sequence_number <= self.through_sequence
        return commit.committed_at_us <= self.through_commit_us

    def as_dict(self) -> dict:
        return {"hour": iso_z(self.hour_us), "late_records": self.late_records, "by": self.by, "at": iso_z(self.at_us),
                "reason": self.reason}

    def property_value(self) -> str:
        return json.dumps({"through_sequence": self.through_sequence, "through_commit": iso_z(self.through_commit_us),
                           "late_records": self.late_records, "by": self.by, "at": iso_z(self.at_us), "reason": self.reason},
                          separators=(",", ":"))


def acks_of(properties: Mapping[str, str]) -> dict[int, LateAck]:
    """hour -> its newest acknowledgement, from cdc.<table>'s properties."""
    out = {}
    for key, value in properties.items():
        if not key.startswith(K.PROP_LATE_ACK_PREFIX):
            continue
        hour = to_us(parse_iso(key[len(K.PROP_LATE_ACK_PREFIX):]))
        entry = json.loads(value)
        out[hour] = LateAck(hour, entry["through_sequence"], to_us(parse_iso(entry["through_commit"])), entry["late_records"],
                            entry["by"], to_us(parse_iso(entry["at"])), entry["reason"])
    return out


def unacknowledged(entry: LateHour, commits: Sequence[LateCommit], acks: Mapping[int, LateAck]) -> list[LateCommit]:
    """`commits` (late commits of the hour of `entry`) that no acknowledgement of that hour covers."""
    ack = acks.get(entry.hour_us)
    return [c for c in commits if ack is None or not ack.covers(c)]


def unacknowledged_late(late: Mapping[int, LateHour], acks: Mapping[int, LateAck]) -> dict[int, LateHour]:
    """`late` without the late commits an acknowledgement covers (hours left with none: dropped)."""
    out = {}
    for hour, entry in late.items():
        commits = unacknowledged(entry, entry.commits, acks)
        if commits:
            out[hour] = LateHour(hour, sum(c.records for c in commits), tuple(commits))
    return out


def acknowledged_hours(late: Mapping[int, LateHour], acks: Mapping[int, LateAck]) -> dict[int, LateAck]:
    """Hours whose every late record is acknowledged (late records after the acknowledgement: not listed)."""
    return {hour: acks[hour] for hour, entry in late.items() if hour in acks and not unacknowledged(entry, entry.commits, acks)}


def acknowledge_late_hours(catalog: Catalog, name: str, hours: Sequence[int] | None, reason: str, by: str) -> list[LateAck]:
    """Acknowledge the late records `hours` of cdc.<name> hold now (None: every hour holding late records)."""
    if not reason.strip():
        raise InvalidInput("an acknowledgement needs a reason (--reason): why the late records need no re-run")
    identifier = f"cdc.{name}"
    load_existing_table(catalog, identifier, "ingest into it first (partfin ingest)")
    late = late_data(catalog, identifier)
    wanted = sorted(late) if hours is None else sorted(set(hours))
    without = [hour_key(h) for h in wanted if h not in late]
    if without:
        raise InvalidInput(f"{identifier} has no late records in hour(s) {', '.join(without)}: nothing to acknowledge")
    if not wanted:
        raise InvalidInput(f"{identifier} has no late records: nothing to acknowledge")
    at = to_us(now_utc())
    acks = []
    for hour in wanted:
        newest = max(late[hour].commits, key=lambda c: (c.sequence_number or 0, c.committed_at_us))
        acks.append(LateAck(hour, newest.sequence_number, newest.committed_at_us, late[hour].records, by, at, reason.strip()))
    set_table_properties(catalog, identifier, {f"{K.PROP_LATE_ACK_PREFIX}{iso_z(a.hour_us)}": a.property_value() for a in acks})
    return acks
