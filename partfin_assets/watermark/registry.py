"""Every watermark policy by name: the one parser of a policy text, the policy in force on a table, a declared change.

Adding a policy: its module in this package (a `WatermarkPolicy` dataclass) and one line in POLICIES.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from pyiceberg.catalog import Catalog

from partfin_assets.iceberg.commit import set_table_properties
from partfin_assets.model.errors import InvalidInput
from partfin_assets.model.table_options import WATERMARK_POLICY
from partfin_assets.watermark.late_budget import LateBudget
from partfin_assets.watermark.min_of_last import MinOfLast
from partfin_assets.watermark.percentile import Percentile
from partfin_assets.watermark.policy import PolicyError, WatermarkPolicy

POLICIES: dict[str, type[WatermarkPolicy]] = {p.kind: p for p in (MinOfLast, Percentile, LateBudget)}

log = logging.getLogger(__name__)


def _forms() -> str:
    forms = [p.forms for p in POLICIES.values()]
    return ", ".join(forms[:-1]) + " or " + forms[-1]


def parse_policy(spec: str) -> WatermarkPolicy:
    """The one parser of a policy text (a table's: `table_policy`)."""
    text = spec.strip()
    kind, *args = text.split(":")
    try:
        if kind not in POLICIES:
            raise PolicyError("unknown form")
        policy = POLICIES[kind].from_args(args)
    except (ValueError, InvalidInput) as exc:
        raise PolicyError(f"watermark policy {text!r} is not valid ({exc}); use {_forms()}") from None
    window = policy.window
    if (window.commits is not None and window.commits < 1) or (window.span_us is not None and window.span_us <= 0):
        raise PolicyError(f"watermark policy {text!r}: the window must be at least 1 commit or a positive duration")
    policy.check(text)
    return policy


def policy_for_budget(budget: float) -> WatermarkPolicy:
    """The policy that finalizes as early as a share `budget` of late records allows (what the policy lab tries)."""
    return LateBudget(budget=budget)


def table_policy(properties: Mapping[str, str]) -> WatermarkPolicy:
    """The policy in force on a table: its property (model/table_options.py; the default when unset)."""
    return parse_policy(WATERMARK_POLICY.read(properties))


def declare_policy(catalog: Catalog, identifier: str, declared: str | None) -> str:
    """Make a declared policy the one in force on an existing table; returns the one in force.

    None (nothing declared) keeps the table's. A declaration that differs sets the property: the
    first checkpoint under it records the change (partfin.watermark-policy.change, change.py),
    whoever declared it: `partfin ingest --watermark-policy`, a sync run's table declaration, a writer's spec.
    """
    properties = catalog.load_table(identifier).properties
    if declared is None:
        return str(table_policy(properties))
    policy = str(parse_policy(declared))
    if policy != WATERMARK_POLICY.text(properties):
        log.warning("%s: watermark policy declared %s (was %s): it takes effect with the next checkpoint", identifier, policy,
                    WATERMARK_POLICY.text(properties))
        set_table_properties(catalog, identifier, {WATERMARK_POLICY.key: policy})
    return policy
