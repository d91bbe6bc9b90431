"""Stress: several processes run all four job kinds at random against one table (SQLite and PostgreSQL catalogs).

Afterwards the snapshot history is replayed against a model built from what every worker
says it did: every committed job appears exactly once and the table content equals the
model row by row; no failed job appears in the history or left a file; the watermark never
regressed (neither in the recorded history nor as seen by the workers).
"""

from __future__ import annotations

import multiprocessing
import random
import uuid
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from partfin_assets.iceberg.catalog import CatalogConfig
from partfin_assets.iceberg.expiry import Retention
from partfin_assets.iceberg.files import hour_partition
from partfin_assets.iceberg.history import summary_of, watermark_history
from partfin_assets.jobs.conflicts import CommitConflictError, touched_partitions
from partfin_assets.jobs.maintenance import list_table_files, referenced_files, remove_orphan_files
from partfin_assets.model import summary_keys as K
from partfin_assets.model.summary_keys import JobKind
from partfin_assets.model.timeutil import to_us
from partfin_assets_tests.conftest import HOUR_US, ORDERS, T0_US, change_batch

WORKERS = 3
JOBS_PER_WORKER = 14
HOURS = [T0_US + i * HOUR_US for i in range(3)]
NO_EXPIRY = Retention(keep_last=10_000)


def _rows(records) -> list[tuple]:
    cols = [records.column(c).to_pylist() for c in ("key", "op", "event_time", "source_seq", "payload")]
    return [(k, o, to_us(t), s, p) for k, o, t, s, p in zip(*cols)]


def _catalog(home: str, uri: str | None):
    return CatalogConfig(home=Path(home), uri=uri).load()


def worker(home: str, uri: str | None, index: int, seed: int, jobs: int) -> list[dict]:
    """One process: `jobs` random jobs; returns what it did (committed / conflict / noop)."""
    from partfin_assets.iceberg.history import watermark_of
    from partfin_assets.ingest.writer import CdcWriter
    from partfin_assets.jobs.compaction import compact
    from partfin_assets.jobs.privacy import cdc_key_filter, delete_where
    from partfin_assets.jobs.replay import replay_hour

    catalog = _catalog(home, uri)
    rng = random.Random(seed)
    writer = CdcWriter(catalog, ORDERS, writer_id=f"stress-{index}", retention=NO_EXPIRY)
    my_keys = list(range(10)) + list(range(100, 110)) + list(range(200, 210))
    log: list[dict] = []
    for j in range(jobs):
        kind = rng.choice(list(JobKind))
        hour = rng.choice(HOURS)
        job_id = f"w{index}-j{j}-{uuid.uuid4().hex[:6]}"
        entry: dict = {"kind": kind.value, "hour": hour, "job_id": job_id}
        try:
            if kind is JobKind.INTO:
                keys = [10_000 + index * 1000 + j * 3 + r for r in range(3)]
                batch = change_batch(hour + rng.randrange(0, HOUR_US - 10_000_000) + np.arange(3) * 1_000_000,
                                     offset=f"{index}-{j}", seq_start=1_000_000 + index * 10_000 + j * 10, keys=keys)
                result = writer.write_checkpoint(batch)
                my_keys += keys
                entry.update(snapshot_id=result.snapshot_id, writer=writer.writer_id, checkpoint=result.checkpoint_id,
                             rows=_rows(batch.records))
            elif kind is JobKind.OVERWRITE:
                keys = [50_000 + index * 1000 + j * 4 + r for r in range(4)]
                records = change_batch(hour + rng.randrange(0, HOUR_US - 10_000_000) + np.arange(4) * 1_000_000,
                                       offset="replay", seq_start=2_000_000 + index * 10_000 + j * 10, keys=keys).records
                result = replay_hour(catalog, "orders", hour, records, job_id=job_id, force=True)  # not the hour's history
                my_keys += keys
                entry.update(snapshot_id=result.snapshot_id, rows=_rows(records))
            elif kind is JobKind.UPDATE_DELETE:
                key = rng.choice(my_keys)
                prune, mask = cdc_key_filter([{"id": key}])
                result = delete_where(catalog, "cdc.orders", prune, mask, job_id=job_id)
                entry.update(snapshot_id=result.snapshot_id, key=key)
            else:
                result = compact(catalog, "cdc.orders", hours=[hour], finalized_only=False, job_id=job_id)
                entry.update(snapshot_id=result.snapshot_id)
            entry["outcome"] = "committed" if entry["snapshot_id"] is not None else "noop"
        except CommitConflictError as exc:
            entry.update(outcome="conflict", snapshot_id=None, conflicting=exc.conflicting_snapshot_id)
        entry["watermark_seen"] = watermark_of(catalog.load_table("cdc.orders").properties)
        log.append(entry)
    writer.close()
    return log


@pytest.fixture(params=["sqlite", "postgres"])
def catalog_location(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "home"), None
    postgres = request.getfixturevalue("postgres")
    database = f"stress_{uuid.uuid4().hex[:10]}"
    postgres.create_database(database)
    return str(tmp_path / "home"), postgres.sqlalchemy_uri(database)


def test_random_jobs_from_several_processes(catalog_location):
    from partfin_assets.ingest.writer import CdcWriter

    home, uri = catalog_location
    catalog = _catalog(home, uri)
    seeder = CdcWriter(catalog, ORDERS, writer_id="seed", retention=NO_EXPIRY)
    seed_rows: list[tuple] = []
    for i in range(2):
        for h, hour in enumerate(HOURS):
            batch = change_batch(hour + np.arange(10) * 60_000_000 + i * 1_000_000, offset=f"s{i}{h}",
                                 seq_start=h * 100 + i * 10 + 1, keys=list(range(h * 100, h * 100 + 10)))
            seeder.write_checkpoint(batch)
            seed_rows += _rows(batch.records)

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=WORKERS, mp_context=context) as pool:
        futures = [pool.submit(worker, home, uri, i, 1000 + i, JOBS_PER_WORKER) for i in range(WORKERS)]
        logs = [f.result(timeout=300) for f in futures]
    entries = [e for log in logs for e in log]
    print("outcomes:", dict(Counter((e["kind"], e["outcome"]) for e in entries)))  # visible with -s
    committed = [e for e in entries if e["outcome"] == "committed"]
    failed = [e for e in entries if e["outcome"] == "conflict"]
    kinds_committed = {e["kind"] for e in committed}
    assert {JobKind.INTO.value, JobKind.OVERWRITE.value} <= kinds_committed
    assert not [e for e in failed if e["kind"] == JobKind.INTO.value]  # INTO never fails
    assert len(committed) >= WORKERS * JOBS_PER_WORKER // 3

    table = catalog.load_table("cdc.orders")
    metadata = table.metadata
    chain = []
    snapshot = metadata.current_snapshot()
    while snapshot is not None:
        chain.append(snapshot)
        snapshot = metadata.snapshot_by_id(snapshot.parent_snapshot_id) if snapshot.parent_snapshot_id else None
    chain.reverse()
    assert len(chain) == len(metadata.snapshots)  # one linear history, nothing expired

    by_job = {e["job_id"]: e for e in committed if e["kind"] != JobKind.INTO.value}
    by_checkpoint = {(e["writer"], e["checkpoint"]): e for e in committed if e["kind"] == JobKind.INTO.value}
    seen: dict[int, int] = {}
    seed_checkpoints = 0

    def hour_path(event_time_us: int) -> str:
        return hour_partition(metadata, event_time_us // HOUR_US * HOUR_US)

    for position, snapshot in enumerate(chain):
        summary = summary_of(snapshot)
        if summary.get(K.WRITER_ID) == "seed":
            assert position == seed_checkpoints, "the seed commits come first"
            seed_checkpoints += 1
            continue
        if K.JOB_ID in summary:
            entry = by_job.get(summary[K.JOB_ID])
            assert entry is not None, f"snapshot {snapshot.snapshot_id} of job {summary[K.JOB_ID]} that no worker committed"
        else:
            entry = by_checkpoint.get((summary.get(K.WRITER_ID), int(summary.get(K.CHECKPOINT_ID, "-1"))))
            assert entry is not None, f"unexpected snapshot {snapshot.snapshot_id}: {summary}"
        assert entry["snapshot_id"] == snapshot.snapshot_id
        seen[id(entry)] = seen.get(id(entry), 0) + 1
    assert seed_checkpoints == len(HOURS) * 2
    model = _replay_model(chain, metadata, table, seed_rows, by_job, by_checkpoint, hour_path)

    # every committed job exactly once; failed jobs nowhere
    assert all(seen.get(id(e)) == 1 for e in committed), "a committed job is missing from or repeated in the history"
    job_ids_in_history = [summary_of(s).get(K.JOB_ID) for s in chain]
    for e in failed:
        assert e["job_id"] not in job_ids_in_history
    # content equals the model, row by row (multiset)
    actual = sorted(_rows(table.scan().to_arrow()))
    assert actual == sorted(model)
    # No failed job left a data file or manifest (nothing is expired here, so every one must be
    # referenced). A commit attempt that loses the catalog's compare-and-set at the last moment
    # leaves its metadata.json (PyIceberg's SqlCatalog writes it before the UPDATE): that is
    # catalog garbage, not a job's data, and orphan-file removal deletes it.
    stray = {f.path for f in list_table_files(metadata.location)} - referenced_files(table)
    assert not {p for p in stray if not p.endswith(".metadata.json")}, f"files left behind: {sorted(stray)[:5]}"
    report = remove_orphan_files(catalog, "cdc.orders", older_than_s=0)
    assert sorted(report.orphans) == sorted(stray)
    assert {f.path for f in list_table_files(metadata.location)} == referenced_files(catalog.load_table("cdc.orders"))
    assert sorted(_rows(catalog.load_table("cdc.orders").scan().to_arrow())) == actual
    # the watermark never regressed: in the history, and as each worker saw it over time
    history = [w for _, w in watermark_history(metadata)]
    assert history == sorted(history)
    for log in logs:
        seen_marks = [e["watermark_seen"] for e in log if e["watermark_seen"] is not None]
        assert seen_marks == sorted(seen_marks)


def _replay_model(chain, metadata, table, seed_rows, by_job, by_checkpoint, hour_path) -> list[tuple]:
    model: list[tuple] = list(seed_rows)
    appended: list[tuple[int, tuple]] = []  # (sequence number, row) of every INTO row
    for snapshot in chain:
        summary = summary_of(snapshot)
        if summary.get(K.WRITER_ID) == "seed":
            continue
        entry = by_job.get(summary.get(K.JOB_ID)) if K.JOB_ID in summary else by_checkpoint[(summary[K.WRITER_ID], int(summary[K.CHECKPOINT_ID]))]
        kind = entry["kind"]
        if kind == JobKind.INTO.value:
            model += [tuple(r) for r in entry["rows"]]
            appended += [(snapshot.sequence_number, tuple(r)) for r in entry["rows"]]
        elif kind == JobKind.OVERWRITE.value:  # replaces the hour as it started; INTO rows appended since stay
            target = hour_path(entry["hour"])
            start = metadata.snapshot_by_id(int(summary[K.JOB_START_SNAPSHOT]))
            since = {r for seq, r in appended if seq > start.sequence_number}
            kept = [r for r in model if hour_path(r[2]) == target and r in since]
            model = [r for r in model if hour_path(r[2]) != target] + kept + [tuple(r) for r in entry["rows"]]
        elif kind == JobKind.UPDATE_DELETE.value:
            touched = touched_partitions(snapshot, metadata, table.io).partitions
            key = f'{{"id":{entry["key"]}}}'
            model = [r for r in model if not (r[0] == key and hour_path(r[2]) in touched)]
    return model
