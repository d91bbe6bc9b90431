"""A table's watermark-policy changes as checkpoints see them (the property partfin.watermark-policy.change):
when a change took effect, and whether the retained snapshots already hold the new policy's whole window."""

from __future__ import annotations

import json
from dataclasses import dataclass

from partfin_assets.model.stats import CommitStats, CommitWindow, compact_json
from partfin_assets.model.timeutil import iso_z, parse_iso, to_us
from partfin_assets.watermark.policy import PolicyError
from partfin_assets.watermark.registry import parse_policy


@dataclass(frozen=True)
class PolicyChange:
    """The table property partfin.watermark-policy.change: the policy's last change, as checkpoints saw it."""

    before: str
    to: str
    requested_at_us: int  # clock of the first checkpoint that ran under the new policy
    effective_at_us: int | None  # clock of the first one whose whole window was known (None: not yet)

    @classmethod
    def decode(cls, text: str | None) -> PolicyChange | None:
        if not text:
            return None
        entry = json.loads(text)
        effective = entry.get("effective-at")
        return cls(entry["from"], entry["to"], to_us(parse_iso(entry["requested-at"])), to_us(parse_iso(effective)) if effective else None)

    def encode(self) -> str:
        return compact_json({"from": self.before, "to": self.to, "requested-at": iso_z(self.requested_at_us),
                             "effective-at": iso_z(self.effective_at_us) if self.effective_at_us is not None else None})

    def before_covers(self, window: CommitWindow) -> bool:
        """Whether expiry, keeping the window of the policy before, kept all that `window` needs."""
        try:
            return parse_policy(self.before).window.covers(window)
        except PolicyError:
            return False

    def effective(self, clock_us: int) -> PolicyChange:
        return PolicyChange(self.before, self.to, self.requested_at_us, clock_us)

    def settled(self, window: CommitWindow, retained: list[CommitStats], boundary: CommitStats | None) -> bool:
        """Whether the retained snapshots hold the whole window: expiry kept enough for the policy before,
        or every commit in it was made since the change (expiry keeps the new window from then on):
        the window is full (a count) or the commit just beyond it was made since the change (a span)."""
        if self.before_covers(window):
            return True
        if window.commits is not None:
            return len(retained) >= window.commits and retained[-1].clock_us >= self.requested_at_us
        return boundary is not None and boundary.clock_us >= self.requested_at_us
