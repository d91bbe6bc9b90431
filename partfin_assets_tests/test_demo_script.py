"""scripts/demo.sh started the way a CI script starts it (in the background from a non-interactive shell,
under nohup) stops cleanly on SIGTERM and on SIGINT, and its log is free of first-run noise.

A background job of a non-interactive shell starts with SIGINT ignored, and `dagster dev` copies SIGINT's
handler onto SIGTERM, so before the fix the demo ignored both.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from partfin_assets.testing.dagster_processes import REPO, wait_for

pytestmark = pytest.mark.timeout(400)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def webserver_up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=3) as response:
            return response.status == 200
    except OSError:
        return False


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whoever adopted it, maybe later)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def ignored_signals(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return int(line.split()[1], 16)
    return 0


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_demo_started_in_background_stops_on_signal(tmp_path, stop_signal):
    home = tmp_path / "partfin"
    log = tmp_path / "demo.log"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "PARTFIN_"))}
    env.update(
        PARTFIN_HOME=str(home),
        PARTFIN_PORT=str(port),
        PARTFIN_SOURCE="synthetic:rate=1,hours=2,key_space=100000",
        PARTFIN_SENSORS="sync",
        PARTFIN_SYNC_INTERVAL="5",
        PYTHONUNBUFFERED="1",
    )
    # what `nohup scripts/demo.sh &` in a CI script does: a background job of a non-interactive shell
    started = subprocess.run(
        ["bash", "-c", f"nohup scripts/demo.sh > {log} 2>&1 & echo $!"], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    pid = int(started.stdout.strip())
    tree: set[int] = set()
    try:
        wait_for(lambda: webserver_up(port), 240, "the demo's webserver", on_timeout=lambda: log.read_text()[-4000:])
        wait_for(lambda: 'Finished execution of run for "sync_orders"' in log.read_text(), 180, "a sync run",
                 on_timeout=lambda: log.read_text()[-4000:])
        tree = descendants(pid)
        assert tree, "dagster dev runs the webserver and the daemon as child processes"
        assert ignored_signals(pid) & (1 << (signal.SIGINT - 1)) == 0, "SIGINT is handled, not ignored"

        os.kill(pid, stop_signal)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and (running(pid) or any(running(p) for p in tree)):
            time.sleep(0.5)
        text = log.read_text()
        assert not running(pid), f"the demo ignored {stop_signal.name}:\n{text[-3000:]}"
        assert not [p for p in tree if running(p)], "the webserver and the daemon stopped with it"
        assert "Shutting down Dagster services" in text

        # a first-time user's log: no Dagster-internal warnings, every materialization line names its partition
        assert "BetaWarning" not in text
        assert "dagster.yaml) in the current folder" not in text
        assert "Materialized value" not in text
        assert "cdc/orders partition " in text
        assert (home / "partitions_start").read_text().strip().endswith(":00")
    finally:
        for p in [pid, *tree]:
            if running(p):
                os.kill(p, signal.SIGKILL)
