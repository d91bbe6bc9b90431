"""Materializing hour partition H of cdc_<table> by hand replays H from the recorded history.

The CDC writer (the `sync_<table>` job) keeps reporting a materialization for every hour a
checkpoint touched; a *manual* materialization of a partition (UI "Materialize", `dagster asset
materialize --partition`, or a backfill: one run per partition) reads that hour again from the
history the table's writers read, up to what they had committed (never from the configured source
as it is now, jobs/replay.py), and OVERWRITEs the hour in cdc.<table>, keeping what any writer
appended meanwhile. The replay runs in the op that also runs the sync (defs/platform/sync.py), whose
pool `partfin_cdc_<table>` (limit 1 by `concurrency.pools.default_limit` in dagster.yaml; pools also
apply to runs launched from the UI, which carry no job tags) makes one replay per table at a time,
and never one while the sync's step runs.

A source that cannot read its history again (a replication slot) or no longer holds it (a changed
file) fails the run at once with the reason; so does a replay that would remove far more records
than it adds, unless run config says `force: true`. Any hour may be replayed, open or final: a
replay reads only what the writer committed, so the writer never appends a record twice.
"""


from dagster import AssetExecutionContext, Failure

from partfin_assets.defs.force import ForceConfig, refused
from partfin_assets.defs.resources import CdcSourceResource
from partfin_assets.defs.retry import retry_on_conflict
from partfin_assets.defs.tables import PartfinTable
from partfin_assets.finalization.hours import hour_from_key
from partfin_assets.finalization.hour_truth import hour_truths
from partfin_assets.iceberg.catalog import load_table_if_exists
from partfin_assets.iceberg.history import watermark_of
from partfin_assets.iceberg.ledger import read_ledger
from partfin_assets.jobs.replay import ReplayRefused, ReplayResult, replay_hour_from_history
from partfin_assets.model.source_identity import ReplayNotPossible
from partfin_assets.model.timeutil import iso_z


class ReplayConfig(ForceConfig):
    """force: replace the hour even if that removes far more records than it adds (see the module docstring)."""


def cdc_pool(table: PartfinTable) -> str:
    """One step writing cdc.<table> at a time: a sync or a replay (the writer and a replay share the op)."""
    return f"partfin_cdc_{table.name}"


def replay_metadata(iceberg, name: str, hour_us: int, result: ReplayResult) -> dict:
    """The partition metadata of the replayed hour (the hour's totals, as the sync job reports them) plus the
    replay's own figures: `replay_records` is what the hour holds after the replay; `added_records` /
    `removed_records` compare it with what it held before (a record is its change log and its position in it), and
    `by_log` gives the same per change log (writer id)."""
    cdc = iceberg.load_table(f"cdc.{name}")
    watermark = watermark_of(cdc.properties)
    (truth,) = hour_truths(read_ledger(iceberg, f"cdc.{name}"), [hour_us], watermark)
    out: dict = {**truth.metadata(), "watermark": iso_z(watermark) if watermark is not None else None}
    out.update({("replay_records" if k == "records" else k): v for k, v in result.metadata().items() if k != "table"})
    out["iceberg_table"] = result.table
    return out


def replay_partition(context: AssetExecutionContext, table: PartfinTable, iceberg, cdc_source: CdcSourceResource, force: bool) -> dict:
    """Replay the run's hour partition of cdc.<table>; the partition metadata of the replayed hour."""
    name = table.name
    hour = hour_from_key(context.partition_key)
    if load_table_if_exists(iceberg, f"cdc.{name}") is None:
        raise Failure(description=f"cdc.{name} does not exist yet: run sync_{name} first", allow_retries=False)
    try:
        with retry_on_conflict(context, f"replay of {iso_z(hour)} of cdc.{name}"):  # a rewrite raced its appends
            result = replay_hour_from_history(
                iceberg, name, hour,
                job_id=f"dagster-{context.run.run_id}-{context.partition_key}",  # a step re-run finds its own commit
                force=force, max_records=cdc_source.max_records,
            )
    except ReplayRefused as exc:
        raise refused(str(exc), table.platform_op_name) from None
    except ReplayNotPossible as exc:
        raise Failure(description=str(exc), allow_retries=False) from None
    context.log.info(
        f"replayed {iso_z(hour)} of cdc.{name} from {result.history}: {result.records} records ({result.added_records} "
        f"added, {result.removed_records} removed, {result.kept_records} appended meanwhile and kept, "
        f"{result.late_records} late; per change log {result.by_log}), snapshot {result.snapshot_id}"
    )
    return replay_metadata(iceberg, name, hour, result)
