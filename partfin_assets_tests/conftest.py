"""Shared fixtures: a real SqlCatalog on SQLite with a file warehouse in tmp_path."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pytest
from dagster import DagsterInstance

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.model.records import CDC_RECORD_SCHEMA_WITHOUT_ARRIVAL, ChangeBatch
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.model.timeutil import to_us

T0 = datetime(2026, 11, 1, tzinfo=UTC)
T0_US = to_us(T0)
MINUTE_US = 60_000_000
HOUR_US = 3_600_000_000
# min-of-last:3: the policy most tests here reason about (one commit is one step); new tables default to late-budget
ORDERS = TableSpec("orders", ("id",), {"id": pa.int64(), "amount": pa.float64()}, watermark_policy="min-of-last:3")


@pytest.fixture
def instance(tmp_path, monkeypatch):
    """A real Dagster instance in tmp_path, PARTFIN_HOME at tmp_path/partfin (the fan-out jobs' tests)."""
    monkeypatch.setenv("PARTFIN_HOME", str(tmp_path / "partfin"))
    (tmp_path / "dagster").mkdir()
    with DagsterInstance.local_temp(str(tmp_path / "dagster")) as instance:
        yield instance


@pytest.fixture
def catalog(tmp_path, monkeypatch):
    monkeypatch.delenv("PARTFIN_CATALOG_URI", raising=False)
    monkeypatch.delenv("PARTFIN_CATALOG", raising=False)
    return load_partfin_catalog(tmp_path / "home")


def change_batch(event_time_us, *, offset: str, seq_start: int = 0, keys=None, ops=None, heartbeat=None) -> ChangeBatch:
    """CDC records with the given event times (epoch us); keys default to a spread over 50 ids."""
    times = np.asarray(event_time_us, dtype=np.int64)
    n = times.size
    seqs = np.arange(seq_start, seq_start + n, dtype=np.int64)
    keys = keys if keys is not None else [int(s % 50) for s in seqs]
    ops = ops if ops is not None else ["u"] * n
    records = pa.table(
        {
            "key": [json.dumps({"id": int(k)}, separators=(",", ":")) for k in keys],
            "op": ops,
            "event_time": pa.array(times, pa.timestamp("us", tz="UTC")),
            "source_seq": seqs,
            "payload": [None if op == "d" else json.dumps({"id": int(k), "amount": 1.5}) for k, op in zip(keys, ops)],
        },
        schema=CDC_RECORD_SCHEMA_WITHOUT_ARRIVAL,
    )
    return ChangeBatch(records, offset=offset, heartbeat=heartbeat)


@pytest.fixture(scope="session")
def postgres():
    """One throwaway PostgreSQL 15 cluster (wal_level=logical) for the whole test session."""
    from partfin_assets_tests.postgres_cluster import throwaway_cluster

    with throwaway_cluster() as cluster:
        yield cluster


@pytest.fixture
def kafka_cluster():
    """librdkafka's mock Kafka cluster: 3 brokers on 127.0.0.1 in a helper process, stopped by PID."""
    from partfin_assets_tests.kafka_cluster import mock_kafka_cluster

    with mock_kafka_cluster(brokers=3) as cluster:
        yield cluster
