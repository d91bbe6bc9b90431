"""The `partfin_assets` code location (workspace.yaml / [tool.dagster])."""

from partfin_assets.defs import build_definitions

defs = build_definitions()
