"""The `partfin_assets` code location (workspace.yaml / [tool.dagster])."""

from partfin_assets.defs import build_definitions
from partfin_assets.model.faults import install_faults
from partfin_assets.testing.faults import EnvFaults

# every Dagster process loads this module first: crash and retry tests drive its fault points through PARTFIN_* variables
install_faults(EnvFaults())
defs = build_definitions()
