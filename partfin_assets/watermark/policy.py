"""What a watermark policy is: a value with its window, its candidate and the state it keeps.

A policy looks at a stream's commits (its window: the commit being made, then older ones, newest
first) and proposes an hour-aligned candidate; the watermark never moves back (step.py). A policy
that learns from the table's history keeps a state, persisted in a table property of its own
(`state_property`), refreshed from the late-data ledger as it sees fit (`refresh_state`).
Every policy is a frozen dataclass registered by its `kind` in registry.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import polars as pl

from partfin_assets.model.errors import InvalidInput
from partfin_assets.model.stats import CommitStats, CommitWindow
from partfin_assets.model.timeutil import US_PER_HOUR, US_PER_SECOND, floor_hour_us, parse_duration

# an event hour's lateness is known once it ended at least this long ago (its late records have arrived):
# what a learning policy learns from, and what the policy lab measures
LEARN_MATURITY_US = 6 * US_PER_HOUR
# (columns, first event hour in us) -> the table's ledger rows of those hours on (at least): what a policy learns from
LedgerRows = Callable[[Sequence[str], int], pl.DataFrame]


class PolicyError(InvalidInput):
    """A watermark policy text that does not parse (e.g. a table property set by hand)."""


def parse_window(text: str) -> CommitWindow:
    """`X` commits or a duration of arrival (`30m`)."""
    if text.isdigit():
        return CommitWindow(commits=int(text))
    span = parse_duration(text)
    return CommitWindow(span_us=int(span.total_seconds() * US_PER_SECOND))


def format_window(window: CommitWindow) -> str:
    if window.commits is not None:
        return str(window.commits)
    seconds = window.span_us // US_PER_SECOND
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def min_low_us(commits: Sequence[CommitStats]) -> int:
    """floor_to_hour(min of min_i over the window): min_i a commit's min event time, or its heartbeat time."""
    return floor_hour_us(min(c.low_us for c in commits))


class WatermarkPolicy:
    """The interface every policy implements (subclasses are frozen dataclasses)."""

    kind: ClassVar[str]  # its name in the registry and the first part of its text
    forms: ClassVar[str]  # its texts, for the error that lists every policy's
    needs_digest: ClassVar[bool] = False  # whether its window's commits carry their event-time digests
    state_property: ClassVar[str | None] = None  # the table property its learned state persists in
    window: CommitWindow  # the commits looked at (a learning policy: those of its fallback)

    @classmethod
    def from_args(cls, args: list[str]) -> WatermarkPolicy:
        """The policy from its text's parts after `kind:`; ValueError / PolicyError when they do not fit."""
        raise NotImplementedError

    def check(self, text: str) -> None:
        """PolicyError naming `text` when a parameter is out of range."""

    def candidate_us(self, window: Sequence[CommitStats], state: Any = None) -> int | None:
        """Hour-aligned candidate of a stream from its window (newest first), under the policy's state."""
        raise NotImplementedError

    # ---- the state a learning policy keeps (none by default)

    def load_state(self, stored: str | None) -> Any:
        """The state as `state_property` recorded it (None: nothing usable)."""
        return None

    def refresh_state(self, state: Any, clock_us: int, ledger: LedgerRows) -> tuple[Any, str | None]:
        """The state in force at `clock_us`, and its text to persist when it was learned again (None: unchanged)."""
        return state, None

    def learning(self, state: Any) -> bool:
        """Whether it still runs on its fallback, waiting for history to learn from (a new table's first commits)."""
        return False

    def window_needed(self, state: Any) -> bool:
        """Whether the candidate reads the window's older commits (a learned state may need only the newest)."""
        return True
