"""The text after `postgres:` in a source spec: `DSN[#[schema.]table][,option=value,...]`."""

from __future__ import annotations

from partfin_assets.model import conninfo


def parse_postgres_spec(argument: str, default_table: str) -> tuple[str, str, dict[str, str]]:
    """`DSN[#[schema.]table][,slot=NAME,...]` -> (dsn, table, options).

    The DSN ends at the first `#` libpq does not read as part of a password (model/conninfo.py):
    a `#` inside a password (quoted or not, in key/value pairs, URI user info or `?password=`)
    belongs to the password. A DSN libpq cannot read, or reads other than written (an '@' inside
    URI user info), is a ConninfoError that shows nothing of it.
    """
    dsn, fragment = conninfo.split_fragment(argument)
    conninfo.read(dsn)
    table, options = f"public.{default_table}", {}
    for item in filter(None, (part.strip() for part in fragment.split(","))):
        name, equals, value = item.partition("=")
        if equals:
            options[name.strip().replace("-", "_")] = value.strip()
        else:
            table = item if "." in item else f"public.{item}"
    return dsn.strip(), table, options
