"""How a parsed `partfin` command runs: its log lines and errors with secrets masked, SIGTERM as Ctrl-C, its exit code.

The parser (cli/__init__.py) hands over here once the arguments are accepted; only then are the
layers below loaded (PyIceberg, PyArrow, SQLAlchemy), by the command's own module.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.model.display_text import terminal_text
from partfin_assets.model.errors import EXIT_BUG, EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_USAGE, PartfinError, environment_failure
from partfin_assets.model.redaction import redact
from partfin_assets.model.settings import Settings
from partfin_assets.model.tablespec import check_table_name


def run(args: argparse.Namespace, command: Callable[[argparse.Namespace], int]) -> int:
    """Run one command on its parsed arguments; its exit code (model/errors.py)."""
    secrets = [getattr(args, "source", None)]
    handler = logging.StreamHandler()
    handler.setFormatter(_RedactingFormatter("%(levelname)s %(name)s: %(message)s", secrets))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, handlers=[handler])
    try:
        secrets += Settings.from_env().secrets()
        if getattr(args, "table", None) is not None:
            check_table_name(args.table)  # every command's --table, before any catalog is touched
        with _sigterm_as_interrupt():
            return command(args)
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
        say(f"partfin: error: {redact(text, *secrets)}", file=sys.stderr)
        return code
    for line in redact("".join(traceback.format_exception(exc)), *secrets).rstrip("\n").split("\n"):
        say(line, file=sys.stderr)
    return EXIT_BUG


def say(line: str, *, file=None) -> None:
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


def existing_catalog():
    """The catalog of a command that only works on tables already there: it never creates one (NoCatalog)."""
    return load_partfin_catalog(create=False)
