"""Resources: the Iceberg catalog and the CDC source, configured from the environment through `dagster.EnvVar`.

Every field set by a PARTFIN_* variable is an `EnvVar` (model/settings.py names them): Dagster
resolves it when a run starts, and the UI shows the variable's name, never its value (the catalog
URI and the source spec carry passwords).
"""

from contextlib import AbstractContextManager

from dagster import ConfigurableResource, EnvVar
from pyiceberg.catalog import Catalog

from partfin_assets.iceberg.catalog import CatalogConfig
from partfin_assets.model.records import CdcSource
from partfin_assets.model.redaction import secrets_redacted
from partfin_assets.model.settings import Settings
from partfin_assets.sources.registry import make_source


class IcebergCatalogResource(ConfigurableResource):
    """The partfin Iceberg catalog. Unset fields fall back to PARTFIN_HOME / PARTFIN_CATALOG_URI / PARTFIN_CATALOG."""

    home: str | None = None
    uri: str | None = None
    catalog_name: str | None = None

    def config(self) -> CatalogConfig:
        env = CatalogConfig.from_env(self.home)
        return CatalogConfig(home=env.home, uri=self.uri or env.uri, named=self.catalog_name or env.named)

    def load(self) -> Catalog:
        return self.config().load()


class CdcSourceResource(ConfigurableResource):
    """How sync runs read each table's CDC source. `source` (PARTFIN_SOURCE) replaces the declared one."""

    source: str | None = None
    max_records: int = 20_000  # records per checkpoint (one Iceberg commit)
    max_checkpoints_per_run: int = 500
    max_seconds_per_run: float = 45.0  # a run stops after the checkpoint that crosses this budget
    heartbeat_interval_seconds: float = 300.0  # an idle source commits a heartbeat checkpoint this often
    subtasks: int = 2

    def open(self, table) -> CdcSource:
        with self.redacted():
            return make_source(self.source or table.source, table.spec)

    def redacted(self) -> AbstractContextManager[None]:
        """Errors raised inside show the source's password masked (reading a source may fail with its DSN in the message)."""
        return secrets_redacted(self.source, *Settings.from_env().secrets())


def resources_from_env() -> dict:
    settings = Settings.from_env()

    def env(name: str, default=None):
        """EnvVar of setting `name` when its variable is set (an int field: EnvVar.int), else `default`."""
        if name not in settings.present:
            return default
        variable = Settings.variable(name)
        return EnvVar.int(variable) if isinstance(getattr(settings, name), int) else EnvVar(variable)

    return {
        "catalog": IcebergCatalogResource(home=env("home"), uri=env("catalog_uri"), catalog_name=env("catalog_name")),
        "cdc_source": CdcSourceResource(
            source=env("source"),
            max_records=env("max_records", settings.max_records),
            max_checkpoints_per_run=env("max_checkpoints_per_run", settings.max_checkpoints_per_run),
            max_seconds_per_run=settings.max_seconds_per_run,  # a float: EnvVar resolves str and int only
        ),
    }
