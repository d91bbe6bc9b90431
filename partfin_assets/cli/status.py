"""What is there: `partfin status` (every table), `streams` (the progress streams of one), `late-data ack`."""

from __future__ import annotations

import argparse
import json

from partfin_assets.cli.running import existing_catalog, say
from partfin_assets.finalization.hours import hour_from_key
from partfin_assets.finalization.late_acks import acknowledge_late_hours
from partfin_assets.finalization.status import all_table_status, stream_status
from partfin_assets.finalization.table_checks import NEEDS_ATTENTION
from partfin_assets.iceberg.catalog import CatalogConfig, NoCatalog, load_existing_table
from partfin_assets.iceberg.streams import idle_timeout_us, retire_stream, set_idle_timeout
from partfin_assets.model.settings import DEFAULT_PARTITIONS_START, Settings
from partfin_assets.model.timeutil import US_PER_SECOND


def where(config: CatalogConfig, settings: Settings) -> str:
    """Which home and catalog a command read: the first thing to check when the tables are not the ones expected."""
    home = f"{config.home} ({'PARTFIN_HOME' if settings.home else 'PARTFIN_HOME unset: ./.partfin'})"
    return f"partfin home {home}, {config.describe()}"


def status_command(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    config = CatalogConfig.from_env()
    try:
        # the downstream partitions' start as the code location reads it (a table declaring its own is not seen here)
        statuses = all_table_status(existing_catalog(), hour_from_key(settings.partitions_start or DEFAULT_PARTITIONS_START))
    except NoCatalog:
        statuses = []  # nothing ingested here yet: said below, and nothing is created
    if args.json:
        print(json.dumps({"home": str(config.home), "catalog": config.describe(), "tables": [s.as_dict() for s in statuses]}, indent=2))
        return 0
    if not statuses:
        say(f"no partfin tables yet in {where(config, settings)}: run `partfin ingest --table T --source ...` first, "
            "or set PARTFIN_HOME to the home they are in")
        return 0
    say(where(config, settings))
    header = (
        f"{'table':<24} {'watermark':<22} {'finalized through':<22} {'policy':<22} {'checkpoint':>10} {'late':>8} "
        f"{'rejected':>9} {'quarantined':>11}"
    )
    say(header)
    for s in statuses:
        say(
            f"{s.name:<24} {s.watermark or ('BROKEN' if s.broken else '-'):<22} {s.finalized_through or '-':<22} {s.policy or '-':<22} "
            f"{s.checkpoint_id if s.checkpoint_id is not None else '-':>10} {s.late_records:>8} "
            f"{s.rejected if s.layer == 'cdc' else '-':>9} {s.quarantined if s.layer == 'base' else '-':>11}"
        )
    for s in statuses:
        for ack in s.acknowledged_late_hours or []:
            say(f"{s.name}: hour {ack['hour']}: {ack['late_records']} late record(s) acknowledged by {ack['by']} at {ack['at']}: "
                f"{ack['reason']}")
        if s.late_hours_needing_attention:
            hours = ", ".join(f"{hour} ({n})" for hour, n in s.late_hours_needing_attention.items())
            say(f"{s.name}: {NEEDS_ATTENTION} in hour(s) {hours}: re-run them downstream, or acknowledge "
                "(`partfin late-data ack`)")
    for s in statuses:
        if s.rebucket:
            say(f"{s.name}: its {s.buckets} buckets hold {s.bytes_per_bucket:,} bytes each on average, above the target file size: "
                f"`{s.rebucket}`, then compact")
    for s in statuses:
        for clock in s.clocks or []:
            say(f"{s.name}: {clock['description']}")
        if s.finalized_tags:
            say(f"{s.name}: {s.finalized_tags} finalized hour(s) tagged, {s.oldest_finalized_tag} .. {s.newest_finalized_tag} "
                f"(`-amend-N`: late data); any engine reads one: SELECT * FROM {s.name} FOR VERSION AS OF "
                f"'{s.newest_finalized_tag}' (see docs/consumers.md)")
    quarantined = [s for s in statuses if s.quarantined]
    for s in quarantined:
        say(f"{s.name}: {s.quarantined} change(s) could not be decoded: see {s.name}__rejected (column, reason)")
    for s in statuses:
        if s.broken:
            say(s.broken)
    return 0


def streams_command(args: argparse.Namespace) -> int:
    catalog = existing_catalog()
    identifier = f"cdc.{args.table}"
    load_existing_table(catalog, identifier)  # one line for a table that is not there, whatever the action
    if args.action == "retire":
        stream = retire_stream(catalog, identifier, args.stream)
        say(f"{identifier}: stream {stream.stream_id!r} retired; the watermark no longer waits for it "
            "(from the next checkpoint of any writer); a writer that starts under this id registers it again")
        return 0
    if args.action == "idle-timeout":
        if args.timeout is not None:
            set_idle_timeout(catalog, identifier, args.timeout)
        timeout = idle_timeout_us(load_existing_table(catalog, identifier).properties) / US_PER_SECOND
        say(f"{identifier}: a stream that commits nothing for {timeout:g}s stops holding the watermark")
        return 0
    rows = stream_status(load_existing_table(catalog, identifier))
    if args.json:
        print(json.dumps({"table": identifier, "streams": rows}, indent=2))
        return 0
    say(f"{'stream':<28} {'state':<8} {'progress':<22} {'last checkpoint at':<28} {'checkpoint':>10}")
    for row in rows:
        say(f"{row['stream']:<28} {row['state']:<8} {row['progress'] or '-':<22} {row['seen']:<28} "
            f"{row['checkpoint'] if row['checkpoint'] is not None else '-':>10}")
    return 0


def late_data_command(args: argparse.Namespace) -> int:
    acks = acknowledge_late_hours(existing_catalog(), args.table, None if args.all else args.hours, args.reason, args.by)
    for ack in acks:
        say(f"cdc.{args.table}: hour {ack.as_dict()['hour']}: {ack.late_records} late record(s) acknowledged by {ack.by} "
            f"({ack.reason}); late records arriving later raise the WARN again")
    return 0


