"""base.<table> is merge-on-read: position deletes + appended versions, read the same by every reader.

The rows a reader sees are the rows the copy-on-write upsert gave: read_base, the downstream asset's
filtered scan, and a plain PyIceberg scan in a process that never imported partfin (so without
partfin's faster position-delete reader) all agree with the reference model, before and after
compaction folds the delete files back.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyiceberg.expressions import And, GreaterThanOrEqual, LessThan
from pyiceberg.io import pyarrow as pyiceberg_arrow
from pyiceberg.manifest import DataFileContent, ManifestContent

from partfin_assets.iceberg.files import data_files, position_delete_files, read_files
from partfin_assets.iceberg.position_deletes import kept_row_indices, pyiceberg_kept_row_indices
from partfin_assets.iceberg.tables import DELETED, EVENT_TIME, SOURCE_SEQ, ensure_base_table, read_base
from partfin_assets.jobs.compaction import compact
from partfin_assets.jobs.conflicts import CommitConflictError
from partfin_assets.jobs.maintenance import remove_orphan_files
from partfin_assets.jobs.privacy import privacy_delete
from partfin_assets.jobs.upsert import run_upsert
from partfin_assets.jobs.upsert.merge import DEFAULT_MAX_DATA_FILES
from partfin_assets.model.timeutil import US_PER_HOUR, to_us
from partfin_assets_tests.test_upsert import SPEC, T0, Harness
from partfin_assets_tests.test_upsert_crash import random_changes
from partfin_assets_tests.test_upsert_properties import reference

PLAIN_SCAN = """
import json, sys
from pyiceberg.catalog.sql import SqlCatalog
home = sys.argv[1]
catalog = SqlCatalog("partfin", uri=f"sqlite:///{home}/catalog.db", warehouse=f"file://{home}/warehouse")
rows = catalog.load_table("base.orders").scan().to_arrow()
assert not [m for m in sys.modules if m.startswith("partfin")]
print(json.dumps(sorted([r["id"], r["amount"], r["_source_seq"], r[sys.argv[2]]] for r in rows.to_pylist())))
"""


def loaded(tmp_path: Path, rounds: int = 4, seed: int = 3) -> tuple[Harness, list]:
    h = Harness(tmp_path)
    rng = np.random.default_rng(seed)
    changes: list = []
    seq = 1
    for round_ in range(rounds):
        batch = random_changes(rng, 400, seq, 150, 60 * round_)
        seq += len(batch)
        changes += batch
        h.write(batch)
        h.upsert()
    return h, changes


def all_rows(h: Harness) -> list:
    rows = read_base(h.catalog, "orders", include_deleted=True)
    return sorted([r["id"], r["amount"], r["_source_seq"], r[DELETED]] for r in rows.to_pylist())


def plain_pyiceberg_rows(home: Path) -> list:
    out = subprocess.run([sys.executable, "-c", PLAIN_SCAN, str(home), DELETED], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_every_reader_sees_the_reference_rows_before_and_after_compaction(tmp_path: Path):
    h, changes = loaded(tmp_path)
    base = h.base()
    deletes = position_delete_files(base, base.current_snapshot())
    assert deletes, "updates of existing keys must have written position deletes"
    buckets = {tuple(d.partition) for d in deletes}
    assert len(deletes) == len(buckets), "at most one live delete file per bucket"
    for manifest in base.current_snapshot().manifests(base.io):
        kinds = {e.data_file.content for e in manifest.fetch_manifest_entry(base.io)}
        assert kinds <= ({DataFileContent.DATA} if manifest.content == ManifestContent.DATA else {DataFileContent.POSITION_DELETES})

    assert h.live() == reference(changes)
    before = all_rows(h)
    assert plain_pyiceberg_rows(tmp_path) == before
    # the downstream asset's read: one hour of _event_time, two columns
    hour = to_us(T0) + US_PER_HOUR
    hour_filter = And(GreaterThanOrEqual(EVENT_TIME, hour), LessThan(EVENT_TIME, hour + US_PER_HOUR))
    downstream = base.scan(row_filter=hour_filter, selected_fields=(EVENT_TIME, DELETED)).to_arrow()
    everything = read_base(h.catalog, "orders", include_deleted=True)
    times = pc.cast(everything.column(EVENT_TIME), pa.int64())
    in_hour = everything.filter(pc.and_(pc.greater_equal(times, hour), pc.less(times, hour + US_PER_HOUR)))
    assert downstream.num_rows == in_hour.num_rows > 0

    result = compact(h.catalog, "base.orders", finalized_only=False)
    assert result.snapshot_id is not None
    base = h.base()
    assert position_delete_files(base, base.current_snapshot()) == []
    partitions = [tuple(f.partition) for f in data_files(base, base.current_snapshot())]
    assert len(partitions) == len(set(partitions)), "one data file per bucket after compaction"
    assert all_rows(h) == before and plain_pyiceberg_rows(tmp_path) == before
    h.write(random_changes(np.random.default_rng(99), 300, 100_000, 150, 400))
    h.upsert()  # merging on top of a compacted table
    assert h.live() == reference(changes + random_changes(np.random.default_rng(99), 300, 100_000, 150, 400))


def test_small_files_of_a_bucket_are_folded_as_they_pile_up(tmp_path: Path):
    h, changes = loaded(tmp_path, rounds=9)
    base = h.base()
    per_bucket: dict[tuple, int] = {}
    for f in data_files(base, base.current_snapshot()):
        per_bucket[tuple(f.partition)] = per_bucket.get(tuple(f.partition), 0) + 1
    # the new versions are folded with the small files: the largest file and one of everything newer
    assert max(per_bucket.values()) <= DEFAULT_MAX_DATA_FILES == 2
    assert h.live() == reference(changes)
    assert plain_pyiceberg_rows(tmp_path) == all_rows(h)


def test_orphan_removal_keeps_delete_files(tmp_path: Path):
    h, changes = loaded(tmp_path, rounds=2)
    report = remove_orphan_files(h.catalog, "base.orders", older_than_s=0)
    assert not [p for p in report.orphans if p.endswith("-deletes.parquet")]
    assert h.live() == reference(changes)


def test_privacy_delete_erases_old_versions_hidden_by_position_deletes(tmp_path: Path):
    h, _ = loaded(tmp_path, rounds=3)
    base = h.base()
    raw = read_files(base, data_files(base, base.current_snapshot()), deletes=[])
    ids, counts = np.unique(raw.column("id").to_numpy(), return_counts=True)
    victim = int(ids[counts > 1][0])  # a key with an old version still in a data file
    privacy_delete(h.catalog, "orders", [{"id": victim}], request_id="r1")
    base = h.base()
    raw = read_files(base, data_files(base, base.current_snapshot()), deletes=[])
    assert victim not in raw.column("id").to_pylist()
    assert victim not in h.rows(include_deleted=True)


def race(later, first) -> dict:
    """Start `later(before_commit=park)`, let `first()` commit while it is parked before its commit, then let it go on.

    Returns its outcome: {"value": result} or {"error": exception}.
    """
    parked, release = threading.Event(), threading.Event()

    def park(job):
        parked.set()
        release.wait(60)

    outcome: dict = {}

    def run_later():
        try:
            outcome["value"] = later(before_commit=park)
        except BaseException as exc:  # noqa: BLE001 - the caller checks it
            outcome["error"] = exc

    thread = threading.Thread(target=run_later)
    thread.start()
    assert parked.wait(60)
    try:
        first()
    finally:
        release.set()
        thread.join(120)
    return outcome


@pytest.mark.parametrize("placement", ["same", "different"])
@pytest.mark.parametrize("first", ["upsert", "compaction"])
def test_upsert_and_compaction_on_a_table_with_delete_files(tmp_path: Path, first: str, placement: str):
    """The conflict matrix with delete files live: UPDATE/DELETE vs MERGE on one bucket, the later one fails."""
    h, changes = loaded(tmp_path, rounds=2)
    key = 5
    pending = [(key, "u", 500, 50_000, 55.0)]
    h.write(pending)
    base = h.base()
    bucket_of_key = next(tuple(f.partition) for f in data_files(base, base.current_snapshot())
                         if key in read_files(base, [f]).column("id").to_pylist())
    deleted_buckets = {tuple(d.partition) for d in position_delete_files(base, base.current_snapshot())}
    others = sorted(p for p in deleted_buckets if p != bucket_of_key)
    target = bucket_of_key if placement == "same" else others[0]
    partition = f"id_bucket={target[0]}"

    def compaction(before_commit=None):
        return compact(h.catalog, "base.orders", partitions=[partition], finalized_only=False, before_commit=before_commit)

    def upsert(before_commit=None):
        return run_upsert(h.catalog, "orders", before_commit=before_commit)

    outcome = race(compaction if first == "upsert" else upsert, upsert if first == "upsert" else compaction)
    if placement == "same":
        assert isinstance(outcome.get("error"), CommitConflictError), outcome
    else:
        assert "error" not in outcome, outcome
    if first == "compaction" and placement == "same":
        run_upsert(h.catalog, "orders")  # the lost upsert, re-run from a fresh snapshot
    assert h.live() == reference(changes + pending)
    assert plain_pyiceberg_rows(tmp_path) == all_rows(h)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2999), max_size=400), max_size=3),
    st.integers(0, 2000),
    st.integers(0, 1000),
)
def test_fast_position_delete_reader_equals_pyiceberg(deletes, start, length):
    chunks = [pa.chunked_array([pa.array(sorted(set(d)), pa.int64())]) for d in deletes]
    ours = kept_row_indices(chunks, start, start + length)
    expected = set(range(start, start + length)) - {p for d in deletes for p in d}
    assert ours.to_pylist() == sorted(p - start for p in expected)
    if chunks:
        assert pyiceberg_kept_row_indices(chunks, start, start + length).to_pylist() == ours.to_pylist()
    assert pyiceberg_arrow._combine_positional_deletes is kept_row_indices  # installed for every scan


def test_lookup_columns_are_delta_encoded_and_outside_files_are_still_searched(tmp_path: Path):
    h, changes = loaded(tmp_path, rounds=2)
    base = h.base()
    for f in data_files(base, base.current_snapshot()):
        with base.io.new_input(f.file_path).open() as stream:
            meta = pq.ParquetFile(stream).metadata.row_group(0)
        encodings = {meta.column(i).path_in_schema: meta.column(i).encodings for i in range(meta.num_columns)}
        for column in ("id", EVENT_TIME, SOURCE_SEQ):
            assert "DELTA_BINARY_PACKED" in encodings[column], (column, encodings)
    # files another tool appended: one unsorted (hash lookup), one sorted with two rows of one key (binary search)
    live = read_base(h.catalog, "orders", include_deleted=True).sort_by("id")
    low, high = live.slice(0, 4), live.slice(live.num_rows - 4, 4)
    base.append(pa.concat_tables([high.slice(3, 1), high.slice(0, 3)]))
    h.base().append(pa.concat_tables([low.slice(0, 1), low]))
    newer = [(int(i), "u", 1000, 1_000_000 + j, 1.5) for j, i in enumerate(low.column("id").to_pylist() + high.column("id").to_pylist())]
    h.write(newer)
    h.upsert()
    ids = read_base(h.catalog, "orders", include_deleted=True).column("id").to_pylist()
    assert len(ids) == len(set(ids)), "every version of a changed key is replaced"
    assert h.live() == reference(changes + newer)
    assert plain_pyiceberg_rows(tmp_path) == all_rows(h)


def test_old_versions_are_found_across_row_groups_with_and_without_hits(tmp_path: Path):
    """Files of many small row groups: the lookup reads the ordering columns only of row groups
    holding a changed key and skips `_deleted` where statistics show it constant; the rows stay the reference's."""
    h = Harness(tmp_path)
    ensure_base_table(h.catalog, SPEC, buckets=2)
    with h.base().transaction() as tx:
        tx.set_properties({"write.parquet.row-group-limit": "8"})
    # a first load without deletes (its files have no tombstones), then small random rounds with deletes
    changes: list = [(i, "c", 0, i, float(i % 89)) for i in range(1, 201)]
    h.write(changes)
    h.upsert()
    rng = np.random.default_rng(21)
    seq = 1000
    for round_ in range(1, 4):  # 20 changes each: most row groups hold no changed key
        batch = random_changes(rng, 20, seq, 200, 60 * round_)
        seq += len(batch)
        changes += batch
        h.write(batch)
        h.upsert()
    base = h.base()
    groups, constant_deleted = [], 0
    for f in data_files(base, base.current_snapshot()):
        with base.io.new_input(f.file_path).open() as stream:
            groups.append(pq.ParquetFile(stream).metadata.num_row_groups)
        field_id = base.schema().find_field(DELETED).field_id
        constant_deleted += f.lower_bounds[field_id] == f.upper_bounds[field_id]
    assert max(groups) > 3, groups
    assert 0 < constant_deleted < len(groups), "files with and without tombstones"
    assert h.live() == reference(changes)
    assert plain_pyiceberg_rows(tmp_path) == all_rows(h)


def test_row_groups_whose_statistics_settle_the_changes_are_not_read_for_ordering(tmp_path: Path):
    """Newer changes (above every row's order time and position) are decided from the row groups'
    statistics; a change behind its base row in their log and a re-delivery make their row groups
    read in full. Every decision matches the reference model."""
    h = Harness(tmp_path)
    ensure_base_table(h.catalog, SPEC, buckets=2)
    with h.base().transaction() as tx:
        tx.set_properties({"write.parquet.row-group-limit": "16"})
    changes: list = [(i, "c", 0, i, float(i)) for i in range(1, 201)]
    h.write(changes)
    h.upsert()

    newer = [(i, "u", 90, 1000 + i, float(i) + 0.5) for i in (3, 50, 120, 199)]
    h.write(newer)
    changes += newer
    result = h.upsert()
    assert result.row_groups_hit > 0 and result.row_groups_settled == result.row_groups_hit, result.describe()
    assert h.live() == reference(changes)

    # late (behind the row it meets in their log), a re-delivery (same position), and newer ones beside them
    late = [(3, "u", 30, 500, -1.0), (50, "u", 90, 1050, -2.0), (7, "u", 120, 2001, 7.5), (180, "u", 120, 2002, 180.5)]
    h.write(late)
    changes += late
    result = h.upsert()
    assert result.stale == 2, result.describe()
    assert 0 < result.row_groups_settled < result.row_groups_hit, result.describe()
    assert h.live() == reference(changes)
    assert f"ordering columns of {result.row_groups_hit - result.row_groups_settled} of {result.row_groups_hit}" in result.describe()
