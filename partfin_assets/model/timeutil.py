"""Event-time helpers shared by every layer: one representation (epoch microseconds, UTC)."""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta

from partfin_assets.model.errors import InvalidInput

US_PER_SECOND = 1_000_000
US_PER_HOUR = 3600 * US_PER_SECOND


def to_us(dt: datetime) -> int:
    if dt.tzinfo is None:
        raise ValueError(f"naive datetime {dt!r}: event times must be timezone-aware (UTC)")
    delta = dt.astimezone(UTC) - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * US_PER_SECOND + delta.microseconds


def from_us(us: int) -> datetime:
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=int(us))


def floor_hour_us(us: int) -> int:
    return (int(us) // US_PER_HOUR) * US_PER_HOUR


_EPOCH_WALL_CLOCK = datetime(1970, 1, 1)  # naive: formatting UTC wall-clock time needs no zone arithmetic


def iso_z(dt_or_us: datetime | int) -> str:
    """ISO-8601 UTC with a trailing Z, the format of every time stored in snapshot summaries."""
    if isinstance(dt_or_us, datetime):
        dt = dt_or_us.astimezone(UTC).replace(tzinfo=None)
    else:
        dt = _EPOCH_WALL_CLOCK + timedelta(microseconds=int(dt_or_us))
    return dt.isoformat(timespec="microseconds" if dt.microsecond else "seconds") + "Z"


def shown_time(us: int) -> str:
    """A time as people read it in the UI: ISO-8601 UTC to the second (the microseconds iso_z keeps are noise there)."""
    return iso_z(us - us % US_PER_SECOND)


def parse_iso(text: str) -> datetime:
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidInput(f"not a time: {text!r}; expected ISO-8601 UTC, e.g. 2026-01-02T03:00:00Z") from None
    if dt.tzinfo is None:
        raise InvalidInput(f"time {text!r} has no timezone; expected ISO-8601 UTC with a trailing Z")
    return dt.astimezone(UTC)


def now_utc() -> datetime:
    return datetime.now(UTC)


_DURATION = re.compile(r"^(\d+(?:\.\d*)?)(s|m|h|d)?$")
_DURATION_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", None: "seconds"}


def parse_duration(text: str) -> timedelta:
    """`90`, `90s`, `20m`, `6h`, `1d` (a bare number is seconds)."""
    match = _DURATION.match(text.strip())
    if not match:
        raise InvalidInput(f"not a duration: {text!r} (expected e.g. 90s, 20m, 6h)")
    return timedelta(**{_DURATION_UNITS[match.group(2)]: float(match.group(1))})


def format_duration(seconds: float | None) -> str | None:
    """A duration as people read it: `45 s`, `6 h 0 min`, `2 d 3 h` (negative: `-` first; None stays None)."""
    if seconds is None or math.isnan(seconds):
        return None
    if math.isinf(seconds):
        return "never"
    sign, total = ("-" if seconds < 0 else ""), round(abs(seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{sign}{days} d {hours} h"
    if hours:
        return f"{sign}{hours} h {minutes} min"
    if minutes:
        return f"{sign}{minutes} min {secs} s" if minutes < 10 and secs else f"{sign}{minutes} min"
    return f"{sign}{secs} s"
