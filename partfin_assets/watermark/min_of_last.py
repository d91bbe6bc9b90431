"""`min-of-last:X` / `min-of-last:30m`: floor_to_hour(min of min_i over the stream's last X stats-bearing commits,
or over the commits of the last 30 minutes of arrival)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from partfin_assets.model.stats import CommitStats, CommitWindow
from partfin_assets.watermark.policy import PolicyError, WatermarkPolicy, format_window, min_low_us, parse_window

MIN_OF_LAST = "min-of-last"


@dataclass(frozen=True)
class MinOfLast(WatermarkPolicy):
    window: CommitWindow

    kind = MIN_OF_LAST
    forms = "'min-of-last:X', 'min-of-last:30m'"

    @classmethod
    def from_args(cls, args: list[str]) -> MinOfLast:
        if len(args) != 1:
            raise PolicyError("unknown form")
        return cls(parse_window(args[0]))

    def __str__(self) -> str:
        return f"{MIN_OF_LAST}:{format_window(self.window)}"

    def candidate_us(self, window: Sequence[CommitStats], state: Any = None) -> int | None:
        return min_low_us(window) if window else None
