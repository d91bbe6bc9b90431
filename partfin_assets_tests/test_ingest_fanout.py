"""`ingest_<table>_fanout`: the CDC writer's subtasks as Dagster steps (multiprocess executor) feeding one committer step.

Over several runs, from the synthetic source and from a Debezium file, the fanned-out writer lands
exactly the records, per-checkpoint summaries, watermarks and ledger rows that `partfin ingest`
lands from the same source into another warehouse; a CLI run racing it on the same table still
lands each event once; a failing share step leaves no file behind and commits nothing.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl
from dagster import Definitions, ReexecutionOptions, execute_job, reconstructable

from partfin_assets.defs.platform.fanout import FORKSERVER
from partfin_assets.defs.platform.ingest_fanout import build_ingest_fanout_job
from partfin_assets.defs.resources import CdcSourceResource, IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable
from partfin_assets.iceberg.catalog import load_partfin_catalog, load_table_if_exists
from partfin_assets.iceberg.history import summary_of
from partfin_assets.iceberg.ledger import read_ledger
from partfin_assets.jobs.maintenance import remove_orphan_files
from partfin_assets.model import summary_keys as K
from partfin_assets.model.faults import install_faults
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.sources.postgres.position import Position
from partfin_assets.sources.synthetic import ORDERS_SPEC
from partfin_assets.testing.faults import EnvFaults
from partfin_assets_tests.cdc_files import orders_lines, partfin, partfin_command, partfin_env, stream_of, write_lines
from partfin_assets_tests.test_postgres_source import (  # noqa: F401  (database is a fixture)
    TABLE_DDL,
    committed_offset,
    connect,
    create_slots,
    database,
    slot_confirmed,
)

POLICY = "min-of-last:3"  # a count window: the same watermarks whatever the commits' wall clocks
SYNTHETIC = "synthetic:seed=11,rate=0.5,start=2026-01-01T00:00:00Z,end=2026-01-01T02:00:00Z,key_space=300,late_fraction=0.05"
T0_MS = 1_767_225_600_000  # 2026-01-01T00:00Z

# the step processes rebuild the job from this module, their entry point: its fault points follow PARTFIN_* variables
install_faults(EnvFaults())


def fanout_job():
    """Module level, so every step process can rebuild the job (reconstructable)."""
    job = build_ingest_fanout_job(PartfinTable(spec=dataclasses.replace(ORDERS_SPEC, watermark_policy=POLICY), source="synthetic"))
    return Definitions(jobs=[job], resources={"catalog": IcebergCatalogResource(), "cdc_source": CdcSourceResource()}).get_job_def(job.name)


def postgres_fanout_job():
    """The fan-out job of a table read from PostgreSQL (its declaration: the key only, as the source's own may differ);
    its hours start yesterday, as the changes' commit times are now."""
    start = (datetime.now(UTC) - timedelta(days=1)).strftime("%Y-%m-%d-00:00")
    job = build_ingest_fanout_job(PartfinTable(spec=TableSpec("orders", ("id",), watermark_policy=POLICY), source="postgres",
                                               partitions_start=start))
    return Definitions(jobs=[job], resources={"catalog": IcebergCatalogResource(), "cdc_source": CdcSourceResource()}).get_job_def(job.name)


def run_fanout(instance, home: Path, source: str, *, max_records: int, max_checkpoints: int, shares: int = 2, spawn: bool = False,
               retry_of: str | None = None, job=fanout_job):
    """One run (`retry_of`: re-executed from that run's failure, reusing its plan); success, steps that succeeded, run id."""
    # the catalog travels in the run config: forked step processes keep the forkserver's environment
    config = {
        "execution": {"config": {"max_concurrent": 2, "start_method": {"spawn": {}} if spawn else FORKSERVER}},
        "resources": {"catalog": {"config": {"home": str(home)}}, "cdc_source": {"config": {"source": source}}},
        "ops": {"plan_ingest_orders": {"config": {"max_records": max_records, "max_checkpoints": max_checkpoints, "shares": shares}}},
    }
    retry = ReexecutionOptions.from_failure(retry_of, instance) if retry_of is not None else None
    with execute_job(reconstructable(job), instance=instance, run_config=config, raise_on_error=False, reexecution_options=retry) as result:
        steps = [e.step_key for e in result.all_events if e.event_type_value == "STEP_SUCCESS"]
        return result.success, steps, result.run_id


def ingest_until_exhausted(instance, home: Path, source: str, *, max_records: int, max_checkpoints: int) -> int:
    """Fan-out runs until one commits nothing; the number of runs that committed."""
    runs = 0
    while True:
        before = checkpoints(home)
        ok, steps, _ = run_fanout(instance, home, source, max_records=max_records, max_checkpoints=max_checkpoints)
        assert ok
        if len(checkpoints(home)) == len(before):
            return runs
        assert sum(s.startswith("write_share_orders") for s in steps) > 1, steps
        runs += 1


def checkpoints(home: Path) -> list[dict[str, str]]:
    """Every checkpoint commit's partfin summary entries (but the commit's own id and wall clock), oldest first."""
    table = load_table_if_exists(load_partfin_catalog(home), "cdc.orders")
    out = []
    for snapshot in table.snapshots() if table is not None else []:
        summary = summary_of(snapshot)
        if K.CHECKPOINT_ID in summary:
            out.append({k: v for k, v in summary.items() if k.startswith("partfin.") and k not in (K.COMMIT_ID, K.COMMIT_CLOCK)})
    return out


def records(home: Path) -> pl.DataFrame:
    rows = pl.from_arrow(load_partfin_catalog(home).load_table("cdc.orders").scan().to_arrow())
    return rows.drop("arrival_time", strict=False).sort("source_seq")


LEDGER = ("stream", "writer_id", "checkpoint_id", "hour", "records", "late_records", "event_time_min", "event_time_max",
          "arrival_min", "arrival_max", "source_clock", "watermark", "event_time_digest")


def ledger(home: Path) -> pl.DataFrame:
    return read_ledger(load_partfin_catalog(home), "cdc.orders", columns=LEDGER).sort("checkpoint_id", "hour", nulls_last=True)


def assert_same_ingest(fanned_out: Path, cli: Path) -> None:
    ours, theirs = checkpoints(fanned_out), checkpoints(cli)
    assert len(ours) > 3 and ours == theirs, "the same checkpoints: offsets, stats, late records, watermarks"
    assert records(fanned_out).equals(records(cli))
    assert ledger(fanned_out).equals(ledger(cli))
    assert load_partfin_catalog(fanned_out).load_table("cdc.orders").properties[K.PROP_WATERMARK] == \
        load_partfin_catalog(cli).load_table("cdc.orders").properties[K.PROP_WATERMARK]


def cli_ingest(home: Path, source: str, records_per_checkpoint: int, *extra: str) -> None:
    out = partfin(home, "ingest", "--table", "orders", "--source", source, "--checkpoint-records", str(records_per_checkpoint),
                  "--watermark-policy", POLICY, *extra)
    assert out.returncode == 0, out.stderr


def test_fanned_out_ingest_of_the_synthetic_source_equals_partfin_ingest(tmp_path: Path, instance):
    home = tmp_path / "partfin"
    runs = ingest_until_exhausted(instance, home, SYNTHETIC, max_records=800, max_checkpoints=3)
    assert runs >= 2, "several runs, each going on from the position the previous one committed"
    cli_ingest(tmp_path / "cli", SYNTHETIC, 800)
    assert_same_ingest(home, tmp_path / "cli")


def test_fanned_out_ingest_of_a_debezium_file_equals_partfin_ingest(tmp_path: Path, instance):
    events, arrivals = stream_of(T0_MS, T0_MS + 3 * 3_600_000, 3000, seed=4, median_lateness_s=30)
    path = tmp_path / "orders.jsonl"
    write_lines(path, orders_lines(events, arrivals, seed=4, key_space=500, wrapped=True))
    source = f"debezium:{path}"
    home = tmp_path / "partfin"
    ingest_until_exhausted(instance, home, source, max_records=400, max_checkpoints=4)
    cli_ingest(tmp_path / "cli", source, 400, "--primary-key", "id")
    assert_same_ingest(home, tmp_path / "cli")
    assert records(home).height == 3000


def test_a_cli_run_racing_the_fanned_out_job_lands_each_event_once(tmp_path: Path, instance):
    home = tmp_path / "partfin"
    cli = subprocess.Popen(  # small checkpoints: it writes while the fan-out runs start
        partfin_command("ingest", "--table", "orders", "--source", SYNTHETIC, "--checkpoint-records", "40", "--watermark-policy", POLICY),
        env=partfin_env(home), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        for _ in range(3):  # fan-out runs while the CLI writes under the same writer id
            ok, _, _ = run_fanout(instance, home, SYNTHETIC, max_records=500, max_checkpoints=3)
            assert ok, "a fenced batch is void, not a failed run"
    finally:
        assert cli.wait(timeout=600) == 0, cli.stderr.read()
    ingest_until_exhausted(instance, home, SYNTHETIC, max_records=500, max_checkpoints=5)
    ours = records(home)
    reference = tmp_path / "reference"
    cli_ingest(reference, SYNTHETIC, 800)
    assert ours.get_column("source_seq").is_unique().all(), "no event twice"
    assert ours.equals(records(reference)), "every event once"
    per_checkpoint = ledger(home).group_by("checkpoint_id").agg(pl.col("records").sum()).sort("checkpoint_id")
    ids = per_checkpoint.get_column("checkpoint_id").to_list()
    assert ids == list(range(1, len(ids) + 1)), "one line of checkpoints, whoever committed them (the ledger outlives expiry)"
    sizes = per_checkpoint.get_column("records").to_list()
    print(f"\ncheckpoints of 40 records (the CLI's cut): {sizes.count(40)}, of 500 (the fan-out's): {sizes.count(500)}")
    assert_only_committed_files(home)


def test_a_killed_share_step_commits_nothing_and_its_rerun_is_fenced_once_another_writer_landed_the_batches(tmp_path: Path, instance, monkeypatch):
    """Share steps SIGKILLed after writing: the run fails before its commit step, nothing lands, the files they wrote
    are orphans (only orphan-file removal finds them: nothing ran after the kill). Re-executed from that failure after
    a CLI run landed the same batches, the run's old plan is fenced: nothing twice, none of its new files left."""
    home = tmp_path / "partfin"
    monkeypatch.setenv("PARTFIN_CRASH_AT", "share-written:1")  # every share step process, once its files are written
    ok, _, failed_run = run_fanout(instance, home, SYNTHETIC, max_records=800, max_checkpoints=3, spawn=True)
    assert not ok and checkpoints(home) == []
    monkeypatch.delenv("PARTFIN_CRASH_AT")
    killed = set(data_files_on_disk(home))
    assert killed, "the killed steps had written their files"
    cli_ingest(home, SYNTHETIC, 800)  # lands everything, from the position the failed run had read from
    landed = checkpoints(home)
    ok, steps, _ = run_fanout(instance, home, SYNTHETIC, max_records=800, max_checkpoints=3, spawn=True, retry_of=failed_run)
    assert ok and "commit_ingest_orders" in steps and "plan_ingest_orders" not in steps, "the old plan, committed again"
    assert checkpoints(home) == landed, "nothing committed twice"
    reference = tmp_path / "reference"
    cli_ingest(reference, SYNTHETIC, 800)
    assert records(home).equals(records(reference))
    assert set(data_files_on_disk(home)) - live_data_files(home) == killed, "only the killed steps' files are orphans"
    remove_orphan_files(load_partfin_catalog(home), "cdc.orders", older_than_s=0)
    assert_only_committed_files(home)


def data_files_on_disk(home: Path) -> list[str]:
    return [str(p) for p in (home / "warehouse" / "cdc" / "orders" / "data").rglob("*.parquet")]


def live_data_files(home: Path) -> set[str]:
    table = load_partfin_catalog(home).load_table("cdc.orders")
    return {f.removeprefix("file://") for f in table.inspect.files().column("file_path").to_pylist()}


def assert_only_committed_files(home: Path) -> None:
    assert set(data_files_on_disk(home)) == live_data_files(home), "only committed files on disk"


def test_a_failing_share_step_leaves_no_file_and_commits_nothing_then_the_next_run_lands_everything_once(tmp_path: Path, instance, monkeypatch):
    home = tmp_path / "partfin"
    monkeypatch.setenv("PARTFIN_FAIL_AT", "share-written:1:0")  # share 0 of the second batch, after its files are written
    ok, steps, _ = run_fanout(instance, home, SYNTHETIC, max_records=1000, max_checkpoints=3, spawn=True)  # spawned: they see the variable
    assert not ok
    assert sum(s.startswith("write_share_orders") for s in steps) == 2, "every share step ran; the failed one handed over its error"
    assert checkpoints(home) == [], "nothing committed"
    assert not list((home / "warehouse" / "cdc" / "orders" / "data").rglob("*.parquet")), "no data file of any share left behind"

    monkeypatch.delenv("PARTFIN_FAIL_AT")
    ingest_until_exhausted(instance, home, SYNTHETIC, max_records=800, max_checkpoints=3)
    cli_ingest(tmp_path / "cli", SYNTHETIC, 800)
    assert_same_ingest(home, tmp_path / "cli")
    assert_only_committed_files(home)


def test_a_postgres_slot_moves_to_what_the_fanned_out_committer_landed_in_the_same_run(postgres, database, tmp_path: Path, instance):
    """The committer step tells the source each checkpoint it landed: once the run ends, the replication slot keeps
    no change already in cdc.orders (not only once the next run's plan starts)."""
    home = tmp_path / "partfin"
    source = f"postgres:{postgres.dsn(database)}#public.orders,heartbeat_settle=0s"
    with connect(postgres, database) as conn:
        conn.execute(TABLE_DDL)
        create_slots(conn, "partfin_orders")  # the changes from now on
        for round_, first in enumerate((1, 31)):
            before = slot_confirmed(conn, "partfin_orders")
            for low in range(first, first + 30, 10):  # three transactions, each a batch of its own
                conn.execute("INSERT INTO orders (id, amount, status, placed) SELECT i, 1, 'new', now() "
                             "FROM generate_series(%s::int, %s::int) i", (low, low + 9))
            ok, steps, _ = run_fanout(instance, home, source, max_records=10, max_checkpoints=10, job=postgres_fanout_job)
            assert ok and sum(s.startswith("write_share_orders") for s in steps) == 2, steps
            assert records(home).height == first + 29, f"run {round_}: every change once"
            landed = Position.from_offset(json.dumps(committed_offset(load_partfin_catalog(home)))).advance_to
            assert slot_confirmed(conn, "partfin_orders") == landed > before
