"""What the instance recorded for an asset's hour partitions, under its key and under the key the previous release
used (`cdc/orders` before `cdc_orders`): Dagster cannot rename a key, so an upgraded instance keeps the old events
and they still say which hours were finalized and run (docs/dagster.md, "Upgrading from `cdc/<table>` keys")."""

from __future__ import annotations

from dagster import AssetKey, AssetRecordsFilter, DagsterInstance, EventLogEntry

from partfin_assets.defs.tables import PartfinTable

PAGE = 1000


def _keys(table: PartfinTable, key: AssetKey) -> list[AssetKey]:
    previous = table.previous_key(key)
    return [key] if previous is None else [key, previous]


def latest_partition_materialization(instance: DagsterInstance, table: PartfinTable, key: AssetKey, partition_key: str) -> EventLogEntry | None:
    """The newest materialization of one hour (events under the current key are newer than any under the previous)."""
    for candidate in _keys(table, key):
        records = instance.fetch_materializations(AssetRecordsFilter(asset_key=candidate, asset_partitions=[partition_key]), limit=1).records
        if records:
            return records[0].event_log_entry
    return None


def materialized_partitions(instance: DagsterInstance, table: PartfinTable, key: AssetKey, partition_keys: list[str]) -> set[str]:
    """Which of these hours have a materialization (reads only their events; the previous key only for hours the
    current one has none of)."""
    found: set[str] = set()
    for candidate in _keys(table, key):
        wanted = [p for p in partition_keys if p not in found]
        cursor = None
        while wanted:
            result = instance.fetch_materializations(
                AssetRecordsFilter(asset_key=candidate, asset_partitions=wanted), limit=PAGE, cursor=cursor)
            found |= {r.partition_key for r in result.records if r.partition_key is not None}
            if not result.has_more:
                break
            cursor = result.cursor
    return found
