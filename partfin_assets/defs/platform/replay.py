"""cdc/<table> as an executable asset: materializing hour partition H replays H from the source.

The CDC writer (the `sync_<table>` job) keeps reporting a materialization for every hour a
checkpoint touched; a *manual* materialization of a partition (UI "Materialize", `dagster asset
materialize --partition`, or a backfill: one run per partition) reads that hour again from the
table's source and OVERWRITEs the hour in cdc.<table> (jobs/replay.py). By the conflict matrix
an OVERWRITE never conflicts with the writer's INTO commits, so it may run while sync runs; one
replay per table at a time is enforced with the op's pool `partfin_replay_<table>` (limit 1 by
`concurrency.pools.default_limit` in dagster.yaml; pools also apply to runs launched from the UI,
which carry no job tags).

Only finalized hours are replayed unless run config says `force: true`: records of an open hour
that the writer has not ingested yet would be appended again by the writer after the replay.
"""


from dagster import AssetExecutionContext, Config, Failure, MaterializeResult, asset
from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

from partfin_assets.defs.metadata import dagster_metadata
from partfin_assets.defs.resources import CdcSourceResource, IcebergCatalogResource
from partfin_assets.defs.tables import PartfinTable
from partfin_assets.finalization.hours import hour_from_key, not_finalized_reason
from partfin_assets.finalization.partition_metadata import checkpoint_reports
from partfin_assets.iceberg.history import summary_of, watermark_of
from partfin_assets.jobs.replay import ReplayResult, replay_hour_from_source
from partfin_assets.model.timeutil import iso_z


class ReplayConfig(Config):
    force: bool = False  # replay an hour that is not finalized yet (see the module docstring)
    max_batches: int | None = None  # stop reading the source after this many batches (following sources)


def replay_pool(table: PartfinTable) -> str:
    return f"partfin_replay_{table.name}"


def replay_metadata(name: str, result: ReplayResult, summary: dict[str, str] | None, committed_at_us: int) -> dict:
    """The partition metadata of the replayed hour (as for a checkpoint) plus the replay's own figures.

    `records` is what the hour holds after the replay; `added_records` / `removed_records`
    compare it with what it held before (by key and source position).
    """
    out: dict = {}
    if summary is not None:
        for report in checkpoint_reports(name, summary, result.snapshot_id, committed_at_us):
            out.update(report.metadata())
    out.update({k: v for k, v in result.metadata().items() if k != "table"})
    out["iceberg_table"] = result.table
    return out


def build_cdc_asset(table: PartfinTable):
    name = table.name

    @asset(
        key=table.cdc_key,
        partitions_def=table.partitions_def(),
        group_name="platform",
        owners=[table.platform_owner],
        kinds={"iceberg"},
        pool=replay_pool(table),
        tags={"partfin/table": name},
        metadata={"iceberg_table": f"cdc.{name}", "watermark_policy": table.spec.watermark_policy},
        description=f"cdc.{name}: append-only change ledger, hidden partitioning hour({table.event_time_column}). "
        f"Written by the `sync_{name}` job (every checkpoint reports the hours it touched). Materializing a partition "
        f"by hand (or a backfill) replays that hour from the source: an OVERWRITE of the hour in cdc.{name}.",
    )
    def cdc(context: AssetExecutionContext, config: ReplayConfig, catalog: IcebergCatalogResource, cdc_source: CdcSourceResource) -> MaterializeResult:
        hour = hour_from_key(context.partition_key)
        iceberg = catalog.load()
        try:
            current = iceberg.load_table(f"cdc.{name}")
        except (NoSuchTableError, NoSuchNamespaceError):
            raise Failure(description=f"cdc.{name} does not exist yet: run sync_{name} first", allow_retries=False)
        watermark = watermark_of(current.properties)
        refusal = not_finalized_reason(hour, watermark, f"cdc.{name}")
        if refusal and not config.force:
            raise Failure(
                description=(
                    f"{refusal}: the writer may still append records of it. To replay it anyway, set run config "
                    f"ops.{table.cdc_key.to_python_identifier()}.config.force: true."
                ),
                allow_retries=False,
            )
        result = replay_hour_from_source(
            iceberg, name, hour, cdc_source.open(table),
            job_id=f"dagster-{context.run.run_id}-{context.partition_key}",  # a step re-run finds its own commit
            max_records=cdc_source.max_records, max_batches=config.max_batches,
        )
        summary, committed_at = None, 0
        if result.snapshot_id is not None:
            snapshot = iceberg.load_table(f"cdc.{name}").metadata.snapshot_by_id(result.snapshot_id)
            if snapshot is not None:
                summary = summary_of(snapshot)
                committed_at = snapshot.timestamp_ms * 1000
        context.log.info(
            f"replayed {iso_z(hour)} of cdc.{name}: {result.records} records ({result.added_records} added, "
            f"{result.removed_records} removed, {result.late_records} late), snapshot {result.snapshot_id}"
        )
        return MaterializeResult(metadata=dagster_metadata(replay_metadata(name, result, summary, committed_at)))

    return cdc
