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


def start_demo_in_background(log: Path, **variables: str) -> int:
    """What `nohup scripts/demo.sh &` in a CI script does (a background job of a non-interactive shell): the demo's PID."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "PARTFIN_"))}
    env.update(PARTFIN_SENSORS="sync", PARTFIN_SYNC_INTERVAL="5", PYTHONUNBUFFERED="1", **variables)
    started = subprocess.run(
        ["bash", "-c", f"nohup scripts/demo.sh > {log} 2>&1 & echo $!"], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    return int(started.stdout.strip())


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_demo_started_in_background_stops_on_signal(tmp_path, stop_signal):
    home = tmp_path / "partfin"
    log = tmp_path / "demo.log"
    port = free_port()
    pid = start_demo_in_background(log, PARTFIN_HOME=str(home), PARTFIN_PORT=str(port), PARTFIN_SOURCE="synthetic:rate=1,hours=2,key_space=100000")
    tree: set[int] = set()
    try:
        wait_for(lambda: webserver_up(port), 600, "the demo's webserver", on_timeout=lambda: log.read_text()[-4000:])
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

        # a first-time user's log: where the tables are (before: never said), no Dagster-internal warnings, every
        # materialization line names its partition
        assert f"demo: PARTFIN_HOME={home} (its tables: PARTFIN_HOME={home} partfin status)" in text
        assert "BetaWarning" not in text
        assert "dagster.yaml) in the current folder" not in text
        assert "Materialized value" not in text
        assert "cdc_orders partition " in text
        assert (home / "partitions_start").read_text().strip().endswith(":00")
    finally:
        for p in [*tree, *descendants(pid), pid]:  # the whole tree, also when the test failed before it looked
            if running(p):
                os.kill(p, signal.SIGKILL)


# --------------------------------------------------------------------------- stopping with a run in flight

STOP_SOURCE = "synthetic:seed=9,rate=20,start=2026-11-01T00:00:00Z,end=2026-11-01T02:00:00Z,key_space=100000"
UNFINISHED = ("STARTING", "STARTED", "CANCELING", "NOT_STARTED")


def dagster_runs(dagster_home: Path) -> list:
    from dagster import DagsterInstance
    from dagster._core.instance.ref import InstanceRef

    with DagsterInstance.from_ref(InstanceRef.from_dir(str(dagster_home))) as instance:
        return list(instance.get_runs())


def checkpoints_committed(home: Path) -> int:
    from partfin_assets.iceberg.catalog import load_partfin_catalog

    try:
        table = load_partfin_catalog(home).load_table("cdc.orders")
    except Exception:  # not created yet
        return 0
    return len(table.metadata.snapshots)


def expected_records(spec_text: str) -> int:
    from partfin_assets.sources.registry import make_source
    from partfin_assets.sources.synthetic import ORDERS_SPEC

    return sum(batch.records.num_rows for batch in make_source(spec_text, ORDERS_SPEC).batches(None, 20_000))


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_demo_stops_within_10s_with_a_sync_run_in_flight_and_the_next_run_continues_exactly_once(tmp_path, stop_signal):
    home = tmp_path / "partfin"
    dagster_home = home / "dagster"
    log = tmp_path / "demo.log"
    port = free_port()
    pid = start_demo_in_background(
        log, PARTFIN_HOME=str(home), PARTFIN_PORT=str(port), PARTFIN_SOURCE=STOP_SOURCE, PARTFIN_MAX_RECORDS="2000",
        PARTFIN_MAX_SECONDS_PER_RUN="300",
    )
    tree: set[int] = set()
    try:
        wait_for(lambda: webserver_up(port), 600, "the demo's webserver", on_timeout=lambda: log.read_text()[-4000:])
        # a sync run in flight that has committed checkpoints and has more to commit (2,000 records each, 144,000 in all)
        wait_for(lambda: any(r.job_name == "sync_orders" and r.status.value == "STARTED" for r in dagster_runs(dagster_home))
                 and checkpoints_committed(home) >= 2, 240, "a sync run in flight", on_timeout=lambda: log.read_text()[-4000:])
        tree = descendants(pid)
        os.kill(pid, stop_signal)
        signalled = time.monotonic()
        while time.monotonic() - signalled < 60 and (running(pid) or any(running(p) for p in tree | descendants(pid))):
            time.sleep(0.2)
        stopped_after = time.monotonic() - signalled
        left = [p for p in tree if running(p)]
        print(f"\n{stop_signal.name}: everything stopped after {stopped_after:.1f}s; left: {len(left)} of {len(tree)} processes")
        assert not running(pid) and not left, f"left running after {stopped_after:.0f}s: {left}\n{log.read_text()[-3000:]}"
        assert stopped_after <= 10, f"stopping took {stopped_after:.1f}s"

        # nothing half-done: no run is left looking in flight (it finished or was cancelled), so nothing blocks the next
        runs = dagster_runs(dagster_home)
        print("runs: " + ", ".join(f"{r.job_name}={r.status.value}" for r in runs))
        assert not [r for r in runs if r.status.value in UNFINISHED], "a run is left as if in flight"
    finally:
        for p in [*tree, *descendants(pid), pid]:  # the whole tree, also when the test failed before it looked
            if running(p):
                os.kill(p, signal.SIGKILL)

    # the next run continues from the committed position: every record of the source exactly once
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets_tests.test_cli import partfin

    resumed = partfin(home, "ingest", "--table", "orders", "--source", STOP_SOURCE, "--checkpoint-records", "20000")
    assert resumed.returncode == 0, resumed.stderr
    records = load_partfin_catalog(home).load_table("cdc.orders").scan(selected_fields=("key", "source_seq")).to_arrow()
    distinct = records.group_by(["key", "source_seq"]).aggregate([]).num_rows
    expected = expected_records(STOP_SOURCE)
    print(f"cdc.orders: {records.num_rows} records, {distinct} distinct, the source has {expected}")
    assert records.num_rows == distinct == expected


def test_runs_a_stop_left_in_flight_are_marked_failed_and_free_their_pool_slots(instance):
    """A run worker killed after the grace period leaves its run STARTED; the next start marks it failed (its op pool slot
    freed), so the queue's writer limit and the pool let the next sync start. Finished runs stay as they are."""
    from dagster import DagsterRunStatus
    from dagster._core.test_utils import create_run_for_test

    from partfin_assets.defs.stopped_runs import mark_stopped_runs_failed

    runs = {status: create_run_for_test(instance, job_name="sync_orders", status=status) for status in (
        DagsterRunStatus.STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.CANCELING, DagsterRunStatus.SUCCESS,
        DagsterRunStatus.CANCELED)}
    pool = "partfin_cdc_orders"
    instance.event_log_storage.set_concurrency_slots(pool, 1)
    claim = instance.event_log_storage.claim_concurrency_slot(pool, runs[DagsterRunStatus.STARTED].run_id, "cdc_and_base_orders")
    assert claim.is_claimed

    marked = mark_stopped_runs_failed(instance)

    LEFT_STATUSES = (DagsterRunStatus.STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.CANCELING)
    assert sorted(marked) == sorted(runs[s].run_id for s in LEFT_STATUSES)
    after = {status: instance.get_run_by_id(run.run_id).status for status, run in runs.items()}
    assert after == {**{s: DagsterRunStatus.FAILURE for s in LEFT_STATUSES},
                     DagsterRunStatus.SUCCESS: DagsterRunStatus.SUCCESS, DagsterRunStatus.CANCELED: DagsterRunStatus.CANCELED}
    assert instance.event_log_storage.get_concurrency_info(pool).claimed_slots == []
    assert mark_stopped_runs_failed(instance) == []  # nothing left the second time


