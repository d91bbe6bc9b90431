"""libpq connection strings, read by libpq itself: their secrets, how they are shown, where a spec's `#` fragment starts.

A PostgreSQL connection string is key/value pairs (`host=db password='a b\\'c'`, backslash escapes,
quotes) or a URI (`postgresql://user:pa%40ss@db/shop?sslpassword=...`, percent-encoded names and
values). Patterns get these wrong (a `#` or `@` inside a password, `pass%77ord=`, `Ab\\ Cd`), so every
reading here is libpq's own (`PQconninfoParse` through psycopg's `conninfo_to_dict`), and the options
it counts as secrets are libpq's own list (those it displays as `*`: password, sslpassword,
oauth_client_secret). A connection string is only ever shown as libpq read it, secrets masked
(`display`); it never reaches an error, a log line, a checkpoint summary or the UI otherwise.
"""

from __future__ import annotations

import re
from functools import cache
from urllib.parse import quote

from psycopg import pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.errors import ProgrammingError

from partfin_assets.model.errors import SourceError, first_line

MASK = "***"
WHERE_PASSWORDS_BELONG = "put the password in PGPASSWORD, a service file (PGSERVICE) or ~/.pgpass, not in the connection string"
_URI = re.compile(r"postgres(?:ql)?://", re.IGNORECASE)
_CUT = "PARTFINFRAGMENTCUT"  # stands in for a `#` while libpq tells whose value it would be part of


class ConninfoError(SourceError):
    """A connection string libpq cannot read, or reads other than it was meant (its text never shown)."""


@cache
def secret_options() -> frozenset[str]:
    """The options libpq hides when it displays a connection's settings (`dispchar` '*')."""
    return frozenset(option.keyword.decode() for option in pq.Conninfo.get_defaults() if option.dispchar == b"*")


def read(dsn: str) -> dict[str, str]:
    """libpq's reading of `dsn`: option -> value (decoded, unquoted). ConninfoError, showing nothing of it, if it cannot."""
    try:
        options = conninfo_to_dict(dsn)
    except ProgrammingError as exc:
        # libpq quotes the token it stopped at, which may be a piece of a password
        why = re.sub(r'"([^"]*)"', lambda m: m.group(0) if m.group(1) == "=" else '"..."', first_line(str(exc)))
        raise ConninfoError(f"libpq cannot read the PostgreSQL connection string ({why}); {_quoting_hint(dsn)}") from None
    _check_user_info(dsn, options)
    return {name: str(value) for name, value in options.items()}


def _check_user_info(dsn: str, options: dict) -> None:
    """libpq ends a URI's user info at its first '@' (or '/'): the rest of a password would be read as the host."""
    if _URI.match(dsn.strip()) and any("@" in str(options.get(name, "")) for name in ("host", "port", "dbname")):
        raise ConninfoError(
            "the PostgreSQL URI's user info holds an '@' or '/' that libpq reads as its end (the rest would be taken as "
            f"the host name): percent-encode them (%40, %2F; '#' as %23, '%' as %25), or better {WHERE_PASSWORDS_BELONG}"
        )


def _quoting_hint(dsn: str) -> str:
    if _URI.match(dsn.strip()):
        return "in a URI, percent-encode special characters (%40 for '@', %23 for '#', %25 for '%')"
    return r"quote a value holding spaces, quotes or backslashes in single quotes, \' and \\ escaped"


def secrets(dsn: str) -> dict[str, str]:
    """The secret options written in `dsn` (libpq's reading): option -> value."""
    return {name: value for name, value in read(dsn).items() if name in secret_options() and value}


def display(dsn: str) -> str:
    """`dsn` as shown anywhere: libpq's reading of it as key/value pairs, every secret option `***`."""
    return make_conninfo("", **{name: MASK if name in secret_options() else value for name, value in read(dsn).items()})


def inline_secret_hint(dsn: str) -> str:
    """`; <where passwords belong>` when `dsn` carries a secret itself (for a one-line error), else ''."""
    try:
        return f"; {WHERE_PASSWORDS_BELONG}" if secrets(dsn) else ""
    except ConninfoError:
        return ""


def written_forms(dsn: str) -> list[str]:
    """Every secret of `dsn` in each form it may be written in or printed as: decoded, escaped, quoted, percent-encoded."""
    try:
        values = list(secrets(dsn).values())
    except ConninfoError:
        return []
    forms = []
    for value in values:
        escaped = re.sub(r"([\\' ])", r"\\\1", value)
        quoted = value.replace("\\", "\\\\").replace("'", "\\'")
        forms += [value, escaped, quoted, f"'{quoted}'", quote(value, safe=""), quote(value), repr(value)[1:-1]]
    return sorted({form for form in forms if form}, key=len, reverse=True)


def _in_secret(marked: str) -> bool:
    try:
        return any(_CUT in value for name, value in conninfo_to_dict(marked).items() if name in secret_options())
    except ProgrammingError:
        return False  # e.g. ` #table` after the last pair: libpq reads it as no value at all


def split_fragment(argument: str) -> tuple[str, str]:
    """`DSN#fragment` -> (DSN, fragment): the first `#` that is not part of a secret's value as libpq reads it.

    A `#` is part of a secret when libpq, reading the whole text, puts it into a secret's value (a
    `password=ab#cd` pair, a quoted value, URI user info, `?sslpassword=`). A URI's query value runs to
    the next `&`, so a `#` in a query password keeps everything after it (write it %23 there). A URI
    whose user info holds an '@' libpq would end it at is refused (ConninfoError) before anything is cut.
    """
    try:
        whole = conninfo_to_dict(argument)
    except ProgrammingError:
        pass  # e.g. `dbname=shop #table`: only the part before the fragment is a connection string
    else:
        _check_user_info(argument, whole)
    hashes = [i for i, char in enumerate(argument) if char == "#"]
    for cut, following in zip(hashes, [*hashes[1:], len(argument)]):
        # the text with this `#` replaced, whole and up to the next `#` (the whole may not parse past a fragment)
        marked = [f"{argument[:cut]}{_CUT}{argument[cut + 1:]}", f"{argument[:cut]}{_CUT}{argument[cut + 1:following]}"]
        if any(_in_secret(text) for text in marked):
            continue
        try:
            conninfo_to_dict(argument[:cut])
        except ProgrammingError:
            continue  # inside a quoted value, or not a connection string up to here
        return argument[:cut], argument[cut + 1 :]
    return argument, ""
