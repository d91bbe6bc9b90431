"""The `partfin` command: ingest, upsert, base, replay, compact, privacy-delete, maintain, status, streams, late-data, report, policy-lab."""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import signal
import sys
import threading
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from rich.console import Console
from rich.live import Live

from partfin_assets.finalization.hours import hour_from_key, hour_key, parse_hour
from partfin_assets.finalization.late_acks import acknowledge_late_hours
from partfin_assets.finalization.report import finalization_picture, report_dir, write_report
from partfin_assets.finalization.status import all_table_status, stream_status
from partfin_assets.finalization.table_checks import NEEDS_ATTENTION
from partfin_assets.iceberg.catalog import CatalogConfig, NoCatalog, load_existing_table, load_partfin_catalog, load_table_if_exists
from partfin_assets.iceberg.expiry import Retention
from partfin_assets.iceberg.ledger import read_ledger
from partfin_assets.iceberg.streams import check_writer_id, idle_timeout_us, retire_stream, set_idle_timeout
from partfin_assets.ingest.session import IngestSession, check_declaration, resolve_spec
from partfin_assets.ingest.writer import DEFAULT_COMMIT_INTERVAL_S, CheckpointResult
from partfin_assets.jobs import compaction
from partfin_assets.jobs.compaction import DEFAULT_TARGET_FILE_SIZE
from partfin_assets.jobs.conflicts import CommitConflictError
from partfin_assets.jobs.maintenance import MAINTENANCE_ORPHAN_AGE_S, expire_table_snapshots, maintained_tables, remove_orphan_files
from partfin_assets.jobs.policy_lab import LAB_COLUMNS, SCENARIOS, lab_policies, recorded, run_lab, simulate, write_plot
from partfin_assets.jobs.privacy import privacy_delete
from partfin_assets.jobs.rebucket import rebucket
from partfin_assets.jobs.replay import ReplayRefused, replay_hour_from_history
from partfin_assets.jobs.retry import retry_on_conflict
from partfin_assets.jobs.upsert import run_upsert
from partfin_assets.model import summary_keys as K
from partfin_assets.model.display_text import terminal_text
from partfin_assets.model.errors import EXIT_BUG, EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_USAGE, InvalidInput, PartfinError, environment_failure, first_line
from partfin_assets.model.faults import install_faults
from partfin_assets.model.record_keys import key_from_json
from partfin_assets.model.redaction import redact
from partfin_assets.model.settings import DEFAULT_PARTITIONS_START, Settings
from partfin_assets.model.tablespec import DEFAULT_WATERMARK_POLICY, check_table_name
from partfin_assets.model.timeutil import US_PER_SECOND, iso_z, parse_duration, parse_iso, to_us
from partfin_assets.sources.registry import make_source
from partfin_assets.testing.faults import EnvFaults


def main(argv: Sequence[str] | None = None) -> int:
    install_faults(EnvFaults())  # process start: crash and race tests drive the fault points through PARTFIN_* variables
    parser = _Parser(prog="partfin", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", required=True)

    ingest = commands.add_parser("ingest", help="stream a CDC source into cdc.<table>, one checkpoint per batch")
    ingest.add_argument("--table", required=True, help="table name: writes cdc.<table>")
    ingest.add_argument(
        "--source", required=True,
        help="synthetic[:opt=value,...] | debezium:PATH | postgres:DSN[#schema.table] | kafka:BOOTSTRAP#TOPIC[,group=G,...]",
    )
    ingest.add_argument("--primary-key", help="primary-key column(s), comma separated (debezium, kafka)")
    ingest.add_argument("--checkpoint-records", type=_option(_at_least_one), default=10_000, help="records per checkpoint (default 10000)")
    ingest.add_argument("--commit-interval", type=_option(_seconds), default=DEFAULT_COMMIT_INTERVAL_S,
                        help="how long the checkpoints of a partitioned source's partitions (Kafka) may wait to land in one "
                        f"commit, e.g. 5s (default {DEFAULT_COMMIT_INTERVAL_S:g}s; 0: a commit per checkpoint)")
    ingest.add_argument("--subtasks", type=_option(_at_least_one), default=1, help="parallel writer subtasks (default 1)")
    ingest.add_argument("--writer-id", type=_option(check_writer_id),
                        help="writer identity (default <table>-writer): letters, digits, '.', '_', '-'; not partfin.*")
    ingest.add_argument("--max-checkpoints", type=_option(_at_least_one), help="stop after this many checkpoints")
    ingest.add_argument("--follow", action="store_true", help="keep reading when the source is exhausted")
    ingest.add_argument("--watermark-policy", help="the table's watermark policy, e.g. min-of-last:30m (default for new tables: "
                        f"{DEFAULT_WATERMARK_POLICY}); on an existing table: a policy change")

    upsert = commands.add_parser("upsert", help="merge new CDC snapshots into base.<table>")
    upsert.add_argument("--table", required=True)

    base = commands.add_parser("base", help="base.<table>'s layout")
    base_actions = base.add_subparsers(dest="action", required=True)
    rebucket_ = base_actions.add_parser(
        "rebucket", help="grow the bucket count (partition evolution); the next compaction moves old files into the new layout"
    )
    rebucket_.add_argument("--table", required=True)
    rebucket_.add_argument("--buckets", type=int, required=True, help="the new count: a multiple of the current one, greater than it")

    replay = commands.add_parser(
        "replay", help="replay one hour of cdc.<table> from the history its writers read (Dagster: materialize that cdc_<table> partition)")
    replay.add_argument("--table", required=True)
    replay.add_argument("--hour", required=True, type=_option(parse_hour), help="the hour, 2026-01-01-05:00 or 2026-01-01T05:00:00Z")
    replay.add_argument("--force", action="store_true", help="replace the hour even if that removes far more records than it adds")

    compact = commands.add_parser(
        "compact", help="small-file compaction of the finalized hours of cdc.<table>, then of base.<table> (Dagster: compact_<table>)")
    compact.add_argument("--table", required=True)
    compact.add_argument("--target-file-size", type=_option(_at_least_one), default=DEFAULT_TARGET_FILE_SIZE,
                         help=f"bytes per rewritten file (default {DEFAULT_TARGET_FILE_SIZE})")
    compact.add_argument("--min-input-files", type=_option(_at_least_one), default=2, help="rewrite a partition holding at least this many small files (default 2)")

    privacy = commands.add_parser(
        "privacy-delete", help="erase primary keys from every table partfin writes for <table>, for good (Dagster: privacy_delete_<table>)")
    privacy.add_argument("--table", required=True)
    privacy.add_argument("--key", action="append", required=True, dest="keys",
                         help='a primary key as JSON, e.g. \'{"id": 42}\' (repeatable)')
    privacy.add_argument("--erase-before", type=_option(parse_iso),
                         help="erase the keys' changes with an event time up to this ISO 8601 time (default: now, when the request "
                         "is registered); later changes at the source are new data")
    privacy.add_argument("--request-id", required=True,
                         help="the request's id: recorded in snapshot summaries (never the keys); the same id resumes a crashed request")

    maintain = commands.add_parser(
        "maintain", help="snapshot expiry, then orphan-file removal, of every table partfin keeps for <table> (Dagster: maintain_<table>)")
    maintain.add_argument("--table", required=True)
    maintain.add_argument("--keep-last", type=_option(_at_least_one), default=Retention.keep_last,
                          help=f"newest snapshots always kept, besides the watermark policy's window and writer positions (default {Retention.keep_last})")
    maintain.add_argument("--orphan-min-age", type=_option(parse_duration), default=f"{MAINTENANCE_ORPHAN_AGE_S // 3600}h",
                          help="never delete an unreferenced file younger than this: a running job may still commit it (default 24h)")
    maintain.add_argument("--dry-run", action="store_true", help="list orphan files without deleting them")

    status = commands.add_parser("status", help="watermark and progress of every cdc/base table")
    status.add_argument("--json", action="store_true", help="machine-readable output")

    streams = commands.add_parser("streams", help="the progress streams that hold the watermark of cdc.<table>")
    stream_actions = streams.add_subparsers(dest="action", required=True)
    listing = stream_actions.add_parser("list", help="every stream: state (active, idle, retired), progress, last checkpoint")
    listing.add_argument("--table", required=True)
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    retire = stream_actions.add_parser("retire", help="stop counting a stream (a writer that is done for good) in the watermark")
    retire.add_argument("--table", required=True)
    retire.add_argument("--stream", required=True, help="the stream id: a writer id (retires its partition streams too)")
    idle = stream_actions.add_parser("idle-timeout", help="show or set how long a silent stream holds the watermark")
    idle.add_argument("--table", required=True)
    idle.add_argument("timeout", nargs="?", type=_option(parse_duration), help="e.g. 15m (the default), 2h, 90s")

    late_data = commands.add_parser("late-data", help="late records of cdc.<table>: acknowledge those that need no re-run")
    late_actions = late_data.add_subparsers(dest="action", required=True)
    ack = late_actions.add_parser("ack", help="acknowledge the late records hours hold now (the late_data WARN clears for them)")
    ack.add_argument("--table", required=True)
    ack_hours = ack.add_mutually_exclusive_group(required=True)
    ack_hours.add_argument("--hour", action="append", type=_option(parse_hour), dest="hours",
                           help="an hour holding late records, 2026-01-01-05:00 or 2026-01-01T05:00:00Z (repeatable)")
    ack_hours.add_argument("--all", action="store_true", help="every hour holding late records")
    ack.add_argument("--reason", required=True, help="why the late records need no re-run (recorded with who and when)")
    ack.add_argument("--by", type=_option(_someone), default=getpass.getuser(), help="who acknowledges (default: the login name)")

    report = commands.add_parser("report", help="a picture of finalization: an HTML page and a PNG for cdc.<table>")
    report.add_argument("--table", required=True)
    report.add_argument("--out", help="folder to write <table>.html and <table>.png into (default $PARTFIN_HOME/reports)")

    lab = commands.add_parser(
        "policy-lab", help="replay a table's recorded ledger (or a simulated stream) through watermark policies: late share and lag"
    )
    lab_input = lab.add_mutually_exclusive_group(required=True)
    lab_input.add_argument("--table", help="replay cdc.<table>'s late-data ledger")
    lab_input.add_argument("--scenario", choices=SCENARIOS, help="replay a simulated stream (--hours after 8 h of history)")
    lab.add_argument("--hours", type=int, default=16, help="measured hours of a simulated stream (default 16)")
    lab.add_argument("--policies", nargs="+", help=f"policies to compare (default: {' '.join(lab_policies(0.001))}, with --budget's)")
    lab.add_argument("--budget", type=float, default=0.001, help="share of records accepted late after finalization (default 0.001)")
    lab.add_argument("--out", default="policy-lab", help="plot files: <out>.png and <out>.html (default ./policy-lab)")
    lab.add_argument("--seed", type=int, default=13, help="seed of the simulated stream (default 13)")

    args = parser.parse_args(argv)
    secrets = [getattr(args, "source", None)]
    handler = logging.StreamHandler()
    handler.setFormatter(_RedactingFormatter("%(levelname)s %(name)s: %(message)s", secrets))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, handlers=[handler])
    try:
        secrets += Settings.from_env().secrets()
        if getattr(args, "table", None) is not None:
            check_table_name(args.table)  # every command's --table, before any catalog is touched
        with _sigterm_as_interrupt():
            return {"ingest": _ingest, "upsert": _upsert, "base": _base, "replay": _replay, "compact": _compact, "privacy-delete": _privacy_delete,
                    "maintain": _maintain, "status": _status, "streams": _streams, "late-data": _late_data, "report": _report,
                    "policy-lab": _policy_lab}[args.command](args)
    except Terminated:
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as exc:
        return _failed(exc, secrets)


class Terminated(KeyboardInterrupt):
    """SIGTERM (systemd, Kubernetes, `kill`): the command stops as on Ctrl-C, cleaning up on the way out."""


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C instead of killing the process where it stands: an ingest then closes its
    source (a Kafka consumer leaves its group at once, so a restarted one is not kept waiting for the dead
    member's session to expire) and a commit in flight settles as on an interrupt. The previous handler is
    restored on the way out (main() also runs inside other programs, tests among them)."""
    def terminate(signum, frame):
        raise Terminated()

    if threading.current_thread() is not threading.main_thread():  # signals can only be handled on the main thread
        yield
        return
    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _failed(exc: Exception, secrets: Sequence[str | None]) -> int:
    """How a command that raised `exc` ends (exit codes in model/errors.py): one line and EXIT_USAGE for a problem
    the user can fix, one line and EXIT_TRY_AGAIN for one that may pass (a locked catalog, a full disk), else a bug:
    its traceback and EXIT_BUG. Passwords are masked in all of them."""
    environment = environment_failure(exc.__cause__ if isinstance(exc, PartfinError) else exc)
    if isinstance(exc, PartfinError) or environment is not None:
        code, text = environment if environment is not None else (EXIT_USAGE, str(exc))
        _say(f"partfin: error: {redact(text, *secrets)}", file=sys.stderr)
        return code
    for line in redact("".join(traceback.format_exception(exc)), *secrets).rstrip("\n").split("\n"):
        _say(line, file=sys.stderr)
    return EXIT_BUG


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (`partfin: error: ...`, exit 2) like every other refusal."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("partfin").strip()
        self.exit(EXIT_USAGE, terminal_text(f"partfin: error: {command + ': ' if command else ''}{message} (see {self.prog} --help)") + "\n")


def _option(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An option's parser whose refusal argparse shows as it is (not as "invalid <function name> value")."""

    def convert(text: str) -> object:
        try:
            return parse(text)
        except (PartfinError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _seconds(text: str) -> float:
    return parse_duration(text).total_seconds()


def _at_least_one(text: str) -> int:
    try:
        number = int(text)
    except ValueError:
        raise InvalidInput(f"not a whole number: {text!r}") from None
    if number < 1:
        raise InvalidInput(f"must be at least 1, got {number}")
    return number


def _someone(text: str) -> str:
    if not text.strip():
        raise InvalidInput("who acknowledges may not be blank")
    return text.strip()


def _say(line: str, *, file=None) -> None:
    """One line for a person (stdout unless `file`): the outside text in it (reasons, ids, properties, paths) is shown
    escaped and cannot end the line or act on the terminal (model/display_text.py). `--json` output is JSON's own."""
    print(terminal_text(line), file=file or sys.stdout, flush=True)


class _RedactingFormatter(logging.Formatter):
    """Log lines (and the tracebacks they carry) with passwords masked and outside text escaped: a message is one
    line whatever text it quotes (a reason, a column name, a table property); a traceback keeps its lines."""

    def __init__(self, fmt: str, secrets: Sequence[str | None]) -> None:
        super().__init__(fmt)
        self.secrets = secrets

    def formatMessage(self, record: logging.LogRecord) -> str:
        return terminal_text(redact(super().formatMessage(record), *self.secrets))

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(terminal_text(line) for line in redact(super().format(record), *self.secrets).split("\n"))


def _ingest(args: argparse.Namespace) -> int:
    check_declaration(args.source, args.watermark_policy)  # refused before any catalog is touched
    config = CatalogConfig.from_env()
    existing = config.load() if config.exists() else None  # a refused ingest creates no catalog
    spec = resolve_spec(existing, args.table, args.source, primary_key=args.primary_key, watermark_policy=args.watermark_policy,
                        complete=not args.follow)
    source = make_source(args.source, spec, primary_key=args.primary_key, complete=not args.follow, **({"follow": True} if args.follow else {}))
    catalog = existing if existing is not None else config.load(create=True)
    progress = _Progress(spec.cdc_identifier)
    try:
        with IngestSession(catalog, spec, source, writer_id=args.writer_id, subtasks=args.subtasks) as session:
            for result in session.run(max_records=args.checkpoint_records, max_checkpoints=args.max_checkpoints,
                                      commit_interval_s=args.commit_interval):
                progress.update(result)
    finally:
        progress.close()
    return 0


class _Progress:
    """A live line on a terminal; one log line per checkpoint otherwise."""

    def __init__(self, table: str) -> None:
        self.table = table
        self.checkpoints = self.commits = self.records = self.late = self.rejected = self.retries = 0
        self.live = None
        if sys.stderr.isatty():
            self.live = Live(console=Console(stderr=True), refresh_per_second=4, transient=False)
            self.live.start()

    def update(self, result: CheckpointResult) -> None:
        self.checkpoints += 1
        self.records += result.records
        self.rejected += result.rejected
        if result.first_of_commit:
            self.commits += 1
            self.retries += result.attempts - 1
        self.late += int(result.summary.get(K.LATE_RECORDS, 0))
        watermark = result.summary.get(K.WATERMARK, "-")
        line = (
            f"{self.table}: checkpoint {result.checkpoint_id}  records {self.records:,}  late {self.late:,}  rejected {self.rejected:,}  watermark {watermark}"
        )
        if K.STREAM in result.summary:  # checkpoint ids count per partition
            line += f"  partition {result.summary[K.STREAM]}"
        if self.commits < self.checkpoints:  # several partitions' checkpoints landed in one commit
            line += f"  commits {self.commits:,}"
        if self.retries:  # commits that lost a race to other processes' commits and were retried
            line += f"  commit retries {self.retries}"
        if self.live is not None:
            # highlighted as rich highlights any text, but no markup or emoji code read in it: a writer id may be `ops[/]team`
            self.live.update(self.live.console.render_str(terminal_text(line), markup=False, emoji=False))
        else:
            _say(line, file=sys.stderr)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


def _existing_catalog():
    """The catalog of a command that only works on tables already there: it never creates one (NoCatalog)."""
    return load_partfin_catalog(create=False)


def _upsert(args: argparse.Namespace) -> int:
    catalog = _existing_catalog()
    result = retry_on_conflict(lambda: run_upsert(catalog, args.table))  # a lost race re-runs from fresh data
    _say(result.describe())
    return 0


def _base(args: argparse.Namespace) -> int:
    catalog = _existing_catalog()
    result = retry_on_conflict(lambda: rebucket(catalog, args.table, args.buckets))  # another rebucket won: re-checked on fresh metadata
    _say(result.describe())
    return 0


# The table jobs: each calls the job function its Dagster job calls (defs/maintenance/jobs.py, defs/platform/replay.py),
# and retries a lost race (CommitConflictError) from a fresh snapshot with the same policy (jobs/retry.py).


def _retrying(what: str, run):
    def say(exc: CommitConflictError, attempt: int) -> None:
        _say(f"partfin: {what}: conflict on attempt {attempt}, retrying from a fresh snapshot: {first_line(str(exc))}",
             file=sys.stderr)

    return retry_on_conflict(run, on_conflict=say)


def _replay(args: argparse.Namespace) -> int:
    hour = args.hour
    catalog = _existing_catalog()
    load_existing_table(catalog, f"cdc.{args.table}")
    job_id = f"cli-{uuid.uuid4().hex}-{hour_key(hour)}"  # every attempt: a re-run after an unknown outcome finds its commit
    try:
        result = _retrying(f"replay of {iso_z(hour)} of cdc.{args.table}", lambda: replay_hour_from_history(
            catalog, args.table, hour, job_id=job_id, force=args.force))
    except ReplayRefused as exc:
        raise ReplayRefused(f"{first_line(str(exc))}; --force replaces it anyway") from None
    _say(f"cdc.{args.table}: replayed {result.hour} from {result.history}: {result.records} records ({result.added_records} added, "
         f"{result.removed_records} removed, {result.kept_records} appended meanwhile and kept, {result.late_records} late), "
         f"snapshot {result.snapshot_id}")
    return 0


def _compact(args: argparse.Namespace) -> int:
    catalog = _existing_catalog()
    load_existing_table(catalog, f"cdc.{args.table}")
    for identifier in (f"cdc.{args.table}", f"base.{args.table}"):  # cdc first, as compact_<table>'s steps
        if load_table_if_exists(catalog, identifier) is None:
            _say(f"{identifier} does not exist yet: nothing to compact")
            continue
        result = _retrying(f"compaction of {identifier}", lambda identifier=identifier: compaction.compact(
            catalog, identifier, target_file_size_bytes=args.target_file_size, min_input_files=args.min_input_files, finalized_only=True))
        _say(result.describe())
    return 0


def _privacy_delete(args: argparse.Namespace) -> int:
    keys = [key_from_json(text, f"--key #{i}") for i, text in enumerate(args.keys, 1)]
    if not args.request_id.strip():
        raise InvalidInput("--request-id must not be blank")
    catalog = _existing_catalog()
    erase_before = to_us(args.erase_before) if args.erase_before else None
    result = _retrying(f"privacy delete {args.request_id} on {args.table}", lambda: privacy_delete(
        catalog, args.table, keys, request_id=args.request_id, erased_before_us=erase_before))
    deleted = ", ".join(f"{n} record(s) from {identifier}" for identifier, n in result.deleted_by_table().items())
    _say(f"privacy delete {args.request_id} ({len(keys)} key(s), changes up to {iso_z(result.erased_before_us or 0)}): "
         f"{deleted or 'nothing held them'}; older snapshots still reference the old files "
         f"until `partfin maintain --table {args.table}` expires them and removes the orphans")
    return 0


def _maintain(args: argparse.Namespace) -> int:
    retention = Retention(keep_last=args.keep_last)
    age_s = args.orphan_min_age.total_seconds()
    catalog = _existing_catalog()
    load_existing_table(catalog, f"cdc.{args.table}")
    tables = maintained_tables(catalog, args.table)
    for maintained in tables:  # expiry first: what it frees becomes an orphan
        expired = expire_table_snapshots(catalog, maintained.identifier, maintained.retention(retention))
        kept = len(catalog.load_table(maintained.identifier).metadata.snapshots)
        _say(f"{maintained.identifier}: {expired} snapshot(s) expired, {kept} kept")
    for maintained in tables:
        report = remove_orphan_files(catalog, maintained.identifier, older_than_s=age_s, dry_run=args.dry_run)
        _say(f"{maintained.identifier}: {len(report.orphans)} orphan file(s) {'found' if args.dry_run else 'deleted'} "
             f"({report.bytes_orphaned:,} bytes), {len(report.too_young)} younger than {age_s:g} s kept")
    return 0


def _status(args: argparse.Namespace) -> int:
    try:
        # the downstream partitions' start as the code location reads it (a table declaring its own is not seen here)
        statuses = all_table_status(_existing_catalog(), hour_from_key(Settings.from_env().partitions_start or DEFAULT_PARTITIONS_START))
    except NoCatalog:
        statuses = []  # nothing ingested here yet: said below, and nothing is created
    if args.json:
        print(json.dumps({"tables": [s.as_dict() for s in statuses]}, indent=2))
        return 0
    if not statuses:
        _say("no partfin tables yet: run `partfin ingest --table T --source ...` first")
        return 0
    header = (
        f"{'table':<24} {'watermark':<22} {'finalized through':<22} {'policy':<22} {'checkpoint':>10} {'late':>8} "
        f"{'rejected':>9} {'quarantined':>11}"
    )
    _say(header)
    for s in statuses:
        _say(
           f"{s.name:<24} {s.watermark or ('BROKEN' if s.broken else '-'):<22} {s.finalized_through or '-':<22} {s.policy or '-':<22} "
           f"{s.checkpoint_id if s.checkpoint_id is not None else '-':>10} {s.late_records:>8} "
           f"{s.rejected if s.layer == 'cdc' else '-':>9} {s.quarantined if s.layer == 'base' else '-':>11}"
       )
    for s in statuses:
        for ack in s.acknowledged_late_hours or []:
            _say(f"{s.name}: hour {ack['hour']}: {ack['late_records']} late record(s) acknowledged by {ack['by']} at {ack['at']}: "
                 f"{ack['reason']}")
        if s.late_hours_needing_attention:
            hours = ", ".join(f"{hour} ({n})" for hour, n in s.late_hours_needing_attention.items())
            _say(f"{s.name}: {NEEDS_ATTENTION} in hour(s) {hours}: re-run them downstream, or acknowledge "
                 "(`partfin late-data ack`)")
    for s in statuses:
        if s.rebucket:
            _say(f"{s.name}: its {s.buckets} buckets hold {s.bytes_per_bucket:,} bytes each on average, above the target file size: "
                 f"`{s.rebucket}`, then compact")
    for s in statuses:
        for clock in s.clocks or []:
            _say(f"{s.name}: {clock['description']}")
        if s.finalized_tags:
            _say(f"{s.name}: {s.finalized_tags} finalized hour(s) tagged, {s.oldest_finalized_tag} .. {s.newest_finalized_tag} "
                 f"(`-amend-N`: late data); any engine reads one: SELECT * FROM {s.name} FOR VERSION AS OF "
                 f"'{s.newest_finalized_tag}' (see docs/consumers.md)")
    quarantined = [s for s in statuses if s.quarantined]
    for s in quarantined:
        _say(f"{s.name}: {s.quarantined} change(s) could not be decoded: see {s.name}__rejected (column, reason)")
    for s in statuses:
        if s.broken:
            _say(s.broken)
    return 0


def _late_data(args: argparse.Namespace) -> int:
    acks = acknowledge_late_hours(_existing_catalog(), args.table, None if args.all else args.hours, args.reason, args.by)
    for ack in acks:
        _say(f"cdc.{args.table}: hour {ack.as_dict()['hour']}: {ack.late_records} late record(s) acknowledged by {ack.by} "
             f"({ack.reason}); late records arriving later raise the WARN again")
    return 0


def _report(args: argparse.Namespace) -> int:
    config = CatalogConfig.from_env()
    out = Path(args.out) if args.out else report_dir(config.home)
    page, picture = write_report(finalization_picture(config.load(create=False), args.table), out)
    _say(f"cdc.{args.table}: {page} (self-contained HTML) and {picture} (PNG)")
    return 0


def _streams(args: argparse.Namespace) -> int:
    catalog = _existing_catalog()
    identifier = f"cdc.{args.table}"
    load_existing_table(catalog, identifier)  # one line for a table that is not there, whatever the action
    if args.action == "retire":
        stream = retire_stream(catalog, identifier, args.stream)
        _say(f"{identifier}: stream {stream.stream_id!r} retired; the watermark no longer waits for it "
             "(from the next checkpoint of any writer); a writer that starts under this id registers it again")
        return 0
    if args.action == "idle-timeout":
        if args.timeout is not None:
            set_idle_timeout(catalog, identifier, args.timeout)
        timeout = idle_timeout_us(load_existing_table(catalog, identifier).properties) / US_PER_SECOND
        _say(f"{identifier}: a stream that commits nothing for {timeout:g}s stops holding the watermark")
        return 0
    rows = stream_status(load_existing_table(catalog, identifier))
    if args.json:
        print(json.dumps({"table": identifier, "streams": rows}, indent=2))
        return 0
    _say(f"{'stream':<28} {'state':<8} {'progress':<22} {'last checkpoint at':<28} {'checkpoint':>10}")
    for row in rows:
        _say(f"{row['stream']:<28} {row['state']:<8} {row['progress'] or '-':<22} {row['seen']:<28} "
             f"{row['checkpoint'] if row['checkpoint'] is not None else '-':>10}")
    return 0


def _policy_lab(args: argparse.Namespace) -> int:
    if not 0 < args.budget < 1:
        raise InvalidInput(f"--budget must be in (0, 1), got {args.budget:g}")
    if args.scenario is not None:
        data = simulate(args.scenario, seed=args.seed, hours=args.hours)
    else:
        catalog = _existing_catalog()
        load_existing_table(catalog, f"cdc.{args.table}")  # a clear error for a table that is not there
        data = recorded(read_ledger(catalog, f"cdc.{args.table}", columns=LAB_COLUMNS), args.table)
    policies = args.policies or lab_policies(args.budget)
    report, lab = run_lab(data, policies, args.budget)
    for line in [*report.table().splitlines(), ""]:
        _say(line)
    png, page = write_plot(report, lab, Path(args.out))
    recommended = next(row.outcome for row in report.rows if row.outcome.name == report.recommended)
    why = (f"the smallest median lag within {args.budget:.2%} late" if recommended.late_share <= args.budget
           else f"none kept within {args.budget:.2%} late: the fewest late records")
    _say(f"recommended: {report.recommended} ({why})")
    _say(f"plot: {png} and {page}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
