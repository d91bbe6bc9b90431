"""Property: any arrival order, duplicates and run boundaries give the reference model's base table.

Reference model (docs/base-tables.md, jobs/upsert/decode.py): within one change log (one writer)
the change with the greatest source position wins, whatever its event time; between logs a change
ranks at its order time (its event time, never before an earlier change of its key in its log), then
by log id, then position. The row exists iff the winner is not a delete, with the winner's values.
One log may arrive in any order (the synthetic source delivers out of order); several logs each
arrive in their own order, interleaved in any way, with re-deliveries at any later point.
After every upsert the base watermark equals the watermark in the summary of the merged CDC
snapshot, and the base watermark history never goes backwards.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from partfin_assets.iceberg.history import summary_of, watermark_history
from partfin_assets.model import summary_keys as K
from partfin_assets.iceberg.tables import ORDER_TIME, SOURCE_LOG, SOURCE_SEQ
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.model.records import ChangeBatch
from partfin_assets_tests.test_upsert import Change, Harness, records

KEYS = st.integers(min_value=1, max_value=4)
OPS = st.sampled_from(["c", "u", "r", "d"])
MINUTES = st.sampled_from([0, 1, 30, 61, 90, 130, 185, 240])  # several hours, ties included: late data, watermark moves


@st.composite
def scenarios(draw):
    n = draw(st.integers(min_value=1, max_value=16))
    changes: list[Change] = []
    for seq in range(1, n + 1):
        op = draw(OPS)
        amount = None if op == "d" else float(draw(st.integers(min_value=0, max_value=99)))
        changes.append((draw(KEYS), op, draw(MINUTES), seq, amount))
    # arrival: a permutation, with some changes delivered twice (at-least-once sources)
    arrival = draw(st.permutations(changes))
    duplicates = draw(st.lists(st.sampled_from(changes), max_size=4))
    for change in duplicates:
        arrival.insert(draw(st.integers(min_value=0, max_value=len(arrival))), change)
    checkpoints, runs_after = draw(run_split(arrival))
    return changes, checkpoints, runs_after


@st.composite
def run_split(draw, arrival: list):
    """Checkpoint boundaries, then upsert runs after some checkpoints (always after the last)."""
    cuts = sorted(draw(st.sets(st.integers(min_value=1, max_value=len(arrival) - 1), max_size=5))) if len(arrival) > 1 else []
    bounds = [0, *cuts, len(arrival)]
    checkpoints = [arrival[a:b] for a, b in zip(bounds, bounds[1:])]
    runs_after = [draw(st.booleans()) for _ in checkpoints[:-1]] + [True]
    return checkpoints, runs_after


LOGS = ("a-writer", "b-writer")


@st.composite
def several_logs(draw):
    """Two writers (two change logs); each log's clock jumps back and forth (MINUTES), positions 1.. per log."""
    logs: dict[str, list[Change]] = {}
    for log in LOGS:
        n = draw(st.integers(min_value=0, max_value=8))
        logs[log] = []
        for seq in range(1, n + 1):
            op = draw(OPS)
            amount = None if op == "d" else float(draw(st.integers(min_value=0, max_value=99)))
            logs[log].append((draw(KEYS), op, draw(MINUTES), seq, amount))
    # arrival: the logs interleaved in any way, each in its own order; re-deliveries at any later point
    pending = {log: list(changes) for log, changes in logs.items()}
    arrival: list[tuple[str, Change]] = []
    while any(pending.values()):
        log = draw(st.sampled_from([log for log, rest in pending.items() if rest]))
        arrival.append((log, pending[log].pop(0)))
    for _ in range(draw(st.integers(min_value=0, max_value=3)) if arrival else 0):
        first = draw(st.integers(min_value=0, max_value=len(arrival) - 1))
        arrival.insert(draw(st.integers(min_value=first + 1, max_value=len(arrival))), arrival[first])
    if not arrival:
        arrival = [(LOGS[0], (1, "c", 0, 1, 1.0))]
        logs[LOGS[0]] = [arrival[0][1]]
    checkpoints, runs_after = draw(run_split(arrival))
    return logs, checkpoints, runs_after


def reference(changes: list[Change]) -> dict[int, tuple[float | None, int]]:
    """One change log: the greatest source position wins (event time plays no part)."""
    latest: dict[int, Change] = {}
    for change in changes:
        key = change[0]
        if key not in latest or change[3] > latest[key][3]:
            latest[key] = change
    return {k: (c[4], c[3]) for k, c in latest.items() if c[1] != "d"}


def reference_of_logs(logs: dict[str, list[Change]]) -> dict[int, tuple[float | None, int, str]]:
    """Several change logs (each list in its log's order): rank = (order time, log, position), greatest wins."""
    best: dict[int, tuple[tuple[int, str, int], Change, str]] = {}
    for log, changes in logs.items():
        order_time: dict[int, int] = {}
        for change in changes:
            key = change[0]
            order_time[key] = max(order_time.get(key, change[2]), change[2])
            rank = (order_time[key], log, change[3])
            if key not in best or rank > best[key][0]:
                best[key] = (rank, change, log)
    return {k: (c[4], c[3], log) for k, (_, c, log) in best.items() if c[1] != "d"}


def check_watermark(h: Harness, result) -> None:
    base = h.base()
    if result.base_snapshot_id is None:
        return
    merged = h.cdc().metadata.snapshot_by_id(result.cdc_snapshot_id)
    expected = summary_of(merged).get(K.WATERMARK)
    assert result.watermark == expected
    assert base.properties.get(K.PROP_WATERMARK) == expected
    assert summary_of(base.current_snapshot()).get(K.WATERMARK) == expected
    assert base.properties[K.PROP_SOURCE_SNAPSHOT_ID] == str(result.cdc_snapshot_id)
    history = [wm for _, wm in watermark_history(base.metadata)]
    assert history == sorted(history)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(scenarios())
@example(  # a newer delete merged, then an older update arrives late: must not resurrect the row
    ([(1, "c", 0, 1, 1.0), (1, "u", 30, 2, 2.0), (1, "d", 61, 3, None)],
     [[(1, "c", 0, 1, 1.0)], [(1, "d", 61, 3, None)], [(1, "u", 30, 2, 2.0)]],
     [True, True, True])
)
def test_any_order_and_run_split_matches_reference(scenario):
    changes, checkpoints, runs_after = scenario
    with tempfile.TemporaryDirectory() as home:
        h = Harness(Path(home))
        for checkpoint, run in zip(checkpoints, runs_after):
            h.write(checkpoint)
            if run:
                check_watermark(h, h.upsert())
        assert h.live() == reference(changes)
        again = h.upsert()
        assert again.base_snapshot_id is None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(scenarios())
def test_two_orderings_give_identical_base_content(scenario):
    """Beyond the model: the full base content (tombstones, metadata columns) does not depend on how runs split the
    log. `_order_time` (the winner's rank between logs) reflects the changes of its log that had arrived: equal when
    the log arrives in its order, and it alone may differ when one log arrives out of its order."""
    changes, checkpoints, runs_after = scenario
    in_order = sorted(changes, key=lambda c: c[3])
    cuts = sorted({min(sum(len(c) for c in checkpoints[:i + 1]), len(in_order)) for i in range(len(checkpoints))} | {len(in_order)})
    split_in_order = [(in_order[a:b], True) for a, b in zip([0, *cuts], cuts) if b > a]
    contents = []
    for plan in ([(c, r) for c, r in zip(checkpoints, runs_after)], split_in_order, [(in_order, True)]):
        with tempfile.TemporaryDirectory() as home:
            h = Harness(Path(home))
            for checkpoint, run in plan:
                h.write(checkpoint)
                if run:
                    h.upsert()
            contents.append(sorted(h.rows(include_deleted=True).items()))
    out_of_order, split, whole = contents
    assert split == whole
    without_order_time = [[(k, {c: v for c, v in row.items() if c != ORDER_TIME}) for k, row in rows] for rows in (out_of_order, whole)]
    assert without_order_time[0] == without_order_time[1]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(several_logs())
@example(  # log a's clock steps back (30 -> 0) before its next change; log b's change sits between
    ({"a-writer": [(1, "c", 30, 1, 1.0), (1, "u", 0, 2, 2.0)], "b-writer": [(1, "u", 1, 1, 3.0)]},
     [[("a-writer", (1, "c", 30, 1, 1.0))], [("b-writer", (1, "u", 1, 1, 3.0))], [("a-writer", (1, "u", 0, 2, 2.0))]],
     [True, True, True])
)
def test_several_change_logs_match_reference(scenario):
    """Each writer's own order decides within its log, its order time between logs, however runs split."""
    logs, checkpoints, runs_after = scenario
    with tempfile.TemporaryDirectory() as home:
        h = Harness(Path(home), writer_id=LOGS[0])
        writers = {LOGS[0]: h.writer, LOGS[1]: CdcWriter(h.catalog, h.spec, writer_id=LOGS[1])}
        offsets = dict.fromkeys(LOGS, 0)
        for checkpoint, run in zip(checkpoints, runs_after):
            for log in LOGS:
                mine = [change for source, change in checkpoint if source == log]
                if mine:
                    offsets[log] += 1
                    writers[log].write_checkpoint(ChangeBatch(records(mine), str(offsets[log])))
            if run:
                check_watermark(h, h.upsert())
        live = {k: (r["amount"], r[SOURCE_SEQ], r[SOURCE_LOG]) for k, r in h.rows().items()}
        assert live == reference_of_logs(logs)
        again = h.upsert()
        assert again.base_snapshot_id is None
