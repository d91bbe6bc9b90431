"""Secrets never shown: one function masks every password partfin could print (errors, logs, identities).

Masked, in any text: the password of a URI's user info (`scheme://user:***@host`), a query
parameter (`?password=***`, `&sslpassword=***`), a libpq key/value pair (`password=***`,
`password = ***`, `password='***'`) and a quoted mapping entry (`'password': '***'`). Passing the
configured connection strings as `known` also masks their password values wherever else they appear
(a driver that echoes a token of its connection string back in its error).

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

from partfin_assets.model.errors import PartfinError, first_line

MASK = "***"

_KEY = r"(?:ssl)?password|passwd|pwd|secret|token|(?:secret[-_.]?)?access[-_.]?key"
# scheme://user:PASSWORD@ (greedy up to the last '@' of the token: a password may contain '@')
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^\s:/?#@'\"]*:)\S*@")
# ?password=VALUE / &password=VALUE: up to the next parameter
_QUERY = re.compile(rf"([?&](?:{_KEY})=)[^&\s'\"]*", re.IGNORECASE)
# password=VALUE / password = 'VALUE': a quoted value (libpq escapes \' and \\) or up to whitespace
_PAIR = re.compile(rf"((?<![\w.?&-])(?:{_KEY})\s*=\s*)('(?:[^'\\]|\\.)*'?|\S+)", re.IGNORECASE)
# 'password': 'VALUE' / "password": "VALUE" (a dict or JSON printed in an error)
_ENTRY = re.compile(rf"""(["'](?:{_KEY})["']\s*:\s*)(["'])(?:(?!\2)[^\\]|\\.)*\2""", re.IGNORECASE)


def redact(text: str, *known: str | None) -> str:
    """`text` with every password masked; `known` connection strings' passwords are masked wherever they appear."""
    for secret in sorted({s for k in known if k for s in password_values(k)}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    text = _USERINFO.sub(rf"\g<1>{MASK}@", text)
    text = _QUERY.sub(rf"\g<1>{MASK}", text)
    text = _PAIR.sub(rf"\g<1>{MASK}", text)
    return _ENTRY.sub(rf"\g<1>\g<2>{MASK}\g<2>", text)


def password_values(config: str) -> list[str]:
    """The password values written in a connection string (URI user info, query, key/value pairs), raw and unquoted."""
    values = [m.group(0)[len(m.group(1)) : -1] for m in _USERINFO.finditer(config)]
    values += [m.group(0)[len(m.group(1)) :] for m in _QUERY.finditer(config)]
    for m in _PAIR.finditer(config):
        value = m.group(2)
        values.append(value.strip("'"))
        if value.startswith("'"):
            values.append(value)
    values += [unquote(v) for v in values]  # a driver may print the decoded form
    return [v for v in values if len(v) >= 3 and v != MASK]  # a one- or two-character value would mask ordinary text


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
