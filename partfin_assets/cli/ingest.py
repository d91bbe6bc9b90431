"""`partfin ingest`: a CDC source into cdc.<table>, one checkpoint per batch, with a live progress line."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.live import Live

from partfin_assets.iceberg.catalog import CatalogConfig
from partfin_assets.ingest.session import IngestSession, check_declaration, resolve_spec
from partfin_assets.cli.running import say
from partfin_assets.ingest.writer import CheckpointResult
from partfin_assets.model import summary_keys as K
from partfin_assets.model.display_text import terminal_text
from partfin_assets.sources.registry import make_source


def ingest_command(args: argparse.Namespace) -> int:
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
            say(line, file=sys.stderr)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


