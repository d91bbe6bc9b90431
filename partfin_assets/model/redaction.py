"""Secrets never shown: one function masks every password partfin could print (errors, logs, identities).

Masked, in any text: the password of a URI's user info (`scheme://user:***@host`), a query
parameter (`?password=***`, `&sslpassword=***`, `?pass%77ord=***`), a libpq key/value pair
(`password=***`, `password = ***`, `password='***'`, `password=a\\ b`) and a quoted mapping entry
(`'password': '***'`). These patterns are a safety net for text of unknown origin; a PostgreSQL
connection string partfin shows is rebuilt from libpq's own reading of it (model/conninfo.py).
Passing the configured connection strings (or `postgres:` source specs) as `known` also masks their
password values, as libpq reads them and in every written form, wherever else they appear (a driver
that echoes a token of its connection string back in its error).

`secrets_redacted(...)` is the boundary for code that may raise with a connection string in the
message: an exception whose text (message, causes, traceback) shows a secret is replaced by a
`RedactedError` carrying the redacted text.
"""

from __future__ import annotations

import re
import traceback
from urllib.parse import unquote
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from partfin_assets.model import conninfo
from partfin_assets.model.conninfo import MASK
from partfin_assets.model.errors import PartfinError, first_line

# Words that make a setting's name a secret's (a password, passphrase, secret, credentials, private key material): the
# one rule for what is masked in text here and what a source spec refuses (sources/kafka.py)
SECRET_NAME_WORDS = r"password|passwd|pwd|passphrase|secret|credentials?|private[-_.]?key"
_KEY = rf"(?:ssl)?(?:{SECRET_NAME_WORDS})|token|(?:secret[-_.]?)?access[-_.]?key"
# scheme://user:PASSWORD@ (greedy up to the last '@' of the token: a password may contain '@')
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^\s:/?#@'\"]*:)\S*@")
# ?NAME=VALUE / &NAME=VALUE: up to the next parameter; NAME may be percent-encoded (libpq decodes it)
_QUERY = re.compile(r"([?&])([^=&\s'\"]+)=([^&\s'\"]*)")
_SECRET_NAME = re.compile(rf"(?:{_KEY})", re.IGNORECASE)
# password=VALUE / password = 'VALUE': a quoted value (libpq escapes \' and \\) or up to whitespace (\ escapes one)
_PAIR = re.compile(rf"((?<![\w.?&-])(?:{_KEY})\s*=\s*)('(?:[^'\\]|\\.)*'?|(?:\\.|\S)+)", re.IGNORECASE)
# 'password': 'VALUE' / "password": "VALUE" (a dict or JSON printed in an error)
_ENTRY = re.compile(rf"""(["'](?:{_KEY})["']\s*:\s*)(["'])(?:(?!\2)[^\\]|\\.)*\2""", re.IGNORECASE)


def redact(text: str, *known: str | None) -> str:
    """`text` with every password masked; `known` connection strings' passwords are masked wherever they appear."""
    for secret in sorted({s for k in known if k for s in password_values(k)}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    text = _USERINFO.sub(rf"\g<1>{MASK}@", text)
    text = _QUERY.sub(_masked_parameter, text)
    text = _PAIR.sub(rf"\g<1>{MASK}", text)
    return _ENTRY.sub(rf"\g<1>\g<2>{MASK}\g<2>", text)


def _masked_parameter(match: re.Match) -> str:
    separator, name, _ = match.groups()
    return f"{separator}{name}={MASK}" if _SECRET_NAME.fullmatch(unquote(name)) else match.group(0)


@lru_cache(maxsize=64)  # the configured strings, read again for every log line
def password_values(config: str) -> tuple[str, ...]:
    """The password values written in a connection string (URI user info, query, key/value pairs), raw and unquoted.

    A libpq connection string, or a `postgres:DSN#...` source spec, adds its secrets as libpq reads them.
    """
    values = [m.group(0)[len(m.group(1)) : -1] for m in _USERINFO.finditer(config)]
    values += [m.group(3) for m in _QUERY.finditer(config) if _SECRET_NAME.fullmatch(unquote(m.group(2)))]
    for dsn in (config, config.partition(":")[2]):
        try:
            values += conninfo.written_forms(conninfo.split_fragment(dsn)[0])
        except conninfo.ConninfoError:
            pass  # not one libpq reads: the patterns above and below mask what they can
    for m in _PAIR.finditer(config):
        value = m.group(2)
        values.append(value.strip("'"))
        if value.startswith("'"):
            values.append(value)
    values += [unquote(v) for v in values]  # a driver may print the decoded form
    return tuple(v for v in values if len(v) >= 3 and v != MASK)  # a one- or two-character value would mask ordinary text


class RedactedError(PartfinError):
    """An error whose original text showed a secret: the same text, passwords masked."""


@contextmanager
def secrets_redacted(*known: str | None) -> Iterator[None]:
    """Re-raise an exception that shows a secret (in its message, causes or traceback) as a RedactedError."""
    try:
        yield
    except Exception as exc:
        full = "".join(traceback.format_exception(exc))
        if redact(full, *known) == full:
            raise
        message = redact(str(exc), *known)
        cause = exc.__cause__ or exc.__context__
        detail = f" (caused by {type(cause).__name__}: {first_line(redact(str(cause), *known))})" if cause else ""
        raise RedactedError(f"{type(exc).__name__}: {message}{detail}") from None
