"""The Dagster layer of partfin: thin wrappers over the plain-Python layers below it, generated per declared table."""

from __future__ import annotations

from collections.abc import Sequence

from dagster import Definitions

from partfin_assets.defs.factory import table_definitions
from partfin_assets.defs.resources import resources_from_env
from partfin_assets.defs.tables import TABLES, PartfinTable


def build_definitions(tables: Sequence[PartfinTable] = TABLES) -> Definitions:
    return Definitions.merge(*(table_definitions(t) for t in tables), Definitions(resources=resources_from_env()))
