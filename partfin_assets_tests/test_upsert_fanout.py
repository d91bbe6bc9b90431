"""`upsert_<table>_fanout`: the upsert fanned out as Dagster steps (one per key group, then one commit) on a multiprocess executor.

The run's steps are separate processes of a real Dagster instance; the result equals the
in-process upsert's, the commit is one UPDATE/DELETE snapshot, and a lost race leaves nothing.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from dagster import Definitions, execute_job, reconstructable

from partfin_assets.defs.platform.fanout import FORKSERVER
from partfin_assets.defs.platform.upsert_fanout import build_upsert_job
from partfin_assets.defs.resources import IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable
from partfin_assets.iceberg.history import summary_of
from partfin_assets.iceberg.tables import ensure_base_table
from partfin_assets.jobs.upsert import run_upsert
from partfin_assets.model import summary_keys as K
from partfin_assets_tests.test_upsert import SPEC, T0, Harness, records
from partfin_assets_tests.test_upsert_crash import random_changes
from partfin_assets_tests.test_upsert_properties import reference


def fanout_job():
    """Module level, so every step process can rebuild the job (reconstructable)."""
    job = build_upsert_job(PartfinTable(spec=SPEC, source="synthetic"))
    return Definitions(jobs=[job], resources={"catalog": IcebergCatalogResource()}).get_job_def(job.name)


def run_fanout(instance, home: Path, processes: int = 2):
    # the catalog travels in the run config: forked step processes keep the forkserver's environment
    config = {
        "execution": {"config": {"max_concurrent": processes, "start_method": FORKSERVER}},
        "resources": {"catalog": {"config": {"home": str(home)}}},
    }
    with execute_job(reconstructable(fanout_job), instance=instance, run_config=config, raise_on_error=False) as result:
        return result.success, [e for e in result.all_events if e.event_type_value == "STEP_SUCCESS"]


def test_fanned_out_upsert_equals_the_in_process_one(tmp_path: Path, instance):
    h = Harness(tmp_path / "partfin")
    ensure_base_table(h.catalog, SPEC, buckets=4)  # 4 key groups: 4 merge steps
    rng = np.random.default_rng(5)
    changes = random_changes(rng, 600, 1, 300, 0)
    h.write(changes)
    run_upsert(h.catalog, "orders")  # the first load in process; the next one fans out
    more = random_changes(rng, 600, 10_000, 300, 90)
    h.write(more)
    before = len(h.base().metadata.snapshots)

    ok, steps = run_fanout(instance, tmp_path / "partfin")
    assert ok
    merged = [e for e in steps if e.step_key.startswith("merge_group_orders")]
    assert len(merged) == 4, "one step per key group"
    base = h.base()
    assert len(base.metadata.snapshots) == before + 1, "all groups in one commit"
    summary = summary_of(base.current_snapshot())
    assert summary[K.JOB_KIND] == "UPDATE/DELETE"
    assert base.properties[K.PROP_SOURCE_SNAPSHOT_ID] == str(h.cdc().current_snapshot().snapshot_id)
    assert h.live() == reference(changes + more)

    ok, steps = run_fanout(instance, tmp_path / "partfin")  # nothing new: the plan step yields no group, nothing commits
    assert ok and len(h.base().metadata.snapshots) == before + 1


def test_changes_that_do_not_fit_are_quarantined_as_the_in_process_upsert_does(tmp_path: Path, instance):
    """The fan-out decodes keys in its plan step and payloads in each group's step; the quarantine must not tell:
    the same rows, reasons and order as `partfin upsert`'s, and the same base rows."""
    good = random_changes(np.random.default_rng(11), 300, 1, 100, 0)
    bad_payload = {7: {"id": 7, "amount": "lots", "status": "x"}, 8: {"id": 8, "amount": 1.0}, 9: {"id": 99, "amount": 1.0, "status": "y"}}

    def payload(c):
        return json.dumps(bad_payload.get(c[3] - 10_000) or {"id": c[0], "amount": c[4], "status": f"s{c[3]}"})

    odd = [(k, "u", 200 + k, 10_000 + k, float(k)) for k in range(1, 13)]
    batch = records(good + odd, payload=payload)
    ops, keys = batch.column("op").to_pylist(), batch.column("key").to_pylist()
    ops[len(good) + 2] = "x"  # unknown operation
    keys[len(good) + 4] = "not json"  # a key that does not decode
    batch = batch.set_column(1, batch.schema.field("op"), pa.array(ops, pa.string()))
    batch = batch.set_column(0, batch.schema.field("key"), pa.array(keys, pa.string()))

    homes = {"in process": tmp_path / "one", "fanned out": tmp_path / "two"}
    harnesses = {how: Harness(home) for how, home in homes.items()}
    for h in harnesses.values():
        ensure_base_table(h.catalog, SPEC, buckets=4)  # the odd changes fall in several groups
        h.write(table=batch)
    run_upsert(harnesses["in process"].catalog, "orders")
    ok, _ = run_fanout(instance, homes["fanned out"])
    assert ok

    quarantined = {how: h.catalog.load_table(SPEC.quarantine_identifier).scan().to_arrow().drop_columns(["cdc_snapshot_id"])
                   for how, h in harnesses.items()}
    assert quarantined["in process"].num_rows == 5
    assert quarantined["fanned out"].to_pylist() == quarantined["in process"].to_pylist()
    assert harnesses["fanned out"].live() == harnesses["in process"].live()
    summaries = {how: summary_of(h.base().current_snapshot()) for how, h in harnesses.items()}
    assert summaries["fanned out"][K.UPSERT_QUARANTINED] == summaries["in process"][K.UPSERT_QUARANTINED] == "5"


def test_a_run_with_no_group_to_merge_still_moves_base_to_the_cdc_snapshot(tmp_path: Path, instance):
    """New CDC snapshots whose only change is quarantined, or that carry heartbeats only, leave no key group to merge.
    The run must still commit base's position and watermark, as `partfin upsert` does; else base's watermark freezes
    on an idle stream, and every later run decodes the quarantined change again."""
    h = Harness(tmp_path / "partfin")
    h.write([(1, "c", 0, 1, 1.0)])
    h.upsert()
    h.write(table=records([(3, "c", 90, 3, 3.0)], payload=lambda c: json.dumps({"id": 3, "amount": "lots", "status": "x"})))
    ok, _ = run_fanout(instance, tmp_path / "partfin")
    assert ok
    assert h.base().properties[K.PROP_SOURCE_SNAPSHOT_ID] == str(h.cdc().current_snapshot().snapshot_id)
    assert summary_of(h.base().current_snapshot())[K.UPSERT_QUARANTINED] == "1"
    assert h.catalog.load_table(SPEC.quarantine_identifier).scan().to_arrow().num_rows == 1

    for hours in (5, 6, 7):
        h.write(heartbeat=T0 + timedelta(hours=hours))
    ok, _ = run_fanout(instance, tmp_path / "partfin")
    assert ok
    base, cdc = h.base(), h.cdc()
    print(f"\nheartbeats only: cdc watermark {cdc.properties[K.PROP_WATERMARK]}, base watermark {base.properties.get(K.PROP_WATERMARK)}")
    assert base.properties[K.PROP_SOURCE_SNAPSHOT_ID] == str(cdc.current_snapshot().snapshot_id)
    assert base.properties[K.PROP_WATERMARK] == cdc.properties[K.PROP_WATERMARK] > "2024-05-01T10:00:00Z"
    assert h.live() == {1: (1.0, 1)}
    snapshots = len(base.metadata.snapshots)
    ok, _ = run_fanout(instance, tmp_path / "partfin")  # nothing new: nothing commits
    assert ok and len(h.base().metadata.snapshots) == snapshots


def test_a_lost_race_commits_nothing_and_leaves_no_files(tmp_path: Path, instance):
    h = Harness(tmp_path / "partfin")
    rng = np.random.default_rng(8)
    changes = random_changes(rng, 400, 1, 200, 0)
    h.write(changes)
    run_upsert(h.catalog, "orders")
    more = random_changes(rng, 400, 10_000, 200, 90)
    h.write(more)
    # another upsert lands between this run's plan and its commit: simulated by landing it first
    # and running the fanned-out steps against a plan taken before (the CAS on the position fails)
    from partfin_assets.iceberg.files import data_files, position_delete_files
    from partfin_assets.jobs.conflicts import CommitConflictError
    from partfin_assets.jobs.job import Job, StagedFiles
    from partfin_assets.jobs.upsert.commit import commit_merge
    from partfin_assets.jobs.upsert.decode import decode_keys
    from partfin_assets.jobs.upsert.merge import merge_group, split_by_group
    from partfin_assets.jobs.upsert.plan import GroupFiles, plan_upsert
    from partfin_assets.iceberg.files import read_files
    from partfin_assets.model.summary_keys import JobKind

    catalog = h.catalog
    ensure_base_table(catalog, SPEC)
    started = Job.start(catalog, "base.orders", JobKind.UPDATE_DELETE)
    plan = plan_upsert(catalog, SPEC, started.table)
    by_group = split_by_group(plan, decode_keys(SPEC, read_files(plan.cdc, plan.cdc_files))[0])
    staged = StagedFiles(catalog.load_table("base.orders"))
    merges = [merge_group(started.table, SPEC, plan.layout.get(g, GroupFiles(g, [])), c, staged) for g, c in by_group.items()]
    run_upsert(catalog, "orders")  # wins the race
    winner = h.base().current_snapshot().snapshot_id
    resumed = Job.resume(catalog, "base.orders", JobKind.UPDATE_DELETE, started.started)
    with pytest.raises(CommitConflictError), resumed:
        resumed.adopt(f for m in merges for f in m.add)
        commit_merge(resumed, plan.position, merges)
    base = h.base()
    assert base.current_snapshot().snapshot_id == winner
    live = {f.file_path for f in data_files(base, base.current_snapshot()) + position_delete_files(base, base.current_snapshot())}
    for path in staged.written:
        assert path not in live and not Path(path.removeprefix("file://")).exists()
    assert h.live() == reference(changes + more)
