"""The Dagster layer of partfin: thin wrappers over the plain-Python layers below it, generated per declared table."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from dagster import BetaWarning, Definitions, in_process_executor

from partfin_assets.defs.factory import table_definitions
from partfin_assets.defs.resources import resources_from_env
from partfin_assets.defs.tables import TABLES, PartfinTable

# Dagster 1.13 re-creates every sensor when it binds resources to their jobs and passes `owners=None`
# to the beta parameter itself: one warning per sensor per code-location load (every run worker and
# sensor tick process) although partfin sets no sensor owners. Only this internal warning is silenced.
warnings.filterwarnings("ignore", message=r"Parameter `owners` of initializer `SensorDefinition.__init__`", category=BetaWarning)


def build_definitions(tables: Sequence[PartfinTable] = TABLES) -> Definitions:
    # runs of assets outside a job (the finalization sensor's downstream hours, materializations by hand) are one
    # small step each: in the run's own process, not one more process per step
    return Definitions.merge(*(table_definitions(t) for t in tables),
                             Definitions(resources=resources_from_env(), executor=in_process_executor))
