"""The asset checks' logic, free of Dagster: table properties, snapshot summaries and the late-data ledger only.

The Dagster layer evaluates them twice: in the checks job, and inside every sync run right after
the materializations it reports (so the latest materialization of cdc_<table> and base_<table>
always carries its check results). Both wrap the same `CheckOutcome`.

cdc:  watermark_fresh, watermark_monotonic, late_data, rejected_input, writer_clocks
base: watermark_matches_merged_cdc_snapshot, watermark_lag_vs_cdc, quarantined_changes
downstream: late_data_after_run (its inputs -- what each downstream run saw -- come from Dagster)
"""

from __future__ import annotations

import itertools

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import polars as pl
from pyiceberg.catalog import Catalog
from pyiceberg.expressions import GreaterThanOrEqual

from partfin_assets.finalization.hours import hour_key, lag_seconds
from partfin_assets.finalization.hour_truth import finalization_times
from partfin_assets.finalization.late_acks import LateAck, acknowledged_hours, acks_of, unacknowledged
from partfin_assets.finalization.late_data import LateHour, late_after_run, late_data, watermark_regressions
from partfin_assets.iceberg.catalog import load_table_if_exists
from partfin_assets.iceberg.ledger import hour_totals, read_ledger
from partfin_assets.iceberg.history import lineage, recorded_watermark, total_records, watermark_history, watermark_of
from partfin_assets.iceberg.streams import writer_clocks
from partfin_assets.model import summary_keys as K
from partfin_assets.model.display_text import markdown_text
from partfin_assets.model.ids import id_text
from partfin_assets.model.stats import commit_clock_us, source_clock_us
from partfin_assets.model.timeutil import US_PER_SECOND, format_duration, from_us, iso_z, now_utc, parse_iso, to_us
from partfin_assets.watermark.registry import table_policy

MAX_LISTED = 24  # hours / commits listed in check metadata
# the one phrase for the hours that need attention: the late_data check, `partfin status` and the UI say it alike
NEEDS_ATTENTION = "late records neither re-run downstream nor acknowledged"
# how many of the newest snapshots watermark_fresh searches for the writer's last two checkpoints
CHECKPOINT_LOOKBACK = 64
WARN, ERROR = "WARN", "ERROR"


@dataclass(frozen=True)
class CheckOutcome:
    passed: bool
    description: str
    severity: str = ERROR  # WARN | ERROR (Dagster's AssetCheckSeverity names)
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DownstreamRun:
    """The latest downstream run of an hour: the CDC sequence number it read up to (or None) and when it ran."""

    sequence_number: int | None
    ran_at_us: int


@dataclass(frozen=True)
class CheckThresholds:
    lag_warn_seconds: int
    lag_error_seconds: int
    base_max_lag_seconds: int
    # a writer that committed within this long is live: a watermark far behind now is a backlog it is catching up on
    live_writer_seconds: int = 600


def _iso(us: int | None) -> str | None:
    return iso_z(us) if us is not None else None


def watermark_fresh(catalog: Catalog, name: str, limits: CheckThresholds, now_us: int | None = None) -> CheckOutcome:
    """The watermark trails now by at most the limits, or the writer is catching up: it committed recently, its source
    clock gains on the wall clock, and the watermark trails the newest record it committed by at most the limits (a
    backlog being read is healthy; a writer that stopped, or reads a source stuck in the past, is not). While the
    table's policy has not learned yet (late-budget's first commits: the ledger rows it learns from are recorded a few
    checkpoints at a time, so a new table's first sync run commits on the fallback) the distance to the newest record
    is the fallback's, not a fault: a catch-up passes whatever it is."""
    cdc = load_table_if_exists(catalog, f"cdc.{name}")
    watermark = watermark_of(cdc.properties) if cdc is not None else None
    if watermark is None:
        return CheckOutcome(False, f"cdc.{name} has no watermark yet")
    now = to_us(now_utc()) if now_us is None else now_us
    lag = lag_seconds(watermark, now)
    # durations as people read them, once: a number beside each was noise, and the constant limits plotted as series
    metadata = {"watermark": iso_z(watermark), "lag": format_duration(lag),
                "warn_after": format_duration(limits.lag_warn_seconds), "error_after": format_duration(limits.lag_error_seconds)}
    description = f"watermark {iso_z(watermark)} trails now by {format_duration(lag)}"
    newest = _newest_checkpoint(cdc)
    if newest is not None and lag > limits.lag_warn_seconds:
        committed_us, newest_event_us = newest
        behind_newest = lag_seconds(watermark, newest_event_us)
        policy = table_policy(cdc.properties)
        learning = policy.state_property is not None and policy.learning(policy.load_state(cdc.properties.get(policy.state_property)))
        if lag_seconds(committed_us, now) <= limits.live_writer_seconds and (behind_newest <= limits.lag_warn_seconds or learning):
            backlog = lag_seconds(newest_event_us, now)
            return CheckOutcome(True, f"catching up: watermark {iso_z(watermark)} trails the newest record committed by "
                                f"{format_duration(behind_newest)}; the writer is {format_duration(backlog)} behind now"
                                + (f"; policy {policy} has not learned yet (it runs on its fallback)" if learning else ""),
                                metadata={**metadata, "catching_up": True, "behind_newest_record": format_duration(behind_newest),
                                          "backlog": format_duration(backlog), "policy_learning": learning})
    return CheckOutcome(
        passed=lag <= limits.lag_warn_seconds,
        severity=ERROR if lag > limits.lag_error_seconds else WARN,
        description=description,
        metadata=metadata,
    )


def _newest_checkpoint(cdc) -> tuple[int, int] | None:
    """(commit clock, newest event time) of the table's newest checkpoint when its source clock gains on the wall clock
    since the checkpoint before it (a backlog shrinking), else None. Commits that are not checkpoints (a compaction, a
    maintenance or privacy fence, a replay) are passed over: they say nothing of how the writer keeps up."""
    checkpoints = []
    for snapshot in itertools.islice(lineage(cdc.metadata), CHECKPOINT_LOOKBACK):
        summary = snapshot.summary.additional_properties if snapshot.summary is not None else {}
        if K.EVENT_TIME_MAX in summary and K.COMMIT_CLOCK in summary and K.SOURCE_CLOCK in summary:
            checkpoints.append(summary)
            if len(checkpoints) == 2:
                break
    if len(checkpoints) < 2:
        return None
    newest, before = checkpoints
    gained = (source_clock_us(newest) - source_clock_us(before)) - (commit_clock_us(newest) - commit_clock_us(before))
    if gained <= 0:
        return None
    return commit_clock_us(newest), to_us(parse_iso(newest[K.EVENT_TIME_MAX]))


def watermark_monotonic(catalog: Catalog, name: str) -> CheckOutcome:
    cdc = load_table_if_exists(catalog, f"cdc.{name}")
    if cdc is None:
        return CheckOutcome(True, f"cdc.{name} does not exist yet")
    history = watermark_history(cdc.metadata)
    regressions = watermark_regressions(history)
    prop = watermark_of(cdc.properties)
    behind = bool(history) and prop is not None and prop < history[-1][1]
    passed = not regressions and not behind
    return CheckOutcome(
        passed=passed,
        description="monotonic" if passed else f"{len(regressions)} regression(s); property behind newest snapshot: {behind}",
        metadata={
            "snapshots_checked": len(history),
            "watermark": _iso(prop),
            "regressions": [{"from_snapshot": id_text(a.snapshot_id), "from": iso_z(a.watermark_us), "to_snapshot": id_text(b.snapshot_id),
                             "to": iso_z(b.watermark_us)} for a, b in regressions[:MAX_LISTED]],
        },
    )


def open_late_hours(late: Mapping[int, LateHour], runs: Mapping[int, DownstreamRun], acks: Mapping[int, LateAck],
                    first_hour_us: int | None = None) -> dict[int, int]:
    """hour -> late records its latest downstream run has not seen (every late record when it never ran) and no
    acknowledgement covers (finalization/late_acks.py). Hours before `first_hour_us`, the downstream's first hour
    partition, have no downstream run to redo (the finalization sensor requests none): they need no attention."""
    out = {}
    for hour, entry in late.items():
        if first_hour_us is not None and hour < first_hour_us:
            continue
        run = runs.get(hour)
        missed = entry.commits if run is None else late_after_run(late, hour, run.sequence_number, run.ran_at_us)
        missed = unacknowledged(entry, missed, acks)
        if missed:
            out[hour] = sum(c.records for c in missed)
    return out


def late_data_outcome(
    catalog: Catalog, name: str, downstream_runs: Callable[[list[int]], Mapping[int, DownstreamRun]], first_hour_us: int | None = None
) -> CheckOutcome:
    """WARN while an hour holds late records its downstream partition has not (re-)run with and nobody acknowledged;
    the ledger is the evidence.

    `downstream_runs(hours)`: the latest downstream run of each hour; `first_hour_us`: the downstream's first hour
    partition (late records before it are counted, never open). Totals (late_records, late_partitions) are the whole
    history's, as `partfin status` shows them.
    """
    late = late_data(catalog, f"cdc.{name}")  # the durable ledger: outlives snapshot expiry
    if not late:
        return CheckOutcome(True, "no late records", metadata={"late_records": 0, "late_partitions": 0})
    total = sum(h.records for h in late.values())
    acks = acks_of(catalog.load_table(f"cdc.{name}").properties)
    open_hours = open_late_hours(late, downstream_runs(sorted(late)), acks, first_hour_us)
    acknowledged = acknowledged_hours(late, acks)
    before = {h: e.records for h, e in late.items() if first_hour_us is not None and h < first_hour_us}
    newest = sorted(late.values(), key=lambda h: h.hour_us)[-MAX_LISTED:]
    metadata = {
        "late_records": total,
        "late_partitions": len(late),
        "open_late_records": sum(open_hours.values()),
        "late_records_before_partitions": sum(before.values()),  # hours the downstream never runs: nothing to re-run
        "partitions_to_rerun": [hour_key(h) for h in sorted(open_hours)][-MAX_LISTED:],
        "acknowledged_partitions": {hour_key(h): a.as_dict() for h, a in sorted(acknowledged.items())[-MAX_LISTED:]},
        "by_partition": {hour_key(h.hour_us): h.records for h in newest},
        "commits": {hour_key(h.hour_us): [c.snapshot_id for c in h.commits] for h in newest},
    }
    if not open_hours:
        handled = len(late) - len(before)
        parts = ([f"{handled} re-run downstream since or acknowledged ({len(acknowledged)} acknowledged)"] if handled else []) + (
            [f"{len(before)} before the downstream partitions start ({sum(before.values())} record(s), nothing to re-run)"]
            if before else [])
        return CheckOutcome(True, f"no hour holds {NEEDS_ATTENTION}: {total} late record(s) in {len(late)} hour partition(s): "
                            + "; ".join(parts), metadata=metadata)
    listed = sorted(open_hours)[-MAX_LISTED:]
    lateness = late_lateness(catalog, name, {h: late[h] for h in listed})
    metadata["lateness_of_open_hours"] = {hour_key(h): lateness[h] for h in listed if h in lateness}
    return CheckOutcome(
        passed=False,
        severity=WARN,
        description=f"{len(open_hours)} hour partition(s) hold {NEEDS_ATTENTION}: "
        + "; ".join(f"{hour_key(h)}: {open_hours[h]} record(s)" + (f", the last {lateness[h]['after_final']} after the hour "
                                                                    "was final" if h in lateness else "") for h in listed)
        + f" ({total} late record(s) in {len(late)} partition(s) in all)",
        metadata=metadata,
    )


def late_lateness(catalog: Catalog, name: str, late: Mapping[int, LateHour]) -> dict[int, dict[str, str]]:
    """hour -> how late its late records were, as durations: `after_final`, how long after the hour became final (the
    commit clock of the first checkpoint whose watermark passed its end) the newest late commit came; and the hour's
    arrival delay (arrival - event time, the ledger's lateness digests) p50 / p99 / max when recorded."""
    if not late:
        return {}
    ledger = read_ledger(catalog, f"cdc.{name}", row_filter=GreaterThanOrEqual("hour", from_us(min(late)).isoformat()))
    final_at = finalization_times(ledger, list(late))
    totals = hour_totals(ledger.filter(pl.col("hour").dt.epoch("us").is_in(list(late))))
    delays = {row["hour"]: row for row in totals.with_columns(pl.col("hour").dt.epoch("us")).iter_rows(named=True)}
    out = {}
    for hour, entry in late.items():
        if hour not in final_at:
            continue
        newest = max(c.committed_at_us for c in entry.commits)
        out[hour] = {"after_final": format_duration(max(0, newest - final_at[hour]) / US_PER_SECOND)}
        row = delays.get(hour)
        if row is not None and row["arrival_delay_max_s"] is not None:
            out[hour].update({f"arrival_delay_{q}": format_duration(row[f"arrival_delay_{q}_s"]) for q in ("p50", "p99", "max")})
    return out


def late_data_after_run(catalog: Catalog, name: str, downstream_runs: Callable[[list[int]], Mapping[int, DownstreamRun]],
                        first_hour_us: int | None = None) -> CheckOutcome:
    """Late records that arrived after an hour's downstream partition ran (hours never run are not listed)."""
    late = late_data(catalog, f"cdc.{name}")
    runs = downstream_runs(sorted(late)) if late else {}
    acks = acks_of(catalog.load_table(f"cdc.{name}").properties) if late else {}
    stale = {h: n for h, n in open_late_hours(late, runs, acks, first_hour_us).items() if h in runs}
    if not stale:
        return CheckOutcome(True, "no late data after any partition ran")
    keys = [hour_key(h) for h in sorted(stale)][-MAX_LISTED:]
    details = {}
    for hour in sorted(stale)[-MAX_LISTED:]:
        run = runs[hour]
        missed = unacknowledged(late[hour], late_after_run(late, hour, run.sequence_number, run.ran_at_us), acks)
        details[hour_key(hour)] = {"late_records": stale[hour], "commits": [c.snapshot_id for c in missed], "ran_at": iso_z(run.ran_at_us)}
    return CheckOutcome(
        passed=False,
        severity=WARN,
        description=f"late data arrived after these partitions ran; re-run them: {', '.join(keys)}",
        metadata={"partitions_to_rerun": keys, "details": details},
    )


def base_matches_cdc(catalog: Catalog, name: str) -> CheckOutcome:
    base = load_table_if_exists(catalog, f"base.{name}")
    cdc = load_table_if_exists(catalog, f"cdc.{name}")
    if base is None or cdc is None or not base.properties.get(K.PROP_SOURCE_SNAPSHOT_ID):
        return CheckOutcome(True, "nothing merged yet")
    source_id = int(base.properties[K.PROP_SOURCE_SNAPSHOT_ID])
    snapshot = cdc.metadata.snapshot_by_id(source_id)
    if snapshot is None:
        return CheckOutcome(False, f"merged cdc snapshot {source_id} is no longer in cdc.{name}'s metadata", WARN)
    # the watermark in force at that snapshot: a commit that records none (a compaction, a privacy delete,
    # a replay on an idle source) leaves the one before it in force, and that is what the upsert carried over
    expected = _iso(recorded_watermark(cdc.metadata, snapshot))
    actual = _iso(watermark_of(base.properties))
    return CheckOutcome(
        passed=expected == actual,
        description=f"base watermark {actual}, watermark in force at merged cdc snapshot {source_id} {expected}",
        metadata={"base_watermark": actual, "cdc_snapshot_watermark": expected, "cdc_snapshot_id": id_text(source_id)},
    )


def base_lag(catalog: Catalog, name: str, limits: CheckThresholds) -> CheckOutcome:
    base = load_table_if_exists(catalog, f"base.{name}")
    cdc = load_table_if_exists(catalog, f"cdc.{name}")
    cdc_w = watermark_of(cdc.properties) if cdc is not None else None
    base_w = watermark_of(base.properties) if base is not None else None
    if cdc_w is None:
        return CheckOutcome(True, f"cdc.{name} has no watermark yet")
    if base_w is None:
        return CheckOutcome(False, f"base.{name} has no watermark yet", WARN)
    lag = (cdc_w - base_w) / US_PER_SECOND
    return CheckOutcome(
        passed=lag <= limits.base_max_lag_seconds,
        severity=WARN,
        description=f"base lags cdc by {format_duration(lag)} (bound {format_duration(limits.base_max_lag_seconds)})",
        metadata={"cdc_watermark": iso_z(cdc_w), "base_watermark": iso_z(base_w), "lag": format_duration(lag),
                  "bound": format_duration(limits.base_max_lag_seconds)},
    )


def bad_input(catalog: Catalog, identifier: str, what: str) -> CheckOutcome:
    held = load_table_if_exists(catalog, identifier)
    count = total_records(held) if held is not None else 0
    metadata = {"records": count, "table": identifier}
    if not count:
        return CheckOutcome(True, f"{identifier} is empty", metadata=metadata)
    return CheckOutcome(False, f"{count} {what}: see {identifier} (with the reason of each)", WARN, metadata)


def clock_disagreements(catalog: Catalog, name: str) -> CheckOutcome:
    """WARN while a writer of cdc.<name> was found with its clock ahead of another's (iceberg/streams.py, "Clocks")."""
    cdc = load_table_if_exists(catalog, f"cdc.{name}")
    found = sorted(writer_clocks(cdc.properties).values(), key=lambda c: c.writer_id) if cdc is not None else []
    if not found:
        return CheckOutcome(True, f"no writer of cdc.{name} was found with a clock ahead of another's", metadata={"disagreements": []})
    # writer ids are anyone's text, and the UI renders a check's description as markdown
    shown = [replace(c, writer_id=markdown_text(c.writer_id), ahead_of=markdown_text(c.ahead_of)) for c in found]
    return CheckOutcome(False, "; ".join(c.describe() for c in shown), WARN, {"disagreements": [c.as_dict() for c in found]})
