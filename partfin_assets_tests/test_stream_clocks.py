"""Which clock judges a progress stream, and which streams hold the watermark (docs/clocks-and-streams.md).

Two writers on one table, one host's clock ahead, or stepped back and forward while its writer
runs (libfaketime on one of two real `partfin ingest` processes): the watermark waits for the
other, active writer whatever the clocks say, and the disagreement is reported (`partfin status`,
the `writer_clocks` check).

One-checkpoint `partfin ingest --source kafka:...` runs on a topic with a partition that
delivers nothing: each run moves the watermark exactly as far as the partitions' progress allows.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import time
from datetime import timedelta

import pytest

from partfin_assets_tests.cdc_files import HOUR_MS, orders_lines, partfin, partfin_command, partfin_env, stream_of, write_lines
from partfin_assets_tests.postgres_cluster import libfaketime
from partfin_assets_tests.test_progress_streams import T10_MS, T15_MS, _late_of_last_run, _status, a_pauses_while_b_commits


def _clock_ahead(offset: str) -> dict[str, str]:
    """The environment that runs a process on a host whose clock is `offset` ahead (libfaketime, Debian `faketime`)."""
    library = libfaketime()
    if library is None:
        pytest.skip("libfaketime not found: install Debian's faketime package (.ci/run does)")
    return {"LD_PRELOAD": str(library), "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ahead,ahead_s", [("+2h", 7200), ("+20m", 1200)])
def test_a_writer_whose_host_clock_is_ahead_never_moves_the_watermark_past_an_active_writer(tmp_path, monkeypatch, ahead, ahead_s):
    """Writer `a` (a true clock) commits 10:00-10:30 and pauses for seconds; writer `b`, on a host whose clock is
    `ahead`, commits 15:00-17:00. `a` is active (silent for seconds, far below the 15 min idle timeout), so the
    watermark must stay at 10:00 and `a`'s next records must not be late. Before: `b` measured `a`'s silence
    with its own clock (2 h or 20 min), called `a` idle and moved the watermark to 16:00."""
    home = tmp_path / "home"
    watermark_after_b, late_of_a = a_pauses_while_b_commits(tmp_path, home, **_clock_ahead(ahead))
    print(f"b's clock {ahead}: watermark {watermark_after_b} after b; a's remaining 2,500 records: {late_of_a:,} late")
    assert watermark_after_b <= "2026-11-20T10:00:00Z"
    assert late_of_a == 0

    # a committed after b and found b's newest commit clock ahead of its own: reported, with a lower bound
    status = _status(home)
    (clock,) = status["clocks"]
    assert (clock["writer"], clock["ahead_of"]) == ("b", "a")
    assert ahead_s - 300 <= clock["ahead_by_seconds"] <= ahead_s
    text = partfin(home, "status")
    assert text.returncode == 0 and "clock of writer b is at least" in text.stdout and "ahead of writer a's" in text.stdout

    # the Dagster check of cdc_orders warns, naming both writers
    monkeypatch.setenv("PARTFIN_HOME", str(home))
    from dagster import AssetCheckSeverity, DagsterInstance

    from partfin_assets.defs import build_definitions
    from partfin_assets.defs.tables import PartfinTable
    from partfin_assets.sources.synthetic import ORDERS_SPEC

    table = PartfinTable(spec=dataclasses.replace(ORDERS_SPEC, primary_key=("id",)), source="synthetic")
    instance = DagsterInstance.ephemeral()
    try:
        checks = build_definitions([table]).resolve_job_def("checks_orders").execute_in_process(instance=instance)
    finally:
        instance.dispose()
    evaluations = {e.check_name: e for e in checks.get_asset_check_evaluations()}
    clocks = evaluations["writer_clocks"]
    assert not clocks.passed and clocks.severity == AssetCheckSeverity.WARN
    assert "b" in clocks.description and "a" in clocks.description
    assert clocks.metadata["disagreements"].value[0]["writer"] == "b"


def _stepped_clock(clock_file) -> dict[str, str]:
    """The environment of a process whose host clock the test steps by rewriting `clock_file` (a FAKETIME offset,
    re-read at every clock call). Every clock of the process steps, its monotonic clock too: harsher than a real
    host, whose kernel steps the wall clock only (and libfaketime 0.9.10 fails a sleep on an unfaked monotonic
    clock once its offset is not 0)."""
    library = libfaketime()
    if library is None:
        pytest.skip("libfaketime not found: install Debian's faketime package (.ci/run does)")
    clock_file.write_text("+0\n")
    return {"LD_PRELOAD": str(library), "FAKETIME_TIMESTAMP_FILE": str(clock_file), "FAKETIME_NO_CACHE": "1"}


@pytest.mark.timeout(600)
def test_a_clock_step_on_one_writers_host_never_moves_the_watermark_past_another_active_writer(tmp_path):
    """Writer `b` (a true clock) commits 10:00-10:30 in short runs; writer `a` follows a file, one checkpoint per
    appended chunk, on a host whose clock the test steps 2 h back, then 2 h forward, between a's checkpoints. `b`
    committed seconds before each of them (real time): it is active, so the watermark must stay at b's 10:00 and
    none of b's remaining records may be late. Before: `a` measured b's silence from its first sight of b's
    checkpoint, taken while its clock was 2 h back, to its next commit after the step forward -- 2 h on its wall
    clock -- called b idle and moved the watermark to a's 15:00."""
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets.iceberg.streams import positions_of

    home, clock_file = tmp_path / "home", tmp_path / "a-clock"
    file_a, file_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    seen: set[int] = set()
    lines_a = orders_lines(*stream_of(T15_MS, T15_MS + HOUR_MS, 750, seed=1), seed=1, seen=seen)
    write_lines(file_b, orders_lines(*stream_of(T10_MS, T10_MS + 3 * HOUR_MS, 3_000, seed=2), seed=2, seen=seen))
    file_a.write_text("")
    common = ["ingest", "--table", "orders", "--primary-key", "id", "--checkpoint-records", "250"]
    ingest_b = [*common, "--source", f"debezium:{file_b}", "--writer-id", "b"]

    def run_b(*extra: str) -> subprocess.CompletedProcess:
        run = partfin(home, *ingest_b, *extra)
        assert run.returncode == 0, run.stderr
        return run

    def a_checkpoint(chunk: int) -> None:
        """Append a's next 250 lines in one write and wait until a has committed them."""
        with file_a.open("a") as out:
            out.write("".join(line + "\n" for line in lines_a[250 * chunk:250 * (chunk + 1)]))
        deadline = time.monotonic() + 120
        while positions_of(load_partfin_catalog(home).load_table("cdc.orders").metadata, "a")["a"].checkpoint_id <= chunk:
            assert writer_a.poll() is None and time.monotonic() < deadline, writer_a.communicate()
            time.sleep(0.2)

    run_b("--max-checkpoints", "2")  # b: 10:00 to about 10:30
    writer_a = subprocess.Popen(partfin_command(*common, "--source", f"debezium:{file_a}", "--writer-id", "a", "--follow"),
                                env=partfin_env(home, **_stepped_clock(clock_file)),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        a_checkpoint(0)  # a's true clock: it finds b's checkpoint
        clock_file.write_text("-2h\n")  # a's host clock steps back 2 h
        run_b("--max-checkpoints", "1")  # b commits, seconds before a
        a_checkpoint(1)  # a finds b's new checkpoint at its clock 2 h back
        clock_file.write_text("+0\n")  # and steps forward 2 h again
        a_checkpoint(2)  # seconds after b's checkpoint in real time
        after_step = _status(home)
    finally:
        writer_a.send_signal(signal.SIGINT)
        _, err_a = writer_a.communicate(timeout=120)
    assert writer_a.returncode == 130, err_a
    late_of_b = _late_of_last_run(run_b().stderr)
    print(f"a's clock stepped 2 h back and forward: watermark {after_step['watermark']} after a's step; "
          f"b's remaining 2,250 records: {late_of_b:,} late")
    assert after_step["watermark"] <= "2026-11-20T10:00:00Z"
    assert late_of_b == 0
    # what the step did to b: a, 2 h back, found b's clock ahead (b's event times capped meanwhile, which finalizes
    # later, never earlier); b's next commit found a's clock right again and cleared it
    assert [(c["writer"], c["ahead_of"]) for c in after_step["clocks"]] == [("b", "a")]
    assert _status(home)["clocks"] == []


@pytest.mark.timeout(600)
def test_a_writer_run_after_its_host_clock_stepped_forward_never_moves_the_watermark_past_another_active_writer(tmp_path):
    """One-checkpoint runs, as the Dagster sync makes them: `b` (a true clock) commits, `a` commits twice, then its
    host clock steps 2 h forward (libfaketime on the wall clock only, as a kernel steps it) and `a` runs once more,
    seconds after b's checkpoint in real time. The watermark must stay at b's 10:00, none of b's remaining records
    late. Before: a's new process measured b's silence on its wall clock from a first sight taken before the step."""
    library = libfaketime()
    if library is None:
        pytest.skip("libfaketime not found: install Debian's faketime package (.ci/run does)")
    home, file_a, file_b = tmp_path / "home", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    seen: set[int] = set()
    write_lines(file_a, orders_lines(*stream_of(T15_MS, T15_MS + HOUR_MS, 750, seed=1), seed=1, seen=seen))
    write_lines(file_b, orders_lines(*stream_of(T10_MS, T10_MS + 3 * HOUR_MS, 3_000, seed=2), seed=2, seen=seen))
    common = ["ingest", "--table", "orders", "--primary-key", "id", "--checkpoint-records", "250"]

    def run(writer: str, source, *extra: str, **env: str) -> subprocess.CompletedProcess:
        result = partfin(home, *common, "--source", f"debezium:{source}", "--writer-id", writer, *extra, **env)
        assert result.returncode == 0, result.stderr
        return result

    run("b", file_b, "--max-checkpoints", "2")
    run("a", file_a, "--max-checkpoints", "1")
    run("b", file_b, "--max-checkpoints", "1")
    run("a", file_a, "--max-checkpoints", "1")  # finds b's checkpoint
    run("a", file_a, "--max-checkpoints", "1", LD_PRELOAD=str(library), FAKETIME="+2h", FAKETIME_DONT_FAKE_MONOTONIC="1")
    watermark_after_step = _status(home)["watermark"]
    late_of_b = _late_of_last_run(run("b", file_b).stderr)
    print(f"a's next run 2 h ahead: watermark {watermark_after_step}; b's remaining 2,250 records: {late_of_b:,} late")
    assert watermark_after_step <= "2026-11-20T10:00:00Z"
    assert late_of_b == 0


def test_the_stream_clock_runs_on_the_monotonic_clock_from_where_the_writer_left_it_and_never_goes_back():
    """The rule that measures silence (iceberg/streams.py, StreamClock), with explicit clocks: a step of the wall
    clock during a run, back or forward, does not move it; a later run on the same boot resumes on the monotonic
    clock; a run that cannot (another boot) starts from its wall clock, but never before what the writer recorded;
    a monotonic clock far ahead on the same boot (libfaketime's) never takes it beyond the wall clock."""
    from partfin_assets.iceberg.streams import SteadyReading, Stream, StreamClock
    from partfin_assets_tests.conftest import HOUR_US, T0_US

    second, true = 1_000_000, T0_US + 30 * HOUR_US
    wall, monotonic = [true], [1_000 * 1_000_000]

    def stream_clock(boot: str = "boot-1", ahead_s: int = 0) -> StreamClock:
        return StreamClock("a", lambda: wall[0], lambda: SteadyReading(boot, monotonic[0] + ahead_s * second))

    run = stream_clock()
    assert run.read({}).us == true
    wall[0], monotonic[0] = wall[0] - 2 * HOUR_US + 5 * second, monotonic[0] + 5 * second  # a step back, 5 s later
    assert run.read({}).us == true + 5 * second
    wall[0], monotonic[0] = wall[0] + 4 * HOUR_US + 5 * second, monotonic[0] + 5 * second  # 4 h forward: 2 h ahead
    reading = run.read({})
    assert reading.us == true + 10 * second

    # the writer's checkpoint records that reading; its next run, a minute later on the same boot, resumes from it
    recorded = {"a": Stream("a", "a", None, wall[0], since={"a": reading.us}, steady=reading.steady)}
    wall[0], monotonic[0] = wall[0] + 60 * second, monotonic[0] + 60 * second
    assert stream_clock().read(recorded).us == true + 70 * second
    # another boot: the wall clock, here stepped 2 h back, but never before what the writer recorded
    wall[0] -= 4 * HOUR_US
    assert stream_clock("boot-2").read(recorded).us == true + 10 * second
    # a monotonic clock a day ahead on the same boot (libfaketime's): no further than the wall clock
    wall[0] = true + 80 * second
    assert stream_clock(ahead_s=86_400).read(recorded).us == true + 80 * second


def test_a_step_of_a_writers_host_clock_during_or_between_its_runs_never_makes_an_active_writer_idle(catalog):
    """In process, with explicit clocks: `b` commits, then `a` commits a checkpoint a minute, each on a host clock
    stepped 2 h back (it finds b's checkpoint then), to the true time, 2 h ahead during one run, and still ahead in
    its next run (same boot). `b` has been silent for 4 minutes at most: active, the watermark stays at its 10:00. Once `b` has really committed nothing for 16 minutes (the idle timeout
    is 15), a's next checkpoint moves the watermark to a's 15:00, whatever a's wall clock says."""
    from partfin_assets.iceberg.streams import SteadyReading
    from partfin_assets.ingest.writer import CdcWriter
    from partfin_assets.model import summary_keys as K
    from partfin_assets.model.timeutil import from_us, iso_z
    from partfin_assets_tests.conftest import HOUR_US, MINUTE_US, ORDERS, T0_US, change_batch

    true = [T0_US + 30 * HOUR_US]  # the true time: b's clock, and the hosts' monotonic clocks
    step = [0]  # a's host clock less the true time

    def hour(h: int, n: int = 60):
        return [T0_US + h * HOUR_US + i * MINUTE_US for i in range(n)]

    def a_run() -> CdcWriter:
        return CdcWriter(catalog, ORDERS, writer_id="a", clock=lambda: from_us(true[0] + step[0]),
                         steady_clock=lambda: SteadyReading("host-a", true[0]))

    b = CdcWriter(catalog, ORDERS, writer_id="b", clock=lambda: from_us(true[0]), steady_clock=lambda: SteadyReading("host-b", true[0]))
    b.write_checkpoint(change_batch(hour(10), offset="b0"))
    a = a_run()
    a.write_checkpoint(change_batch(hour(15), offset="a0", seq_start=1000))  # a finds b's checkpoint
    true[0] += MINUTE_US
    b.write_checkpoint(change_batch(hour(10), offset="b1", seq_start=100))  # b commits again, and then nothing
    watermarks = []
    for i, a_host_clock in enumerate((-2 * HOUR_US, 0, 2 * HOUR_US, 2 * HOUR_US)):
        true[0] += MINUTE_US
        step[0] = a_host_clock  # a's host clock steps
        if i == 3:
            a = a_run()  # a's next run, its host clock still 2 h ahead
        watermarks.append(a.write_checkpoint(change_batch(hour(15), offset=f"a{i + 1}", seq_start=1000 * (i + 2))).summary[K.WATERMARK])
    print(f"a's host clock -2h, 0, +2h, +2h (next run): watermarks {watermarks}")
    assert watermarks == [iso_z(T0_US + 10 * HOUR_US)] * 4

    true[0] += 16 * MINUTE_US  # b has committed nothing for 16 minutes: idle
    step[0] = -2 * HOUR_US
    result = a.write_checkpoint(change_batch(hour(15), offset="a5", seq_start=10_000))
    assert result.summary[K.WATERMARK] == iso_z(T0_US + 15 * HOUR_US)


def test_the_clock_cap_uses_the_slower_clock_once_two_writers_disagree(catalog):
    """In process, with explicit clocks: `b` runs 2 h ahead and its source with it (event times up to its own
    'now'). Once `a` has committed after `b` and found b's clock ahead, b's commits cap event time at b's clock
    less what it was found ahead: after `a` is retired, the watermark still never passes the hour that has
    begun on a's (the true) clock."""
    from partfin_assets.iceberg.streams import retire_stream
    from partfin_assets.ingest.writer import CdcWriter
    from partfin_assets.model import summary_keys as K
    from partfin_assets.model.timeutil import floor_hour_us, from_us, iso_z
    from partfin_assets_tests.conftest import HOUR_US, MINUTE_US, ORDERS, T0_US, change_batch

    now = [T0_US + 30 * HOUR_US + 30 * MINUTE_US]  # the true clock, 06:30 the next day
    ahead = 2 * HOUR_US

    def minutes_before(clock_us: int, n: int = 60):
        return [clock_us - n * MINUTE_US + i * MINUTE_US for i in range(n)]

    a = CdcWriter(catalog, ORDERS, writer_id="a", clock=lambda: from_us(now[0]))
    a.write_checkpoint(change_batch(minutes_before(now[0]), offset="a0"))
    b = CdcWriter(catalog, ORDERS, writer_id="b", clock=lambda: from_us(now[0] + ahead))
    b.write_checkpoint(change_batch(minutes_before(now[0] + ahead), offset="b0"))  # b's source follows b's clock
    now[0] += MINUTE_US
    a.write_checkpoint(change_batch(minutes_before(now[0], 5), offset="a1"))  # a finds b's commit clock 2 h ahead of its own
    retire_stream(catalog, "cdc.orders", "a")
    for i in range(3):
        now[0] += MINUTE_US
        result = b.write_checkpoint(change_batch(minutes_before(now[0] + ahead, 20), offset=f"b{i + 1}"))
    watermark = catalog.load_table("cdc.orders").properties[K.PROP_WATERMARK]
    print(f"b alone, 2 h ahead: watermark {watermark}, true now {iso_z(now[0])}, b's clock {iso_z(now[0] + ahead)}")
    assert watermark == iso_z(floor_hour_us(now[0]))  # b's progress (07:00), capped at the hour begun on the slower clock
    assert K.SUSPECT_FUTURE in result.summary  # b's records from beyond the true clock + tolerance claim nothing


# --------------------------------------------------------------------------- Kafka: per-partition streams


@pytest.mark.timeout(600)
def test_one_checkpoint_kafka_runs_move_the_watermark_as_far_as_the_partitions_allow(tmp_path, kafka_cluster):
    """A 2-partition topic: partition 1 delivered hours 0-3 and then nothing; partition 0 gets one more hour before
    each one-checkpoint run (the Dagster sync every minute on a quiet topic). Each run must move the watermark to
    min(partition 0's hour, partition 1's hour 3) while partition 1 is active, and to partition 0's hour once
    partition 1 is idle. Before: each run re-registered the writer's own stream with no progress, and its one
    commit never moved the watermark."""
    from partfin_assets.iceberg.catalog import load_partfin_catalog
    from partfin_assets.iceberg.streams import set_idle_timeout, streams_of
    from partfin_assets_tests.test_kafka_source import TOPIC, kafka_spec, per_minute, produce_to, run_ingest, watermark_hour

    kafka_cluster.create_topic(TOPIC, 2)
    spec = kafka_spec(kafka_cluster)
    home = tmp_path / "home"
    ids = {0: list(range(0, 10)), 1: list(range(10, 20))}
    produce_to(kafka_cluster, 1, per_minute(ids[1], 0, 240))
    produce_to(kafka_cluster, 0, per_minute(ids[0], 0, 60))
    # one hour a checkpoint: partition 1's last one holds hour 3 only
    run_ingest(home, spec, "--checkpoint-records", "60", "--watermark-policy", "min-of-last:1")
    assert watermark_hour(home) == 0
    watermarks = []
    for hour in range(1, 6):
        produce_to(kafka_cluster, 0, per_minute(ids[0], 60 * hour, 60 * (hour + 1)))
        run_ingest(home, spec, "--checkpoint-records", "1000", "--max-checkpoints", "1")
        watermarks.append(watermark_hour(home))
    streams = streams_of(load_partfin_catalog(home).load_table("cdc.orders").properties)
    assert streams["orders-writer"].retired  # the writer's own stream never came back to hold the watermark
    set_idle_timeout(load_partfin_catalog(home), "cdc.orders", timedelta(seconds=1))  # `partfin streams idle-timeout 1s`
    time.sleep(2)  # partition 1 has now delivered nothing for longer than that
    for hour in range(6, 8):
        produce_to(kafka_cluster, 0, per_minute(ids[0], 60 * hour, 60 * (hour + 1)))
        run_ingest(home, spec, "--checkpoint-records", "1000", "--max-checkpoints", "1")
        watermarks.append(watermark_hour(home))
    print(f"one-checkpoint kafka runs: watermark hours {watermarks}")
    assert watermarks == [1, 2, 3, 3, 3, 6, 7]
