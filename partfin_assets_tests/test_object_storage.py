"""The whole pipeline with the warehouse on S3 (moto's server on loopback): the CLI ingest, then the fanned-out
ingest and the fanned-out upsert on Dagster's multiprocess executor, the in-process upsert, compaction, and the
downstream asset.

Every data and delete file lands in the bucket (none on local disk), steps in other processes
read and write them, and the base rows equal the reference merge of everything in cdc.orders.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from dagster import DagsterInstance, Definitions, execute_job, reconstructable

from partfin_assets.defs.platform.ingest_fanout import build_ingest_fanout_job
from partfin_assets.defs.platform.upsert_fanout import build_upsert_job
from partfin_assets.defs.resources import CdcSourceResource, IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable
from partfin_assets.iceberg.files import data_files, position_delete_files
from partfin_assets.iceberg.tables import DELETED, SOURCE_SEQ, read_base
from partfin_assets.jobs.compaction import compact
from partfin_assets.jobs.upsert.decode import decode_keys, decode_payloads, latest_per_log
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.model.timeutil import US_PER_HOUR, iso_z
from partfin_assets_tests.s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server

SOURCE = "synthetic:seed=3,rate=5,hours=3,key_space=400"
BUCKET = "partfin-lake"


def orders_table() -> PartfinTable:
    from partfin_assets.sources.synthetic import ORDERS_SPEC

    return PartfinTable(spec=ORDERS_SPEC, source=SOURCE)


def fanout_job():
    job = build_upsert_job(orders_table())
    return Definitions(jobs=[job], resources={"catalog": IcebergCatalogResource()}).get_job_def(job.name)


def ingest_fanout_job():
    job = build_ingest_fanout_job(orders_table())
    resources = {"catalog": IcebergCatalogResource(), "cdc_source": CdcSourceResource(source=SOURCE)}
    return Definitions(jobs=[job], resources=resources).get_job_def(job.name)


@pytest.fixture
def s3(tmp_path: Path):
    server = S3Server(tmp_path / "moto.log").start()
    try:
        server.create_bucket(BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture
def lake(tmp_path: Path, s3: S3Server, monkeypatch) -> Path:
    """A named SQL catalog whose warehouse is the S3 bucket; every process of the test inherits it."""
    home = tmp_path / "partfin"
    home.mkdir()
    env = {
        "PARTFIN_HOME": str(home),
        "PARTFIN_CATALOG": "lake",
        "PYICEBERG_CATALOG__LAKE__TYPE": "sql",
        "PYICEBERG_CATALOG__LAKE__URI": f"sqlite:///{tmp_path / 'catalog.db'}",
        "PYICEBERG_CATALOG__LAKE__WAREHOUSE": f"s3://{BUCKET}/warehouse",
        "PYICEBERG_CATALOG__LAKE__S3__ENDPOINT": s3.endpoint,
        "PYICEBERG_CATALOG__LAKE__S3__ACCESS_KEY_ID": ACCESS_KEY,
        "PYICEBERG_CATALOG__LAKE__S3__SECRET_ACCESS_KEY": SECRET_KEY,
        "PYICEBERG_CATALOG__LAKE__S3__REGION": REGION,
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # for the processes the test starts (PyIceberg reads its env once, at import)
    return home


def lake_catalog(s3: S3Server, tmp_path: Path):
    """The same catalog in this process (PyIceberg read its environment before the fixture set it)."""
    from pyiceberg.catalog import load_catalog

    return load_catalog(
        "lake", type="sql", uri=f"sqlite:///{tmp_path / 'catalog.db'}", warehouse=f"s3://{BUCKET}/warehouse",
        **{"s3.endpoint": s3.endpoint, "s3.access-key-id": ACCESS_KEY, "s3.secret-access-key": SECRET_KEY, "s3.region": REGION},
    )


def partfin(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "partfin_assets.cli", *args], capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_pipeline_end_to_end_on_object_storage(tmp_path: Path, lake: Path, s3: S3Server):
    partfin("ingest", "--table", "orders", "--source", SOURCE, "--checkpoint-records", "4000", "--max-checkpoints", "4")
    partfin("upsert", "--table", "orders")  # the first load

    (tmp_path / "dagster").mkdir()
    with DagsterInstance.local_temp(str(tmp_path / "dagster")) as instance:
        # spawned step processes: they take this test's environment (a forkserver started by an earlier
        # test in this process would hand its children that test's environment)
        config = {"execution": {"config": {"max_concurrent": 2, "start_method": {"spawn": {}}}}}
        # the rest (updates of the same keys) through the fanned-out writer: shares written by steps, one committer
        ingest = {**config, "ops": {"plan_ingest_orders": {"config": {"max_records": 4000, "max_checkpoints": 100, "shares": 2}}}}
        with execute_job(reconstructable(ingest_fanout_job), instance=instance, run_config=ingest) as result:
            assert result.success
            share_steps = [e for e in result.all_events if e.event_type_value == "STEP_SUCCESS" and e.step_key.startswith("write_share_")]
            assert len(share_steps) == 2, "one step per share, writing that share of every batch"
        with execute_job(reconstructable(ingest_fanout_job), instance=instance, run_config=ingest) as result:
            assert result.success  # the source is exhausted: nothing more
        with execute_job(reconstructable(fanout_job), instance=instance, run_config=config) as result:
            assert result.success
            merge_steps = [e for e in result.all_events if e.event_type_value == "STEP_SUCCESS" and e.step_key.startswith("merge_group_")]
            assert len(merge_steps) > 1

    catalog = lake_catalog(s3, tmp_path)
    base, cdc = catalog.load_table("base.orders"), catalog.load_table("cdc.orders")
    deletes = position_delete_files(base, base.current_snapshot())
    assert deletes, "the second upsert updated existing keys by position deletes"
    files = data_files(base, base.current_snapshot()) + deletes + data_files(cdc, cdc.current_snapshot())
    assert all(f.file_path.startswith(f"s3://{BUCKET}/") for f in files)
    stored = set(s3.keys(BUCKET))
    assert all(f.file_path.removeprefix(f"s3://{BUCKET}/") in stored for f in files)
    assert not list(lake.rglob("*.parquet")), "no data file on local disk"

    spec = TableSpec.from_properties("orders", cdc.properties)
    keyed, unfit_keys = decode_keys(spec, cdc.scan().to_arrow())
    changes, unfit_payloads = decode_payloads(spec, keyed)
    assert unfit_keys.num_rows == unfit_payloads.num_rows == 0
    assert changes.get_column(SOURCE_SEQ).is_unique().all(), "no event twice, whichever writer landed it"
    expected = latest_per_log(spec, changes)  # every key's newest change (one writer: one change log)
    expected_rows = {(r["id"], r[SOURCE_SEQ], r[DELETED]) for r in expected.select("id", SOURCE_SEQ, DELETED).to_dicts()}

    def base_rows():
        rows = read_base(catalog, "orders", include_deleted=True)
        return {(r["id"], r[SOURCE_SEQ], r[DELETED]) for r in rows.select(["id", SOURCE_SEQ, DELETED]).to_pylist()}

    assert base_rows() == expected_rows
    compacted = compact(catalog, "base.orders", finalized_only=False)
    assert compacted.snapshot_id is not None
    base = catalog.load_table("base.orders")
    assert position_delete_files(base, base.current_snapshot()) == []
    assert base_rows() == expected_rows

    # the downstream asset reads one hour of base from S3 (forced: the synthetic stream may not have finalized it)
    first_hour = min(changes.get_column("_event_time").dt.epoch("us").to_list()) // US_PER_HOUR * US_PER_HOUR
    key = iso_z(first_hour)[:13].replace("T", "-") + ":00"
    table = orders_table()
    out = subprocess.run(
        [str(Path(sys.executable).with_name("dagster")), "asset", "materialize", "-m", "partfin_assets.definitions",
         "--select", table.activity_key.to_user_string(), "--partition", key,
         "--config-json", '{"ops": {"%s": {"config": {"force": true}}}}' % table.activity_key.to_python_identifier()],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PARTFIN_SENSORS": "", "PARTFIN_SCHEDULES": ""},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert list((lake / "activity" / "orders").glob("*.parquet")), "the downstream asset wrote its hour"
