"""The Iceberg SqlCatalog on PostgreSQL via PARTFIN_CATALOG_URI: the same writer, the same guarantees."""

from __future__ import annotations

import uuid

import numpy as np

from partfin_assets.iceberg.catalog import CatalogConfig
from partfin_assets.iceberg.history import watermark_history
from partfin_assets.ingest.writer import CdcWriter
from partfin_assets.model import summary_keys as K
from partfin_assets_tests.conftest import HOUR_US, ORDERS, T0_US, change_batch


def test_writer_on_a_postgres_catalog(postgres, tmp_path):
    database = f"catalog_{uuid.uuid4().hex[:8]}"
    postgres.create_database(database)
    catalog = CatalogConfig(home=tmp_path, uri=postgres.sqlalchemy_uri(database)).load()
    writer = CdcWriter(catalog, ORDERS)
    for h in range(5):
        writer.write_checkpoint(change_batch(T0_US + h * HOUR_US + np.arange(100) * 1_000_000, offset=str(h)))
    table = catalog.load_table("cdc.orders")
    assert table.scan().to_arrow().num_rows == 500
    history = [w for _, w in watermark_history(table.metadata)]
    assert history == sorted(history) and len(history) == 5
    assert table.properties[K.PROP_WATERMARK] == "2026-11-01T02:00:00Z"
