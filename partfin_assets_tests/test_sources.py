"""CDC sources: canonical keys, the synthetic generator, the Debezium file reader, the registry."""

from __future__ import annotations

import gc
import itertools
import json
import random
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from partfin_assets.model.change_columns import ChangeColumns
from partfin_assets.model.record_keys import canonical_key, key_json_column
from partfin_assets.model.records import CDC_RECORD_SCHEMA, REJECTED_RECORD_SCHEMA, UTC_US, ChangeBatch
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.model.timeutil import to_us
from partfin_assets.sources.debezium import DebeziumFileSource
from partfin_assets.sources.debezium_json import DebeziumJsonDecoder
from partfin_assets.sources.registry import make_source
from partfin_assets.sources.synthetic import ORDERS_SPEC, SyntheticSource
from partfin_assets_tests.debezium_lines import change_line

DATA = Path(__file__).parent / "data"
T0 = datetime(2024, 5, 1, tzinfo=UTC)
IDENTITY = ["key", "op", "event_time", "source_seq"]


def read_all(source, start_offset=None, max_records=1000, limit=None) -> list[ChangeBatch]:
    batches = list(itertools.islice(source.batches(start_offset, max_records), limit))
    for batch in batches:
        assert batch.records.schema.equals(CDC_RECORD_SCHEMA)
        assert batch.rejected.schema.equals(REJECTED_RECORD_SCHEMA)
        assert batch.records.num_rows + batch.rejected.num_rows <= max_records
    return batches


def records(batches: list[ChangeBatch]) -> pa.Table:
    return pa.concat_tables([CDC_RECORD_SCHEMA.empty_table()] + [b.records for b in batches])


def rejected(batches: list[ChangeBatch]) -> pa.Table:
    return pa.concat_tables([REJECTED_RECORD_SCHEMA.empty_table()] + [b.rejected for b in batches])


def identity_rows(batches: list[ChangeBatch]) -> list[dict]:
    return records(batches).select(IDENTITY).to_pylist()


# --- keys -------------------------------------------------------------------------------


def test_key_column_is_sorted_compact_json_identical_to_the_per_record_form():
    regions = ["eu", 'quote " back \\ slash', "new\nline", "ünïcode ✓", "tab\tand \x01"]
    ids = np.array([42, -1, 0, 2**62, 7])
    keys = key_json_column({"region": regions, "id": ids}).to_pylist()
    assert keys[0] == '{"id":42,"region":"eu"}'
    assert keys == [canonical_key({"region": r, "id": int(i)}) for r, i in zip(regions, ids, strict=True)]
    assert [json.loads(k) for k in keys] == [{"id": int(i), "region": r} for r, i in zip(regions, ids, strict=True)]


def test_key_column_with_mixed_value_types_falls_back_to_the_same_canonical_text():
    assert key_json_column({"id": [1, "1", True]}).to_pylist() == ['{"id":1}', '{"id":"1"}', '{"id":true}']


# --- synthetic ------------------------------------------------------------------------


def synthetic(hours: float = 3, **options) -> SyntheticSource:
    return SyntheticSource(**{"seed": 7, "start": T0, "end": T0 + timedelta(hours=hours), **options})


def test_orders_spec_declares_the_payload_columns():
    batches = read_all(synthetic(hours=0.5))
    payloads = [json.loads(p) for p in records(batches)["payload"].to_pylist() if p is not None]
    assert payloads and all(set(p) == set(ORDERS_SPEC.columns) for p in payloads)
    assert {p["status"] for p in payloads} <= {"pending", "paid", "shipped", "delivered", "cancelled"}
    assert ORDERS_SPEC.primary_key == ("id",)


def test_synthetic_is_deterministic_by_seed():
    one = records(read_all(synthetic(seed=3), max_records=5000))
    assert one.num_rows > 0
    assert one.equals(records(read_all(synthetic(seed=3), max_records=5000)))
    assert not one.equals(records(read_all(synthetic(seed=4), max_records=5000)))


def test_synthetic_batches_come_in_arrival_order_with_a_monotonic_heartbeat():
    batches = read_all(synthetic(), max_records=700)
    heartbeats = [b.heartbeat for b in batches]
    assert all(h is not None for h in heartbeats)
    assert heartbeats == sorted(heartbeats)
    for previous, batch in itertools.pairwise(batches):
        if batch.records.num_rows:
            # every event of a batch arrives after the previous heartbeat, and no later than its own
            assert batch.heartbeat >= previous.heartbeat
    assert all(b.heartbeat <= T0 + timedelta(hours=3) for b in batches)


def test_synthetic_resumes_exactly_after_any_offset():
    def source() -> SyntheticSource:
        return synthetic(rate=2, idle_every=timedelta(hours=1), idle_for=timedelta(minutes=15))

    one_pass = read_all(source(), max_records=2000)
    expected = identity_rows(one_pass)
    rng = random.Random(11)
    for _ in range(3):
        pieces: list[ChangeBatch] = []
        offset = None
        while True:
            piece = read_all(source(), offset, max_records=rng.choice([1, 37, 500, 3000]), limit=rng.randint(1, 8))
            if not piece:
                break
            pieces += piece
            offset = piece[-1].offset
        assert identity_rows(pieces) == expected
        # heartbeats of empty batches are part of the stream too: none lost or repeated on resume
        assert [b.heartbeat for b in pieces if not b.records.num_rows] == [
            b.heartbeat for b in one_pass if not b.records.num_rows
        ]


def test_synthetic_ops_follow_each_key_lifecycle_and_keys_come_back_after_delete():
    source = synthetic(hours=3, key_space=300, max_lateness=timedelta(hours=1))
    table = records(read_all(source, max_records=10_000))
    # every event of the first two hours has arrived by the end (lateness <= 1h)
    table = table.filter(pc.less(table["event_time"], pa.scalar(T0 + timedelta(hours=2), UTC_US)))
    rows = sorted(table.select(["key", "op", "source_seq", "payload"]).to_pylist(), key=lambda r: r["source_seq"])
    alive: dict[str, bool] = {}
    reinserted = 0
    for row in rows:
        exists = alive.get(row["key"], False)
        assert row["op"] == "c" if not exists else row["op"] in ("u", "d"), row
        reinserted += row["op"] == "c" and row["key"] in alive
        alive[row["key"]] = row["op"] != "d"
        assert (row["payload"] is None) == (row["op"] == "d")
        if row["payload"] is not None:
            assert canonical_key({"id": json.loads(row["payload"])["id"]}) == row["key"]
    ops = table["op"].to_pylist()
    assert {"c", "u", "d"} == set(ops)
    assert ops.count("u") > ops.count("d") > 0
    assert reinserted > 0
    assert [r["source_seq"] for r in rows] == list(range(len(rows)))


def test_synthetic_lateness_is_heavy_tailed():
    # An event arrives after the previous batch's heartbeat and no later than its own batch's.
    batches = read_all(synthetic(hours=4, late_fraction=0.002), max_records=50)
    lower, upper = [], []
    previous_us = to_us(T0)
    for batch in batches:
        event_us = batch.records["event_time"].cast(pa.int64()).to_numpy()
        lower.append(previous_us - event_us)
        upper.append(to_us(batch.heartbeat) - event_us)
        previous_us = to_us(batch.heartbeat)
    lower_s, upper_s = np.concatenate(lower) / 1e6, np.concatenate(upper) / 1e6
    assert np.median(upper_s) < 60
    assert lower_s.max() >= 3600
    assert np.mean(lower_s >= 3600) < 0.01


def test_synthetic_idle_gaps_emit_heartbeat_batches():
    source = synthetic(hours=4, idle_every=timedelta(hours=2), idle_for=timedelta(minutes=30))
    batches = read_all(source, max_records=5000)
    event_times = records(batches)["event_time"].to_pylist()
    in_gap = [t for t in event_times if (t - T0) % timedelta(hours=2) >= timedelta(minutes=90)]
    assert not in_gap
    idle = [b for b in batches if b.records.num_rows == 0]
    assert len(idle) >= 10
    heartbeats = [b.heartbeat for b in idle]
    assert heartbeats == sorted(set(heartbeats))
    assert all(b.offset != batches[0].offset for b in idle)
    # the heartbeats fall in the gaps (late events may still trickle in there)
    phases = [(h - T0) % timedelta(hours=2) for h in heartbeats]
    assert all(phase >= timedelta(minutes=90) or phase == timedelta(0) for phase in phases)


def test_synthetic_without_idle_gaps_has_no_empty_batch_at_a_busy_rate():
    batches = read_all(synthetic(hours=1, idle_every=None), max_records=5000)
    assert all(b.records.num_rows for b in batches)


def test_synthetic_replays_the_past_hours_up_to_now_by_default():
    now = datetime(2024, 5, 1, 10, 20, tzinfo=UTC)
    source = SyntheticSource(seed=1, hours=2, clock=lambda: now)
    batches = read_all(source, max_records=100_000)
    times = records(batches)["event_time"].to_pylist()
    assert min(times) >= datetime(2024, 5, 1, 8, tzinfo=UTC)
    assert max(b.heartbeat for b in batches) <= now
    assert json.loads(batches[0].offset)["anchor_us"] == to_us(datetime(2024, 5, 1, 8, tzinfo=UTC))


def test_synthetic_follow_paces_by_the_clock_and_streams_the_same_events():
    now = [T0 + timedelta(hours=1)]
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += timedelta(seconds=seconds)

    source = SyntheticSource(seed=5, start=T0, follow=True, clock=lambda: now[0], sleep=sleep)
    followed = []
    for batch in itertools.islice(source.batches(None, 1000), 200):
        assert batch.heartbeat <= now[0]
        followed.append(batch)
    assert sleeps and all(s >= 0 for s in sleeps)
    assert now[0] > T0 + timedelta(hours=1)
    replayed = read_all(synthetic(seed=5, hours=3), max_records=1000)
    assert identity_rows(followed) == identity_rows(replayed)[: records(followed).num_rows]


def test_synthetic_rejects_a_foreign_offset():
    with pytest.raises(ValueError, match="not a synthetic-source offset"):
        next(synthetic().batches('{"byte":1,"line":1}', 10))


# --- debezium -------------------------------------------------------------------------

def change(op: str, row: dict | None, ts_ms: int = 1714521600000, wrapped: bool = False, **extra) -> str:
    envelope = {
        "before": row if op == "d" else None,
        "after": None if op == "d" else row,
        "source": {"ts_ms": ts_ms},
        "op": op,
        **extra,
    }
    return json.dumps({"schema": {"type": "struct", "fields": []}, "payload": envelope} if wrapped else envelope)


def write_lines(path: Path, lines: list[str], end: str = "\n") -> Path:
    path.write_text("\n".join(lines) + end)
    return path


@pytest.mark.parametrize("wrapped", [False, True])
def test_debezium_reads_wrapped_and_unwrapped_events(tmp_path, wrapped):
    path = write_lines(
        tmp_path / "orders.jsonl",
        [
            change("r", {"id": 1, "status": "new"}, 1714521600000, wrapped),
            change("u", {"id": 1, "status": "paid"}, 1714521601500, wrapped),
            change("d", {"id": 1, "status": "paid"}, 1714521602000, wrapped),
        ],
    )
    batches = read_all(DebeziumFileSource(path, spec=ORDERS_SPEC))
    rows = records(batches).to_pylist()
    assert [(r["key"], r["op"], r["source_seq"]) for r in rows] == [
        ('{"id":1}', "r", 1),
        ('{"id":1}', "u", 2),
        ('{"id":1}', "d", 3),
    ]
    assert rows[1]["event_time"] == datetime(2024, 5, 1, 0, 0, 1, 500_000, tzinfo=UTC)
    assert json.loads(rows[1]["payload"]) == {"id": 1, "status": "paid"}
    assert rows[2]["payload"] is None
    assert all(b.heartbeat is None for b in batches)


def test_debezium_composite_primary_key_from_option(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [change("c", {"region": "eu", "id": 4, "v": 1})])
    keys = records(read_all(DebeziumFileSource(path, primary_key=("id", "region"))))["key"].to_pylist()
    assert keys == ['{"id":4,"region":"eu"}']
    with pytest.raises(ValueError, match="no primary key"):
        DebeziumFileSource(path)


BAD_LINES = [
    ('{"op": "c", "after": {"id": 1}', "invalid JSON"),
    (json.dumps({"op": "c", "after": {"id": 1}, "source": {}}), "missing source.ts_ms"),
    (json.dumps({"op": "c", "after": {"id": 1}}), "missing source.ts_ms"),
    (change("x", {"id": 1}), "unknown op 'x'"),
    (json.dumps({"after": {"id": 1}, "source": {"ts_ms": 1}}), "missing op"),
    (change("c", None), "op 'c' without 'after'"),
    (change("u", None), "op 'u' without 'after'"),
    (change("d", None), "op 'd' without 'before'"),
    (change("c", {"user_id": 3}), "missing key column(s) 'id' in 'after'"),
    (change("d", {"id": None}), "missing key column(s) 'id' in 'before'"),
    (json.dumps({"op": "c", "after": {"id": 1}, "source": {"ts_ms": "soon"}}), "source.ts_ms is not an integer"),
    ("[1, 2]", "not a JSON object"),
]


@pytest.mark.parametrize(("bad_line", "reason"), BAD_LINES)
def test_debezium_rejects_each_kind_of_bad_line_and_reads_on(tmp_path, bad_line, reason):
    path = write_lines(tmp_path / "t.jsonl", [change("c", {"id": 1}), bad_line, change("u", {"id": 1})])
    batches = read_all(DebeziumFileSource(path, spec=ORDERS_SPEC))
    assert records(batches)["source_seq"].to_pylist() == [1, 3]
    [rejection] = rejected(batches).to_pylist()
    assert (rejection["source_seq"], rejection["raw"]) == (2, bad_line)
    assert rejection["reason"].startswith(f"line 2: {reason}"), rejection["reason"]


def test_debezium_rejects_undecodable_bytes(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"op":"c","after":{"id":"\xff"}}\n' + change("c", {"id": 2}).encode() + b"\n")
    batches = read_all(DebeziumFileSource(path, spec=ORDERS_SPEC))
    assert rejected(batches)["reason"].to_pylist() == ["line 1: not UTF-8 (invalid start byte)"]
    assert records(batches)["source_seq"].to_pylist() == [2]


def test_debezium_skips_tombstones_and_blank_lines_but_counts_them(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", ['{"schema":null,"payload":null}', "", change("c", {"id": 1})])
    batches = read_all(DebeziumFileSource(path, spec=ORDERS_SPEC))
    assert records(batches)["source_seq"].to_pylist() == [3]
    assert rejected(batches).num_rows == 0


def test_debezium_types_and_values_from_the_schema_block():
    source = DebeziumFileSource(DATA / "debezium_wrapped.jsonl", primary_key=("id",))
    assert source.column_types() is None
    batches = read_all(source)
    rows = records(batches).to_pylist()
    assert [(r["key"], r["op"]) for r in rows] == [
        ('{"id":1}', "r"),
        ('{"id":2}', "c"),
        ('{"id":1}', "u"),
        ('{"id":2}', "d"),
    ]
    first = json.loads(rows[0]["payload"])
    assert first == {
        "id": 1,
        "region": "eu",
        "price": "123.45",
        "created_at": "2024-05-01T12:34:56.789000",  # Timestamp / MicroTimestamp: the source's wall clock, zoneless
        "updated_at": "2024-05-01T12:34:56.789123",
        "shipped_at": "2024-05-01T12:34:56.500000Z",
        "order_date": "2024-05-01",
        "pickup_time": "09:30:00.250000",
        "weight": "-1.500",
        "gift": True,
        "score": 0.5,
    }
    assert json.loads(rows[1]["payload"])["price"] == "-0.05"
    assert json.loads(rows[2]["payload"])["price"] == "1.00"
    assert source.column_types() == {
        "id": pa.int64(),
        "region": pa.string(),
        "price": pa.decimal128(10, 2),
        "created_at": pa.timestamp("us"),
        "updated_at": pa.timestamp("us"),
        "shipped_at": UTC_US,
        "order_date": pa.date32(),
        "pickup_time": pa.time64("us"),
        "weight": pa.string(),
        "gift": pa.bool_(),
        "score": pa.float64(),
    }
    assert rejected(batches).num_rows == 0


def test_debezium_without_schema_block_normalizes_by_the_spec(tmp_path):
    spec = TableSpec(
        name="invoices",
        primary_key=("id",),
        columns={"id": pa.int64(), "total": pa.decimal128(10, 2), "due": pa.date32(), "paid_at": UTC_US},
    )
    path = write_lines(
        tmp_path / "t.jsonl",
        [
            change("c", {"id": 1, "total": "MDk=", "due": 19844, "paid_at": 1714566896789123}),
            change("u", {"id": 1, "total": "Au4=", "due": "2024-05-02", "paid_at": "2024-05-01T14:00:00+02:00"}),  # 7.50 as base64
        ],
    )
    source = DebeziumFileSource(path, spec=spec)
    payloads = [json.loads(p) for p in records(read_all(source))["payload"].to_pylist()]
    assert payloads == [
        {"id": 1, "total": "123.45", "due": "2024-05-01", "paid_at": "2024-05-01T12:34:56.789123Z"},
        {"id": 1, "total": "7.50", "due": "2024-05-02", "paid_at": "2024-05-01T12:00:00Z"},  # at the declared scale
    ]
    assert source.column_types() == spec.columns


def test_debezium_bad_column_value_is_rejected(tmp_path):
    spec = TableSpec(name="t", primary_key=("id",), columns={"id": pa.int64(), "due": pa.date32()})
    path = write_lines(tmp_path / "t.jsonl", [change("c", {"id": 1, "due": "someday"}), change("c", {"id": 2})])
    batches = read_all(DebeziumFileSource(path, spec=spec))
    assert rejected(batches)["reason"].to_pylist()[0].startswith("line 1: bad column value in 'after'")
    assert records(batches)["source_seq"].to_pylist() == [2]


def test_debezium_does_not_consume_a_truncated_last_line(tmp_path):
    complete, partial = change("c", {"id": 1}), change("c", {"id": 2})
    path = tmp_path / "t.jsonl"
    path.write_text(complete + "\n" + partial[:20])
    source = DebeziumFileSource(path, spec=ORDERS_SPEC)
    batches = read_all(source)
    assert records(batches)["source_seq"].to_pylist() == [1]
    assert rejected(batches).num_rows == 0
    assert not read_all(source, batches[-1].offset)

    with path.open("a") as file:
        file.write(partial[20:] + "\n")
    resumed = read_all(source, batches[-1].offset)
    assert records(resumed).select(["key", "source_seq"]).to_pylist() == [{"key": '{"id":2}', "source_seq": 2}]


def test_debezium_resumes_exactly_after_the_last_committed_line(tmp_path):
    lines = [change(random.Random(i).choice("cud"), {"id": i % 5}, 1714521600000 + i) for i in range(40)]
    lines[13] = "garbage"
    path = write_lines(tmp_path / "t.jsonl", lines)
    source = DebeziumFileSource(path, spec=ORDERS_SPEC)
    one_pass = read_all(source, max_records=1000)
    offset, pieces = None, []
    while piece := read_all(source, offset, max_records=3, limit=2):
        pieces += piece
        offset = piece[-1].offset
    assert identity_rows(pieces) == identity_rows(one_pass)
    assert rejected(pieces).equals(rejected(one_pass))
    assert records(one_pass).num_rows == 39


def test_debezium_follow_waits_for_new_lines(tmp_path):
    path = shutil.copy(DATA / "debezium_wrapped.jsonl", tmp_path / "orders.jsonl")
    clock = [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds
        if clock[0] == 3:  # a writer appends a line after the reader has idled a while
            with open(path, "a") as file:
                file.write(change("c", {"id": 3}, 1714566004000) + "\n")

    source = DebeziumFileSource(
        path,
        primary_key=("id",),
        follow=True,
        poll_interval=1,
        idle_batch_every=1.5,
        sleep=sleep,
        monotonic=lambda: clock[0],
    )
    batches = read_all(source, max_records=100, limit=3)
    assert [b.records.num_rows for b in batches] == [4, 0, 1]
    assert batches[1].heartbeat is None and batches[1].offset == batches[0].offset
    assert records(batches[2:])["source_seq"].to_pylist() == [6]


# --- registry -------------------------------------------------------------------------


def test_make_source_synthetic_with_options():
    source = make_source("synthetic:seed=7,rate=5,hours=24,late_fraction=0.01,idle_every=off", ORDERS_SPEC)
    assert isinstance(source, SyntheticSource)
    assert (source.seed, source.rate, source.late_fraction, source.idle_every_us) == (7, 5.0, 0.01, None)
    default = make_source("synthetic", ORDERS_SPEC, start=T0, end=T0 + timedelta(hours=1))
    assert default.anchor_us == to_us(T0) and default.end_us == to_us(T0 + timedelta(hours=1))


def test_make_source_debezium_with_primary_key_text(tmp_path):
    (tmp_path / "a,b.jsonl").touch()
    source = make_source(f"debezium:{tmp_path}/a,b.jsonl", ORDERS_SPEC, primary_key="id, region", follow=True)
    assert isinstance(source, DebeziumFileSource)
    assert (source.path, source.primary_key, source.follow) == (tmp_path / "a,b.jsonl", ("id", "region"), True)


@pytest.mark.parametrize(
    ("spec_text", "message"),
    [
        ("kinesis:orders", "unknown source kind 'kinesis'"),
        ("kafka:orders", "expected kafka:BOOTSTRAP#TOPIC"),
        ("kafka:broker:9092#orders,sasl.password=hunter2", "in the environment as PARTFIN_KAFKA_SASL_PASSWORD"),
        ("kafka:broker:9092#orders,enable.auto.commit=true", "set by partfin"),
        ("synthetic:pace=3", "unknown synthetic option 'pace'"),
        ("synthetic:speed=3", "speed needs start"),
        ("synthetic:seed", "option 'seed' is not name=value"),
        ("synthetic:rate=fast", "option rate"),
        ("synthetic:heartbeat_every=soon", "not a duration"),
        ("debezium:", "needs a file path"),
    ],
)
def test_make_source_names_the_problem(spec_text, message):
    with pytest.raises(ValueError, match=message):
        make_source(spec_text, ORDERS_SPEC)


def test_make_source_synthetic_refuses_a_table_it_cannot_feed():
    other = TableSpec(name="users", primary_key=("uid",), columns={"uid": pa.int64()})
    with pytest.raises(ValueError, match="keys rows by"):
        make_source("synthetic", other)
    with pytest.raises(ValueError, match="keys rows by"):
        make_source("synthetic", ORDERS_SPEC, primary_key="id,region")
    renamed = TableSpec(name="orders_demo", primary_key=("id",), columns={"id": pa.int64(), "note": pa.string()})
    with pytest.raises(ValueError, match="produces columns"):
        make_source("synthetic", renamed)
    read_back_columns = {**ORDERS_SPEC.columns, "status": pa.large_string()}
    read_back = TableSpec(name="orders_demo", primary_key=("id",), columns=read_back_columns)
    assert isinstance(make_source("synthetic", read_back), SyntheticSource)


def test_synthetic_on_an_accelerated_clock_emits_the_same_stream_sooner_and_never_from_the_future():
    """The demo's event clock: 60x wall speed from `speed_since`, capped at the wall clock."""
    wall = [T0 + timedelta(hours=5)]  # the wall clock; the event clock reads T0 + 1h then
    spec = f"synthetic:seed=5,start={T0.isoformat()},speed=60,speed_since={wall[0].isoformat()},speed_event={(T0 + timedelta(hours=1)).isoformat()}"
    source = make_source(spec, ORDERS_SPEC, clock=lambda: wall[0])
    first = read_all(source, max_records=100_000)
    assert max(b.heartbeat for b in first) <= T0 + timedelta(hours=1)
    wall[0] += timedelta(minutes=2)  # two wall minutes: two more event hours
    later = read_all(source, first[-1].offset, max_records=100_000)
    assert T0 + timedelta(hours=2, minutes=55) < max(b.heartbeat for b in later) <= T0 + timedelta(hours=3)
    plain = read_all(synthetic(seed=5, hours=3), max_records=100_000)  # event times do not depend on the pace
    assert identity_rows(first + later) == identity_rows(plain)[: records(first + later).num_rows]
    wall[0] += timedelta(hours=1)  # 60 event hours later the event clock would pass the wall clock: it stops there
    caught_up = read_all(source, later[-1].offset, max_records=1_000_000)
    assert max(b.heartbeat for b in caught_up) <= wall[0]


def test_every_registered_source_kind_declares_the_capabilities_docs_sources_md_lists():
    """The contract table of docs/sources.md says which kind declares which optional capability; the source classes'
    bases (what the writer, session and fan-out ask with isinstance) say the same, for every kind in the registry."""
    import re
    from pathlib import Path

    from partfin_assets.model import records
    from partfin_assets.sources.registry import SOURCE_KINDS

    text = (Path(__file__).parents[1] / "docs" / "sources.md").read_text()
    table = text[text.index("## The source contract"):text.index("## Source identity")]
    documented = {}
    for capability, declared_by in re.findall(r"^\| `(\w+)` \|[^\n]*\| ([^|\n]+) \|$", table, re.M):
        documented[capability] = {kind for kind in SOURCE_KINDS if re.search(rf"\b{kind}\b", declared_by)}
    assert set(documented) == {"ReplayableSource", "AcknowledgesCommits", "HoldsConnections", "DiscoversColumns", "ReadsPartitions"}
    for capability, kinds in documented.items():
        protocol = getattr(records, capability)
        assert {k for k, entry in SOURCE_KINDS.items() if protocol in entry.source.__mro__} == kinds, capability  # declared


def collector_walk(root) -> int:
    """How many objects the cyclic garbage collector visits to reach everything `root` holds (its class and what
    that reaches left out: they are there whatever a source holds)."""
    seen, stack = set(), [root]
    while stack:
        item = stack.pop()
        if id(item) not in seen:
            seen.add(id(item))
            stack.extend(ref for ref in gc.get_referents(item) if gc.is_tracked(ref) and not isinstance(ref, type))
    return len(seen)


def test_changes_held_before_a_checkpoint_are_columns_the_collector_walks_in_a_few_steps():
    """A Kafka source holds every partition's changes until its batch is full: hundreds of thousands per process on
    a topic of many partitions. As (seq, change) pairs each full collection walked two objects per change (10,001 here),
    and four group members on two cores spent a third of their CPU in the collector; as columns the walk does not grow."""
    decoder = DebeziumJsonDecoder("t", ("id",), None)
    columns = ChangeColumns(("id",))
    for seq in range(5_000):
        change = decoder.decode(change_line({"id": seq % 300, "amount": 1.5, "note": "n"}, 1_714_521_600_000 + seq))
        columns.append(seq * 2, change.op, change.key_values, change.event_time_us, change.payload, change.arrival_us)
    assert len(columns) == 5_000
    assert collector_walk(columns) < 20

    records = columns.to_records()
    assert records.schema.equals(CDC_RECORD_SCHEMA)
    assert records.column("source_seq").to_pylist() == list(range(0, 10_000, 2))
    assert records.column("key").to_pylist()[:301:300] == ['{"id":0}', '{"id":0}']
    assert json.loads(records.column("payload")[7].as_py()) == {"id": 7, "amount": 1.5, "note": "n"}
    assert ChangeColumns(("id",)).to_records().equals(CDC_RECORD_SCHEMA.empty_table())
