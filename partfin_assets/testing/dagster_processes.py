"""Starting and stopping real Dagster processes (dagster dev, dagster-daemon) for tests and benches.

Each process starts in its own process group (what `set -m` gives a shell job), so it is
stopped by PID: SIGTERM to the group (Dagster maps it to its SIGINT handler), a bounded
wait, then SIGKILL to the group.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def dagster_env(partfin_home: Path, dagster_home: Path, **extra: str) -> dict[str, str]:
    """Environment for a Dagster process: its own DAGSTER_HOME (with the repo's dagster.yaml) and PARTFIN_HOME."""
    dagster_home.mkdir(parents=True, exist_ok=True)
    partfin_home.mkdir(parents=True, exist_ok=True)
    if not (dagster_home / "dagster.yaml").exists():
        shutil.copy(REPO / "dagster.yaml", dagster_home / "dagster.yaml")
    env = dict(os.environ)
    env.update({"DAGSTER_HOME": str(dagster_home), "PARTFIN_HOME": str(partfin_home), "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def bin_path(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


class DagsterProcess:
    def __init__(self, args: Sequence[str], env: dict[str, str], log_path: Path) -> None:
        self.args = list(args)
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> DagsterProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.args, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # own process group: stoppable by PID, children included
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid  # group leader: pgid == pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(pgid, signal.SIGKILL)  # leftovers of the group (code servers, run workers)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""


def daemon(env: dict[str, str], log_path: Path) -> DagsterProcess:
    return DagsterProcess([bin_path("dagster-daemon"), "run", "-w", str(REPO / "workspace.yaml")], env, log_path)


def dev(env: dict[str, str], log_path: Path, port: int, host: str = "127.0.0.1") -> DagsterProcess:
    return DagsterProcess([bin_path("dagster"), "dev", "-w", str(REPO / "workspace.yaml"), "-h", host, "-p", str(port)], env, log_path)


def wait_for(condition: Callable[[], object], timeout: float, what: str, interval: float = 1.0, on_timeout: Callable[[], str] | None = None):
    """Poll until condition() is truthy; raise TimeoutError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = on_timeout() if on_timeout else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}\n{detail}")
        time.sleep(interval)
