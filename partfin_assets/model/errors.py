"""partfin's errors: one base class, so callers (the CLI) can tell a user-facing problem from a bug.

Every partfin exception derives from `PartfinError`. Its message is one line that names what is
wrong and how to fix it; the CLI prints it and exits 2. Anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations


class PartfinError(Exception):
    """A problem partfin reports to the user in one line (bad input, configuration, a lost race)."""


class PartfinConfigError(PartfinError, RuntimeError):
    """A configuration problem the user must fix; the message names what and how."""


class InvalidInput(PartfinError, ValueError):
    """A value the user gave that partfin cannot use: a table declaration, an option, a time, a duration, a key."""


class SourceError(PartfinError, ValueError):
    """A CDC source that cannot be read as configured (a missing file, a declaration its data contradicts)."""


class SnapshotUnavailable(PartfinError, LookupError):
    """A table cannot be read as of the snapshot asked for: it expired, or a privacy delete ran after it."""


def first_line(text: str) -> str:
    """The first line of a message ('' if it has none): how a foreign error is quoted in a one-line message."""
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


def one_line(exc: BaseException) -> str:
    """`Type: first line` of an exception another library raised."""
    return f"{type(exc).__name__}: {first_line(str(exc))}"
