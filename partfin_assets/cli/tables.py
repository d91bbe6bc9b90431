"""The table jobs by hand: `partfin upsert`, `base rebucket`, `replay`, `compact`, `privacy-delete`, `maintain`.

Each calls the job function its Dagster job calls (defs/maintenance/jobs.py, defs/platform/replay.py),
and retries a lost race (CommitConflictError) from a fresh snapshot with the same policy (jobs/retry.py).
"""

from __future__ import annotations

import argparse
import sys
import uuid

from partfin_assets.cli.running import existing_catalog, say
from partfin_assets.finalization.hours import hour_key
from partfin_assets.iceberg.catalog import load_existing_table, load_table_if_exists
from partfin_assets.iceberg.expiry import Retention
from partfin_assets.jobs import compaction
from partfin_assets.jobs.conflicts import CommitConflictError
from partfin_assets.jobs.maintenance import expire_table_snapshots, maintained_tables, remove_orphan_files
from partfin_assets.jobs.privacy import privacy_delete
from partfin_assets.jobs.rebucket import rebucket
from partfin_assets.jobs.replay import ReplayRefused, replay_hour_from_history
from partfin_assets.jobs.retry import retry_on_conflict
from partfin_assets.jobs.upsert import run_upsert
from partfin_assets.model.errors import InvalidInput, first_line
from partfin_assets.model.record_keys import key_from_json
from partfin_assets.model.timeutil import iso_z, to_us


def upsert_command(args: argparse.Namespace) -> int:
    catalog = existing_catalog()
    result = retry_on_conflict(lambda: run_upsert(catalog, args.table))  # a lost race re-runs from fresh data
    say(result.describe())
    return 0


def base_command(args: argparse.Namespace) -> int:
    catalog = existing_catalog()
    result = retry_on_conflict(lambda: rebucket(catalog, args.table, args.buckets))  # another rebucket won: re-checked on fresh metadata
    say(result.describe())
    return 0


def _retrying(what: str, run):
    def tell(exc: CommitConflictError, attempt: int) -> None:
        say(f"partfin: {what}: conflict on attempt {attempt}, retrying from a fresh snapshot: {first_line(str(exc))}",
            file=sys.stderr)

    return retry_on_conflict(run, on_conflict=tell)


def replay_command(args: argparse.Namespace) -> int:
    hour = args.hour
    catalog = existing_catalog()
    load_existing_table(catalog, f"cdc.{args.table}")
    job_id = f"cli-{uuid.uuid4().hex}-{hour_key(hour)}"  # every attempt: a re-run after an unknown outcome finds its commit
    try:
        result = _retrying(f"replay of {iso_z(hour)} of cdc.{args.table}", lambda: replay_hour_from_history(
            catalog, args.table, hour, job_id=job_id, force=args.force))
    except ReplayRefused as exc:
        raise ReplayRefused(f"{first_line(str(exc))}; --force replaces it anyway") from None
    say(f"cdc.{args.table}: replayed {result.hour} from {result.history}: {result.records} records ({result.added_records} added, "
        f"{result.removed_records} removed, {result.kept_records} appended meanwhile and kept, {result.late_records} late), "
        f"snapshot {result.snapshot_id}")
    return 0


def compact_command(args: argparse.Namespace) -> int:
    catalog = existing_catalog()
    load_existing_table(catalog, f"cdc.{args.table}")
    for identifier in (f"cdc.{args.table}", f"base.{args.table}"):  # cdc first, as compact_<table>'s steps
        if load_table_if_exists(catalog, identifier) is None:
            say(f"{identifier} does not exist yet: nothing to compact")
            continue
        result = _retrying(f"compaction of {identifier}", lambda identifier=identifier: compaction.compact(
            catalog, identifier, target_file_size_bytes=args.target_file_size, min_input_files=args.min_input_files, finalized_only=True))
        say(result.describe())
    return 0


def privacy_delete_command(args: argparse.Namespace) -> int:
    keys = [key_from_json(text, f"--key #{i}") for i, text in enumerate(args.keys, 1)]
    if not args.request_id.strip():
        raise InvalidInput("--request-id must not be blank")
    catalog = existing_catalog()
    erase_before = to_us(args.erase_before) if args.erase_before else None
    result = _retrying(f"privacy delete {args.request_id} on {args.table}", lambda: privacy_delete(
        catalog, args.table, keys, request_id=args.request_id, erased_before_us=erase_before))
    deleted = ", ".join(f"{n} record(s) from {identifier}" for identifier, n in result.deleted_by_table().items())
    say(f"privacy delete {args.request_id} ({len(keys)} key(s), changes up to {iso_z(result.erased_before_us or 0)}): "
        f"{deleted or 'nothing held them'}; older snapshots still reference the old files "
        f"until `partfin maintain --table {args.table}` expires them and removes the orphans")
    return 0


def maintain_command(args: argparse.Namespace) -> int:
    retention = Retention(keep_last=args.keep_last)
    age_s = args.orphan_min_age.total_seconds()
    catalog = existing_catalog()
    load_existing_table(catalog, f"cdc.{args.table}")
    tables = maintained_tables(catalog, args.table)
    for maintained in tables:  # expiry first: what it frees becomes an orphan
        expired = expire_table_snapshots(catalog, maintained.identifier, maintained.retention(retention))
        kept = len(catalog.load_table(maintained.identifier).metadata.snapshots)
        say(f"{maintained.identifier}: {expired} snapshot(s) expired, {kept} kept")
    for maintained in tables:
        report = remove_orphan_files(catalog, maintained.identifier, older_than_s=age_s, dry_run=args.dry_run)
        say(f"{maintained.identifier}: {len(report.orphans)} orphan file(s) {'found' if args.dry_run else 'deleted'} "
            f"({report.bytes_orphaned:,} bytes), {len(report.too_young)} younger than {age_s:g} s kept")
    return 0


