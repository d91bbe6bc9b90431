"""Watermark policies: the last few commits' event-time stats -> an hour-aligned, monotonic watermark.

`min-of-last:X`          floor_to_hour(min of min_i over the last X stats-bearing commits)
`percentile:q:last:X`    floor_to_hour(q-quantile of the merged t-digests of the last X commits)

min_i is a commit's min event time, or its heartbeat time when it carried no records.
The new watermark is max(previous, candidate): late data never moves it back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from partfin_assets.model.errors import InvalidInput
from partfin_assets.model.stats import CommitStats, EventTimeStats
from partfin_assets.model.tablespec import DEFAULT_WATERMARK_POLICY
from partfin_assets.model.timeutil import floor_hour_us


class PolicyError(InvalidInput):
    """A watermark policy text that does not parse (e.g. a table property set by hand)."""


@dataclass(frozen=True)
class WatermarkPolicy:
    lookback: int  # X: stats-bearing commits looked at, this one included
    quantile: float | None = None  # None: min-of-last

    @classmethod
    def parse(cls, spec: str | None) -> WatermarkPolicy:
        text = (spec or DEFAULT_WATERMARK_POLICY).strip()
        parts = text.split(":")
        try:
            if parts[0] == "min-of-last" and len(parts) == 2:
                policy = cls(lookback=int(parts[1]))
            elif parts[0] == "percentile" and len(parts) == 4 and parts[2] == "last":
                policy = cls(lookback=int(parts[3]), quantile=float(parts[1]))
            else:
                raise PolicyError("unknown form")
        except ValueError as exc:
            raise PolicyError(
                f"watermark policy {text!r} is not valid ({exc}); use 'min-of-last:X' or 'percentile:q:last:X'"
            ) from None
        if policy.lookback < 1:
            raise PolicyError(f"watermark policy {text!r}: X must be at least 1")
        if policy.quantile is not None and not 0.0 <= policy.quantile < 1.0:
            raise PolicyError(f"watermark policy {text!r}: q must be in [0, 1)")
        return policy

    def __str__(self) -> str:
        if self.quantile is None:
            return f"min-of-last:{self.lookback}"
        return f"percentile:{self.quantile:g}:last:{self.lookback}"

    def candidate_us(self, commits: Sequence[CommitStats]) -> int | None:
        """Hour-aligned candidate from the last `lookback` stats-bearing commits (newest first)."""
        window = list(commits)[: self.lookback]
        if not window:
            return None
        if self.quantile is None:
            return floor_hour_us(min(c.low_us for c in window))
        with_records = [c.stats for c in window if not c.stats.is_empty]
        heartbeats = [c.low_us for c in window if c.stats.is_empty]
        lows = heartbeats
        if with_records:
            lows = lows + [EventTimeStats.merge_all(with_records).quantile_us(self.quantile)]
        return floor_hour_us(min(lows))


def advance(previous_us: int | None, candidate_us: int | None) -> int | None:
    """Monotonic: the watermark only ever moves forward."""
    if candidate_us is None:
        return previous_us
    if previous_us is None:
        return candidate_us
    return max(previous_us, candidate_us)
