"""Where the source is in the WAL: LSNs and the offset it records with every checkpoint.

Offset: compact JSON `{"lsn": L, "seq": S}` or, inside a transaction, `{"lsn": L, "n": k,
"safe": F, "seq": S}`: every transaction whose commit record ends before L has been
delivered; of the transaction whose commit record ends at L, all changes (no "n") or the
first k; F is the end of the last wholly delivered transaction (where the slot may be
advanced to); S is the last source_seq issued. LSNs are PostgreSQL's `X/Y` text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from partfin_assets.model.errors import SourceError


def lsn_to_int(text: str) -> int:
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) | int(low, 16)


def lsn_to_text(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


@dataclass(frozen=True)
class Position:
    lsn: int  # commit end LSN of the last (partly) delivered transaction
    seq: int  # last source_seq issued
    n: int | None = None  # changes of that transaction delivered; None: all
    safe: int | None = None  # end of the last wholly delivered transaction (when n is set)

    @property
    def advance_to(self) -> int:
        return self.lsn if self.n is None else (self.safe or 0)

    def to_offset(self) -> str:
        fields: dict[str, Any] = {"lsn": lsn_to_text(self.lsn)}
        if self.n is not None:
            fields["n"] = self.n
            fields["safe"] = lsn_to_text(self.safe or 0)
        fields["seq"] = self.seq
        return json.dumps(fields, separators=(",", ":"))

    @classmethod
    def from_offset(cls, offset: str) -> Position:
        try:
            fields = json.loads(offset)
            n = fields.get("n")
            return cls(
                lsn_to_int(fields["lsn"]),
                int(fields["seq"]),
                None if n is None else int(n),
                lsn_to_int(fields["safe"]) if n is not None else None,
            )
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise SourceError(f"not a postgres offset: {offset!r} ({exc})") from exc
