"""Sessions on the source database, and the one error class of the PostgreSQL source.

Every session runs in UTC with ISO dates, so the text wal2json and the catalog queries return
is read one way. A connection that fails is one line showing the DSN as libpq read it, secrets
masked (model/conninfo.py; libpq may echo a token of the DSN in its message: masked by value too),
and, when the DSN carries a password itself, where passwords belong instead.
"""

from __future__ import annotations

import psycopg

from partfin_assets.model import conninfo
from partfin_assets.model.errors import SourceError, first_line
from partfin_assets.model.redaction import redact


class PostgresSourceError(SourceError):
    """A PostgreSQL configuration that logical decoding of the table cannot work with."""


def quote_error(exc: BaseException) -> str:
    """A driver error as quoted in a PostgresSourceError: its first line (its type name if it has none)."""
    return first_line(str(exc)) or type(exc).__name__


def connect(dsn: str, autocommit: bool) -> psycopg.Connection:
    try:
        conn = psycopg.connect(dsn, autocommit=autocommit)
    except psycopg.Error as exc:
        raise PostgresSourceError(
            f"cannot connect to PostgreSQL ({conninfo.display(dsn)}): {redact(quote_error(exc), dsn)}{conninfo.inline_secret_hint(dsn)}"
        ) from None
    conn.execute("SET TimeZone = 'UTC'")
    conn.execute("SET DateStyle = 'ISO, YMD'")
    conn.execute("SET IntervalStyle = 'iso_8601'")
    conn.execute("SET extra_float_digits = 1")
    if not autocommit:
        conn.commit()
    return conn
