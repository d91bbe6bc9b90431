"""Fault points: where a crash, failure or pause test may act on production code.

Production code calls `faults().crash_point(...)` etc. and knows nothing of how a test drives them: the
installed hooks do nothing unless an entry point (the `partfin` command, the Dagster code location, a test's
own job module) installs others, the environment-driven ones of `partfin_assets.testing.faults`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class FaultHooks(Protocol):
    def crash_point(self, name: str) -> None:
        """May kill the process (SIGKILL) here; every crash point is also a pause point."""

    def fail_point(self, name: str) -> None:
        """May raise here."""

    def pause_point(self, name: str) -> None:
        """May park the process here until a racing test releases it."""

    def fail_once(self, table: str, partition_key: str, home: Path) -> None:
        """May fail this partition's run once (a marker under `home` remembers)."""


class NoFaults:
    """The default: every point passes."""

    def crash_point(self, name: str) -> None:
        pass

    def fail_point(self, name: str) -> None:
        pass

    def pause_point(self, name: str) -> None:
        pass

    def fail_once(self, table: str, partition_key: str, home: Path) -> None:
        pass


_installed: FaultHooks = NoFaults()


def install_faults(hooks: FaultHooks) -> None:
    """Entry points only: the hooks every fault point of this process calls from now on."""
    global _installed
    _installed = hooks


def faults() -> FaultHooks:
    return _installed
