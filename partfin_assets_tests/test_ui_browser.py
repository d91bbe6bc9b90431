"""The demo in a real browser: Debian's chromium, driven by Playwright, against a `dagster dev` this test starts.

Checks that the asset graph shows the three layers (platform cdc/base -> activity), that a
finalized downstream partition is visible as materialized, and that a check result is
visible. Screenshots are saved under the directory printed at the start of the test.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from dagster import AssetCheckKey, AssetKey, DagsterInstance, DagsterRunStatus, RunsFilter

from partfin_assets.testing import dagster_processes

pytestmark = pytest.mark.timeout(420)


def chromium_binary() -> str | None:
    """Debian's chromium; installed with apt-get when missing and allowed (root), else None."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        try:
            subprocess.run(["apt-get", "update", "-qq"], env=env, timeout=300, capture_output=True)
            subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], env=env, timeout=600, capture_output=True)
        except (subprocess.TimeoutExpired, OSError):
            return None
    return shutil.which("chromium")


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


def late_data_evaluated(instance) -> bool:
    key = AssetCheckKey(AssetKey(["cdc", "orders"]), "late_data")
    records = instance.event_log_storage.get_asset_check_execution_history(key, limit=1)
    return bool(records) and records[0].status.value in ("SUCCEEDED", "FAILED") and records[0].event is not None


def finalized_partition(instance) -> str | None:
    runs = instance.get_runs(filters=RunsFilter(job_name="activity_orders_job", statuses=[DagsterRunStatus.SUCCESS]), limit=1)
    return runs[0].tags.get("dagster/partition") if runs else None


def test_demo_in_chromium(tmp_path):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright Python package is not installed (pip install playwright)")
    browser_path = chromium_binary()
    if browser_path is None:
        pytest.skip("Debian's chromium is not installed and could not be installed (apt-get install -y chromium)")

    shots = Path(os.environ.get("PARTFIN_SCREENSHOT_DIR") or Path(tempfile.gettempdir()) / "partfin-ui-screenshots")
    shots = shots / datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    shots.mkdir(parents=True)
    print(f"\nscreenshots: {shots}")
    start = (datetime.now(UTC) - timedelta(days=1)).strftime("%Y-%m-%d-00:00")
    env = dagster_processes.dagster_env(
        tmp_path / "partfin", tmp_path / "dagster",
        # a short replay with a heavier late tail: partitions, finalization and a WARN within a minute or two
        PARTFIN_SOURCE="synthetic:rate=1,hours=4,late_fraction=0.01,key_space=1000000",
        PARTFIN_PARTITIONS_START=start,
        PARTFIN_MAX_RECORDS="2500",
        PARTFIN_SYNC_INTERVAL="5",
        PARTFIN_FINALIZE_INTERVAL="3",
        PARTFIN_CHECKS_INTERVAL="10",
    )
    port = free_port()
    instance = DagsterInstance.from_config(str(tmp_path / "dagster"))  # creates the storage before dagster dev does
    proc = dagster_processes.dev(env, tmp_path / "dagster-dev.log", port).start()
    try:
        dagster_processes.wait_for(lambda: webserver_up(port), 120, "the webserver", on_timeout=proc.log_tail)
        partition = dagster_processes.wait_for(lambda: finalized_partition(instance), 240, "a finalized downstream partition", on_timeout=proc.log_tail)
        dagster_processes.wait_for(lambda: late_data_evaluated(instance), 180, "a late_data check result", on_timeout=proc.log_tail)

        base_url = f"http://127.0.0.1:{port}"
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=browser_path, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
            )
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            # the first-visit "Join the Dagster community" dialog may pop up at any time: dismiss it
            page.add_locator_handler(page.get_by_role("button", name="Skip"), lambda skip: skip.click())

            def open_page(path: str, expect: list[str], shot: str) -> str:
                page.goto(base_url + path, wait_until="domcontentloaded")
                for text in expect:
                    page.get_by_text(text, exact=False).first.wait_for(timeout=60_000)
                page.wait_for_timeout(1500)
                skip = page.get_by_role("button", name="Skip")
                if skip.count() and skip.first.is_visible():
                    skip.first.click()
                    page.wait_for_timeout(500)
                page.screenshot(path=str(shots / shot))
                return page.inner_text("body")

            # the community dialog shows up a few seconds after the first visit; see it off once
            page.goto(base_url + "/overview", wait_until="domcontentloaded")
            try:
                page.get_by_role("button", name="Skip").first.click(timeout=15_000)
            except Exception:  # noqa: BLE001 - not shown in this Dagster build: nothing to dismiss
                pass
            # the asset graph: platform (cdc/orders -> base/orders) -> activity (orders_hourly)
            graph = open_page(
                "/assets/activity/orders_hourly?view=lineage&lineageScope=upstream&lineageDepth=3",
                ["platform", "orders_hourly"],
                "1-asset-graph.png",
            )
            assert "platform" in graph and "activity" in graph and "orders_hourly" in graph
            assert graph.count("Iceberg") >= 2  # cdc/orders and base/orders nodes
            # the finalized downstream partition, materialized, with its metadata
            detail = open_page(
                f"/assets/activity/orders_hourly?view=partitions&partition={partition}",
                [partition, "finalized"],
                "2-finalized-partition.png",
            )
            assert partition in detail and "Materialized" in detail and "finalized" in detail
            # a check result on cdc/orders
            open_page("/assets/cdc/orders?view=checks", ["late_data", "watermark_monotonic"], "3-checks.png")
            page.get_by_text("Execution history").first.click()
            page.get_by_text("late record", exact=False).first.wait_for(timeout=60_000)  # an evaluated result's description
            page.wait_for_timeout(1000)
            page.screenshot(path=str(shots / "4-late-data-history.png"))
            history = page.inner_text("body")
            assert "late_data" in history and ("Passed" in history or "Failed" in history or "Warn" in history)
            browser.close()
        print(f"screenshots saved: {sorted(p.name for p in shots.iterdir())} in {shots}")
    finally:
        proc.stop()
        instance.dispose()
