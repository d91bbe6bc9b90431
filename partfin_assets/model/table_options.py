"""Per-table settings: one typed option each (key, type, default, doc), stored as a table property.

The table property is the one source of truth at run time: every reader goes through `read` (the
default applies when the property is unset), and a declaration (TableSpec, `partfin ingest
--watermark-policy`, `partfin streams idle-timeout`) only ever acts by setting the property.
The options' table in docs/operations.md is `options_table()` (test_table_options checks it),
the way Flink's and Paimon's ConfigOptions generate their docs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from partfin_assets.model import summary_keys as K
from partfin_assets.model.timeutil import US_PER_SECOND, parse_duration

T = TypeVar("T")


def duration_us(text: str) -> int:
    return int(parse_duration(text).total_seconds() * US_PER_SECOND)


def policy_text(text: str) -> str:
    # parsed into a WatermarkPolicy by watermark/registry.py `table_policy`, the one reader of the policy
    return text.strip()


@dataclass(frozen=True)
class TableOption(Generic[T]):
    key: str  # the table property
    type_name: str  # as the docs show it
    default: str  # as text, parsed like a stored value
    table: str  # which table carries it: cdc.<t> or base.<t>
    set_by: str  # how a user changes it
    doc: str
    parse: Callable[[str], T]

    def text(self, properties: Mapping[str, str]) -> str:
        """The setting in force, as text: the property, else the default."""
        return properties.get(self.key) or self.default

    def read(self, properties: Mapping[str, str]) -> T:
        """The setting in force, typed."""
        return self.parse(self.text(properties))

    @property
    def default_value(self) -> T:
        return self.parse(self.default)


WATERMARK_POLICY = TableOption(
    K.PROP_WATERMARK_POLICY, "watermark policy", "late-budget:0.001:feedback", "cdc.<t>",
    "`partfin ingest --watermark-policy P`, or the declaration (`TableSpec.watermark_policy`, e.g. a Dagster table's): "
    "one that differs takes effect with the next writer, recorded as a policy change",
    "how the watermark follows the streams' event times ([watermarks](watermarks.md))", policy_text)
FUTURE_TOLERANCE = TableOption(
    K.PROP_FUTURE_TOLERANCE, "duration", "5m", "cdc.<t>", "a table property set by hand",
    "how far past the commit clock an event time is still plausible; beyond it, suspect (claims no progress)", duration_us)
STREAMS_IDLE_TIMEOUT = TableOption(
    K.PROP_STREAMS_IDLE_TIMEOUT, "duration", "15m", "cdc.<t>", "`partfin streams idle-timeout --table T 2h`",
    "how long a stream that commits nothing still holds the watermark", duration_us)
FINALIZED_TAG_MAX_AGE = TableOption(
    K.PROP_FINALIZED_TAG_MAX_AGE, "duration", "7d", "base.<t>", "a table property set by hand",
    "how long a `finalized-<hour>` tag is kept", duration_us)

TABLE_OPTIONS: tuple[TableOption, ...] = (WATERMARK_POLICY, FUTURE_TOLERANCE, STREAMS_IDLE_TIMEOUT, FINALIZED_TAG_MAX_AGE)


def options_table() -> str:
    """The options as a Markdown table (docs/operations.md holds it verbatim)."""
    rows = ["| property | on | type | default | set by | what |", "|---|---|---|---|---|---|"]
    rows += [f"| `{o.key}` | `{o.table}` | {o.type_name} | `{o.default}` | {o.set_by} | {o.doc} |" for o in TABLE_OPTIONS]
    return "\n".join(rows)
