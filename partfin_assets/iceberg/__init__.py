"""The Iceberg layer: catalog, the commit layer, snapshot history, data files, table schemas and snapshot expiry."""
