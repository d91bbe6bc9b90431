"""`percentile:q:last:X|30m`: floor_to_hour(q-quantile of the merged t-digests of the window); a commit without
records counts with its heartbeat time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from partfin_assets.model.stats import CommitStats, CommitWindow, EventTimeStats
from partfin_assets.model.timeutil import floor_hour_us
from partfin_assets.watermark.policy import PolicyError, WatermarkPolicy, format_window, parse_window

PERCENTILE = "percentile"


@dataclass(frozen=True)
class Percentile(WatermarkPolicy):
    window: CommitWindow
    quantile: float

    kind = PERCENTILE
    forms = "'percentile:q:last:X' (or ':last:30m')"
    needs_digest = True

    @classmethod
    def from_args(cls, args: list[str]) -> Percentile:
        if len(args) != 3 or args[1] != "last":
            raise PolicyError("unknown form")
        return cls(parse_window(args[2]), quantile=float(args[0]))

    def check(self, text: str) -> None:
        if not 0.0 <= self.quantile < 1.0:
            raise PolicyError(f"watermark policy {text!r}: q must be in [0, 1)")

    def __str__(self) -> str:
        return f"{PERCENTILE}:{self.quantile:g}:last:{format_window(self.window)}"

    def candidate_us(self, window: Sequence[CommitStats], state: Any = None) -> int | None:
        if not window:
            return None
        with_records = [c.stats for c in window if not c.stats.is_empty]
        lows = [c.low_us for c in window if c.stats.is_empty]
        if with_records:
            lows = lows + [EventTimeStats.merge_all(with_records).quantile_us(self.quantile)]
        return floor_hour_us(min(lows))
