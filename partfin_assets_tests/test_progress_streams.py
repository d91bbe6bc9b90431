"""Several writer ids on one table -- the watermark never passes a writer's uncommitted data.

Writer `a` streams 10:00-13:00 and stops after two checkpoints; writer `b` commits 15:00-17:00.
Nothing says `a` is done, so the watermark must stay at or below the hour of `a`'s progress,
and `a`'s next records must not be late. Real `partfin ingest` processes.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime


from partfin_assets_tests.cdc_files import HOUR_MS, orders_lines, partfin, stream_of, write_lines

T10_MS = int(datetime(2026, 11, 20, 10, tzinfo=UTC).timestamp() * 1000)
T15_MS = int(datetime(2026, 11, 20, 15, tzinfo=UTC).timestamp() * 1000)


def _status(home) -> dict:
    result = partfin(home, "status", "--json")
    assert result.returncode == 0, result.stderr
    return next(t for t in json.loads(result.stdout)["tables"] if t["name"] == "cdc.orders")


def _late_of_last_run(stderr: str) -> int:
    """Late records the ingest's progress lines report (the last line carries the run's total)."""
    lines = [line for line in stderr.splitlines() if " late " in line]
    return int(lines[-1].split(" late ")[1].split()[0].replace(",", "")) if lines else 0


def two_writers(tmp_path) -> tuple[list[str], list[str]]:
    """`partfin ingest` arguments of writer `a` (3,000 records, 10:00-13:00) and `b` (2,000, 15:00-17:00)."""
    file_a, file_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    seen: set[int] = set()
    write_lines(file_a, orders_lines(*stream_of(T10_MS, T10_MS + 3 * HOUR_MS, 3_000, seed=1), seed=1, seen=seen))
    write_lines(file_b, orders_lines(*stream_of(T15_MS, T15_MS + 2 * HOUR_MS, 2_000, seed=2), seed=2, seen=seen))
    common = ["ingest", "--table", "orders", "--primary-key", "id", "--checkpoint-records", "250"]
    return [*common, "--source", f"debezium:{file_a}", "--writer-id", "a"], [*common, "--source", f"debezium:{file_b}", "--writer-id", "b"]


def a_pauses_while_b_commits(tmp_path, home, **b_env: str) -> tuple[str | None, int]:
    """`a` commits two checkpoints (10:00 to about 10:30) and pauses while `b` (in environment `b_env`) commits all of
    its own; then `a` goes on where it stopped. The watermark after b, and the late records of a's second run."""
    ingest_a, ingest_b = two_writers(tmp_path)
    first = partfin(home, *ingest_a, "--max-checkpoints", "2")
    assert first.returncode == 0, first.stderr
    second = partfin(home, *ingest_b, **b_env)
    assert second.returncode == 0, second.stderr
    watermark_after_b = _status(home)["watermark"]
    rest = partfin(home, *ingest_a)
    assert rest.returncode == 0, rest.stderr
    return watermark_after_b, _late_of_last_run(rest.stderr)


def test_a_second_writer_id_does_not_move_the_watermark_past_the_first_writers_data(tmp_path):
    watermark_after_b, late_of_a = a_pauses_while_b_commits(tmp_path, tmp_path / "home")
    print(f"two writer ids: watermark {watermark_after_b} after b; a's remaining 2,500 records: {late_of_a:,} late")
    assert watermark_after_b <= "2026-11-20T10:00:00Z"
    assert late_of_a == 0


def test_streams_are_listed_retired_by_the_cli_and_a_retired_stream_lets_the_watermark_go(tmp_path):
    home = tmp_path / "home"
    file_a, file_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    seen: set[int] = set()
    write_lines(file_a, orders_lines(*stream_of(T10_MS, T10_MS + HOUR_MS, 1_000, seed=1), seed=1, seen=seen))
    write_lines(file_b, orders_lines(*stream_of(T15_MS, T15_MS + 2 * HOUR_MS, 2_000, seed=2), seed=2, seen=seen))
    common = ["ingest", "--table", "orders", "--primary-key", "id", "--checkpoint-records", "250"]
    assert partfin(home, *common, "--source", f"debezium:{file_a}", "--writer-id", "a").returncode == 0
    assert partfin(home, *common, "--source", f"debezium:{file_b}", "--writer-id", "b", "--max-checkpoints", "4").returncode == 0

    listed = json.loads(partfin(home, "streams", "list", "--table", "orders", "--json").stdout)["streams"]
    by_id = {row["stream"]: row for row in listed}
    assert by_id["a"]["state"] == by_id["b"]["state"] == "active"
    assert by_id["a"]["progress"] == "2026-11-20T10:00:00Z" and by_id["a"]["checkpoint"] == 4
    assert by_id["b"]["progress"] == "2026-11-20T15:00:00Z"
    assert _status(home)["watermark"] == "2026-11-20T10:00:00Z"  # a has committed 10:00-11:00 and holds it
    assert [s["stream"] for s in _status(home)["streams"]] == ["a", "b"]

    retired = partfin(home, "streams", "retire", "--table", "orders", "--stream", "a")
    assert retired.returncode == 0 and "stream 'a' retired" in retired.stdout
    assert partfin(home, *common, "--source", f"debezium:{file_b}", "--writer-id", "b").returncode == 0
    assert _status(home)["watermark"] == "2026-11-20T16:00:00Z"  # b alone now
    listed = json.loads(partfin(home, "streams", "list", "--table", "orders", "--json").stdout)["streams"]
    assert {row["stream"]: row["state"] for row in listed} == {"a": "retired", "b": "active"}

    unknown = partfin(home, "streams", "retire", "--table", "orders", "--stream", "nobody")
    assert unknown.returncode == 2
    assert unknown.stderr.strip() == "partfin: error: cdc.orders has no stream 'nobody' (streams: a, b)"
    timeout = partfin(home, "streams", "idle-timeout", "--table", "orders", "30m")
    assert timeout.returncode == 0 and "nothing for 1800s" in timeout.stdout


def test_a_registered_writer_holds_the_watermark_until_it_commits_and_an_idle_one_stops_holding_it(catalog):
    from datetime import timedelta

    from partfin_assets.iceberg.streams import SteadyReading, set_idle_timeout
    from partfin_assets.ingest.writer import CdcWriter
    from partfin_assets.model import summary_keys as K
    from partfin_assets.model.timeutil import from_us, iso_z
    from partfin_assets_tests.conftest import HOUR_US, MINUTE_US, ORDERS, T0_US, change_batch

    now = [T0_US + 30 * HOUR_US]  # the writers' commit clock, and their host's monotonic clock, moved by the test
    clock = lambda: from_us(now[0])  # noqa: E731
    steady = lambda: SteadyReading("host", now[0])  # noqa: E731

    def hours(first: int, last: int, n: int = 60):
        return [T0_US + first * HOUR_US + i * (last - first) * HOUR_US // n for i in range(n)]

    fast = CdcWriter(catalog, ORDERS, writer_id="fast", clock=clock, steady_clock=steady)
    for i in range(3):
        fast.write_checkpoint(change_batch(hours(10 + i, 11 + i), offset=f"f{i}"))
    assert catalog.load_table("cdc.orders").properties[K.PROP_WATERMARK] == iso_z(T0_US + 10 * HOUR_US)

    slow = CdcWriter(catalog, ORDERS, writer_id="slow", clock=clock, steady_clock=steady)  # registered: claims nothing yet
    fast.write_checkpoint(change_batch(hours(13, 14), offset="f3"))
    assert catalog.load_table("cdc.orders").properties[K.PROP_WATERMARK] == iso_z(T0_US + 10 * HOUR_US)
    slow.write_checkpoint(change_batch(hours(11, 12), offset="s0"))  # its own window: 11:00
    fast.write_checkpoint(change_batch(hours(14, 15), offset="f4"))
    assert catalog.load_table("cdc.orders").properties[K.PROP_WATERMARK] == iso_z(T0_US + 11 * HOUR_US)

    set_idle_timeout(catalog, "cdc.orders", timedelta(minutes=10))
    now[0] += 11 * MINUTE_US  # slow has committed nothing for 11 minutes: idle
    result = fast.write_checkpoint(change_batch(hours(15, 16), offset="f5"))
    assert result.summary[K.WATERMARK] == iso_z(T0_US + 13 * HOUR_US)  # fast's own window (13..16)
    # slow comes back with 12:00 data: late, counted, and it holds the watermark again
    result = slow.write_checkpoint(change_batch(hours(12, 13), offset="s1"))
    assert result.summary[K.LATE_RECORDS] == "60"
    fast.write_checkpoint(change_batch(hours(16, 17), offset="f6"))
    assert catalog.load_table("cdc.orders").properties[K.PROP_WATERMARK] == iso_z(T0_US + 13 * HOUR_US)
