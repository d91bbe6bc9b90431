"""Runs a stopped deployment left looking in flight: marked failed, so they hold no queue or pool slot.

A run whose worker process is gone (killed with its process group after the stop's grace period, a
kill -9, a power cut) stays STARTING, STARTED or CANCELING in the instance: the queue counts it
against the table's `partfin/writer` limit and its step keeps the op pool slot `partfin_cdc_<table>`,
so no sync of the table would ever start again (the default run launcher cannot check a worker's
health). Nothing of it is half-done in the tables: every commit is atomic and the next run goes on
from the last committed checkpoint, exactly once.

`python -m partfin_assets.defs.stopped_runs` (scripts/demo.sh runs it before it starts Dagster, when
no run worker of this instance can be alive) marks each such run failed, with the reason in its event
log, and frees its pool slots.
"""

from __future__ import annotations

from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

LEFT_IN_FLIGHT = [DagsterRunStatus.STARTING, DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]
REASON = (
    "the deployment stopped while this run was in flight and its process is gone: marked failed so it holds no queue "
    "or pool slot; its commits are atomic, the next run goes on from the last committed checkpoint"
)


def mark_stopped_runs_failed(instance: DagsterInstance) -> list[str]:
    """Mark every run left in flight failed and free its pool slots; their run ids."""
    marked = []
    for run in instance.get_runs(RunsFilter(statuses=LEFT_IN_FLIGHT)):
        instance.report_run_failed(run, REASON)
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        marked.append(run.run_id)
    return marked


def main() -> None:
    with DagsterInstance.get() as instance:
        for run_id in mark_stopped_runs_failed(instance):
            print(f"run {run_id} was left in flight by a stop: marked failed (its commits are atomic; the next run goes on)")


if __name__ == "__main__":
    main()
