"""partfin's errors: one base class, so callers (the CLI) can tell a user-facing problem from a bug.

Every partfin exception derives from `PartfinError`. Its message is one line that names what is
wrong and how to fix it; the CLI prints it and exits 2 (EXIT_USAGE). A failure that may pass by
itself (a locked catalog database, a full disk, a read-only file system: `temporary_failure`) is
one line too, exit 75 (EXIT_TRY_AGAIN, sysexits' EX_TEMPFAIL): run the command again, it goes on
where it stopped. Anything else is a bug and keeps its traceback (exit 1).
"""

from __future__ import annotations

import errno

EXIT_OK = 0
EXIT_BUG = 1  # an unexpected error: its traceback is printed
EXIT_USAGE = 2  # the user must fix something: an option, the configuration, the data, a broken table
EXIT_TRY_AGAIN = 75  # sysexits' EX_TEMPFAIL: a temporary failure, running the command again may succeed
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it
EXIT_TERMINATED = 143  # SIGTERM (128 + SIGTERM): stopped as on Ctrl-C


class PartfinError(Exception):
    """A problem partfin reports to the user in one line (bad input, configuration, a lost race)."""


class PartfinConfigError(PartfinError, RuntimeError):
    """A configuration problem the user must fix; the message names what and how."""


class InvalidInput(PartfinError, ValueError):
    """A value the user gave that partfin cannot use: a table declaration, an option, a time, a duration, a key."""


class SourceError(PartfinError, ValueError):
    """A CDC source that cannot be read as configured (a missing file, a declaration its data contradicts)."""


class BrokenTable(PartfinError):
    """A table the catalog lists but that cannot be loaded: its current metadata file is missing."""


class SnapshotUnavailable(PartfinError, LookupError):
    """A table cannot be read as of the snapshot asked for: it expired, or a privacy delete ran after it."""


def first_line(text: str) -> str:
    """The first line of a message ('' if it has none): how a foreign error is quoted in a one-line message."""
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


def one_line(exc: BaseException) -> str:
    """`Type: first line` of an exception another library raised."""
    return f"{type(exc).__name__}: {first_line(str(exc))}"


# (errno, what an error's text says when it has no errno, what happened, what to do, exit code): first match wins
_ENVIRONMENT_FAILURES = (
    (None, "database is locked", "the catalog database is locked by another process", "run the command again", EXIT_TRY_AGAIN),
    (errno.ENOSPC, "no space left on device", "the disk is full", "free space, then run the command again", EXIT_TRY_AGAIN),
    (None, "database or disk is full", "the disk is full", "free space, then run the command again", EXIT_TRY_AGAIN),
    (errno.EROFS, "read-only file system", "the file system is read-only", "make it writable, then run the command again",
     EXIT_TRY_AGAIN),
    (None, "attempt to write a readonly database", "the catalog database is read-only",
     "make it writable, then run the command again", EXIT_TRY_AGAIN),
    (errno.EACCES, None, "partfin may not write there", "give it write access, then run the command again",
     EXIT_USAGE),
)


def environment_failure(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, one line) for a failure of the machine rather than of partfin: a locked catalog database,
    a full disk, a read-only file system (EXIT_TRY_AGAIN), no permission (EXIT_USAGE); None otherwise.

    Looks through the exception's causes: libraries wrap the OSError or database error that says it.
    Partfin's commits are all or nothing, so running the command again goes on where it stopped.
    """
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        text = str(cause).lower()
        code = getattr(cause, "errno", None)
        for number, marker, what, todo, exit_code in _ENVIRONMENT_FAILURES:
            if (number is not None and code == number) or (marker is not None and marker in text):
                return exit_code, f"{what} ({one_line(cause)}); {todo}: it goes on where it stopped, nothing is lost or doubled"
        cause = cause.__cause__ or cause.__context__
    return None
