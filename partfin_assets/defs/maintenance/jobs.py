"""Table jobs of each declared table: compaction, privacy delete, maintenance (job kinds: docs/concurrency.md).

- `compact_<table>` (MERGE; schedule hourly, on by default): small-file compaction of the
  finalized hours of cdc.<table>, then of base.<table>; files before/after are recorded as an
  AssetObservation of cdc_<table> and base_<table>.
- `privacy_delete_<table>` (UPDATE/DELETE; launched by hand with run config `keys`,
  `request_id` and optionally `erase_before`): erases those primary keys from every table partfin
  writes for the table and registers them, so nothing brings them back (jobs/privacy.py,
  docs/privacy.md); re-running the same request finishes a crashed one. Records deleted per table
  are recorded.
- `maintain_<table>` (schedule daily, on by default): snapshot expiry, then orphan-file removal
  of cdc.<table>, base.<table> and the tables kept beside them (ledger, rejected lines, quarantine:
  jobs/maintenance.py; the hard erase of a privacy request); files younger than `orphan_min_age_seconds`
  are never deleted.

`partfin compact`, `partfin privacy-delete`, `partfin maintain` (cli/tables.py) call the same job functions
with the same conflict retry policy, in process.

Every op that can lose a race (CommitConflictError) is retried from a fresh snapshot, bounded
(the one policy of jobs/retry.py, as step retries: defs/retry.py). Runs carry `partfin/maintenance: <table>` (compaction and
maintenance of a table never overlap) or `partfin/privacy: <table>`, limited to 1 in dagster.yaml.
"""


from typing import Any, Optional

from dagster import (
    AssetObservation,
    Config,
    Failure,
    In,
    Nothing,
    OpExecutionContext,
    Out,
    ScheduleDefinition,
    in_process_executor,
    job,
    op,
)

from partfin_assets.defs.resources import IcebergCatalogResource
from partfin_assets.defs.retry import retry_on_conflict
from partfin_assets.defs.tables import PartfinTable, schedule_default_status
from partfin_assets.iceberg.catalog import load_table_if_exists
from partfin_assets.iceberg.expiry import Retention
from partfin_assets.jobs import compaction as compaction_core
from partfin_assets.jobs import maintenance as maintenance_core
from partfin_assets.jobs import privacy as privacy_core
from partfin_assets.jobs.compaction import DEFAULT_TARGET_FILE_SIZE
from partfin_assets.model.errors import InvalidInput, first_line
from partfin_assets.model.ids import id_text
from partfin_assets.model.timeutil import iso_z, parse_iso, to_us


# --------------------------------------------------------------------------- compaction


class CompactionConfig(Config):
    target_file_size_bytes: int = DEFAULT_TARGET_FILE_SIZE
    min_input_files: int = 2  # a partition is rewritten when it has at least this many small files


def _compact_op(table: PartfinTable, layer: str):
    name = table.name
    identifier = f"{layer}.{name}"
    asset_key = table.cdc_key if layer == "cdc" else table.base_key

    @op(name=f"compact_{layer}_{name}", ins={"after": In(Nothing)}, out=Out(Nothing), tags={"kind": "iceberg"})
    def compact_op(context: OpExecutionContext, config: CompactionConfig, catalog: IcebergCatalogResource) -> None:
        iceberg = catalog.load()
        if load_table_if_exists(iceberg, identifier) is None:
            context.log.info(f"{identifier} does not exist yet: nothing to compact")
            return
        with retry_on_conflict(context, f"compaction of {identifier}"):
            # a fresh MERGE job per attempt: it reads the snapshot current now
            result = compaction_core.compact(
                iceberg, identifier, target_file_size_bytes=config.target_file_size_bytes,
                min_input_files=config.min_input_files, finalized_only=True,
                job_id=f"dagster-{context.run_id}-{identifier}-{context.retry_number}",
            )
        context.log.info(result.describe())
        metadata = {
            "iceberg_table": identifier,
            "snapshot_id": id_text(result.snapshot_id),
            "partitions_compacted": len(result.partitions),
            "files_before": result.files_before,
            "files_after": result.files_after,
            "bytes_rewritten": sum(p.bytes_rewritten for p in result.partitions),
            "bytes_written": sum(p.bytes_written for p in result.partitions),
            "records_rewritten": sum(p.records for p in result.partitions),
            "skipped_not_finalized": len(result.skipped_not_finalized),
            "attempt": context.retry_number + 1,
            "per_partition": {p.partition: {"files_before": p.files_before, "files_after": p.files_after} for p in result.partitions[:48]},
        }
        context.log_event(AssetObservation(asset_key=asset_key, metadata={"compaction": True, **metadata}))

    return compact_op


def build_compaction_job(table: PartfinTable):
    cdc_op, base_op = _compact_op(table, "cdc"), _compact_op(table, "base")

    return _scheduled_two_step_job(
        table, "compact", cdc_op, base_op, table.compaction_cron,
        f"Small-file compaction (MERGE) of the finalized hours of cdc.{table.name}, then of base.{table.name}.",
        f"Compacts {table.name} hourly; a run with nothing to compact commits nothing.",
    )


def _scheduled_two_step_job(table: PartfinTable, kind: str, first, then, cron: str, description: str, schedule_description: str):
    """`<kind>_<table>`: `first`, then `then`, tagged as the table's maintenance (one at a time), and its schedule (UTC)."""

    @job(
        name=f"{kind}_{table.name}",
        executor_def=in_process_executor,
        description=description,
        tags={"partfin/table": table.name, "partfin/maintenance": table.name},
    )
    def two_steps():
        then(after=first())

    schedule = ScheduleDefinition(
        name=f"{kind}_{table.name}_schedule",
        job=two_steps,
        cron_schedule=cron,
        execution_timezone="UTC",
        default_status=schedule_default_status(kind),
        description=schedule_description,
    )
    return two_steps, schedule


# --------------------------------------------------------------------------- privacy delete


class PrivacyDeleteConfig(Config):
    keys: list[dict[str, Any]]  # primary keys to erase, e.g. [{"id": 42}]
    request_id: str  # the same id resumes a crashed request; recorded in snapshot summaries (never the keys)
    # changes of the keys with an event time up to this (ISO 8601, UTC) are erased; later ones are new data.
    # Default: when the request is first registered
    erase_before: Optional[str] = None


def build_privacy_job(table: PartfinTable):
    name = table.name

    @op(name=f"privacy_delete_{name}_op", out=Out(Nothing), tags={"kind": "iceberg"})
    def privacy_op(context: OpExecutionContext, config: PrivacyDeleteConfig, catalog: IcebergCatalogResource) -> None:
        erase_before = to_us(parse_iso(config.erase_before)) if config.erase_before else None
        iceberg = catalog.load()
        try:
            with retry_on_conflict(context, f"privacy delete {config.request_id} on {name}"):
                result = privacy_core.privacy_delete(iceberg, name, config.keys, request_id=config.request_id, erased_before_us=erase_before)
        except InvalidInput as exc:  # a key that is not exactly one key of the table: refused, nothing written
            raise Failure(description=first_line(str(exc)), allow_retries=False) from None
        counts = result.deleted_by_table()
        context.log.info(
            f"privacy delete {config.request_id} ({len(config.keys)} key(s), changes up to {iso_z(result.erased_before_us or 0)}): "
            + ", ".join(f"{n} record(s) in {identifier}" for identifier, n in counts.items())
        )
        for identifier, results in result.by_table().items():
            context.log_event(
                AssetObservation(
                    asset_key=table.base_key if identifier.startswith("base.") else table.cdc_key,
                    metadata={
                        "privacy_request_id": config.request_id,
                        "iceberg_table": identifier,
                        "deleted_records": counts[identifier],
                        "files_rewritten": sum(r.files_rewritten for r in results),
                        "snapshot_ids": [id_text(r.snapshot_id) for r in results],
                        "keys": len(config.keys),
                        "erased_before": iso_z(result.erased_before_us or 0),
                    },
                )
            )

    @job(
        name=f"privacy_delete_{name}",
        executor_def=in_process_executor,
        description=f"Erases the given primary keys from cdc.{name}, base.{name} and their rejected tables, and "
        "registers them so no replay, re-delivery or late record brings them back (changes made at the source after "
        "erase_before, default now, are new data). Run config: keys (list of {column: value}), request_id (re-running "
        f"the same request resumes it), erase_before (optional, ISO 8601). Old files stay referenced by older snapshots "
        f"until maintain_{name} expires them and removes the orphans (docs/privacy.md).",
        tags={"partfin/table": name, "partfin/privacy": name},
    )
    def privacy_job():
        privacy_op()

    return privacy_job


# --------------------------------------------------------------------------- snapshot expiry + orphan files


def _layer_key(table: PartfinTable, layer: str):
    """The asset a maintained table's figures are reported on: cdc_<table> or base_<table>."""
    return table.cdc_key if layer == "cdc" else table.base_key


class MaintenanceConfig(Config):
    keep_last: int = Retention.keep_last  # newest snapshots always kept (plus the policy's window and writer positions)
    orphan_min_age_seconds: int | None = None  # default: the table declaration's orphan_min_age_seconds
    dry_run: bool = False  # list orphan files without deleting them


def build_maintenance_job(table: PartfinTable):
    name = table.name

    @op(name=f"expire_snapshots_{name}", out=Out(Nothing), tags={"kind": "iceberg"})
    def expire_op(context: OpExecutionContext, config: MaintenanceConfig, catalog: IcebergCatalogResource) -> None:
        iceberg = catalog.load()
        for maintained in maintenance_core.maintained_tables(iceberg, name):
            identifier = maintained.identifier
            expired = maintenance_core.expire_table_snapshots(iceberg, identifier, maintained.retention(Retention(keep_last=config.keep_last)))
            left = len(iceberg.load_table(identifier).metadata.snapshots)
            context.log.info(f"{identifier}: {expired} snapshot(s) expired, {left} kept")
            context.log_event(AssetObservation(asset_key=_layer_key(table, maintained.layer), metadata=
                {"iceberg_table": identifier, "snapshots_expired": expired, "snapshots_kept": left}))

    @op(name=f"remove_orphans_{name}", ins={"after": In(Nothing)}, out=Out(Nothing), tags={"kind": "iceberg"})
    def orphans_op(context: OpExecutionContext, config: MaintenanceConfig, catalog: IcebergCatalogResource) -> None:
        iceberg = catalog.load()
        age = config.orphan_min_age_seconds if config.orphan_min_age_seconds is not None else table.orphan_min_age_seconds
        for maintained in maintenance_core.maintained_tables(iceberg, name):
            identifier = maintained.identifier
            report = maintenance_core.remove_orphan_files(iceberg, identifier, older_than_s=age, dry_run=config.dry_run)
            context.log.info(f"{identifier}: {len(report.orphans)} orphan file(s) {'found' if config.dry_run else 'deleted'}, "
                             f"{len(report.too_young)} younger than {age}s kept")
            context.log_event(AssetObservation(asset_key=_layer_key(table, maintained.layer), metadata={
                "iceberg_table": identifier, "orphan_files": len(report.orphans), "orphan_bytes": report.bytes_orphaned,
                "too_young": len(report.too_young), "files_scanned": report.scanned, "dry_run": config.dry_run,
                "orphan_min_age_seconds": age}))

    return _scheduled_two_step_job(
        table, "maintain", expire_op, orphans_op, table.maintenance_cron,
        f"Snapshot expiry (keeps the watermark policy's window and writer positions), then orphan-file "
        f"removal, of cdc.{name}, base.{name} and the tables partfin keeps beside them (the late-data ledger, "
        "rejected lines, quarantined changes: the hard erase of a privacy request). `partfin maintain` runs the same.",
        f"Expires snapshots and removes orphan files of {name} daily.",
    )
