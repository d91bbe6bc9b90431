"""What change history a source reads: recorded with every checkpoint's offset, checked on every start,
used by replays to read that history again.

A table has one change log. Its offsets, the order of its changes (`source_seq`, see records.py) and
what a replay of an hour reads all mean something only within that log, so the writer records the
source's identity in every checkpoint (`partfin.source`, next to `partfin.source-offset`) and refuses
to go on from a source whose identity differs, naming the table's current source.

Each source kind says what makes a history the same:

- `synthetic`: the generator's seed, options and anchor (the stream depends on nothing else);
- `debezium-file`: the file's content: its first line (so a moved file is still the same history,
  a rotated or replaced one is not), checked again at the committed offset on every resume;
- `postgres`: the server's system identifier, the database, the table and the replication slot;
- later `kafka`: the cluster, topic and partitions.

`replayable` says whether the history can be read again from its start: a generator or a file can,
a replication slot cannot (it holds only what was not ingested yet).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from partfin_assets.model.errors import PartfinError

# What a different history of each kind usually means, for the one-line refusal.
_LIKELY_CAUSE = {
    "synthetic": "other generator options or another start",
    "debezium-file": "the file at that path is another one: rotated, truncated and rewritten, or replaced?",
    "postgres": "another server, database, table or replication slot",
}


class SourceMismatch(PartfinError, ValueError):
    """A source whose history is not the one the table was reading (another kind, file, stream, database)."""


class SourceChanged(PartfinError, ValueError):
    """The table's source no longer holds what was read from it (a file truncated, rotated or rewritten)."""


class ReplayNotPossible(PartfinError, ValueError):
    """The table's source cannot read its history again (a replication slot), or nothing was ingested yet."""


@dataclass(frozen=True)
class SourceIdentity:
    kind: str  # synthetic | debezium-file | postgres (later kafka)
    spec: str  # how a user names the source, never a secret: e.g. `synthetic:seed=5,...,start=...`, `debezium:/data/x.jsonl`
    history: Mapping[str, Any] = field(default_factory=dict)  # what makes the history the same (JSON values)
    cannot_replay: str | None = None  # why this history cannot be read again; None: it can (a generator, a file)

    def to_json(self) -> str:
        return json.dumps(
            {"kind": self.kind, "spec": self.spec, "history": dict(self.history), "cannot_replay": self.cannot_replay},
            separators=(",", ":"), sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> SourceIdentity:
        fields = json.loads(text)
        return cls(fields["kind"], fields["spec"], fields.get("history") or {}, fields.get("cannot_replay"))

    def mismatch(self, other: SourceIdentity) -> str | None:
        """Why `other` is not this (recorded) history, e.g. `seed 5 != 7: other generator options ...`; None if it is."""
        if other.kind != self.kind:
            return f"a {other.kind} source is not a {self.kind} one"
        differences = self.differences(other)
        if not differences:
            return None
        return f"{'; '.join(differences)}: {_LIKELY_CAUSE.get(self.kind, 'another history')}"

    def differences(self, other: SourceIdentity) -> list[str]:
        """How `other` differs from this recorded history, e.g. `seed 5 != 7` (empty: the same history).

        A field recorded as None was not known yet (a file that was still empty) and matches anything.
        """
        names = sorted(set(self.history) | set(other.history))
        return [
            f"{n} {self.history.get(n)!r} != {other.history.get(n)!r}"
            for n in names
            if self.history.get(n) is not None and self.history.get(n) != other.history.get(n)
        ]


class IdentifiedSource(Protocol):
    """The part of every CDC source (model/records.py CdcSource) that names its history."""

    kind: ClassVar[str]  # SourceIdentity.kind of every source of the class

    def identity(self, offset: str | None) -> SourceIdentity:
        """The history this source reads when it resumes from `offset` (an offset of this kind, or None)."""
        ...


def check_source(identifier: str, recorded: SourceIdentity | None, source: IdentifiedSource, offset: str | None) -> SourceIdentity:
    """The identity of `source` resuming from `offset`, if it reads the history `identifier` recorded.

    Otherwise SourceMismatch, one line naming the table's current source. A table without a recorded
    identity (new, or written before partfin recorded them) takes the source as it is.
    """
    if recorded is not None and source.kind != recorded.kind:
        raise SourceMismatch(
            f"{identifier} reads from {recorded.spec}, not from a {source.kind} source: a table keeps the one change "
            f"log it started with (its positions, replays and the order of its changes belong to it). Ingest the new "
            f"source into a new table, or drop {identifier} and its base table to start over"
        )
    identity = source.identity(offset)
    why = recorded.mismatch(identity) if recorded is not None else None
    if why is not None:
        assert recorded is not None
        raise SourceMismatch(
            f"{identifier} reads from {recorded.spec}; the source given, {identity.spec}, reads another history "
            f"({why}). A writer keeps the one change log it started with: give it that source again, or ingest the "
            "new one into a new table or under a writer id of its own (--writer-id)"
        )
    return identity
