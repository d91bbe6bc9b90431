"""The PostgreSQL-backed deployment end to end: live source -> Iceberg on PostgreSQL -> Dagster on PostgreSQL.

One throwaway PostgreSQL 15 cluster (wal_level=logical, track_commit_timestamp=on, a free
loopback port, stopped by PID) holds three databases:

- `shop`: the source. A workload thread commits inserts, updates and deletes of
  `public.orders` at a steady pace (real transactions, real commit timestamps);
- `iceberg`: the PyIceberg SqlCatalog (PARTFIN_CATALOG_URI), with the file warehouse;
- `dagster`: run, event-log and schedule storage of the Dagster instance, configured by the
  repository's `dagster.postgres.yaml` (DAGSTER_PG_* variables).

A real `dagster-daemon` runs everything, as in production: the sync sensor launches
`sync_orders` runs (CDC writer from the `postgres:` source, then the upsert of base.orders)
through the queued run coordinator, and the finalization sensor requests one
`activity_orders_hourly` run per finalized hour.

Crossing hour boundaries honestly
---------------------------------
Finalization is hour-aligned by contract (hour H is final when H + 1h <= W), and event time
is the source transaction's commit time, which PostgreSQL takes from the OS clock: commits
cannot be pre-dated, and a test cannot wait hours. So the database server -- and only the
server -- runs under libfaketime (Debian `faketime`): its clock starts a day in the past,
a few minutes before an hour boundary, and runs SPEED times faster than real time. Every
source-side time the pipeline uses comes from that server: commit timestamps (event time),
`clock_timestamp()` of the heartbeat fence, `pg_xact_commit_timestamp`. Nothing in partfin
compares event time with the wall clock when it decides finalization, so the pipeline sees
exactly what it would see from a database whose hours pass in SPEED-times less time. The
Python processes (daemon, runs, this test) keep the real clock, which is why the lag
figures below are real seconds. What the speed-up does change: source-time knobs shrink in
real time (the writer's 300 s heartbeat interval is 300/SPEED real seconds), and one sync
run spans SPEED times more event time than it would in production.

The test is deterministic in what it asserts: it waits (bounded) until the watermark passes
the hour of the last workload commit, whatever the wall clock, and then checks

- per finalized hour, the live rows of base.orders whose `_event_time` is in the hour ==
  the source database's own count of live rows whose last change committed in that hour
  (`pg_xact_commit_timestamp(xmin)`, independent of the CDC path), and every source row
  is in a finalized hour;
- exactly one successful downstream run per finalized hour, none for an unfinalized hour,
  and one `finalized_orders` event per hour in hour order;
- the Dagster instance really lives in PostgreSQL, and the per-table limits of the queued
  run coordinator held (sync runs never overlapped; at most 2 downstream runs at once).

It prints the end-to-end lag per hour: from the hour's close on the source clock (and
from the hour's last source commit) to the base watermark passing it, the
`finalized_orders` event and the downstream run's success. Run it with

    .venv/bin/python -m pytest partfin_assets_tests/test_postgres_deployment.py -s

Needs Debian's postgresql-15, postgresql-15-wal2json and faketime.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pyarrow.compute as pc
import pytest
from dagster import AssetKey, AssetRecordsFilter, DagsterInstance, DagsterRunStatus, RunsFilter

from partfin_assets.finalization.hours import hour_key
from partfin_assets.iceberg.catalog import CatalogConfig
from partfin_assets.iceberg.history import summary_of, watermark_of
from partfin_assets.iceberg.tables import read_base
from partfin_assets.model import summary_keys as K
from partfin_assets.model.timeutil import US_PER_HOUR, floor_hour_us, iso_z, to_us
from partfin_assets.testing import dagster_processes
from partfin_assets_tests.postgres_cluster import throwaway_cluster

pytestmark = pytest.mark.timeout(420)

REPO = Path(__file__).resolve().parents[1]
SPEED = 120  # source-clock seconds per real second: one source hour passes in 30 s
WORKLOAD_SECONDS = 80.0  # real seconds of workload: about 2.7 source hours
FAKE_START_BEFORE_BOUNDARY = timedelta(minutes=50)  # the source clock starts at HH:10, a day ago
DRAIN_TIMEOUT = 150.0
DOWNSTREAM = {"partfin/downstream": "orders"}  # the finalization sensor's runs: runs of the downstream asset
SYNC_JOB = "sync_orders"
FINALIZED = AssetKey("finalized_orders")
IN_FLIGHT = {DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED}

ORDERS_DDL = "CREATE TABLE orders (id bigint PRIMARY KEY, user_id bigint, amount double precision, status text)"
STATUSES = ("pending", "paid", "shipped", "delivered", "cancelled")


# --------------------------------------------------------------------------- the source workload


@dataclass
class Workload:
    """Commits a mix of inserts, updates and deletes until stopped; records real commit times and clock samples."""

    dsn: str
    seed: int = 5
    pace_s: float = 0.04
    commits: list[float] = field(default_factory=list)  # real time after each COMMIT returned
    clock: list[tuple[float, int]] = field(default_factory=list)  # (real time, server clock us)
    changes: Counter = field(default_factory=Counter)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="source-workload", daemon=True)

    def start(self) -> Workload:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the workload thread did not stop"

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def _loop(self) -> None:
        rng = random.Random(self.seed)
        live: list[int] = []
        next_id = 1
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            last_sample = 0.0
            while not self._stop.is_set():
                with conn.transaction():
                    roll = rng.random()
                    if roll < 0.55 or len(live) < 20:
                        for _ in range(rng.choice((1, 1, 2, 3)) if rng.random() > 0.03 else 40):  # now and then a bulk insert
                            conn.execute(
                                "INSERT INTO orders VALUES (%s, %s, %s, %s)",
                                (next_id, rng.randrange(1000), round(rng.uniform(1, 500), 2), "pending"),
                            )
                            live.append(next_id)
                            next_id += 1
                            self.changes["c"] += 1
                    elif roll < 0.9:
                        for _ in range(rng.choice((1, 1, 2))):
                            key = rng.choice(live)
                            conn.execute("UPDATE orders SET status = %s, amount = amount + 1 WHERE id = %s", (rng.choice(STATUSES), key))
                            self.changes["u"] += 1
                    else:
                        key = live.pop(rng.randrange(len(live)))
                        conn.execute("DELETE FROM orders WHERE id = %s", (key,))
                        self.changes["d"] += 1
                self.commits.append(time.time())
                if time.monotonic() - last_sample >= 1.0:
                    self.sample_clock(conn)
                    last_sample = time.monotonic()
                self._stop.wait(self.pace_s)
            self.sample_clock(conn)

    def sample_clock(self, conn) -> None:
        before = time.time()
        (server,) = conn.execute("SELECT clock_timestamp()").fetchone()
        after = time.time()
        self.clock.append(((before + after) / 2, to_us(server)))


@dataclass(frozen=True)
class ClockMap:
    """The server's fake clock as a line over real time: server_us = offset_us + speed * real_s * 1e6."""

    speed: float
    offset_us: float

    @classmethod
    def fit(cls, samples: list[tuple[float, int]]) -> ClockMap:
        (r0, s0), (r1, s1) = samples[0], samples[-1]
        speed = (s1 - s0) / 1e6 / (r1 - r0)
        offset = statistics.median(s - speed * r * 1e6 for r, s in samples)
        return cls(speed, offset)

    def server_us(self, real_s: float) -> int:
        return int(self.offset_us + self.speed * real_s * 1e6)

    def real_s(self, server_us: int) -> float:
        return (server_us - self.offset_us) / self.speed / 1e6


# --------------------------------------------------------------------------- the deployment


def database_setup(cluster) -> None:
    for name in ("shop", "iceberg", "dagster"):
        cluster.create_database(name)
    with psycopg.connect(cluster.dsn("shop"), autocommit=True) as conn:
        conn.execute(ORDERS_DDL)
        # the slot exists before the first change: only changes made after it are captured
        conn.execute("SELECT pg_create_logical_replication_slot('partfin_orders', 'wal2json')")


def deployment_env(cluster, home: Path, dagster_home: Path, start_hour_us: int) -> dict[str, str]:
    dagster_home.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "dagster.postgres.yaml", dagster_home / "dagster.yaml")  # dagster_env keeps an existing one
    return dagster_processes.dagster_env(
        home,
        dagster_home,
        DAGSTER_PG_HOST=cluster.host,
        DAGSTER_PG_PORT=str(cluster.port),
        DAGSTER_PG_USERNAME=cluster.user,
        DAGSTER_PG_PASSWORD="",  # trust auth
        DAGSTER_PG_DB="dagster",
        PARTFIN_CATALOG_URI=cluster.sqlalchemy_uri("iceberg"),
        PARTFIN_SOURCE=f"postgres:{cluster.dsn('shop')}#public.orders",
        PARTFIN_SENSORS="sync,finalize",
        PARTFIN_SYNC_INTERVAL="1",
        PARTFIN_FINALIZE_INTERVAL="1",
        PARTFIN_PARTITIONS_START=hour_key(start_hour_us),
        PARTFIN_MAX_SECONDS_PER_RUN="20",
    )


def runs_of(instance, job: str | None = None, tags: dict | None = None):
    return instance.get_run_records(filters=RunsFilter(job_name=job, tags=tags))


def base_state(catalog):
    """(watermark, live rows per hour of _event_time, snapshots) of base.orders, all from one metadata version."""
    try:
        table = catalog.load_table("base.orders")
    except Exception:
        return None, Counter(), []
    watermark = watermark_of(table.properties)
    snapshot = table.current_snapshot()
    if snapshot is None:
        return watermark, Counter(), []
    rows = read_base(catalog, "orders", snapshot_id=snapshot.snapshot_id)
    hours = Counter(floor_hour_us(t) for t in pc.cast(rows.column("_event_time"), "int64").to_pylist())
    return watermark, hours, list(table.metadata.snapshots)


def source_counts(dsn: str) -> Counter:
    """The source's own count of live rows per hour of the commit time of their last change."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET TimeZone = 'UTC'")
        rows = conn.execute(
            "SELECT date_trunc('hour', pg_xact_commit_timestamp(xmin)), count(*) FROM orders GROUP BY 1"
        ).fetchall()
    return Counter({to_us(hour): n for hour, n in rows})


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    depth = peak = 0
    for _, step in edges:
        depth += step
        peak = max(peak, depth)
    return peak


# --------------------------------------------------------------------------- the test


def test_postgres_deployment_finalizes_each_hour_once_with_source_counts(tmp_path, monkeypatch):
    real_start = datetime.now(UTC)
    # a day back, so every hour the accelerated clock reaches exists as a partition (they end at the real hour)
    fake_start = datetime.fromtimestamp(floor_hour_us(to_us(real_start - timedelta(days=1))) / 1e6, UTC) + (
        timedelta(hours=1) - FAKE_START_BEFORE_BOUNDARY
    )
    fake_clock = f"@{fake_start:%Y-%m-%d %H:%M:%S} x{SPEED}"
    settings = [
        "track_commit_timestamp=on",
        # server timers run SPEED times faster too: keep them from firing every few milliseconds
        "authentication_timeout=600s", "checkpoint_timeout=1d", "bgwriter_delay=10s", "wal_writer_delay=10s",
        "autovacuum_naptime=1d",
    ]  # fmt: skip
    home, dagster_home = tmp_path / "partfin", tmp_path / "dagster"
    with throwaway_cluster(settings=settings, fake_clock=fake_clock) as cluster:
        database_setup(cluster)
        env = deployment_env(cluster, home, dagster_home, floor_hour_us(to_us(fake_start)))
        for name in ("DAGSTER_PG_HOST", "DAGSTER_PG_PORT", "DAGSTER_PG_USERNAME", "DAGSTER_PG_PASSWORD", "DAGSTER_PG_DB"):
            monkeypatch.setenv(name, env[name])
        instance = DagsterInstance.from_config(str(dagster_home))  # creates the schema before the daemon starts
        catalog = CatalogConfig(home=home, uri=env["PARTFIN_CATALOG_URI"]).load()
        daemon = dagster_processes.daemon(env, tmp_path / "daemon.log").start()
        workload = Workload(cluster.dsn("shop"))
        try:
            workload.start()
            time.sleep(WORKLOAD_SECONDS)
            workload.stop()
            assert workload.error is None, repr(workload.error)
            clock = ClockMap.fit(workload.clock)
            assert abs(clock.speed - SPEED) < 0.05 * SPEED, f"the server clock runs x{clock.speed:.1f}"
            last_commit_us = clock.server_us(workload.commits[-1])
            first_hour = floor_hour_us(clock.server_us(workload.commits[0]))
            target = floor_hour_us(last_commit_us) + US_PER_HOUR  # base watermark that finalizes the last workload hour
            hours = list(range(first_hour, target, US_PER_HOUR))

            def drained():
                watermark, _, _ = base_state(catalog)
                if watermark is None or watermark < target:
                    return False
                done = {r.dagster_run.tags.get("dagster/partition") for r in runs_of(instance, tags=DOWNSTREAM)
                        if r.dagster_run.status == DagsterRunStatus.SUCCESS}  # fmt: skip
                return {hour_key(h) for h in hours} <= done

            dagster_processes.wait_for(drained, DRAIN_TIMEOUT, f"base watermark >= {iso_z(target)} and downstream runs of {len(hours)} hours",
                              interval=1.0, on_timeout=daemon.log_tail)  # fmt: skip
        finally:
            workload.stop()
            daemon.stop()

        # ---- source counts per finalized hour == base counts per hour
        watermark, base_hours, base_snapshots = base_state(catalog)
        source_hours = source_counts(cluster.dsn("shop"))
        assert watermark is not None and watermark >= target
        assert all(h < watermark for h in source_hours), "every source row is in a finalized hour"
        finalized = range(first_hour, floor_hour_us(watermark), US_PER_HOUR)
        mismatches = {iso_z(h): (base_hours[h], source_hours[h]) for h in finalized if base_hours[h] != source_hours[h]}
        assert not mismatches, f"hour: (base rows, source rows) {mismatches}"
        assert sum(base_hours.values()) == sum(source_hours.values()) > 0
        assert sum(1 for h in hours if source_hours[h]) >= 2, f"workload hours {[iso_z(h) for h in hours]}"

        # ---- exactly once per finalized hour, nothing for an unfinalized one
        activity = runs_of(instance, tags=DOWNSTREAM)
        partitions = [r.dagster_run.tags.get("dagster/partition") for r in activity]
        assert all(first_hour <= _hour(p) < watermark for p in partitions), partitions
        successes = Counter(p for r, p in zip(activity, partitions) if r.dagster_run.status == DagsterRunStatus.SUCCESS)
        assert all(n == 1 for n in successes.values()), successes
        assert {hour_key(h) for h in hours} <= set(successes)
        events = instance.fetch_materializations(AssetRecordsFilter(asset_key=FINALIZED), limit=10_000, ascending=True).records
        event_keys = [e.partition_key for e in events]
        assert event_keys == sorted(set(event_keys)) and {hour_key(h) for h in hours} <= set(event_keys)

        # ---- the instance lives in PostgreSQL; the queued run coordinator's per-table limits held
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        assert type(instance.schedule_storage).__name__ == "PostgresScheduleStorage"
        with psycopg.connect(cluster.dsn("dagster")) as conn:
            stored = conn.execute("SELECT count(*) FROM run_tags WHERE key = %s AND value = %s", ("partfin/downstream", "orders")).fetchone()[0]
        assert stored == len(activity)
        sync = runs_of(instance, SYNC_JOB)
        assert sum(r.dagster_run.status == DagsterRunStatus.SUCCESS for r in sync) >= 3
        sync_spans = [(r.start_time, r.end_time) for r in sync if r.start_time and r.end_time]
        activity_spans = [(r.start_time, r.end_time) for r in activity if r.start_time and r.end_time]
        assert max_overlap(sync_spans) == 1, "partfin/writer limit: one sync run per table at a time"
        assert max_overlap(activity_spans) <= 2, "partfin/downstream limit: two downstream runs per table"

        report = lag_report(hours, clock, workload, source_hours, base_snapshots, events, activity, sync)
        print(report)
        instance.dispose()


def _hour(partition_key: str) -> int:
    from partfin_assets.finalization.hours import hour_from_key

    return hour_from_key(partition_key)


# --------------------------------------------------------------------------- lag figures


def run_timing(records) -> str:
    """Median seconds from run creation to its process starting (queue + launch) and from start to end."""
    done = [r for r in records if r.start_time and r.end_time]
    if not done:
        return "none finished"
    launch = statistics.median(r.start_time - r.create_timestamp.timestamp() for r in done)
    work = statistics.median(r.end_time - r.start_time for r in done)
    return f"{len(done)} runs, median create->start {launch:.1f}s, start->end {work:.1f}s"


def lag_report(hours, clock: ClockMap, workload: Workload, source_hours, base_snapshots, events, activity, sync) -> str:
    """Per hour, real seconds from the hour's close on the source clock (and from its last commit) to each step."""
    watermark_at = []  # (real time of the base commit, watermark it set)
    for snapshot in base_snapshots:
        value = summary_of(snapshot).get(K.WATERMARK)
        if value:
            watermark_at.append((snapshot.timestamp_ms / 1000, to_us(datetime.fromisoformat(value.replace("Z", "+00:00")))))
    event_at = {e.partition_key: e.timestamp for e in events}
    done_at = {r.dagster_run.tags.get("dagster/partition"): r.end_time for r in activity if r.dagster_run.status == DagsterRunStatus.SUCCESS}
    lines = [
        f"end-to-end lag, PostgreSQL deployment (source clock x{clock.speed:.0f}; real seconds; {len(workload.commits)} source "
        f"transactions, {sum(workload.changes.values())} changes {dict(workload.changes)})",
        f"{'hour':22} {'rows':>5} {'close->base W':>14} {'close->finalized':>17} {'close->run done':>16} {'last commit->run done':>22}",
    ]
    close_to_done, commit_to_done = [], []
    for hour in hours:
        key = hour_key(hour)
        close = clock.real_s(hour + US_PER_HOUR)
        in_hour = [t for t in workload.commits if hour <= clock.server_us(t) < hour + US_PER_HOUR]
        base_w = next((t for t, w in sorted(watermark_at) if w >= hour + US_PER_HOUR), None)
        done = done_at.get(key)

        def fmt(t, start):
            return f"{t - start:.1f}" if t is not None and start is not None else "n/a"

        if done is not None:
            close_to_done.append(done - close)
            if in_hour:
                commit_to_done.append(done - in_hour[-1])
        lines.append(
            f"{iso_z(hour):22} {source_hours[hour]:>5} {fmt(base_w, close):>14} {fmt(event_at.get(key), close):>17} "
            f"{fmt(done, close):>16} {fmt(done, in_hour[-1] if in_hour else None):>22}"
        )
    if close_to_done:
        lines.append(
            f"hour close -> downstream run done: median {statistics.median(close_to_done):.1f}s, max {max(close_to_done):.1f}s; "
            f"last source commit of the hour -> done: median {statistics.median(commit_to_done or [0]):.1f}s"
        )
    lines.append(f"sync_orders: {run_timing(sync)}; downstream runs: {run_timing(activity)}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the instance config


def test_postgres_instance_config_differs_from_the_default_only_in_storage():
    """dagster.postgres.yaml keeps dagster.yaml's run coordinator, per-table limits, retries and sensors."""
    import yaml

    default = yaml.safe_load((REPO / "dagster.yaml").read_text())
    postgres = yaml.safe_load((REPO / "dagster.postgres.yaml").read_text())
    assert "storage" not in default  # SQLite under DAGSTER_HOME: the zero-setup path
    assert {k: v for k, v in postgres.items() if k != "storage"} == default
    db = postgres["storage"]["postgres"]["postgres_db"]
    assert all(set(db[field]) == {"env"} for field in ("hostname", "port", "username", "password", "db_name"))


# --------------------------------------------------------------------------- a named PyIceberg catalog


def partfin_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "partfin_assets.cli", *args], env=env, capture_output=True, text=True, timeout=180)


def test_named_pyiceberg_catalog_selected_by_configuration(postgres, tmp_path):
    """PARTFIN_CATALOG=<name> loads a catalog configured the PyIceberg way: PYICEBERG_CATALOG__<NAME>__* or .pyiceberg.yaml.

    A REST (or Glue, Hive...) catalog is selected the same way with its own properties; here the
    named catalog is a SqlCatalog on PostgreSQL so that the test needs no other server.
    """
    database = f"lake_{uuid.uuid4().hex[:8]}"
    postgres.create_database(database)
    warehouse = (tmp_path / "warehouse").as_uri()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PARTFIN_", "PYICEBERG_"))}
    clean.update(PARTFIN_HOME=str(tmp_path / "home"), PYICEBERG_HOME=str(tmp_path / "no-config"))
    by_env = {
        **clean,
        "PARTFIN_CATALOG": "lake",
        "PYICEBERG_CATALOG__LAKE__TYPE": "sql",
        "PYICEBERG_CATALOG__LAKE__URI": postgres.sqlalchemy_uri(database),
        "PYICEBERG_CATALOG__LAKE__WAREHOUSE": warehouse,
    }
    result = partfin_cli(by_env, "ingest", "--table", "orders", "--source", "synthetic:start=2026-11-01T00:00:00Z,end=2026-11-01T02:00:00Z,rate=1")  # < 10,000 events: one checkpoint
    assert result.returncode == 0, result.stderr

    config_dir = tmp_path / "pyiceberg"
    config_dir.mkdir()
    (config_dir / ".pyiceberg.yaml").write_text(
        f"catalog:\n  lake:\n    type: sql\n    uri: {postgres.sqlalchemy_uri(database)}\n    warehouse: {warehouse}\n"
    )
    by_file = {**clean, "PARTFIN_CATALOG": "lake", "PYICEBERG_HOME": str(config_dir)}
    status = partfin_cli(by_file, "status", "--json")
    assert status.returncode == 0, status.stderr
    (cdc,) = [t for t in json.loads(status.stdout)["tables"] if t["name"] == "cdc.orders"]
    assert cdc["checkpoint_id"] == 1 and cdc["watermark"]
    assert not (tmp_path / "home" / "catalog.db").exists()  # the embedded SQLite catalog was never used

    missing = partfin_cli({**clean, "PARTFIN_CATALOG": "nowhere"}, "status")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert "PyIceberg catalog 'nowhere' set by PARTFIN_CATALOG" in missing.stderr
    assert "PYICEBERG_CATALOG__NOWHERE__" in missing.stderr
