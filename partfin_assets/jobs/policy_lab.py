"""The policy lab: how early and how right each watermark policy would have finalized a table's hours.

Input is a late-data ledger (iceberg/ledger.py): the table's recorded one (`partfin policy-lab
--table T`), or one built by `simulate` for a scenario (steady, outage, idle, bad-clocks, shift, backfill) with the
ledger's own row builder, so a user can try policies before having history. Each policy is
replayed checkpoint by checkpoint with the code the writer runs (the policy's state and candidate, the
step of watermark/step.py, the stream minimum of the watermark processor), so
replaying a writer's own ledger gives back the watermarks it committed (a test holds it to that).

Measured per policy, over the measured hours: the share of records written after their hour was
finalized (late), and the median finalization lag (first commit at which the watermark passed
hour H + 1 h, minus H + 1 h) against an oracle that knows each hour's last arrival: a never
decreasing watermark can finalize H no earlier than the last arrival of any hour up to H. Two
baselines are tuned to the same late share: a fixed delay (Flink's partition-time commit trigger:
H is final at H + 1 h + D of arrival) and an idle time (Paimon's partition idle-time-to-done: H is
final once no record of it arrived for I, and all hours before it are).
"""

from __future__ import annotations

import html
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa

from pyiceberg.catalog import Catalog

from partfin_assets.iceberg.ledger import COMMIT_STATS_COLUMNS, REPLAY_STREAM, Checkpoint, checkpoint_rows, ledger_commit_stats, read_ledger
from partfin_assets.iceberg.streams import DEFAULT_IDLE_TIMEOUT
from partfin_assets.ingest.watermark_processor import DEFAULT_FUTURE_TOLERANCE
from partfin_assets.model.table_options import WATERMARK_POLICY
from partfin_assets.model.defaults import POLICY_LAB_POLICIES, POLICY_LAB_SCENARIOS
from partfin_assets.model.errors import InvalidInput
from partfin_assets.model.stats import CommitStats
from partfin_assets.model.timeutil import US_PER_HOUR, US_PER_SECOND, floor_hour_us, parse_iso, to_us
from partfin_assets.watermark.policy import LEARN_MATURITY_US
from partfin_assets.watermark.registry import parse_policy, policy_for_budget
from partfin_assets.watermark.step import advance, stream_progress, window_of

SCENARIOS = POLICY_LAB_SCENARIOS
# the `shift` scenario: a connector falls behind by 30 minutes (the body of the lateness, median 20 s, ~90x longer; its
# tail as much later) over the middle half of the measured hours, then recovers
SHIFT_LAG_S = 1800.0
SHIFT_ONSET_HOURS = 2  # the phase a policy may need to see the shift: not held to the budget on its own
# the `backfill` scenario: the connector stops for 3 hours (no records, no heartbeats), then re-reads its backlog in
# arrival order 8x faster than it was written until it has caught up with the live stream (after about 26 minutes)
BACKFILL_DOWN_HOURS = 3
BACKFILL_SPEED = 8
MIN_HOURS = {"shift": 4, "backfill": BACKFILL_DOWN_HOURS + 2}  # measured hours a scenario needs (others: 1)
DEFAULT_POLICIES = POLICY_LAB_POLICIES


def lab_policies(budget: float) -> list[str]:
    """What `partfin policy-lab` compares by default: DEFAULT_POLICIES and the registry's policy for `budget`."""
    return [*DEFAULT_POLICIES, str(policy_for_budget(budget))]


LAB_COLUMNS = tuple(dict.fromkeys(COMMIT_STATS_COLUMNS + ("lateness_digest", "watermark")))
SIM_START_US = to_us(parse_iso("2026-11-01T00:00:00Z"))
MINUTE_US = 60 * US_PER_SECOND


# --------------------------------------------------------------------------- simulated streams


@dataclass(frozen=True)
class LabInput:
    """Ledger rows to replay, and the event hours measured ([start, end), hour aligned)."""

    rows: pl.DataFrame
    measure_from_us: int
    measure_to_us: int
    description: str
    phases: tuple[tuple[str, int, int], ...] = ()  # (name, first event hour, end): parts of the measured hours reported alone


def simulate(scenario: str, *, hours: int = 16, history_hours: int = 8, rate: float = 3.0, checkpoint_s: int = 60,
             seed: int = 13) -> LabInput:
    """A stream as the issue measured it, as the writer's ledger would record it.

    Event times at `rate` per second; lateness lognormal around 20 s plus a 1.5 % tail uniform up to
    3 h; one checkpoint per `checkpoint_s` of arrival (its clock: the end of that interval), records
    without a source arrival time (the commit clock is their arrival), an empty interval commits a
    heartbeat. `history_hours` of the same steady stream come first (the table's history: what
    a learning policy learns from), then `hours` measured hours, then 4 hours in which late records of the
    measured hours still arrive. Scenarios: `outage` -- a shard with a quarter of the events delivers
    nothing for 90 minutes from the 5th measured hour on, then its backlog within 5 minutes; `idle` --
    no events for 4 hours from the 6th measured hour on (the source sends heartbeats); `bad-clocks` --
    0.05 % of the events carry event times 2 days ahead; `shift` -- a connector falls behind: the events of the
    middle half of the measured hours (hours 4 to 11 of 16) arrive 30 minutes later, then it recovers; measured
    per phase too (before, the shift's first two hours, the rest of the shift, after recovery); `backfill` -- a
    connector that catches up: from the measured hour hours // 4 on it is down for 3 hours (nothing arrives, not even a
    heartbeat: the writer commits nothing), then it re-reads what arrived meanwhile, in arrival order, 8 times as fast,
    until it has caught up with the live stream (about 26 minutes later); its first records are 3 hours behind, a gap
    that closes as it reads. The backfilled hours are not final yet (nothing told the table they were): a policy
    should hold them until the backlog delivers them, then follow it. Measured per phase too (before, the backlog's
    event hours, after). A replay of hours the table had already finalized is another thing: its records are late by
    nature, whatever the policy.
    """
    if scenario not in SCENARIOS:
        raise InvalidInput(f"unknown scenario {scenario!r}; use one of {', '.join(SCENARIOS)}")
    if hours < MIN_HOURS.get(scenario, 1):
        raise InvalidInput(f"--hours {hours}: the {scenario} scenario measures at least {MIN_HOURS.get(scenario, 1)} hour(s)")
    rng = np.random.default_rng(seed)
    measure_from = SIM_START_US + history_hours * US_PER_HOUR
    measure_to = measure_from + hours * US_PER_HOUR
    end = measure_to + 4 * US_PER_HOUR
    count = int((measure_to - SIM_START_US) / US_PER_SECOND * rate)
    event = SIM_START_US + np.sort(rng.integers(0, measure_to - SIM_START_US, count))
    if scenario == "idle":
        night = measure_from + 6 * US_PER_HOUR
        event = event[(event < night) | (event >= night + 4 * US_PER_HOUR)]
    lateness_s = rng.lognormal(math.log(20.0), 0.8, event.size)
    tail = rng.random(event.size) < 0.015
    lateness_s[tail] = rng.uniform(0, 3 * 3600, int(tail.sum()))
    phases: tuple[tuple[str, int, int], ...] = ()
    if scenario == "shift":
        shift_from, shift_to = measure_from + hours // 4 * US_PER_HOUR, measure_from + (hours - hours // 4) * US_PER_HOUR
        onset_end = min(shift_from + SHIFT_ONSET_HOURS * US_PER_HOUR, shift_to)
        phases = (("before", measure_from, shift_from), (f"shift, first {SHIFT_ONSET_HOURS} h", shift_from, onset_end),
                  (f"shift, after {SHIFT_ONSET_HOURS} h", onset_end, shift_to), ("after recovery", shift_to, measure_to))
        lateness_s[(event >= shift_from) & (event < shift_to)] += SHIFT_LAG_S
    arrival = event + (lateness_s * US_PER_SECOND).astype(np.int64)
    if scenario == "outage":
        down_from = measure_from + 5 * US_PER_HOUR
        down_to = down_from + 90 * MINUTE_US
        held = (rng.random(event.size) < 0.25) & (arrival >= down_from) & (arrival < down_to)
        arrival[held] = down_to + rng.integers(0, 5 * MINUTE_US, int(held.sum()))
    silent_from = silent_to = end  # commit clocks at which the writer commits nothing
    if scenario == "backfill":
        silent_from = measure_from + hours // 4 * US_PER_HOUR
        silent_to = silent_from + BACKFILL_DOWN_HOURS * US_PER_HOUR
        # read from where it stopped at BACKFILL_SPEED x real time: it reaches the live stream when both meet
        caught_up = silent_from + (silent_to - silent_from) * BACKFILL_SPEED // (BACKFILL_SPEED - 1)
        backlog = (arrival >= silent_from) & (arrival < caught_up)
        arrival[backlog] = silent_to + (arrival[backlog] - silent_from) // BACKFILL_SPEED
        phases = (("before", measure_from, silent_from), ("backlog", silent_from, silent_to), ("after", silent_to, measure_to))
    if scenario == "bad-clocks":
        ahead = rng.random(event.size) < 0.0005
        event = event + np.where(ahead, 2 * 24 * US_PER_HOUR, 0)
    keep = arrival < end
    event, arrival = event[keep], arrival[keep]
    order = np.argsort(arrival, kind="stable")
    event, arrival = event[order], arrival[order]

    step = checkpoint_s * US_PER_SECOND
    cell = (arrival - SIM_START_US) // step
    bounds = np.searchsorted(cell, np.arange(0, (end - SIM_START_US) // step + 1))
    tables = []
    for i in range(bounds.size - 1):
        clock = SIM_START_US + (i + 1) * step
        start, stop = int(bounds[i]), int(bounds[i + 1])
        if stop == start and silent_from < clock <= silent_to:
            continue
        checkpoint = Checkpoint("lab", "lab", i + 1, i + 1, i + 1, clock, None, {}, None if stop > start else clock)
        tables.append(checkpoint_rows(checkpoint, event[start:stop]))
    rows = pl.from_arrow(pa.concat_tables(tables))
    assert isinstance(rows, pl.DataFrame)
    return LabInput(rows.select(LAB_COLUMNS), measure_from, measure_to, f"simulated {scenario}: {hours} h measured after "
                    f"{history_hours} h of history, {rate:g} events/s, {checkpoint_s} s checkpoints, seed {seed}", phases)


def recorded(rows: pl.DataFrame, table: str) -> LabInput:
    """A table's recorded ledger. Measured: its hours with records, up to the last one that ended 6 h
    before its newest checkpoint (a younger hour's late records may still come), or all of them
    when none is that old."""
    data = rows.filter(pl.col("hour").is_not_null() & (pl.col("records") > 0))
    if data.is_empty():
        raise InvalidInput(f"cdc.{table} has no checkpoints with records in its ledger yet: try --scenario")
    hours = data["hour"].dt.epoch("us")
    last_commit = int(rows["commit_time"].dt.epoch("us").max())
    plausible = hours.filter(hours <= last_commit)
    first, last = int(plausible.min()), int(plausible.max())
    settled = floor_hour_us(last_commit - LEARN_MATURITY_US)
    end = min(last + US_PER_HOUR, settled) if settled > first else last + US_PER_HOUR
    return LabInput(rows.select(LAB_COLUMNS), first, end, f"cdc.{table}: recorded ledger, {rows['checkpoint_id'].n_unique()} "
                    f"checkpoint(s), {(end - first) // US_PER_HOUR} hour(s) measured")


# --------------------------------------------------------------------------- replay


@dataclass(frozen=True)
class Replay:
    """A watermark sequence: after each checkpoint (commit order), the table's watermark (us; -inf as int64 min)."""

    clock_us: np.ndarray
    watermark_us: np.ndarray


NO_WATERMARK = np.iinfo(np.int64).min


def replay(commits: Sequence[CommitStats], streams: Sequence[str], policy_text: str, rows: pl.DataFrame, *,
           idle_timeout_us: int = int(DEFAULT_IDLE_TIMEOUT.total_seconds() * US_PER_SECOND)) -> Replay:
    """The watermarks the writer would have committed under `policy_text`, checkpoint by checkpoint.

    `commits`/`streams`: the ledger's stats-bearing checkpoints in commit order and the stream of
    each. Per stream the policy's window (the commit and its older ones), the candidate capped at
    the commit clock's hour; the table's candidate is the minimum over the streams seen within the
    idle timeout; the watermark advances, never back. Silence is measured on the ledger's commit
    clocks, as the writers' rule (iceberg/streams.py) measures it when they share one clock that
    never steps: the ledger does not record their stream clocks. A learning policy learns its
    state from the rows committed before, refreshed as the writer refreshes it.
    """
    policy = parse_policy(policy_text)
    history: dict[str, list[CommitStats]] = {}
    progress: dict[str, tuple[int | None, int]] = {}  # stream -> (progress, last commit clock)
    state = None
    watermark = None
    clocks = np.empty(len(commits), dtype=np.int64)
    marks = np.empty(len(commits), dtype=np.int64)
    # each ledger row's commit among `commits` (-1: none): the rows a learning policy reads carry the watermarks
    # of this replay, as a writer's ledger carries its own
    index = {c.snapshot_id: i for i, c in enumerate(commits)}
    row_commit = np.array([index.get(s, -1) for s in rows["snapshot_id"].to_list()], dtype=np.int64)

    def ledger(upto: int) -> pl.DataFrame:
        known = (row_commit >= 0) & (row_commit < upto)
        replayed = np.where(known, marks[np.where(known, row_commit, 0)], NO_WATERMARK)
        series = pl.Series("watermark", replayed)
        return rows.with_columns(pl.when(series != NO_WATERMARK).then(series).otherwise(None).cast(pl.Datetime("us", "UTC"))
                                 .alias("watermark"))

    for i, (commit, stream) in enumerate(zip(commits, streams)):
        clock = commit.clock_us
        if policy.state_property is not None:
            state, _ = policy.refresh_state(state, clock, lambda columns, from_hour_us: ledger(i))  # the policy picks its hours
        older = history.setdefault(stream, [])
        window = window_of(policy.window, [commit], reversed(older))[0] if policy.window_needed(state) else [commit]
        older.append(commit)
        progress[stream] = (stream_progress(policy, state, window, clock), clock)
        active = [p for p, seen in progress.values() if clock - seen <= idle_timeout_us]
        table = None if any(p is None for p in active) else min(active)
        watermark = advance(watermark, table)
        clocks[i] = clock
        marks[i] = NO_WATERMARK if watermark is None else watermark
    return Replay(clocks, marks)


def fixed_delay(commits: Sequence[CommitStats], delay_us: int) -> Replay:
    """Flink's partition-time trigger: hour H is final once arrival passes H + 1 h + delay (arrival as
    a policy reads it: the source's latest arrival time, else the commit clock)."""
    clocks = np.array([c.clock_us for c in commits], dtype=np.int64)
    arrivals = np.array([c.arrival_us if c.arrival_us is not None else c.clock_us for c in commits], dtype=np.int64)
    return Replay(clocks, np.maximum.accumulate((arrivals - delay_us) // US_PER_HOUR * US_PER_HOUR))


def idle_time(clocks_us: np.ndarray, hours_us: np.ndarray, first_hour_us: int, idle_us: int) -> Replay:
    """Paimon's idle-time-to-done: hour H is final once it ended, no record of it arrived for `idle_us`,
    and every hour before it is final (a watermark). `hours_us`: per commit, the hours it wrote (lists)."""
    last_seen: dict[int, int] = {}
    watermark = first_hour_us
    marks = np.empty(clocks_us.size, dtype=np.int64)
    for i, (clock, hours) in enumerate(zip(clocks_us.tolist(), hours_us)):
        for hour in hours:
            last_seen[hour] = clock
        while watermark + US_PER_HOUR <= clock and clock - last_seen.get(watermark, watermark + US_PER_HOUR) >= idle_us:
            watermark += US_PER_HOUR
        marks[i] = watermark
    return Replay(clocks_us.copy(), marks)


# --------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Outcome:
    name: str
    late_share: float  # of the measured hours' records
    median_lag_s: float  # inf when most measured hours never finalized
    oracle_lag_s: float
    phase_shares: tuple[tuple[str, float], ...] = ()  # the late share of each phase of the measured hours

    @property
    def lag_ratio(self) -> float:
        return self.median_lag_s / self.oracle_lag_s if self.oracle_lag_s > 0 else math.inf


class Lab:
    """One ledger, measured: replays policies and baselines over its checkpoints."""

    def __init__(self, data: LabInput, *, tolerance_us: int = int(DEFAULT_FUTURE_TOLERANCE.total_seconds() * US_PER_SECOND)) -> None:
        self.data = data
        rows = data.rows
        self.rows = rows
        self.tolerance_us = tolerance_us
        self._with_digests: list[CommitStats] | None = None
        data_rows = rows.filter(pl.col("hour").is_not_null() & (pl.col("records") > 0) & (pl.col("stream") != REPLAY_STREAM))
        self._data_rows = data_rows.with_columns(pl.col("hour").dt.epoch("us").alias("hour_us"),
                                                 pl.col("commit_time").dt.epoch("us").alias("commit_us"))
        self.hour_us = self._data_rows["hour_us"].to_numpy()
        self.row_commit_us = self._data_rows["commit_us"].to_numpy()
        self.records = self._data_rows["records"].to_numpy()
        self.measured = (self.hour_us >= data.measure_from_us) & (self.hour_us < data.measure_to_us)
        self.hours = np.arange(data.measure_from_us, data.measure_to_us, US_PER_HOUR, dtype=np.int64)
        self.oracle_final = self._oracle_final()
        self.oracle_lag_s = float(np.median(self.oracle_final - (self.hours + US_PER_HOUR))) / US_PER_SECOND

    @cached_property
    def commits(self) -> list[CommitStats]:
        return ledger_commit_stats(self.rows, self.tolerance_us)

    @cached_property
    def streams(self) -> list[str]:
        by_snapshot = dict(zip(self.rows["snapshot_id"].to_list(), self.rows["stream"].to_list()))
        return [by_snapshot[c.snapshot_id] for c in self.commits]

    @cached_property
    def _commit_hours(self) -> tuple[np.ndarray, list[list[int]]]:
        per_commit = self._data_rows.group_by("commit_us", maintain_order=True).agg(pl.col("hour_us").unique())
        hours_at = dict(zip(per_commit["commit_us"].to_list(), per_commit["hour_us"].to_list()))
        clocks = np.array([c.clock_us for c in self.commits], dtype=np.int64)
        return clocks, [hours_at.get(c, []) for c in clocks.tolist()]

    def recorded(self, name: str) -> Outcome:
        """What the table's own watermark did: each checkpoint's recorded watermark (the ledger's `watermark`)."""
        checkpoints = self.rows.unique(["stream", "checkpoint_id"], maintain_order=True).sort("commit_time")
        clocks = checkpoints["commit_time"].dt.epoch("us").to_numpy()
        marks = checkpoints["watermark"].dt.epoch("us").fill_null(NO_WATERMARK).to_numpy()
        return self.measure(name, Replay(clocks, marks))

    def _oracle_final(self) -> np.ndarray:
        last = np.full(self.hours.size, NO_WATERMARK, dtype=np.int64)
        first = self.data.measure_from_us
        before = self.row_commit_us[(self.hour_us < first) & (self.hour_us >= first - 48 * US_PER_HOUR)]
        carried = int(before.max()) if before.size else NO_WATERMARK
        index = (self.hour_us[self.measured] - first) // US_PER_HOUR
        np.maximum.at(last, index, self.row_commit_us[self.measured])
        last = np.maximum(last, self.hours + US_PER_HOUR)
        last[0] = max(last[0], carried)
        return np.maximum.accumulate(last)

    def measure(self, name: str, run: Replay) -> Outcome:
        marks = np.maximum.accumulate(run.watermark_us)
        # the watermark in force when each row was committed: after the last earlier checkpoint
        before = np.searchsorted(run.clock_us, self.row_commit_us, side="left") - 1
        in_force = np.where(before >= 0, marks[np.maximum(before, 0)], NO_WATERMARK)
        late = self.measured & (self.hour_us + US_PER_HOUR <= in_force)
        share = _share(self.records, late, self.measured)
        phases = tuple((name, _share(self.records, late, (self.hour_us >= start) & (self.hour_us < end)))
                       for name, start, end in self.data.phases)
        at = np.searchsorted(marks, self.hours + US_PER_HOUR, side="left")
        final = np.where(at < marks.size, run.clock_us[np.minimum(at, marks.size - 1)], np.iinfo(np.int64).max)
        lags = np.where(at < marks.size, (final - (self.hours + US_PER_HOUR)) / US_PER_SECOND, math.inf)
        return Outcome(name, share, float(np.median(lags)), self.oracle_lag_s, phases)

    def commits_for(self, text: str) -> list[CommitStats]:
        """The checkpoints as the policy reads them (with event-time digests for a percentile)."""
        if not parse_policy(text).needs_digest:
            return self.commits
        if self._with_digests is None:
            self._with_digests = ledger_commit_stats(self.rows, self.tolerance_us, with_digest=True)
        return self._with_digests

    def policy(self, text: str) -> Outcome:
        return self.measure(text, replay(self.commits_for(text), self.streams, text, self.rows))

    def fixed_delay(self, delay_us: int) -> Outcome:
        return self.measure(f"fixed delay {delay_us / US_PER_SECOND / 60:g} min", fixed_delay(self.commits, delay_us))

    def idle_time(self, idle_us: int) -> Outcome:
        first = min(int(self.hour_us.min()), self.data.measure_from_us)
        clocks, hours = self._commit_hours
        run = idle_time(clocks, hours, first, idle_us)
        return self.measure(f"idle time {idle_us / US_PER_SECOND / 60:g} min", run)

    def tuned(self, baseline: str, late_share: float) -> Outcome:
        """The baseline's smallest parameter (whole minutes) whose late share is at most `late_share`."""
        run = self.fixed_delay if baseline == "fixed" else self.idle_time
        low, high = 0, 24 * 60
        if run(high * MINUTE_US).late_share > late_share:
            return run(high * MINUTE_US)
        while low < high:
            middle = (low + high) // 2
            if run(middle * MINUTE_US).late_share <= late_share:
                high = middle
            else:
                low = middle + 1
        return run(low * MINUTE_US)


def _share(records: np.ndarray, late: np.ndarray, of: np.ndarray) -> float:
    total = int(records[of].sum())
    return float(records[late & of].sum()) / total if total else 0.0


def measured_policy(catalog: Catalog, table: str) -> Outcome | None:
    """The table's current policy as its own watermark did, over its recorded ledger (None: nothing to measure yet)."""
    rows = read_ledger(catalog, f"cdc.{table}", columns=LAB_COLUMNS)
    try:
        data = recorded(rows, table)
    except InvalidInput:
        return None
    policy = WATERMARK_POLICY.text(catalog.load_table(f"cdc.{table}").properties)
    return Lab(data).recorded(policy)


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class LabRow:
    outcome: Outcome
    fixed: Outcome | None  # the baselines tuned to this policy's late share
    idle: Outcome | None


@dataclass(frozen=True)
class LabReport:
    description: str
    budget: float
    rows: list[LabRow]
    baselines: list[Outcome]  # tuned to the budget
    recommended: str

    def table(self) -> str:
        lines = [
            f"{self.description}; oracle median lag {self.rows[0].outcome.oracle_lag_s / 3600:.2f} h",
            "",
            "| policy | late after finalization | median lag | vs oracle | vs fixed delay at the same late share | "
            "vs idle time at the same late share |",
            "|---|---|---|---|---|---|",
        ]
        for row in self.rows:
            o = row.outcome
            mark = " (recommended)" if o.name == self.recommended else ""
            lines.append(f"| `{o.name}`{mark} | {o.late_share:.3%} | {_hours(o.median_lag_s)} | {_ratio(o.lag_ratio)} | "
                         f"{_ratio(o.median_lag_s, row.fixed.median_lag_s)} | {_ratio(o.median_lag_s, row.idle.median_lag_s)} |")
        for o in self.baselines:
            lines.append(f"| {o.name} (tuned to {self.budget:.2%} late) | {o.late_share:.3%} | {_hours(o.median_lag_s)} | "
                         f"{_ratio(o.lag_ratio)} | | |")
        phases = [name for name, _ in self.rows[0].outcome.phase_shares]
        if phases:
            lines += ["", "Late after finalization, per phase of the measured hours:", "",
                      "| policy | " + " | ".join(phases) + " |", "|---|" + "---|" * len(phases)]
            for o in [row.outcome for row in self.rows] + self.baselines:
                lines.append(f"| `{o.name}` | " + " | ".join(f"{share:.3%}" for _, share in o.phase_shares) + " |")
        return "\n".join(lines)


def _hours(seconds: float) -> str:
    return "never" if math.isinf(seconds) else f"{seconds / 3600:.2f} h"


def _ratio(value: float, of: float = 1.0) -> str:
    if not (math.isfinite(value) and math.isfinite(of)) or of <= 0:
        return "-"
    return f"{value / of:.2f}x"


def run_lab(data: LabInput, policies: Sequence[str], budget: float) -> tuple[LabReport, Lab]:
    for text in policies:
        parse_policy(text)  # a bad one is refused before any work
    lab = Lab(data)
    rows = []
    for text in policies:
        outcome = lab.policy(text)
        rows.append(LabRow(outcome, lab.tuned("fixed", outcome.late_share), lab.tuned("idle", outcome.late_share)))
    within = [r.outcome for r in rows if r.outcome.late_share <= budget]
    best = min(within, key=lambda o: o.median_lag_s) if within else min((r.outcome for r in rows), key=lambda o: o.late_share)
    return LabReport(data.description, budget, rows, [lab.tuned("fixed", budget), lab.tuned("idle", budget)], best.name), lab


# --------------------------------------------------------------------------- plot


def write_plot(report: LabReport, lab: Lab, path: Path) -> tuple[Path, Path]:
    """Lag (x oracle) vs late share: each policy a point, each baseline the curve of its parameter.

    matplotlib renders the PNG and the SVG embedded in the HTML page (with the table), so the
    page needs no script and no network.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5), dpi=110)
    for name, run, grid in (("fixed delay", lab.fixed_delay, range(0, 6 * 60 + 1, 10)), ("idle time", lab.idle_time, range(0, 121, 4))):
        points = [run(m * MINUTE_US) for m in grid]
        axes.plot([max(p.late_share, 1e-6) * 100 for p in points], [p.lag_ratio for p in points], marker=".", label=f"{name} (swept)")
    for row in report.rows:
        o = row.outcome
        axes.scatter([max(o.late_share, 1e-6) * 100], [o.lag_ratio], zorder=3)
        axes.annotate(o.name, (max(o.late_share, 1e-6) * 100, o.lag_ratio), textcoords="offset points", xytext=(5, 5), fontsize=8)
    axes.axvline(report.budget * 100, color="grey", linestyle="--", linewidth=1, label=f"budget {report.budget:.2%}")
    axes.set_xscale("log")
    axes.set_xlabel("records late after finalization (%)")
    axes.set_ylabel("median finalization lag / oracle's")
    axes.set_title(report.description, fontsize=8)
    axes.legend(fontsize=8)
    axes.grid(True, alpha=0.3)
    png = path.with_suffix(".png")
    page = path.with_suffix(".html")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, bbox_inches="tight")
    svg = io.StringIO()
    figure.savefig(svg, format="svg", bbox_inches="tight")
    plt.close(figure)
    body = svg.getvalue()
    body = body[body.index("<svg"):]
    page.write_text(f"<!doctype html><meta charset='utf-8'><title>partfin policy lab</title>\n{body}\n"
                    f"<pre>{html.escape(report.table())}</pre>\n")
    return png, page
