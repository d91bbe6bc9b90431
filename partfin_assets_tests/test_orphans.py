"""Table maintenance: orphan-file removal (never a referenced file, never a young one) and policy-aware expiry."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from partfin_assets.iceberg.expiry import Retention
from partfin_assets.iceberg.history import recent_commit_stats
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.jobs.compaction import compact
from partfin_assets.jobs.job import Job
from partfin_assets.jobs.maintenance import expire_table_snapshots, list_table_files, referenced_files, remove_orphan_files
from partfin_assets.model import summary_keys as K
from partfin_assets.model.records import cdc_records
from partfin_assets.model.summary_keys import JobKind
from partfin_assets_tests.conftest import HOUR_US, MINUTE_US, ORDERS, T0_US, change_batch


def ingest(catalog, n=4):
    writer = CdcWriter(catalog, ORDERS, retention=Retention(keep_last=1000))
    for i in range(n):
        writer.write_checkpoint(change_batch(T0_US + (i % 2) * HOUR_US + np.arange(10) * MINUTE_US, offset=str(i), seq_start=i * 100))
    return writer


def all_rows(catalog):
    data = catalog.load_table("cdc.orders").scan().to_arrow()
    return sorted(data.column("source_seq").to_pylist())


def test_abandoned_job_deletes_its_files(catalog):
    ingest(catalog)
    rows = cdc_records(change_batch(T0_US + np.arange(5) * MINUTE_US, offset="x", seq_start=7000).records)
    with pytest.raises(RuntimeError):
        with Job.start(catalog, "cdc.orders", JobKind.OVERWRITE) as job:
            files = job.write(rows)
            assert files and all(os.path.exists(f.file_path.removeprefix("file://")) for f in files)
            raise RuntimeError("the job gave up")
    assert not any(os.path.exists(f.file_path.removeprefix("file://")) for f in files)
    table = catalog.load_table("cdc.orders")
    assert {f.path for f in list_table_files(table.metadata.location)} <= referenced_files(table)


def test_orphans_removed_only_when_unreferenced_and_old(catalog):
    ingest(catalog)
    # a hard-killed job: files written, never committed, never cleaned
    job = Job.start(catalog, "cdc.orders", JobKind.INTO)
    killed = [f.file_path.removeprefix("file://") for f in job.write(cdc_records(change_batch(T0_US + np.arange(3) * MINUTE_US, offset="k", seq_start=9000).records))]
    table = catalog.load_table("cdc.orders")
    junk = Path(table.metadata.location.removeprefix("file://")) / "data" / "junk.bin"
    junk.write_bytes(b"x")
    before = all_rows(catalog)

    young = remove_orphan_files(catalog, "cdc.orders")  # default safety age: 1 h
    assert young.orphans == [] and set(killed) | {str(junk)} <= set(young.too_young)
    dry = remove_orphan_files(catalog, "cdc.orders", older_than_s=3600, now_s=time.time() + 7200, dry_run=True)
    assert set(dry.orphans) == set(killed) | {str(junk)} and all(os.path.exists(p) for p in killed)
    done = remove_orphan_files(catalog, "cdc.orders", older_than_s=3600, now_s=time.time() + 7200)
    assert set(done.orphans) == set(killed) | {str(junk)}
    assert not any(os.path.exists(p) for p in killed) and not junk.exists()
    assert all_rows(catalog) == before
    table = catalog.load_table("cdc.orders")
    assert {f.path for f in list_table_files(table.metadata.location)} == referenced_files(table)


def test_expiry_then_orphan_removal_frees_replaced_files_but_keeps_live_and_policy_snapshots(catalog):
    writer = ingest(catalog, 6)
    compact(catalog, "cdc.orders", finalized_only=False)  # replaces the small files
    table = catalog.load_table("cdc.orders")
    replaced = {f.path for f in list_table_files(table.metadata.location) if f.path.endswith(".parquet")} - {
        t.file.file_path.removeprefix("file://") for t in table.scan().plan_files()
    }
    assert replaced
    # still referenced by the snapshots before the compaction: not orphans
    assert not remove_orphan_files(catalog, "cdc.orders", older_than_s=0).orphans
    # more checkpoints, and a few more compactions (stats-free commits the policy must look past)
    for i in range(3):
        writer.write_checkpoint(change_batch(T0_US + 2 * HOUR_US + np.arange(10) * MINUTE_US, offset=f"n{i}", seq_start=5000 + i * 100))
        compact(catalog, "cdc.orders", finalized_only=False, min_input_files=2)
    table = catalog.load_table("cdc.orders")
    stats_before = [c.snapshot_id for c in recent_commit_stats(table.metadata, 3)]
    rows_before = all_rows(catalog)
    expired = expire_table_snapshots(catalog, "cdc.orders", Retention(keep_last=1))
    assert expired > 0
    table = catalog.load_table("cdc.orders")
    assert [c.snapshot_id for c in recent_commit_stats(table.metadata, 3)] == stats_before  # min-of-last:3 keeps its window
    report = remove_orphan_files(catalog, "cdc.orders", older_than_s=0)
    assert replaced <= set(report.orphans)  # the pre-compaction small files are gone now
    assert not (set(report.orphans) & referenced_files(table))
    for snapshot in table.metadata.snapshots:  # every retained snapshot is still fully readable
        table.scan(snapshot_id=snapshot.snapshot_id).to_arrow()
    assert all_rows(catalog) == rows_before
    assert {f.path for f in list_table_files(table.metadata.location)} == referenced_files(table)
    assert K.PROP_WATERMARK in table.properties


def test_orphan_removal_never_follows_links_out_of_the_table(catalog, tmp_path):
    ingest(catalog)
    table = catalog.load_table("cdc.orders")
    data = Path(table.metadata.location.removeprefix("file://")) / "data"
    outside = tmp_path / "outside-the-warehouse"
    (outside / "folder").mkdir(parents=True)
    kept = [outside / "folder" / f"precious-{i}.parquet" for i in range(3)] + [outside / "single.parquet"]
    for path in kept:
        path.write_bytes(b"PAR1 not partfin's")
    (data / "linked-folder").symlink_to(outside / "folder", target_is_directory=True)
    (data / "linked-file.parquet").symlink_to(outside / "single.parquet")
    stray = data / "stray.parquet"  # a regular file no snapshot names: the one orphan
    stray.write_bytes(b"PAR1")
    rows = all_rows(catalog)

    report = remove_orphan_files(catalog, "cdc.orders", older_than_s=0)
    assert report.orphans == [str(stray)] and not stray.exists()
    assert all(path.exists() for path in kept)  # nothing outside the table's folder, through a link or otherwise
    assert (data / "linked-folder").is_symlink() and (data / "linked-file.parquet").is_symlink()  # links are no files of the table
    assert all_rows(catalog) == rows
