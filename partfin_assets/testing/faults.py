"""Fault injection for crash and retry tests, switched on by environment variables only.

`EnvFaults` implements `partfin_assets.model.faults.FaultHooks`; only the entry points install it
(`install_faults(EnvFaults())`), production code calls whatever hooks are installed. With the variables unset
every point passes.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def crash_point(name: str) -> None:
    """Crash tests: PARTFIN_CRASH_AT=<name>:<n> kills the process (SIGKILL) at the n-th pass of point <name>.

    Every crash point is also a pause point (`pause_point`)."""
    pause_point(name)
    spec = os.environ.get("PARTFIN_CRASH_AT")
    if not spec or not spec.startswith(name + ":"):
        return
    remaining = int(spec.split(":", 1)[1]) - 1
    if remaining <= 0:
        os.kill(os.getpid(), signal.SIGKILL)
    os.environ["PARTFIN_CRASH_AT"] = f"{name}:{remaining}"


def fail_once(table: str, partition_key: str, home: Path) -> None:
    """Retry tests: PARTFIN_FAIL_ONCE=<table>:<partition key> fails that run once (a marker under `home` remembers)."""
    spec = os.environ.get("PARTFIN_FAIL_ONCE")
    if spec != f"{table}:{partition_key}":
        return
    marker = home / "fail-once" / spec.replace(":", "_").replace("/", "_")
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("failed once\n")
    raise RuntimeError(f"injected failure for {spec} (PARTFIN_FAIL_ONCE)")


def fail_point(name: str) -> None:
    """Failure tests: PARTFIN_FAIL_AT=<name> raises at point <name>, in every process that passes it."""
    if os.environ.get("PARTFIN_FAIL_AT") == name:
        raise RuntimeError(f"injected failure at {name} (PARTFIN_FAIL_AT)")


def pause_point(name: str) -> None:
    """Race tests between real processes: with PARTFIN_PAUSE_AT=<name>[,<name>...] and PARTFIN_PAUSE_DIR=<dir>, the
    first pass of point <name> creates <dir>/<name>.reached and waits until the test creates <dir>/<name>.go (at
    most 10 minutes)."""
    names = [n for n in os.environ.get("PARTFIN_PAUSE_AT", "").split(",") if n]
    if name not in names or not os.environ.get("PARTFIN_PAUSE_DIR"):
        return
    os.environ["PARTFIN_PAUSE_AT"] = ",".join(n for n in names if n != name)  # the first pass only
    folder = Path(os.environ["PARTFIN_PAUSE_DIR"])
    (folder / f"{name}.reached").touch()
    deadline = time.monotonic() + 600
    while not (folder / f"{name}.go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"pause point {name}: never released (PARTFIN_PAUSE_DIR={folder})")
        time.sleep(0.02)


class EnvFaults:
    """The `PARTFIN_CRASH_AT` / `PARTFIN_FAIL_AT` / `PARTFIN_FAIL_ONCE` / `PARTFIN_PAUSE_AT` hooks above."""

    crash_point = staticmethod(crash_point)
    fail_point = staticmethod(fail_point)
    pause_point = staticmethod(pause_point)
    fail_once = staticmethod(fail_once)

