"""Growing base.<table>'s bucket count: `partfin base rebucket`, then compaction moves old-spec files over.

A 4-bucket table gets upserts, is rebucketed to 8 through the CLI, gets more upserts (updates,
deletes and late changes of keys whose old versions sit in files of the old spec), then one
compaction: after every step read_base, its hour-filtered form (the downstream asset's read), a
plain PyIceberg scan in a process that never imported partfin and the reference model agree, and after the compaction every live file is of the new spec.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pyiceberg.expressions import And, GreaterThanOrEqual, LessThan
from pyiceberg.schema import Schema
from pyiceberg.types import LongType, NestedField

from partfin_assets.iceberg.commit import set_table_properties
from partfin_assets.iceberg.files import data_files, position_delete_files
from partfin_assets.iceberg.tables import EVENT_TIME, ensure_base_table, read_base
from partfin_assets.jobs.compaction import compact
from partfin_assets.jobs.conflicts import CommitConflictError
from partfin_assets.jobs.rebucket import rebucket
from partfin_assets.jobs.upsert import run_upsert
from partfin_assets.jobs.upsert.plan import bucket_count
from partfin_assets.model import summary_keys as K
from partfin_assets.model.timeutil import US_PER_HOUR, to_us
from partfin_assets_tests.test_cli import partfin
from partfin_assets_tests.test_merge_on_read import all_rows, plain_pyiceberg_rows, race
from partfin_assets_tests.test_upsert import SPEC, Harness
from partfin_assets_tests.test_upsert_crash import random_changes
from partfin_assets_tests.test_upsert_properties import reference

KEYS = 150


def four_bucket_table(tmp_path: Path, rounds: int, seed: int = 5) -> tuple[Harness, list]:
    h = Harness(tmp_path)
    ensure_base_table(h.catalog, SPEC, buckets=4)
    changes: list = []
    rng = np.random.default_rng(seed)
    for round_ in range(rounds):
        batch = random_changes(rng, 300, 1 + len(changes), KEYS, 60 * round_)
        changes += batch
        h.write(batch)
        h.upsert()
    return h, changes


def assert_readers_agree(h: Harness, tmp_path: Path, changes: list) -> None:
    assert h.live() == reference(changes)
    assert plain_pyiceberg_rows(tmp_path) == all_rows(h)
    # the downstream asset's read: read_base filtered to one hour of _event_time, planned against every live spec
    live = read_base(h.catalog, "orders")
    hours = {to_us(t) // US_PER_HOUR * US_PER_HOUR for t in live.column(EVENT_TIME).to_pylist()}
    for hour in sorted(hours):
        in_hour = read_base(h.catalog, "orders", row_filter=And(GreaterThanOrEqual(EVENT_TIME, hour), LessThan(EVENT_TIME, hour + US_PER_HOUR)))
        expected = [r["id"] for r in live.to_pylist() if hour <= to_us(r[EVENT_TIME]) < hour + US_PER_HOUR]
        assert sorted(in_hour.column("id").to_pylist()) == sorted(expected)


def live_spec_ids(h: Harness) -> set[int]:
    base = h.base()
    snapshot = base.current_snapshot()
    return {f.spec_id for f in data_files(base, snapshot) + position_delete_files(base, snapshot)}


def test_rebucket_then_upserts_then_compaction_every_reader_agrees(tmp_path: Path):
    h, changes = four_bucket_table(tmp_path, rounds=3)
    assert_readers_agree(h, tmp_path, changes)
    old_spec_id = h.base().metadata.default_spec_id

    done = partfin(tmp_path, "base", "rebucket", "--table", "orders", "--buckets", "8")
    assert done.returncode == 0, done.stderr
    assert "4 -> 8" in done.stdout
    base = h.base()
    assert bucket_count(base.spec()) == 8 and base.properties[K.PROP_BASE_BUCKETS] == "8"
    assert base.metadata.default_spec_id != old_spec_id
    assert live_spec_ids(h) == {old_spec_id}  # nothing rewritten yet: the data stays where it was
    assert_readers_agree(h, tmp_path, changes)

    rng = np.random.default_rng(11)
    for round_ in range(3, 6):  # the same keys: updates and deletes of versions in old-spec files, some late
        batch = random_changes(rng, 300, 1 + len(changes), KEYS, 60 * round_)
        changes += batch
        h.write(batch)
        h.upsert()
        assert_readers_agree(h, tmp_path, changes)
    stale = [(int(k), "u", -500, 1, -1.0) for k in range(1, 11)]  # late and behind every version: must lose
    changes += stale
    h.write(stale)
    merged = partfin(tmp_path, "upsert", "--table", "orders")
    assert merged.returncode == 0, merged.stderr
    assert_readers_agree(h, tmp_path, changes)
    base = h.base()
    old_deletes = [d for d in position_delete_files(base, base.current_snapshot()) if d.spec_id == old_spec_id]
    assert old_deletes, "old versions in old-spec files are deleted by position there"
    assert {h.base().metadata.default_spec_id, old_spec_id} <= live_spec_ids(h)

    result = compact(h.catalog, "base.orders", finalized_only=False)
    assert result.snapshot_id is not None
    base = h.base()
    assert position_delete_files(base, base.current_snapshot()) == []
    assert live_spec_ids(h) == {base.metadata.default_spec_id}, "after one compaction the table is all in the new layout"
    partitions = [tuple(f.partition) for f in data_files(base, base.current_snapshot())]
    assert len(partitions) == len(set(partitions)) <= 8, "one data file per new bucket"
    assert_readers_agree(h, tmp_path, changes)

    batch = random_changes(rng, 300, 1 + len(changes), KEYS, 400)  # and the upsert goes on in the new layout
    changes += batch
    h.write(batch)
    h.upsert()
    assert_readers_agree(h, tmp_path, changes)


@pytest.mark.parametrize("racing", ["upsert", "compaction"])
def test_a_job_started_before_the_spec_change_fails_and_its_retry_succeeds(tmp_path: Path, racing: str):
    h, changes = four_bucket_table(tmp_path, rounds=2)
    pending = random_changes(np.random.default_rng(3), 200, 1 + len(changes), KEYS, 200)
    h.write(pending)

    def racer(before_commit):
        if racing == "upsert":
            return run_upsert(h.catalog, "orders", before_commit=before_commit)
        return compact(h.catalog, "base.orders", finalized_only=False, before_commit=before_commit)

    outcome = race(racer, lambda: rebucket(h.catalog, "orders", 8))
    error = outcome.get("error")
    assert isinstance(error, CommitConflictError), outcome
    assert "partition spec changed" in str(error)
    if racing == "upsert":
        run_upsert(h.catalog, "orders")  # the retry, from a fresh snapshot
    else:
        compact(h.catalog, "base.orders", finalized_only=False)  # the retry, from a fresh snapshot
        assert live_spec_ids(h) == {h.base().metadata.default_spec_id}
        run_upsert(h.catalog, "orders")
    assert_readers_agree(h, tmp_path, changes + pending)


def test_a_bad_bucket_count_or_table_is_refused_in_one_line(tmp_path: Path):
    h, _ = four_bucket_table(tmp_path, rounds=1)
    h.catalog.create_table("base.plain", schema=Schema(NestedField(1, "id", LongType(), required=True)))
    for table, buckets, says in [
        ("orders", "6", "multiple of 4"),
        ("orders", "4", "multiple of 4"),
        ("orders", "2", "multiple of 4"),
        ("plain", "8", "not a partfin base table"),
        ("missing", "8", "base.missing"),
    ]:
        refused = partfin(tmp_path, "base", "rebucket", "--table", table, "--buckets", buckets)
        assert refused.returncode == 2, (table, buckets, refused.stderr)
        assert len(refused.stderr.strip().splitlines()) == 1 and says in refused.stderr, refused.stderr
    assert bucket_count(h.base().spec()) == 4 and h.base().properties[K.PROP_BASE_BUCKETS] == "4"


def test_status_recommends_doubling_when_buckets_outgrow_the_target(tmp_path: Path):
    h, _ = four_bucket_table(tmp_path, rounds=1)
    status = json.loads(partfin(tmp_path, "status", "--json").stdout)
    (base,) = [t for t in status["tables"] if t["name"] == "base.orders"]
    assert base["buckets"] == 4 and base["bytes_per_bucket"] > 0 and base["rebucket"] is None
    set_table_properties(h.catalog, "base.orders", {"write.target-file-size-bytes": "1000"})
    shown = partfin(tmp_path, "status")
    assert "partfin base rebucket --table orders --buckets 8" in shown.stdout, shown.stdout
    status = json.loads(partfin(tmp_path, "status", "--json").stdout)
    (base,) = [t for t in status["tables"] if t["name"] == "base.orders"]
    assert base["rebucket"] == "partfin base rebucket --table orders --buckets 8"


def test_the_spec_change_fails_only_when_the_spec_changed_first(tmp_path: Path):
    """A MERGE of the layout: a data commit landing meanwhile does not make it fail, another rebucket does."""
    h, changes = four_bucket_table(tmp_path, rounds=1)
    pending = random_changes(np.random.default_rng(4), 200, 1 + len(changes), KEYS, 100)
    h.write(pending)
    outcome = race(lambda before_commit: rebucket(h.catalog, "orders", 8, before_commit=before_commit),
                   lambda: run_upsert(h.catalog, "orders"))
    assert "error" not in outcome, outcome
    assert bucket_count(h.base().spec()) == 8
    assert_readers_agree(h, tmp_path, changes + pending)

    outcome = race(lambda before_commit: rebucket(h.catalog, "orders", 16, before_commit=before_commit),
                   lambda: rebucket(h.catalog, "orders", 32))
    assert isinstance(outcome.get("error"), CommitConflictError), outcome
    assert bucket_count(h.base().spec()) == 32 and h.base().properties[K.PROP_BASE_BUCKETS] == "32"
    assert_readers_agree(h, tmp_path, changes + pending)
