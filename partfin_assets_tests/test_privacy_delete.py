"""Privacy delete by primary key across cdc.<table> and base.<table>: complete, idempotent, resumable."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from partfin_assets.iceberg.expiry import Retention
from partfin_assets.iceberg.tables import read_base
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.jobs.conflicts import CommitConflictError
from partfin_assets.jobs.privacy import base_key_filter, cdc_key_filter, delete_where, privacy_delete
from partfin_assets.jobs.upsert import run_upsert
from partfin_assets.model import summary_keys as K
from partfin_assets.model.errors import InvalidInput
from partfin_assets.model.summary_keys import JobKind
from partfin_assets_tests.conftest import HOUR_US, MINUTE_US, ORDERS, T0_US, change_batch


def cdc_keys(catalog) -> list[str]:
    return catalog.load_table("cdc.orders").scan().to_arrow().column("key").to_pylist()


def base_ids(catalog, include_deleted=True) -> set[int]:
    return set(read_base(catalog, "orders", include_deleted=include_deleted).column("id").to_pylist())


@pytest.fixture
def loaded(catalog):
    writer = CdcWriter(catalog, ORDERS, retention=Retention(keep_last=1000))
    for h in range(3):
        # keys 0..19 in every hour; key 7 deleted in hour 2 (a tombstone in base)
        keys = list(range(20))
        ops = ["d" if (h == 2 and k == 7) else "u" for k in keys]
        writer.write_checkpoint(change_batch(T0_US + h * HOUR_US + np.arange(20) * MINUTE_US, offset=str(h),
                                             seq_start=h * 100, keys=keys, ops=ops))
    run_upsert(catalog, "orders")
    return catalog


def test_privacy_delete_removes_the_keys_from_both_tables(loaded):
    catalog = loaded
    before_cdc = cdc_keys(catalog)
    assert 7 in base_ids(catalog) and 7 not in base_ids(catalog, include_deleted=False)  # tombstone
    result = privacy_delete(catalog, "orders", [{"id": 3}, {"id": 7}], request_id="gdpr-1")
    assert result.cdc_deleted == 6 and result.base_deleted == 2
    after_cdc = cdc_keys(catalog)
    assert '{"id":3}' not in after_cdc and '{"id":7}' not in after_cdc
    assert sorted(after_cdc) == sorted(k for k in before_cdc if k not in ('{"id":3}', '{"id":7}'))
    assert base_ids(catalog) == set(range(20)) - {3, 7}  # tombstone gone too
    for name in ("cdc.orders", "base.orders"):
        summary = catalog.load_table(name).current_snapshot().summary.additional_properties
        assert summary[K.JOB_KIND] == JobKind.UPDATE_DELETE.value
        assert summary[K.PRIVACY_REQUEST_ID] == "gdpr-1"
        assert K.EVENT_TIME_COUNT not in summary
        assert not any('"id":3' in v or '"id":7' in v for v in summary.values())  # never the keys
    # only the bucket of the keys was rewritten in base
    base_commit = result.base[0]
    assert len(base_commit.partitions) == len({p for p in base_commit.partitions})
    assert all(p.startswith("id_bucket=") for p in base_commit.partitions)
    # the next upsert brings nothing back
    run_upsert(catalog, "orders")
    assert base_ids(catalog) == set(range(20)) - {3, 7}
    # idempotent: nothing left, nothing committed
    snapshots = {n: len(catalog.load_table(n).metadata.snapshots) for n in ("cdc.orders", "base.orders")}
    again = privacy_delete(catalog, "orders", [{"id": 3}, {"id": 7}], request_id="gdpr-1")
    assert again.cdc == [] and again.base == []
    assert snapshots == {n: len(catalog.load_table(n).metadata.snapshots) for n in ("cdc.orders", "base.orders")}


def test_a_crash_between_the_tables_is_finished_by_a_rerun(loaded):
    catalog = loaded

    def crash(step):
        if step == "cdc.orders":
            raise KeyboardInterrupt("killed between the two tables")

    with pytest.raises(KeyboardInterrupt):
        privacy_delete(catalog, "orders", [{"id": 5}], request_id="gdpr-2", after_step=crash)
    assert '{"id":5}' not in cdc_keys(catalog) and 5 in base_ids(catalog)
    result = privacy_delete(catalog, "orders", [{"id": 5}], request_id="gdpr-2")
    assert result.cdc == [] and result.base_deleted == 1
    assert 5 not in base_ids(catalog)


def test_a_concurrent_append_of_the_key_is_caught_by_the_next_round(loaded):
    """Another engine (a plain INTO job: it knows nothing of erasures) appends the key during the delete."""
    from partfin_assets.jobs.job import Job
    from partfin_assets.model.records import with_source_log
    from partfin_assets_tests.table_helpers import commit_append

    catalog = loaded
    calls = []

    def append_key_elsewhere(job):
        if job.identifier == "cdc.orders" and not calls:
            calls.append(job.job_id)
            # a new hour: no conflict with the delete's partitions, but the key is back
            rows = with_source_log(change_batch(T0_US + 5 * HOUR_US + np.arange(2) * MINUTE_US, offset="x", seq_start=900, keys=[11, 12]).records, "other")
            with Job.start(catalog, "cdc.orders", JobKind.INTO) as other:
                commit_append(other, other.write(rows.append_column("arrival_time", pa.nulls(2, pa.timestamp("us", tz="UTC"))).select(
                    ["key", "op", "event_time", "source_seq", "payload", "arrival_time", "source_log"])))

    result = privacy_delete(catalog, "orders", [{"id": 11}], before_commit=append_key_elsewhere)
    assert len(result.cdc) == 2  # the second round removed what the concurrent append brought
    assert '{"id":11}' not in cdc_keys(catalog) and '{"id":12}' in cdc_keys(catalog)


def test_a_writer_that_read_before_the_request_commits_nothing_of_the_key(loaded):
    """The CDC writer prepared its batch (filtered with no erasure) before the request; it commits while the delete
    runs: its commit sees the fence, the batch is void and read again without the key."""
    from partfin_assets.ingest.writer import ErasedMeanwhile

    catalog = loaded
    writer = CdcWriter(catalog, ORDERS, writer_id="late")
    prepared = writer.prepare(change_batch(T0_US + 5 * HOUR_US + np.arange(2) * MINUTE_US, offset="x", seq_start=900, keys=[11, 12]))
    written = writer.write_shares(prepared)
    outcome = []

    def writer_commits(job):
        if job.identifier == "cdc.orders" and not outcome:
            with pytest.raises(ErasedMeanwhile) as void:
                writer.commit_checkpoint(prepared, written)
            outcome.append(void.value)

    privacy_delete(catalog, "orders", [{"id": 11}], before_commit=writer_commits)
    assert outcome and '{"id":11}' not in cdc_keys(catalog)
    assert writer.position == outcome[0].position  # read again from where it was
    again = writer.write_checkpoint(change_batch(T0_US + 5 * HOUR_US + np.arange(2) * MINUTE_US, offset="x", seq_start=900, keys=[11, 12]))
    assert again.summary[K.PRIVACY_ERASED_RECORDS] == "1"
    assert '{"id":11}' not in cdc_keys(catalog) and '{"id":12}' in cdc_keys(catalog)


def test_delete_conflicts_with_a_commit_to_its_partition_and_leaves_nothing(loaded):
    catalog = loaded
    table = catalog.load_table("cdc.orders")
    files_before = {t.file.file_path for t in table.scan().plan_files()}
    written = []

    def race(job):
        written.extend(job.written)
        CdcWriter(catalog, ORDERS, writer_id="racer").write_checkpoint(
            change_batch(T0_US + np.arange(2) * MINUTE_US, offset="r", seq_start=800, keys=[40, 41]))

    prune, mask = cdc_key_filter([{"id": 4}])
    with pytest.raises(CommitConflictError) as info:
        delete_where(catalog, "cdc.orders", prune, mask, before_commit=race)
    assert info.value.kind is JobKind.UPDATE_DELETE
    assert written and not any(os.path.exists(p.removeprefix("file://")) for p in written)
    assert '{"id":4}' in cdc_keys(catalog)
    assert files_before <= {t.file.file_path for t in catalog.load_table("cdc.orders").scan().plan_files()}


def test_base_key_filter_matches_exactly(loaded):
    from partfin_assets.model.tablespec import TableSpec

    spec = TableSpec.from_properties("orders", loaded.load_table("cdc.orders").properties)
    _, mask = base_key_filter(spec, [{"id": 2}, {"id": 9}])
    data = read_base(loaded, "orders")
    assert sorted(data.filter(mask(data)).column("id").to_pylist()) == [2, 9]
    with pytest.raises(InvalidInput, match="primary key"):  # refused before anything is read or written
        privacy_delete(loaded, "orders", [{"nope": 1}])
    assert pc.sum(mask(data)).as_py() == 2


@pytest.mark.parametrize("same_bucket", [False, True])
def test_upsert_conflicts_with_a_base_delete_only_in_its_buckets(loaded, same_bucket):
    """The upsert is an UPDATE/DELETE job on base: a privacy delete in another bucket does not make it fail."""
    from pyiceberg.transforms import BucketTransform
    from pyiceberg.types import LongType

    from partfin_assets.model.tablespec import TableSpec

    catalog = loaded
    bucket = BucketTransform(16).transform(LongType())
    bucket_of = {k: bucket(k) for k in range(20)}
    victim = next(k for k in range(20) if k != 1 and (bucket_of[k] == bucket_of[1]) == same_bucket)
    # new CDC changes for key 1 only; while the upsert sits between read and commit, the victim is deleted from base
    CdcWriter(catalog, ORDERS, writer_id="more").write_checkpoint(
        change_batch(T0_US + 4 * HOUR_US + np.arange(1) * MINUTE_US, offset="m", seq_start=700, keys=[1]))
    spec = TableSpec.from_properties("orders", catalog.load_table("cdc.orders").properties)
    prune, mask = base_key_filter(spec, [{"id": victim}])
    fired = []

    def hook(phase):
        if phase == "after-read" and not fired:
            fired.append(delete_where(catalog, "base.orders", prune, mask))

    if same_bucket:
        with pytest.raises(CommitConflictError) as lost:
            run_upsert(catalog, "orders", crash_hook=hook)
        assert lost.value.conflicting_snapshot_id == fired[0].snapshot_id
        assert lost.value.partitions == [f"id_bucket={bucket_of[1]}"]
        result = run_upsert(catalog, "orders")  # the re-run plans from the head the delete left
    else:
        result = run_upsert(catalog, "orders", crash_hook=hook)
    assert fired and fired[0].snapshot_id is not None
    assert result.attempts == 1
    assert victim not in base_ids(catalog)
    assert result.updated == 1


def files_holding(catalog, spec, key: int) -> list[str]:
    """Data files under any of the table's locations (referenced or not) holding a row or raw line of `key`."""
    import re
    from pathlib import Path

    import pyarrow.parquet as pq

    names = re.compile(rf'\\?"id\\?"\s*:\s*{key}(?![0-9.])')
    found = []
    for identifier in spec.row_identifiers:
        location = Path(catalog.load_table(identifier).metadata.location.removeprefix("file://"))
        for path in sorted(location.rglob("*.parquet")):
            rows = pq.read_table(path).to_pylist()
            if any(r.get("id") == key or any(isinstance(v, str) and names.search(v) for v in r.values()) for r in rows):
                found.append(str(path.relative_to(location.parent)))
    return found


def manifest_bounds_naming(catalog, spec, text: bytes) -> list[str]:
    """Manifest entries (removed files' too) of every retained snapshot whose column bounds hold `text`."""
    found = []
    for identifier in spec.row_identifiers:
        table = catalog.load_table(identifier)
        for snapshot in table.metadata.snapshots:
            for manifest in snapshot.manifests(table.io):
                for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=False):
                    bounds = list((entry.data_file.lower_bounds or {}).values()) + list((entry.data_file.upper_bounds or {}).values())
                    if any(text in bytes(b) for b in bounds):
                        found.append(f"{identifier} {manifest.manifest_path}")
    return found


def test_the_hard_erase_leaves_no_file_holding_the_key(catalog):
    """After the request, once 10 newer snapshots, the policy window (min-of-last:3) and the writer's newest checkpoint
    have moved past it and an upsert moved the merged tag, one maintenance run (expiry, orphan removal) of every table
    leaves no file on storage holding the key (the rejected tables' too)."""
    from partfin_assets.iceberg.expiry import Retention as KeepAll
    from partfin_assets.jobs.maintenance import expire_table_snapshots, maintained_tables, remove_orphan_files
    from partfin_assets.model.records import REJECTED_RECORD_SCHEMA, ChangeBatch

    writer = CdcWriter(catalog, ORDERS, retention=KeepAll(keep_last=10_000))  # only maintenance expires here
    bad = pa.table({"source_seq": [999], "raw": ['{"after":{"id":7,"amount":'], "reason": ["not JSON"]}, schema=REJECTED_RECORD_SCHEMA)
    for h in range(3):
        batch = change_batch(T0_US + h * HOUR_US + np.arange(20) * MINUTE_US, offset=str(h), seq_start=h * 100, keys=list(range(20)))
        writer.write_checkpoint(ChangeBatch(batch.records, offset=str(h), rejected=bad if h == 0 else batch.rejected))
    run_upsert(catalog, "orders")
    spec = ORDERS
    privacy_delete(catalog, "orders", [{"id": 7}], request_id="gdpr-hard")
    held = files_holding(catalog, spec, 7)
    print("\nfiles still holding the key after the delete:", len(held))
    assert held  # older snapshots still reference them
    # the rejected tables keep no column bounds: the first bytes of a raw line never reach a manifest
    assert manifest_bounds_naming(catalog, spec, b'"id":7') == []
    for i in range(11):  # the table goes on: more than keep_last (10) and the policy window (3) of newer commits
        writer.write_checkpoint(change_batch(T0_US + 4 * HOUR_US + np.arange(2) * MINUTE_US + i, offset=f"n{i}", seq_start=1000 + i * 10, keys=[30, 31]))
    run_upsert(catalog, "orders")  # moves cdc's partfin-base-merged tag past the delete
    for _ in range(10):  # base's newer snapshots (upserts)
        writer.write_checkpoint(change_batch(T0_US + 5 * HOUR_US + np.arange(1) * MINUTE_US + _, offset=f"b{_}", seq_start=2000 + _ * 10, keys=[32]))
        run_upsert(catalog, "orders")
    for maintained in maintained_tables(catalog, "orders"):  # maintain_<table>
        expire_table_snapshots(catalog, maintained.identifier, maintained.retention(KeepAll()))
        remove_orphan_files(catalog, maintained.identifier, older_than_s=0)
    assert files_holding(catalog, spec, 7) == []
    assert manifest_bounds_naming(catalog, spec, b'"id":7') == []  # column bounds of the removed files went too
    assert 7 not in base_ids(catalog) and sorted(base_ids(catalog)) == sorted(set(range(20)) - {7} | {30, 31, 32})
