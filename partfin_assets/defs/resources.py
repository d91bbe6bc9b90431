"""Resources: the Iceberg catalog and the CDC source, configured from the environment."""


import os

from dagster import ConfigurableResource
from pyiceberg.catalog import Catalog

from partfin_assets.iceberg.catalog import CatalogConfig
from partfin_assets.model.records import CdcSource
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
        return make_source(self.source or table.source, table.spec)


def resources_from_env() -> dict:
    return {
        "catalog": IcebergCatalogResource(
            home=os.environ.get("PARTFIN_HOME") or None,
            uri=os.environ.get("PARTFIN_CATALOG_URI") or None,
            catalog_name=os.environ.get("PARTFIN_CATALOG") or None,
        ),
        "cdc_source": CdcSourceResource(
            source=os.environ.get("PARTFIN_SOURCE") or None,
            max_records=int(os.environ.get("PARTFIN_MAX_RECORDS", "20000")),
            max_checkpoints_per_run=int(os.environ.get("PARTFIN_MAX_CHECKPOINTS_PER_RUN", "500")),
            max_seconds_per_run=float(os.environ.get("PARTFIN_MAX_SECONDS_PER_RUN", "45")),
        ),
    }
