"""Iceberg snapshot ids, sequence numbers and checkpoint ids as people see them: as text.

A snapshot id is a random 63-bit integer. The Dagster UI (like any browser) reads JSON numbers as
doubles, exact only up to 2**53: 6413704546968363933 showed as 6413704546968364000, a snapshot no
table has. Every identifier partfin puts into Dagster metadata, in a list or a JSON entry as much as
on its own, goes through `id_text`; readers take `int(...)` of it.
"""

from __future__ import annotations


def id_text(value: int | None) -> str | None:
    """An identifier as exact text (None stays None: no such id)."""
    return None if value is None else str(int(value))


def id_value(value: object) -> int | None:
    """An identifier read back from metadata: text (what partfin writes) or an int (what releases before wrote)."""
    return None if value is None else int(value)
