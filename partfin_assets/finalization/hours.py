"""Which hours are final: hour H is finalized when H + 1h <= W.

Hour keys are Dagster's hourly partition keys (`YYYY-MM-DD-HH:00`, UTC); hours are epoch
microseconds as everywhere else. The finalization sensor's cursor lives here too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime

from partfin_assets.model.errors import InvalidInput
from partfin_assets.model.timeutil import US_PER_HOUR, US_PER_SECOND, floor_hour_us, from_us, iso_z, parse_iso, to_us

HOUR_KEY_FORMAT = "%Y-%m-%d-%H:%M"  # Dagster's HourlyPartitionsDefinition key format


# --------------------------------------------------------------------------- hour keys


def hour_key(hour_us: int) -> str:
    return from_us(floor_hour_us(hour_us)).strftime(HOUR_KEY_FORMAT)


def hour_from_key(key: str) -> int:
    return to_us(datetime.strptime(key, HOUR_KEY_FORMAT).replace(tzinfo=UTC))


def parse_hour(text: str) -> int:
    """An hour a user names: a partition key (2026-01-01-05:00) or an ISO-8601 UTC time on the hour (2026-01-01T05:00:00Z)."""
    try:
        hour = hour_from_key(text)
    except ValueError:
        try:
            hour = to_us(parse_iso(text))
        except InvalidInput:
            raise InvalidInput(f"not an hour: {text!r}; name an hour as 2026-01-01-05:00 or 2026-01-01T05:00:00Z") from None
    if hour != floor_hour_us(hour):
        raise InvalidInput(f"{text!r} is not on the hour; name an hour as 2026-01-01-05:00 or 2026-01-01T05:00:00Z")
    return hour


def is_finalized(hour_us: int, watermark_us: int | None) -> bool:
    """Hour H is finalized when H + 1h <= W."""
    return watermark_us is not None and floor_hour_us(hour_us) + US_PER_HOUR <= watermark_us


def finalized_through(watermark_us: int | None) -> int | None:
    """The last finalized hour (the newest H with H + 1h <= W); None without a watermark."""
    return None if watermark_us is None else floor_hour_us(watermark_us) - US_PER_HOUR


def not_finalized_reason(hour_us: int, watermark_us: int | None, identifier: str) -> str | None:
    """Why hour H of `identifier` may not be used yet, naming the hour and the watermark; None once final."""
    if is_finalized(hour_us, watermark_us):
        return None
    current = iso_z(watermark_us) if watermark_us is not None else "not set"
    return (
        f"hour {iso_z(floor_hour_us(hour_us))} of {identifier} is not finalized: its watermark is {current} "
        f"(needs >= {iso_z(floor_hour_us(hour_us) + US_PER_HOUR)})"
    )


@dataclass(frozen=True)
class FinalizationCursor:
    """The finalization sensor's cursor: the first hour not yet requested, and the cdc sequence number
    base had merged up to when late data was last looked for (None: not yet, e.g. an older cursor)."""

    next_hour_us: int
    merged_sequence: int | None = None

    def encode(self) -> str:
        return json.dumps({"next_hour": iso_z(self.next_hour_us), "merged_sequence": self.merged_sequence})

    @classmethod
    def decode(cls, text: str | None) -> FinalizationCursor | None:
        if not text:
            return None
        state = json.loads(text)
        return cls(to_us(parse_iso(state["next_hour"])), state.get("merged_sequence"))


def newly_finalized(next_hour_us: int, watermark_us: int | None, limit: int | None = None) -> list[int]:
    """Hours in [next_hour, watermark) in order (each finalized: H + 1h <= W), at most `limit`."""
    if watermark_us is None:
        return []
    first = floor_hour_us(next_hour_us)
    last = floor_hour_us(watermark_us) - US_PER_HOUR  # W is hour aligned; floor for safety
    if last < first:
        return []
    count = (last - first) // US_PER_HOUR + 1
    if limit is not None:
        count = min(count, limit)
    return [first + i * US_PER_HOUR for i in range(count)]


def lag_seconds(watermark_us: int | None, now_us: int) -> float | None:
    if watermark_us is None:
        return None
    return round((now_us - watermark_us) / US_PER_SECOND, 3)
