"""A Kafka member frozen while it holds the SQLite catalog's write lock: the other `ingest --follow` members wait for
it, saying so, instead of giving up after SQLite's own 5 s (exit 75), and every message lands once.

Real processes against librdkafka's mock cluster: member A is parked inside its catalog commit, after the UPDATE that
took SQLite's write lock (fault point `catalog-commit-locked`), and frozen there with SIGSTOP; member B must commit
meanwhile. After well over SQLite's 5 s A is thawed and released. A lock held longer than the bound
(PARTFIN_CATALOG_LOCK_WAIT) is one line and exit 75: test_refusals.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from partfin_assets_tests import debezium_messages as dbz
from partfin_assets_tests.test_kafka_cluster import produce
from partfin_assets_tests.test_kafka_source import T0_MS, TOPIC, cdc_rows, events, expected_events, kafka_spec, run_ingest, wait_for

FROZEN_S = 12.0  # how long A holds the lock frozen: well over SQLite's own 5 s wait, under the bound (60 s)
WAITING = "the catalog database is locked by another process: waiting for it"


def _member(tmp_path, home, spec: str, name: str, **env: str) -> subprocess.Popen:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PARTFIN_")}
    environment.update({"PARTFIN_HOME": str(home), **env})
    command = [sys.executable, "-m", "partfin_assets.cli", "-v", "ingest", "--table", "orders", "--source", spec,
               "--primary-key", "id", "--checkpoint-records", "20", "--follow"]
    with open(tmp_path / f"{name}.log", "wb") as out:
        return subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=out)


def test_a_member_frozen_holding_the_catalog_lock_is_waited_for_and_every_message_lands_once(tmp_path, kafka_cluster):
    kafka_cluster.create_topic(TOPIC, 2)
    spec = kafka_spec(kafka_cluster)
    home, pauses = tmp_path / "home", tmp_path / "pauses"
    pauses.mkdir()
    messages = dbz.row_history(range(40), T0_MS, updates=1, delete_every=9)
    delivered = produce(kafka_cluster, TOPIC, messages)
    run_ingest(home, spec)  # the table exists, and the members start from its positions

    frozen = _member(tmp_path, home, spec, "member-a", PARTFIN_PAUSE_AT="catalog-commit-locked", PARTFIN_PAUSE_DIR=str(pauses))
    waiting = _member(tmp_path, home, spec, "member-b")
    log_b = tmp_path / "member-b.log"
    members = (frozen, waiting)
    try:
        rounds = 1

        def produce_round() -> None:
            nonlocal rounds
            more = dbz.row_history(range(40 * rounds, 40 * (rounds + 1)), T0_MS + rounds * 20 * 60_000, updates=1, delete_every=9)
            delivered.extend(produce(kafka_cluster, TOPIC, more))
            messages.extend(more)
            rounds += 1

        produce_round()
        wait_for(lambda: (pauses / "catalog-commit-locked.reached").exists() or frozen.poll() is not None,
                 "member A to hold the catalog's write lock", timeout_s=120)
        assert frozen.poll() is None, (tmp_path / "member-a.log").read_text()
        frozen.send_signal(signal.SIGSTOP)  # frozen while it holds the lock
        frozen_at = time.monotonic()
        while time.monotonic() - frozen_at < FROZEN_S:  # more to commit for B, whichever partitions it holds now
            produce_round()
            time.sleep(2.0)
        assert WAITING in log_b.read_text(errors="replace"), log_b.read_text(errors="replace")[-3000:]
        assert waiting.poll() is None, f"member B ended {waiting.returncode}:\n{log_b.read_text(errors='replace')[-3000:]}"

        frozen.send_signal(signal.SIGCONT)
        (pauses / "catalog-commit-locked.go").touch()
        produce_round()
        wait_for(lambda: events(cdc_rows(home)) == expected_events(messages, delivered), "every message to land", timeout_s=180)
    finally:
        for member in members:
            member.send_signal(signal.SIGCONT)
            member.send_signal(signal.SIGTERM)
        codes = [member.wait(60) for member in members]
    assert codes == [143, 143], (codes, log_b.read_text(errors="replace")[-3000:])
    assert "the catalog database is free again" in log_b.read_text(errors="replace")
    assert events(cdc_rows(home)) == expected_events(messages, delivered)  # every message once
