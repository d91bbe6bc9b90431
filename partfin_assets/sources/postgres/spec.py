"""The text after `postgres:` in a source spec: `DSN[#[schema.]table][,option=value,...]`."""

from __future__ import annotations

import re


def parse_postgres_spec(argument: str, default_table: str) -> tuple[str, str, dict[str, str]]:
    """`DSN[#[schema.]table][,slot=NAME,...]` -> (dsn, table, options).

    A `#` inside a password (quoted or not, in key/value pairs, URI user info or `?password=`)
    belongs to the password; the first `#` outside one starts the table and options.
    """
    dsn, fragment = _split_fragment(argument)
    table, options = f"public.{default_table}", {}
    for item in filter(None, (part.strip() for part in fragment.split(","))):
        name, equals, value = item.partition("=")
        if equals:
            options[name.strip().replace("-", "_")] = value.strip()
        else:
            table = item if "." in item else f"public.{item}"
    return dsn.strip(), table, options


_URI_DSN = re.compile(r"postgres(?:ql)?://", re.IGNORECASE)
# libpq key/value pair: key = 'quoted value' (\' and \\ escaped) or a value up to whitespace
_DSN_PAIR = re.compile(r"\s*(\w+)\s*=\s*('(?:[^'\\]|\\.)*'|\S*)")


def _split_fragment(argument: str) -> tuple[str, str]:
    if _URI_DSN.match(argument):
        start = max(argument.rfind("@") + 1, _URI_DSN.match(argument).end())  # the user info ends at its last '@'
        passwords = [m.span(1) for m in re.finditer(r"[?&]password=([^&\s]*)", argument, re.IGNORECASE)]
        for i in range(start, len(argument)):
            if argument[i] == "#" and not any(a <= i < b for a, b in passwords):
                return argument[:i], argument[i + 1 :]
        return argument, ""
    position = 0
    while match := _DSN_PAIR.match(argument, position):
        if not match.group(0).strip():
            break
        key, value = match.group(1), match.group(2)
        if key.lower() != "password" and not value.startswith("'") and "#" in value:
            cut = match.start(2) + value.index("#")
            return argument[:cut], argument[cut + 1 :]
        position = match.end()
    cut = argument.find("#", position)
    return (argument[:cut], argument[cut + 1 :]) if cut >= 0 else (argument, "")
