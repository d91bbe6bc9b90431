"""The conflict matrix (docs/concurrency.md), every cell, same and different partition, on SQLite and PostgreSQL catalogs.

Each case races two real jobs on one table from two threads. The *later* job starts
first (reads its start snapshot, writes its files) and parks at a barrier just before
its commit; the *earlier* job then runs to completion; the later job is released and
commits (or fails). So "earlier/later" is the order of finishing, deterministically.
Outcome, conflict error, final table content row by row, leftover files and the
watermark are all checked.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from pyiceberg.transforms import BucketTransform
from pyiceberg.types import LongType

from partfin_assets.iceberg.catalog import CatalogConfig
from partfin_assets.iceberg.expiry import Retention
from partfin_assets.iceberg.files import hour_partition, live_files, read_files
from partfin_assets.iceberg.history import watermark_history
from partfin_assets.iceberg.tables import DELETED, read_base
from partfin_assets.ingest.extensions import CommitProcessor
from partfin_assets.ingest.watermark_processor import WatermarkProcessor
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.jobs.compaction import compact
from partfin_assets.jobs.conflicts import CommitConflictError
from partfin_assets.jobs.job import Job
from partfin_assets.jobs.maintenance import list_table_files, referenced_files
from partfin_assets.jobs.privacy import base_key_filter, cdc_key_filter, delete_where
from partfin_assets.jobs.replay import replay_hour
from partfin_assets.jobs.retry import retry_on_conflict
from partfin_assets.jobs.upsert import run_upsert
from partfin_assets.model import summary_keys as K
from partfin_assets.model.summary_keys import JobKind
from partfin_assets.model.tablespec import TableSpec
from partfin_assets_tests.conftest import HOUR_US, ORDERS, T0_US, change_batch
from partfin_assets_tests.table_helpers import commit_append, files_per_partition

KINDS = [JobKind.OVERWRITE, JobKind.INTO, JobKind.UPDATE_DELETE, JobKind.MERGE]
HOURS = {"A": T0_US, "B": T0_US + HOUR_US}
DELETE_KEY = {"A": 3, "B": 103}  # a key that lives only in that hour
NO_EXPIRY = Retention(keep_last=10_000)

Row = tuple  # (key, op, event_time us, source_seq, payload)


# --------------------------------------------------------------------------- catalogs


@pytest.fixture(params=["sqlite", "postgres"])
def any_catalog(request, tmp_path):
    """(catalog, home) on the embedded SQLite catalog or on a fresh database of the throwaway PostgreSQL cluster."""
    if request.param == "sqlite":
        config = CatalogConfig(home=tmp_path / "home")
    else:
        postgres = request.getfixturevalue("postgres")
        database = f"matrix_{uuid.uuid4().hex[:10]}"
        postgres.create_database(database)
        config = CatalogConfig(home=tmp_path / "home", uri=postgres.sqlalchemy_uri(database))
    catalog = config.load()
    yield catalog
    engine = getattr(catalog, "engine", None)
    if engine is not None:
        engine.dispose()


# --------------------------------------------------------------------------- the table and a model of it


def rows_of(batch_records: pa.Table) -> list[Row]:
    cols = [batch_records.column(c).to_pylist() for c in ("key", "op", "event_time", "source_seq", "payload")]
    return [(k, o, t.timestamp() if t is not None else None, s, p) for k, o, t, s, p in zip(*cols)]


def table_rows(catalog) -> list[Row]:
    return sorted(rows_of(catalog.load_table("cdc.orders").scan().to_arrow()))


def hour_of(row: Row) -> str:
    return "A" if row[2] < (T0_US + HOUR_US) / 1e6 else "B"


def key_id(row: Row) -> int:
    return int(row[0].split(":")[1].rstrip("}"))


def seed(catalog) -> list[Row]:
    """Two checkpoints per hour (two small files each), keys 0-9 in A and 100-109 in B."""
    writer = CdcWriter(catalog, ORDERS, writer_id="seed", retention=NO_EXPIRY)
    rows: list[Row] = []
    for i in range(2):
        for name, keys in (("A", range(10)), ("B", range(100, 110))):
            batch = change_batch(
                HOURS[name] + np.arange(10) * 60_000_000 + i * 30_000_000,
                offset=f"{name}{i}", seq_start=(1 if name == "A" else 2) * 1000 + i * 100, keys=list(keys),
            )
            writer.write_checkpoint(batch)
            rows += rows_of(batch.records)
    return rows


# --------------------------------------------------------------------------- the four jobs


class Gate(CommitProcessor):
    """Parks the first commit attempt of a writer checkpoint (after it loaded its head) at the barrier."""

    def __init__(self, barrier: Barrier | None) -> None:
        self.barrier = barrier

    def pre_commit(self, ctx) -> None:
        if self.barrier is not None:
            barrier, self.barrier = self.barrier, None
            barrier.park()


@dataclass
class Barrier:
    reached: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    written: list[str] = field(default_factory=list)

    def park(self, job=None) -> None:
        if job is not None:
            self.written[:] = list(job.written)  # the parked job's files, for cleanup checks
        self.reached.set()
        assert self.release.wait(60), "the test never released the job"


@dataclass
class Outcome:
    snapshot_id: int | None = None
    error: BaseException | None = None


def into_rows(name: str, tag: int) -> pa.Table:
    return change_batch(HOURS[name] + 45 * 60_000_000 + np.arange(3) * 1_000_000, offset=f"into-{tag}",
                        seq_start=5000 + tag * 10, keys=[200 + tag, 201 + tag, 202 + tag]).records


def replay_rows(name: str, tag: int) -> pa.Table:
    return change_batch(HOURS[name] + 5 * 60_000_000 + np.arange(4) * 1_000_000, offset="replay",
                        seq_start=6000 + tag * 10, keys=[300 + tag, 301 + tag, 302 + tag, 303 + tag]).records


def run_job(catalog, kind: JobKind, name: str, tag: int, barrier: Barrier | None) -> Outcome:
    """Run one job of `kind` acting on hour `name`; returns its snapshot id (None: nothing committed)."""
    hook = barrier.park if barrier is not None else None
    if kind is JobKind.INTO:
        writer = CdcWriter(catalog, ORDERS, writer_id=f"into-{tag}", retention=NO_EXPIRY,
                           processors=[Gate(barrier), WatermarkProcessor()])
        records = into_rows(name, tag)
        from partfin_assets.model.records import ChangeBatch

        return Outcome(writer.write_checkpoint(ChangeBatch(records, offset=f"into-{tag}")).snapshot_id)
    if kind is JobKind.OVERWRITE:
        # force: these rows are not the hour's history, a replay of them removes what the hour held
        return Outcome(replay_hour(catalog, "orders", HOURS[name], replay_rows(name, tag), force=True, before_commit=hook).snapshot_id)
    if kind is JobKind.UPDATE_DELETE:
        prune, mask = cdc_key_filter([{"id": DELETE_KEY[name]}])
        return Outcome(delete_where(catalog, "cdc.orders", prune, mask, before_commit=hook).snapshot_id)
    result = compact(catalog, "cdc.orders", partitions=[hour_partition(catalog.load_table("cdc.orders").metadata, HOURS[name])],
                     finalized_only=False, before_commit=hook)
    assert result.snapshot_id is not None, "nothing to compact: the seed must leave two small files per hour"
    return Outcome(result.snapshot_id)


def apply(model: list[Row], kind: JobKind, name: str, tag: int, appended_since_start: list[Row] = ()) -> list[Row]:
    """The effect of a successful job on the table content (`appended_since_start`: INTO rows it did not see)."""
    if kind is JobKind.INTO:
        return model + rows_of(into_rows(name, tag))
    if kind is JobKind.OVERWRITE:  # replaces what the hour held at its start; what INTO appended since stays
        return [r for r in model if hour_of(r) != name] + list(appended_since_start) + rows_of(replay_rows(name, tag))
    if kind is JobKind.UPDATE_DELETE:
        return [r for r in model if not (hour_of(r) == name and key_id(r) == DELETE_KEY[name])]
    return model  # MERGE rewrites files, not rows


def assert_no_stray_files(catalog, identifier: str = "cdc.orders") -> None:
    """Every file in the table's directory is referenced by a retained snapshot or the metadata (nothing expired here)."""
    table = catalog.load_table(identifier)
    on_disk = {f.path for f in list_table_files(table.metadata.location)}
    stray = on_disk - referenced_files(table)
    assert not stray, f"files left behind: {sorted(stray)}"


# --------------------------------------------------------------------------- the matrix


@pytest.mark.parametrize("placement", ["same", "different"])
@pytest.mark.parametrize("later", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("earlier", KINDS, ids=lambda k: k.name)
def test_conflict_matrix(any_catalog, earlier, later, placement):
    catalog = any_catalog
    model = seed(catalog)
    files_before = files_per_partition(catalog, "cdc.orders")
    assert files_before == {hour_partition(catalog.load_table("cdc.orders").metadata, h): 2 for h in HOURS.values()}
    later_hour = "A"
    earlier_hour = "A" if placement == "same" else "B"

    barrier = Barrier()
    later_outcome = Outcome()

    def later_job() -> None:
        try:
            later_outcome.snapshot_id = run_job(catalog, later, later_hour, 2, barrier).snapshot_id
        except BaseException as exc:  # noqa: BLE001 - reported below
            later_outcome.error = exc

    thread = threading.Thread(target=later_job, name=f"later-{later.name}")
    thread.start()
    try:
        assert barrier.reached.wait(60), f"later job never got to its commit: {later_outcome.error!r}"
        earlier_outcome = run_job(catalog, earlier, earlier_hour, 1, None)
    finally:
        barrier.release.set()
        thread.join(120)
    assert not thread.is_alive()
    assert earlier_outcome.snapshot_id is not None
    model = apply(model, earlier, earlier_hour, 1)
    appended = rows_of(into_rows(earlier_hour, 1)) if earlier is JobKind.INTO and placement == "same" else []

    must_fail = later in (JobKind.UPDATE_DELETE, JobKind.MERGE) and placement == "same"
    if must_fail:
        error = later_outcome.error
        assert isinstance(error, CommitConflictError), f"expected a conflict, got {error!r}"
        assert error.conflicting_snapshot_id == earlier_outcome.snapshot_id
        assert error.conflicting_kind == earlier.value
        assert error.kind is later and error.table == "cdc.orders"
        assert error.partitions == [hour_partition(catalog.load_table("cdc.orders").metadata, HOURS["A"])]
    else:
        assert later_outcome.error is None, f"later {later.value} failed: {later_outcome.error!r}"
        assert later_outcome.snapshot_id is not None
        model = apply(model, later, later_hour, 2, appended)

    # final content, row by row
    assert table_rows(catalog) == sorted(model)
    # the later job's snapshot (if any) is the head, on top of the earlier one
    table = catalog.load_table("cdc.orders")
    if not must_fail:
        assert table.metadata.current_snapshot_id == later_outcome.snapshot_id
        assert table.current_snapshot().parent_snapshot_id == earlier_outcome.snapshot_id
    else:
        assert table.metadata.current_snapshot_id == earlier_outcome.snapshot_id
    assert_no_stray_files(catalog)
    # watermark: recorded values never decrease, the property equals the newest
    history = [w for _, w in watermark_history(table.metadata)]
    assert history == sorted(history)
    assert table.properties.get(K.PROP_WATERMARK)
    # commits without event-time stats (all but INTO) are skipped by the policy
    for snapshot in table.metadata.snapshots:
        summary = snapshot.summary.additional_properties
        if summary.get(K.JOB_KIND) in (JobKind.OVERWRITE.value, JobKind.MERGE.value, JobKind.UPDATE_DELETE.value):
            assert K.EVENT_TIME_COUNT not in summary
    if later is JobKind.MERGE and not must_fail:
        assert files_per_partition(catalog, "cdc.orders")[hour_partition(table.metadata, HOURS["A"])] == 1


# --------------------------------------------------------------------------- the upsert in the matrix (base.orders)

BUCKET_OF = BucketTransform(16).transform(LongType())
UPSERT_KEY = 1  # the key the pending CDC change updates: its bucket is the upsert's partition
OTHER_BUCKET_KEY = next(k for k in range(40) if BUCKET_OF(k) != BUCKET_OF(UPSERT_KEY))


def bucket_path(key: int) -> str:
    return f"id_bucket={BUCKET_OF(key)}"


def keys_in_bucket_of(key: int, candidates) -> list[int]:
    return [k for k in candidates if BUCKET_OF(k) == BUCKET_OF(key)]


def base_state(catalog) -> dict[int, tuple]:
    rows = read_base(catalog, "orders", include_deleted=True)
    return {i: (a, s) for i, a, s in zip(*(rows.column(c).to_pylist() for c in ("id", "amount", "_source_seq")))}


def seed_base(catalog) -> None:
    """base.orders with keys 0-39, two files in the buckets of both placements, and one pending CDC change of UPSERT_KEY."""
    writer = CdcWriter(catalog, ORDERS, writer_id="seed", retention=NO_EXPIRY)
    writer.write_checkpoint(change_batch(T0_US + np.arange(40) * 60_000_000, offset="s0", seq_start=0, keys=list(range(40))))
    run_upsert(catalog, "orders")
    for tag, key in enumerate((UPSERT_KEY, OTHER_BUCKET_KEY)):  # a second (small) file in each bucket: MERGE has work
        base_into(catalog, extra_key(key, tag), 500 + tag, None)
    writer.write_checkpoint(change_batch(T0_US + HOUR_US + np.arange(1), offset="s1", seq_start=100, keys=[UPSERT_KEY]))


def extra_key(near: int, tag: int) -> int:
    """A new key (not among 0-39) in the bucket of `near`."""
    return next(k for k in range(1000 + tag * 1000, 10_000) if BUCKET_OF(k) == BUCKET_OF(near))


def base_into(catalog, key: int, seq: int, hook):
    """A plain INTO job on base.orders: append one row."""
    row = pa.table({"id": [key], "amount": [9.0], "_event_time": pa.array([T0_US], pa.timestamp("us", tz="UTC")),
                    "_source_seq": [seq], DELETED: [False]})
    with Job.start(catalog, "base.orders", JobKind.INTO, before_commit=hook) as job:
        return commit_append(job, job.write(row))


def run_base_job(catalog, kind: JobKind, key: int, barrier: Barrier | None) -> Outcome:
    """A job of `kind` on base.orders in the bucket of `key`: INTO appends a row, OVERWRITE rewrites the bucket
    as read at its start, UPDATE/DELETE deletes a seeded key, MERGE compacts the bucket."""
    hook = barrier.park if barrier is not None else None
    if kind is JobKind.INTO:
        return Outcome(base_into(catalog, extra_key(key, 3), 900, hook).snapshot_id)
    if kind is JobKind.OVERWRITE:
        with Job.start(catalog, "base.orders", JobKind.OVERWRITE, before_commit=hook) as job:
            rows = read_files(job.table, live_files(job.table, None, [bucket_path(key)])[bucket_path(key)])
            job.target([bucket_path(key)])
            return Outcome(job.commit_overwrite(job.write(rows)).snapshot_id)
    if kind is JobKind.UPDATE_DELETE:
        spec = TableSpec.from_properties("orders", catalog.load_table("cdc.orders").properties)
        victim = next(k for k in keys_in_bucket_of(key, range(40)) if k != UPSERT_KEY)
        prune, mask = base_key_filter(spec, [{"id": victim}])
        return Outcome(delete_where(catalog, "base.orders", prune, mask, before_commit=hook).snapshot_id)
    return Outcome(compact(catalog, "base.orders", partitions=[bucket_path(key)], finalized_only=False, before_commit=hook).snapshot_id)


def apply_base(model: dict, kind: JobKind, key: int, read_at_start: dict) -> dict:
    """The effect of a successful job of `kind` (bucket of `key`) on base.orders; `read_at_start`: base when it started."""
    model = dict(model)
    if kind is JobKind.INTO:
        model[extra_key(key, 3)] = (9.0, 900)
    elif kind is JobKind.OVERWRITE:
        model = {k: v for k, v in model.items() if BUCKET_OF(k) != BUCKET_OF(key)}
        model.update({k: v for k, v in read_at_start.items() if BUCKET_OF(k) == BUCKET_OF(key)})
    elif kind is JobKind.UPDATE_DELETE:
        model.pop(next(k for k in keys_in_bucket_of(key, range(40)) if k != UPSERT_KEY))
    return model


UPSERTED = (1.5, 100)  # UPSERT_KEY after the pending change is merged


@pytest.mark.parametrize("placement", ["same", "different"])
@pytest.mark.parametrize("other", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("upsert_finishes", ["later", "earlier"])
def test_upsert_in_the_conflict_matrix(catalog, upsert_finishes, other, placement):
    """The upsert is an UPDATE/DELETE job on base.<table>: its row of the conflict matrix and its column, per bucket."""
    seed_base(catalog)
    start = base_state(catalog)
    other_key = UPSERT_KEY if placement == "same" else OTHER_BUCKET_KEY
    barrier = Barrier()
    later = Outcome()
    later_kind = JobKind.UPDATE_DELETE if upsert_finishes == "later" else other

    def later_job() -> None:
        try:
            if upsert_finishes == "later":
                later.snapshot_id = run_upsert(catalog, "orders", before_commit=barrier.park).base_snapshot_id
            else:
                later.snapshot_id = run_base_job(catalog, other, other_key, barrier).snapshot_id
        except BaseException as exc:  # noqa: BLE001 - reported below
            later.error = exc

    thread = threading.Thread(target=later_job, name=f"later-{later_kind.name}")
    thread.start()
    try:
        assert barrier.reached.wait(60), f"later job never got to its commit: {later.error!r}"
        if upsert_finishes == "later":
            earlier = run_base_job(catalog, other, other_key, None)
        else:
            earlier = Outcome(run_upsert(catalog, "orders").base_snapshot_id)
    finally:
        barrier.release.set()
        thread.join(120)
    assert not thread.is_alive() and earlier.snapshot_id is not None

    model = dict(start)
    upsert_effect = {UPSERT_KEY: UPSERTED}
    if upsert_finishes == "later":
        model = apply_base(model, other, other_key, start)
    else:
        model.update(upsert_effect)
    must_fail = later_kind in (JobKind.UPDATE_DELETE, JobKind.MERGE) and placement == "same"
    if must_fail:
        error = later.error
        assert isinstance(error, CommitConflictError), f"expected a conflict, got {error!r}"
        assert error.table == "base.orders" and error.kind is later_kind
        assert error.conflicting_snapshot_id == earlier.snapshot_id
        assert error.conflicting_kind == (other.value if upsert_finishes == "later" else JobKind.UPDATE_DELETE.value)
        assert bucket_path(UPSERT_KEY) in error.partitions
    else:
        assert later.error is None, f"later {later_kind.value} failed: {later.error!r}"
        model = model | upsert_effect if upsert_finishes == "later" else apply_base(model, other, other_key, start)
    assert base_state(catalog) == model
    table = catalog.load_table("base.orders")
    if must_fail:
        assert table.metadata.current_snapshot_id == earlier.snapshot_id
    else:
        assert table.metadata.current_snapshot_id == later.snapshot_id
        assert table.current_snapshot().parent_snapshot_id == earlier.snapshot_id
    assert_no_stray_files(catalog, "base.orders")
    merged = table.properties.get(K.PROP_SOURCE_SNAPSHOT_ID)
    upsert_landed = not (must_fail and upsert_finishes == "later")
    assert (merged == str(catalog.load_table("cdc.orders").metadata.current_snapshot_id)) == upsert_landed
    if not upsert_landed:  # the lost upsert, run again under the retry policy, merges from the new head
        rerun = retry_on_conflict(lambda: run_upsert(catalog, "orders"))
        assert rerun.updated == 1 and base_state(catalog) == model | upsert_effect


# --------------------------------------------------------------------------- the conflict layer itself (SQLite)


def _seeded(catalog, *, partition_limit: str | None = None):
    seed(catalog)
    if partition_limit is not None:
        with catalog.load_table("cdc.orders").transaction() as tx:
            tx.set_properties({"write.summary.partition-limit": partition_limit})


@pytest.mark.parametrize("summaries", ["summary", "truncated", "stripped"])
def test_conflicts_are_found_from_manifests_when_summaries_lack_partitions(catalog, monkeypatch, summaries):
    """Partition summaries present; truncated by write.summary.partition-limit; or absent (another engine)."""
    from partfin_assets.jobs import conflicts
    from partfin_assets.jobs.conflicts import find_conflict, touched_partitions

    _seeded(catalog, partition_limit="0" if summaries == "truncated" else None)
    if summaries == "stripped":
        monkeypatch.setattr(conflicts, "PARTITION_SUMMARIES_INCLUDED", "no-such-summary-key")
    table = catalog.load_table("cdc.orders")
    start = table.metadata.current_snapshot_id
    a, b = (hour_partition(table.metadata, HOURS[n]) for n in "AB")
    first = run_job(catalog, JobKind.OVERWRITE, "B", 1, None)
    run_job(catalog, JobKind.OVERWRITE, "B", 2, None)
    head = catalog.load_table("cdc.orders")
    touched = [touched_partitions(s, head.metadata, head.io) for s in head.metadata.snapshots[-2:]]
    assert [t.partitions for t in touched] == [frozenset({b}), frozenset({b})]
    assert all(t.from_manifests == (summaries != "summary") for t in touched)
    assert find_conflict(head, start, {a}) is None
    conflict = find_conflict(head, start, {a, b})
    assert conflict is not None and conflict.partitions == {b} and conflict.kind == JobKind.OVERWRITE.value
    assert conflict.snapshot_id == first.snapshot_id  # the first commit that touched it


def test_unpartitioned_tables_conflict_on_any_file_change_but_not_on_empty_commits(catalog):
    from pyiceberg.schema import Schema
    from pyiceberg.types import LongType, NestedField

    from partfin_assets.iceberg.catalog import ensure_namespaces
    from partfin_assets.iceberg.commit import MANAGED_TABLE_PROPERTIES
    from partfin_assets.iceberg.files import WHOLE_TABLE
    from partfin_assets.jobs.job import Job

    ensure_namespaces(catalog, "misc")
    catalog.create_table("misc.t", Schema(NestedField(1, "x", LongType(), required=True)), properties=MANAGED_TABLE_PROPERTIES)
    rows = pa.table({"x": pa.array([1, 2, 3], pa.int64())})
    first = Job.start(catalog, "misc.t", JobKind.INTO)
    commit_append(first, first.write(rows))

    job = Job.start(catalog, "misc.t", JobKind.UPDATE_DELETE)
    files = [t.file for t in job.table.scan().plan_files()]
    new = job.write(rows.slice(0, 2))
    with catalog.load_table("misc.t").transaction() as tx:  # an empty append: touches nothing
        with tx.update_snapshot().fast_append():
            pass
    appender = Job.start(catalog, "misc.t", JobKind.INTO)
    commit_append(appender, appender.write(rows))  # any file change on an unpartitioned table
    with pytest.raises(CommitConflictError) as info:
        job.commit_replace(files, new)
    assert info.value.partitions == [WHOLE_TABLE]
    assert not any(Path(f.file_path.removeprefix("file://")).exists() for f in new)


@pytest.mark.parametrize("scenario", ["start-expired", "start-expired-own-partition", "gap"])
def test_expiry_during_a_job_neither_hides_nor_invents_conflicts(catalog, scenario):
    """The writer expires snapshots as it goes, the job's start snapshot included: sequence numbers decide.

    Only when snapshots *after* the start expired too (a gap) is the answer unknowable: then conflict.
    """
    touch_own_partition = scenario == "start-expired-own-partition"
    from partfin_assets.jobs.conflicts import find_conflict

    seed(catalog)
    run_job(catalog, JobKind.OVERWRITE, "B", 9, None)  # the job's start: a snapshot nothing protects from expiry
    racer = CdcWriter(catalog, ORDERS, writer_id="racer", retention=Retention(keep_last=2 if scenario == "gap" else 8, slack=0))
    hold = Barrier()
    outcome = Outcome()

    def merge_a():
        try:
            outcome.snapshot_id = run_job(catalog, JobKind.MERGE, "A", 1, hold).snapshot_id
        except BaseException as exc:  # noqa: BLE001
            outcome.error = exc

    thread = threading.Thread(target=merge_a)
    thread.start()
    try:
        assert hold.reached.wait(60)
        start_id = catalog.load_table("cdc.orders").metadata.current_snapshot_id
        for i in range(8):
            hour = HOURS["A"] if (touch_own_partition and i == 3) else HOURS["B"] + 30 * 60_000_000
            racer.write_checkpoint(change_batch(hour + np.arange(2) * 1_000_000, offset=f"r{i}", seq_start=70_000 + i * 10, keys=[400 + i, 450 + i]))
        head = catalog.load_table("cdc.orders")
        assert head.metadata.snapshot_by_id(start_id) is None  # the start snapshot itself is gone
        assert find_conflict(head, start_id, {"x"}) is not None  # without the sequence number: unknowable
    finally:
        hold.release.set()
        thread.join(60)
    assert hold.written
    if scenario == "gap":
        assert isinstance(outcome.error, CommitConflictError) and "expired" in outcome.error.reason
        assert not any(Path(p.removeprefix("file://")).exists() for p in hold.written)
    elif touch_own_partition:
        assert isinstance(outcome.error, CommitConflictError) and outcome.error.conflicting_kind == JobKind.INTO.value
        assert not any(Path(p.removeprefix("file://")).exists() for p in hold.written)
    else:
        assert outcome.error is None and outcome.snapshot_id is not None
        assert files_per_partition(catalog, "cdc.orders")[hour_partition(catalog.load_table("cdc.orders").metadata, HOURS["A"])] == 1


def test_a_job_whose_start_snapshot_expired_under_it_retries_from_the_head(catalog):
    """A replay racing the writer's snapshot expiry: its start snapshot's manifest list is gone when it commits.
    That is a conflict like any other (nothing of the attempt visible, its files deleted): the retry lands."""
    model = seed(catalog)
    run_job(catalog, JobKind.OVERWRITE, "B", 9, None)  # the replay's start: a snapshot nothing protects from expiry
    model = apply(model, JobKind.OVERWRITE, "B", 9)
    racer = CdcWriter(catalog, ORDERS, writer_id="racer", retention=Retention(keep_last=2, slack=0))
    raced: list[str] = []
    attempts: list[list[str]] = []
    appended: list[Row] = []

    def expire_under_it(job: Job) -> None:
        attempts.append(list(job.written))
        if raced:
            return
        raced.append(str(job.start_snapshot_id))
        for i in range(4):  # into hour B: hour A, the replay's, is not touched
            batch = change_batch(HOURS["B"] + 50 * 60_000_000 + np.arange(2) * 1_000_000, offset=f"r{i}", seq_start=70_000 + i * 10,
                                 keys=[400 + i, 450 + i])
            racer.write_checkpoint(batch)
            appended.extend(rows_of(batch.records))
        assert catalog.load_table("cdc.orders").metadata.snapshot_by_id(job.start_snapshot_id) is None

    result = retry_on_conflict(
        lambda: replay_hour(catalog, "orders", HOURS["A"], replay_rows("A", 1), force=True, before_commit=expire_under_it),
        sleep=lambda s: None)
    assert result.snapshot_id is not None and len(attempts) == 2
    assert sorted(table_rows(catalog)) == sorted(apply(model + appended, JobKind.OVERWRITE, "A", 1))
    assert attempts[0] and not any(Path(p.removeprefix("file://")).exists() for p in attempts[0])  # the lost attempt's files


@pytest.mark.parametrize("landed", [True, False])
def test_unknown_commit_outcome_is_resolved_from_the_history(catalog, monkeypatch, landed):
    """The catalog call raises something else than CommitFailedException (a timeout): look, don't guess."""
    from pyiceberg.table import Transaction

    seed(catalog)
    real = Transaction.commit_transaction
    calls = []

    def flaky(self):
        if "__ledger" in ".".join(self._table.name()):  # the replay's row in the late-data ledger, after its commit
            return real(self)
        calls.append(1)
        if len(calls) == 1:
            if landed:
                real(self)
            raise TimeoutError("catalog did not answer")
        return real(self)

    monkeypatch.setattr(Transaction, "commit_transaction", flaky)
    written = []

    def spy(job):
        written.extend(job.written)

    if landed:
        result = replay_hour(catalog, "orders", HOURS["A"], replay_rows("A", 1), force=True, before_commit=spy)
        table = catalog.load_table("cdc.orders")
        assert result.snapshot_id == table.metadata.current_snapshot_id
        assert len(calls) == 1  # found in the history: not committed twice
        assert all(Path(p.removeprefix("file://")).exists() for p in written)
        assert sorted(k for k, *_ in (r for r in table_rows(catalog) if hour_of(r) == "A")) == sorted(
            r[0] for r in rows_of(replay_rows("A", 1)))
    else:
        with pytest.raises(TimeoutError):
            replay_hour(catalog, "orders", HOURS["A"], replay_rows("A", 1), force=True, before_commit=spy)
        assert written and not any(Path(p.removeprefix("file://")).exists() for p in written)
        # the data files are gone; the attempt's manifests stay (the outcome was unknown when they
        # were written) until orphan-file removal, which finds exactly those
        from partfin_assets.jobs.maintenance import remove_orphan_files

        report = remove_orphan_files(catalog, "cdc.orders", older_than_s=0)
        assert report.orphans and all("/metadata/" in p and p.endswith(".avro") for p in report.orphans)
        assert_no_stray_files(catalog)


def test_retry_on_conflict_reruns_from_a_fresh_snapshot(catalog):
    from partfin_assets.jobs.retry import ConflictRetryPolicy, retry_on_conflict

    seed(catalog)
    attempts = []

    def racer(job):
        if len(attempts) == 1:
            run_job(catalog, JobKind.INTO, "A", 5, None)

    def run():
        attempts.append(1)
        return compact(catalog, "cdc.orders", hours=[HOURS["A"]], finalized_only=False, before_commit=racer)

    result = retry_on_conflict(run, ConflictRetryPolicy(max_retries=2, base_delay_s=0.0))
    assert len(attempts) == 2 and result.snapshot_id is not None
    assert files_per_partition(catalog, "cdc.orders")[hour_partition(catalog.load_table("cdc.orders").metadata, HOURS["A"])] == 1


def test_partfin_transaction_sees_each_staged_change_and_commits_like_pyiceberg(catalog):
    from partfin_assets.iceberg.commit import new_transaction

    seed(catalog)
    table = catalog.load_table("cdc.orders")
    tx = new_transaction(table)
    before = tx.table_metadata
    assert tx.table_metadata is before  # derived once while nothing is staged
    tx.set_properties({"owner": "analytics"})
    staged = tx.table_metadata
    assert staged.properties["owner"] == "analytics" and "owner" not in before.properties
    tx.remove_properties("owner")
    assert "owner" not in tx.table_metadata.properties
    tx.set_properties({"owner": "platform"})
    tx.commit_transaction()
    reloaded = catalog.load_table("cdc.orders")
    assert reloaded.properties["owner"] == "platform"
    assert reloaded.metadata.current_snapshot_id == table.metadata.current_snapshot_id
