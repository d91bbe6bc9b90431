"""`compact_<table>_fanout`: base compaction fanned out as Dagster steps (one per group of buckets, then one commit) on a multiprocess executor.

The steps are separate processes of a real Dagster instance; the result equals the in-process
compaction's (same rows for every reader, no delete file left, one file per bucket), the commit
is one MERGE snapshot, and a run with nothing to compact commits nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from dagster import Definitions, execute_job, reconstructable

from partfin_assets.defs.platform.compaction_fanout import build_compaction_fanout_job
from partfin_assets.defs.platform.fanout import FORKSERVER
from partfin_assets.defs.resources import IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable
from partfin_assets.iceberg.files import data_files, position_delete_files
from partfin_assets.iceberg.history import summary_of
from partfin_assets.iceberg.tables import DELETED, ensure_base_table, read_base
from partfin_assets.jobs.rebucket import rebucket
from partfin_assets.jobs.upsert import run_upsert
from partfin_assets.model import summary_keys as K
from partfin_assets_tests.test_merge_on_read import plain_pyiceberg_rows
from partfin_assets_tests.test_upsert import SPEC, Harness
from partfin_assets_tests.test_upsert_crash import random_changes
from partfin_assets_tests.test_upsert_properties import reference


def compaction_job():
    """Module level, so every step process can rebuild the job (reconstructable)."""
    job = build_compaction_fanout_job(PartfinTable(spec=SPEC, source="synthetic"))
    return Definitions(jobs=[job], resources={"catalog": IcebergCatalogResource()}).get_job_def(job.name)


def run_compaction(instance, home: Path, max_groups: int):
    config = {
        "execution": {"config": {"max_concurrent": 2, "start_method": FORKSERVER}},
        "resources": {"catalog": {"config": {"home": str(home)}}},
        "ops": {"plan_compaction_orders": {"config": {"max_groups": max_groups}}},
    }
    with execute_job(reconstructable(compaction_job), instance=instance, run_config=config, raise_on_error=False) as result:
        return result.success, [e.step_key for e in result.all_events if e.event_type_value == "STEP_SUCCESS"]


def test_fanned_out_compaction_folds_every_bucket_in_one_commit(tmp_path: Path, instance):
    h = Harness(tmp_path / "partfin")
    ensure_base_table(h.catalog, SPEC, buckets=4)
    rng = np.random.default_rng(11)
    changes: list = []
    for round_ in range(3):  # three upserts: every bucket gets delete files and a second data file
        batch = random_changes(rng, 300, 1 + 1000 * round_, 120, 60 * round_)
        changes += batch
        h.write(batch)
        run_upsert(h.catalog, "orders")
    base = h.base()
    assert position_delete_files(base, base.current_snapshot()), "the upserts left delete files to fold"
    before_rows = read_base(h.catalog, "orders", include_deleted=True).sort_by("id")
    snapshots = len(base.metadata.snapshots)

    ok, steps = run_compaction(instance, tmp_path / "partfin", max_groups=2)
    assert ok
    assert sorted(s for s in steps if s.startswith("rewrite_orders")) == ["rewrite_orders[group_0]", "rewrite_orders[group_1]"]
    base = h.base()
    assert len(base.metadata.snapshots) == snapshots + 1, "all groups in one commit"
    assert summary_of(base.current_snapshot())[K.JOB_KIND] == "MERGE"
    assert position_delete_files(base, base.current_snapshot()) == []
    partitions = [tuple(f.partition) for f in data_files(base, base.current_snapshot())]
    assert len(partitions) == len(set(partitions)) == 4, "one data file per bucket"
    assert read_base(h.catalog, "orders", include_deleted=True).sort_by("id") == before_rows
    assert h.live() == reference(changes)
    assert plain_pyiceberg_rows(tmp_path / "partfin") == sorted(
        [r["id"], r["amount"], r["_source_seq"], r[DELETED]] for r in before_rows.to_pylist()
    )

    ok, steps = run_compaction(instance, tmp_path / "partfin", max_groups=2)  # nothing left: no step, no commit
    assert ok and not [s for s in steps if s.startswith("rewrite_orders")]
    assert len(h.base().metadata.snapshots) == snapshots + 1


def test_a_compaction_that_loses_the_race_commits_nothing_and_leaves_no_files(tmp_path: Path):
    """What the commit step does after an upsert landed between the plan step and it: conflict, every group's files gone."""
    from partfin_assets.jobs.compaction import commit_compaction, plan_compaction_job, rewrite_partition
    from partfin_assets.jobs.conflicts import CommitConflictError
    from partfin_assets.jobs.job import Job, StagedFiles
    from partfin_assets.model.summary_keys import JobKind

    h = Harness(tmp_path / "partfin")
    ensure_base_table(h.catalog, SPEC, buckets=2)
    rng = np.random.default_rng(12)
    changes = random_changes(rng, 300, 1, 100, 0)
    h.write(changes)
    run_upsert(h.catalog, "orders")
    more = random_changes(rng, 300, 1000, 100, 60)
    h.write(more)
    run_upsert(h.catalog, "orders")  # delete files in both buckets

    started = Job.start(h.catalog, "base.orders", JobKind.MERGE)
    plan = plan_compaction_job(started)
    assert len(plan.rewrites) == 2
    staged = [StagedFiles(h.catalog.load_table("base.orders")) for _ in plan.rewrites]  # one per step
    rewritten = [rewrite_partition(started.table, r, s, plan.sort_by, plan.target_file_size_bytes) for r, s in zip(plan.rewrites, staged)]
    late = random_changes(rng, 50, 5000, 100, 120)
    h.write(late)
    run_upsert(h.catalog, "orders")  # lands first, in both buckets
    winner = h.base().current_snapshot().snapshot_id

    resumed = Job.resume(h.catalog, "base.orders", JobKind.MERGE, plan.start)
    with pytest.raises(CommitConflictError), resumed:
        resumed.adopt(f for r in rewritten for f in r.added)
        commit_compaction(resumed, plan, rewritten)
    base = h.base()
    assert base.current_snapshot().snapshot_id == winner
    for s in staged:
        for path in s.written:
            assert not Path(path.removeprefix("file://")).exists()
    assert h.live() == reference(changes + more + late)


def test_fanned_out_compaction_moves_a_rebucketed_table_into_the_new_layout(tmp_path: Path, instance):
    h = Harness(tmp_path / "partfin")
    ensure_base_table(h.catalog, SPEC, buckets=2)
    rng = np.random.default_rng(13)
    changes = random_changes(rng, 300, 1, 120, 0)
    h.write(changes)
    run_upsert(h.catalog, "orders")
    rebucket(h.catalog, "orders", 4)
    more = random_changes(rng, 300, 1000, 120, 60)  # old versions in old-spec files, new ones under the new spec
    h.write(more)
    run_upsert(h.catalog, "orders")
    before_rows = read_base(h.catalog, "orders", include_deleted=True).sort_by("id")

    ok, steps = run_compaction(instance, tmp_path / "partfin", max_groups=8)
    assert ok
    assert len([s for s in steps if s.startswith("rewrite_orders")]) == 2, "one step per old bucket's key group"
    base = h.base()
    live = data_files(base, base.current_snapshot())
    assert position_delete_files(base, base.current_snapshot()) == []
    assert {f.spec_id for f in live} == {base.metadata.default_spec_id}
    assert sorted(tuple(f.partition) for f in live) == [(0,), (1,), (2,), (3,)], "one data file per new bucket"
    assert read_base(h.catalog, "orders", include_deleted=True).sort_by("id") == before_rows
    assert h.live() == reference(changes + more)
