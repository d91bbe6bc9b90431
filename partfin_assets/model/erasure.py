"""Erased keys: which changes a privacy request erases, and which raw lines name an erased key.

A privacy request erases a key's changes up to a cutoff: every change of the key whose event time
(the source's commit time of the change) is at or before `erased_before`. Those are the changes the
request is about, however and whenever they reach partfin again: a replay of recorded history, a
re-delivered Kafka message, a restarted backfill, a late record from before the request. A change
made at the source after the request carries a later event time: new data, it lands.

Keys are remembered by a salted SHA-256 of their canonical text (model/record_keys.py), never as
text: the registry (iceberg/erasures.py) can tell whether a key it is shown was erased, not list the
keys. `without_erased` is the one filter every writer of partfin's tables calls (ingest, replay,
upsert, quarantine); `naming_erased` finds raw lines (that could not be parsed into a key) that
name an erased key in JSON form.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from partfin_assets.model.record_keys import canonical_key

# candidates per raw line for a key of several columns (each column's values combined)
MAX_KEY_CANDIDATES_PER_LINE = 256


@dataclass(frozen=True)
class Erasure:
    request_id: str
    key_hash: str
    erased_before_us: int  # changes of the key with an event time at or before this are erased


@dataclass(frozen=True)
class Erasures:
    """The erasures in force for a table, as of one version of its registry (0: no request ever)."""

    primary_key: tuple[str, ...]
    version: int = 0
    salt: str = ""
    entries: tuple[Erasure, ...] = field(default=())

    def __bool__(self) -> bool:
        return bool(self.entries)

    def key_hash(self, key: str) -> str:
        return key_hash(self.salt, key)

    @cached_property
    def _by_hash(self) -> dict[str, Erasure]:
        """Per key, the request with the latest cutoff (a later request of a key erases more)."""
        out: dict[str, Erasure] = {}
        for entry in self.entries:
            known = out.get(entry.key_hash)
            if known is None or entry.erased_before_us > known.erased_before_us:
                out[entry.key_hash] = entry
        return out

    def erased(self, keys: pa.Array | pa.ChunkedArray, event_time: pa.Array | pa.ChunkedArray | None) -> np.ndarray:
        """Which of these changes an erasure covers (`event_time` None: every change of an erased key)."""
        count = len(keys)
        if not self.entries or count == 0:
            return np.zeros(count, dtype=bool)
        frame = pl.DataFrame({"key": pl.from_arrow(keys)})
        unique = frame.get_column("key").unique()
        cutoffs = {k: self._by_hash[h].erased_before_us for k in unique.to_list()
                   if k is not None and (h := self.key_hash(k)) in self._by_hash}
        if not cutoffs:
            return np.zeros(count, dtype=bool)
        cutoff = frame.get_column("key").replace_strict(cutoffs, default=None, return_dtype=pl.Int64).to_numpy()
        hit = ~np.isnan(cutoff.astype(np.float64))
        if event_time is None:
            return hit
        times = pc.cast(event_time, pa.int64()).to_numpy(zero_copy_only=False)
        out = np.zeros(count, dtype=bool)
        out[hit] = times[hit] <= cutoff[hit].astype(np.int64)
        return out

    def naming_erased(self, raw_lines: Iterable[str | None]) -> list[str | None]:
        """Per raw line, the request whose erased key it names (in JSON form: `"id":42`, `\\"id\\": 42`), or None."""
        if not self.entries:
            return [None for _ in raw_lines]
        patterns = [_value_pattern(column) for column in self.primary_key]
        out: list[str | None] = []
        for raw in raw_lines:
            found = None
            if raw:
                for key in _candidate_keys(raw, self.primary_key, patterns):
                    entry = self._by_hash.get(self.key_hash(key))
                    if entry is not None:
                        found = entry.request_id
                        break
            out.append(found)
        return out


def key_hash(salt: str, key: str) -> str:
    return hashlib.sha256(f"{salt}\x00{key}".encode()).hexdigest()


def without_erased(records: pa.Table, erasures: Erasures) -> tuple[pa.Table, int]:
    """`records` (CDC rows: `key`, `event_time`) without the changes an erasure covers, and how many were left out.

    The one filter every writer of cdc.<table> and base.<table> applies before it writes (ingest, replay,
    upsert, quarantine), so an erased change never comes back whatever path it takes.
    """
    if not erasures or records.num_rows == 0:
        return records, 0
    hit = erasures.erased(records.column("key"), records.column("event_time"))
    erased = int(hit.sum())
    return (records.filter(pa.array(~hit)) if erased else records), erased


ERASED_RAW_REASON = "raw text removed: it names a key erased by privacy request {request_id}"


def redact_raw_lines(rows: pa.Table, erasures: Erasures) -> tuple[pa.Table, int]:
    """Rejected rows (`raw`, `reason`) with the text of those that name an erased key removed, and how many.

    A raw line could not be parsed, so its event time is unknown: whatever it names of an erased key is
    removed, the row itself (its source position) stays so the line can be found at the source.
    """
    if not erasures or rows.num_rows == 0:
        return rows, 0
    requests = erasures.naming_erased(rows.column("raw").to_pylist())
    if not any(requests):
        return rows, 0
    raw = [("" if r else line) for r, line in zip(requests, rows.column("raw").to_pylist())]
    reasons = [(ERASED_RAW_REASON.format(request_id=r) if r else reason) for r, reason in zip(requests, rows.column("reason").to_pylist())]
    rows = rows.set_column(rows.schema.get_field_index("raw"), rows.schema.field("raw"), pa.array(raw, rows.schema.field("raw").type))
    rows = rows.set_column(rows.schema.get_field_index("reason"), rows.schema.field("reason"), pa.array(reasons, rows.schema.field("reason").type))
    return rows, sum(1 for r in requests if r)


# --------------------------------------------------------------------------- raw lines

_NUMBER = r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?"
_STRING = r'\\?"(?P<s>(?:[^"\\]|\\(?!")|\\\\)*?)\\?"'


def _value_pattern(column: str) -> re.Pattern:
    """`"<column>": <value>` in a JSON text, or in JSON quoted inside a JSON string (`\\"<column>\\":`)."""
    return re.compile(rf'\\?"{re.escape(column)}\\?"\s*:\s*(?:(?P<n>{_NUMBER})|{_STRING}|(?P<b>true|false))')


def _values(raw: str, pattern: re.Pattern) -> list:
    values: list = []
    for match in pattern.finditer(raw):
        if match.group("n") is not None:
            number = json.loads(match.group("n"))
            values.append(number)
            if isinstance(number, float) and number.is_integer():
                values.append(int(number))
        elif match.group("b") is not None:
            values.append(match.group("b") == "true")
        else:
            text = match.group("s")
            try:
                values.append(json.loads(f'"{text}"'))
            except ValueError:
                values.append(text)
    return list({(type(v), v): v for v in values}.values())  # 42 and 42.0 (and True and 1) are different keys


def _candidate_keys(raw: str, primary_key: Sequence[str], patterns: Sequence[re.Pattern]) -> Iterable[str]:
    per_column = [_values(raw, p) for p in patterns]
    if not all(per_column):
        return
    for combination in itertools.islice(itertools.product(*per_column), MAX_KEY_CANDIDATES_PER_LINE):
        yield canonical_key(dict(zip(primary_key, combination)))
