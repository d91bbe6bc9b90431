"""The `partfin` command: ingest, upsert, base, replay, compact, privacy-delete, maintain, status, streams, late-data, report, policy-lab.

This module is the argument parser only, light enough that `--help` and a refused argument answer at
once: it imports nothing that loads PyIceberg, PyArrow, pandas or SQLAlchemy. An accepted command
loads its own module, named in COMMANDS, and runs through cli/running.py.
"""

from __future__ import annotations

import argparse
import getpass
import pkgutil
import re
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import NoReturn

from partfin_assets.finalization.hours import parse_hour
from partfin_assets.model.defaults import (
    DEFAULT_COMMIT_INTERVAL_S,
    DEFAULT_TARGET_FILE_SIZE,
    KEEP_LAST_SNAPSHOTS,
    MAINTENANCE_ORPHAN_AGE_S,
    POLICY_LAB_POLICIES,
    POLICY_LAB_SCENARIOS,
)
from partfin_assets.model.display_text import terminal_text
from partfin_assets.model.errors import EXIT_USAGE, InvalidInput, PartfinError
from partfin_assets.model.faults import install_faults
from partfin_assets.model.stream_names import check_writer_id
from partfin_assets.model.table_options import WATERMARK_POLICY
from partfin_assets.model.timeutil import parse_duration, parse_iso
from partfin_assets.testing.faults import EnvFaults

# command -> "module:function" running it, loaded only once its arguments are accepted. The one place partfin
# imports by name: test_layers.py reads these names as the imports they are (layers, cycles).
COMMANDS = {
    "ingest": "partfin_assets.cli.ingest:ingest_command",
    "upsert": "partfin_assets.cli.tables:upsert_command",
    "base": "partfin_assets.cli.tables:base_command",
    "replay": "partfin_assets.cli.tables:replay_command",
    "compact": "partfin_assets.cli.tables:compact_command",
    "privacy-delete": "partfin_assets.cli.tables:privacy_delete_command",
    "maintain": "partfin_assets.cli.tables:maintain_command",
    "status": "partfin_assets.cli.status:status_command",
    "streams": "partfin_assets.cli.status:streams_command",
    "late-data": "partfin_assets.cli.status:late_data_command",
    "report": "partfin_assets.cli.report:report_command",
    "policy-lab": "partfin_assets.cli.report:policy_lab_command",
}
RUN = "partfin_assets.cli.running:run"


def main(argv: Sequence[str] | None = None) -> int:
    install_faults(EnvFaults())  # process start: crash and race tests drive the fault points through PARTFIN_* variables
    args = parser().parse_args(argv)
    return pkgutil.resolve_name(RUN)(args, pkgutil.resolve_name(COMMANDS[args.command]))


def parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="partfin", description=__doc__.splitlines()[0])
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
                        f"{WATERMARK_POLICY.default}); on an existing table: a policy change")

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
    maintain.add_argument("--keep-last", type=_option(_at_least_one), default=KEEP_LAST_SNAPSHOTS,
                          help=f"newest snapshots always kept, besides the watermark policy's window and writer positions (default {KEEP_LAST_SNAPSHOTS})")
    maintain.add_argument("--orphan-min-age", type=_option(_duration), default=f"{MAINTENANCE_ORPHAN_AGE_S // 3600}h",
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
    idle.add_argument("timeout", nargs="?", type=_option(_duration), help="e.g. 15m (the default), 2h, 90s")

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
    lab_input.add_argument("--scenario", choices=POLICY_LAB_SCENARIOS, help="replay a simulated stream (--hours after 8 h of history)")
    lab.add_argument("--hours", type=int, default=16, help="measured hours of a simulated stream (default 16)")
    lab.add_argument("--policies", nargs="+", help=f"policies to compare (default: {' '.join(POLICY_LAB_POLICIES)} late-budget:B, B being --budget)")
    lab.add_argument("--budget", type=float, default=0.001, help="share of records accepted late after finalization (default 0.001)")
    lab.add_argument("--out", default="policy-lab", help="plot files: <out>.png and <out>.html (default ./policy-lab)")
    lab.add_argument("--seed", type=int, default=13, help="seed of the simulated stream (default 13)")

    return parser


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (`partfin: error: ...`, exit 2) like every other refusal."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # `-5m` is a (negative) value, not an unknown option: argparse only takes `-5` and `-0.5` for numbers, and
        # answered `idle-timeout -5m` with "unrecognized arguments". No partfin option starts with a digit.
        self._negative_number_matcher = re.compile(r"^-\d")

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


def _duration(text: str) -> timedelta:
    if text.strip().startswith("-"):
        raise InvalidInput(f"a negative duration is refused: {text!r} (a duration is e.g. 90s, 15m, 2h)")
    return parse_duration(text)


def _seconds(text: str) -> float:
    return _duration(text).total_seconds()


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
