"""Every Iceberg id partfin shows in the Dagster UI is exact, read back through the webserver's GraphQL API as the UI reads it.

Before: a `finalized_orders` amendment showed `late_commits` as 6413704546968364000 beside the real
6413704546968363933: a browser reads a JSON number as a double, exact up to 2**53 only, and a snapshot id
is a random 63-bit integer. The same held for every id shown as a number. Now ids are text (model/ids.py).

Real pipeline in process (sync, the finalization sensor, late data, an amendment, the downstream asset) on a
real instance; the answers come from dagster-graphql's schema over a workspace loaded as `dagster dev` loads
it. Each value is decoded as a browser decodes it: JSON numbers (and Int entries) as doubles.
"""

from __future__ import annotations

import json
import re

import pytest
from dagster import AssetKey, DagsterInstance
from dagster._core.workspace.context import WorkspaceProcessContext
from dagster._core.workspace.load_target import WorkspaceFileTarget
from dagster_graphql.test.utils import execute_dagster_graphql

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.testing.dagster_processes import REPO
from partfin_assets_tests.scenario_helpers import append_lines, change, hour_of_changes, ms
from partfin_assets_tests.test_downstream_reproducible import H1_KEY, HOURS, Pipeline

ENTRY = """metadataEntries { label __typename ... on IntMetadataEntry { intRepr } ... on TextMetadataEntry { text }
  ... on JsonMetadataEntry { jsonString } ... on FloatMetadataEntry { floatValue } }"""
EVENTS = f"""query ($path: [String!]!) {{ assetOrError(assetKey: {{path: $path}}) {{ ... on Asset {{
  assetMaterializations(limit: 1000) {{ partition {ENTRY} }}
  assetObservations(limit: 1000) {{ {ENTRY} }} }} }} }}"""
CHECKS = """query ($path: [String!]!, $check: String!) { assetCheckExecutions(assetKey: {path: $path}, checkName: $check, limit: 100) {
  evaluation { ENTRY } } }""".replace("ENTRY", ENTRY)
EXACT_IN_A_BROWSER = 2**53
SUB_SECOND_TIME = re.compile(r"\d{2}:\d{2}:\d{2}\.\d+Z")  # 2026-11-01T01:00:07.250000Z: noise on a page people read


def as_a_browser_reads(entry: dict):
    """An entry's value as the UI's JavaScript holds it: numbers are doubles."""
    kind = entry["__typename"]
    if kind == "IntMetadataEntry":
        return float(entry["intRepr"])
    if kind == "JsonMetadataEntry":
        return json.loads(entry["jsonString"], parse_int=float)
    if kind == "TextMetadataEntry":
        return entry["text"]
    return entry.get("floatValue")


def numbers_in(value) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        return [n for v in value.values() for n in numbers_in(v)]
    if isinstance(value, list):
        return [n for v in value for n in numbers_in(v)]
    return []


@pytest.fixture
def pipeline(tmp_path, monkeypatch):
    """H0-H3 of orders, synced and finalized; then late records for H1: an amendment naming its late commits;
    the downstream asset run for H1."""
    path = tmp_path / "orders.jsonl"
    for n, hour in enumerate(HOURS):
        append_lines(path, hour_of_changes(hour, range(100 * n + 1, 100 * n + 21), minute_step=2.5, status="paid"))
    monkeypatch.setenv("PARTFIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.delenv("PARTFIN_SOURCE", raising=False)
    monkeypatch.setenv("PARTFIN_PARTITIONS_START", "2026-11-01-00:00")
    monkeypatch.setenv("PARTFIN_MAX_RECORDS", "10")
    (tmp_path / "dagster").mkdir()
    with DagsterInstance.local_temp(str(tmp_path / "dagster")) as instance:
        pipeline = Pipeline(path, instance)
        pipeline.sync()
        pipeline.finalization_tick()
        append_lines(path, [change("c", 5000 + i, ms(HOURS[1]) + (30 + i) * 60_000, status="paid") for i in range(2)])
        pipeline.sync()
        (rerun,) = [r for r in pipeline.finalization_tick().run_requests if r.partition_key == H1_KEY]
        pipeline.activity(H1_KEY, rerun.tags)
        yield pipeline


def test_every_id_the_ui_shows_is_the_iceberg_id_exactly(pipeline):
    catalog = load_partfin_catalog()
    cdc, base = catalog.load_table("cdc.orders"), catalog.load_table("base.orders")
    snapshot_ids = {"cdc": {str(s.snapshot_id) for s in cdc.metadata.snapshots},
                    "base": {str(s.snapshot_id) for s in base.metadata.snapshots}}
    checkpoint_ids = {s.summary.additional_properties.get("partfin.checkpoint-id") for s in cdc.metadata.snapshots}
    # which table each id names: the key's prefix, else (snapshot_id, on a layer's own events) the asset's layer
    names = {"base_snapshot_id": "base", "cdc_snapshot_id": "cdc", "late_commits": "cdc"}
    with WorkspaceProcessContext(pipeline.instance, WorkspaceFileTarget([str(REPO / "workspace.yaml")])) as process:
        context = process.create_request_context()
        shown = {}
        for key, layer in ((AssetKey("finalized_orders"), None), (AssetKey("cdc_orders"), "cdc"), (AssetKey("base_orders"), "base"),
                           (AssetKey("activity_orders_hourly"), None)):
            asset = execute_dagster_graphql(context, EVENTS, variables={"path": key.path}).data["assetOrError"]
            events = asset["assetMaterializations"] + asset["assetObservations"]
            assert events, key
            shown[key.to_user_string()] = [({e["label"]: as_a_browser_reads(e) for e in event["metadataEntries"]}, layer)
                                           for event in events]
        checks = {label: as_a_browser_reads(e) for key, check in (("cdc_orders", "watermark_fresh"), ("base_orders", "watermark_lag_vs_cdc"))
                  for execution in execute_dagster_graphql(context, CHECKS, variables={"path": [key], "check": check}).data["assetCheckExecutions"]
                  for e in execution["evaluation"]["metadataEntries"] for label in [f"{key} {check} {e['label']}"]}
    checked = {}
    for asset, events in shown.items():
        for entries, layer in events:
            for label, value in entries.items():
                # no number a browser cannot hold exactly, anywhere (an id, or anything else)
                assert all(abs(n) < EXACT_IN_A_BROWSER for n in numbers_in(value)), (asset, label, value)
                table = names.get(label, layer if label == "snapshot_id" else None)
                if table is not None and value is not None:
                    for one in value if isinstance(value, list) else [value]:
                        assert one in snapshot_ids[table], (asset, label, one)  # the id of a snapshot the table holds
                    checked[label] = checked.get(label, 0) + 1
                if label == "checkpoint_id" and value is not None:
                    assert value in checkpoint_ids, (asset, label, value)
                    checked[label] = checked.get(label, 0) + 1
                if label == "cdc_sequence_number" and value is not None:
                    assert int(value) in {s.sequence_number for s in cdc.metadata.snapshots}, (asset, label, value)
                    checked[label] = checked.get(label, 0) + 1
    # no noise: a duration once, as text (not again in seconds), no constant limit plotted as a series, no microseconds
    assert checks and not [label for label, value in checks.items() if label.endswith("_seconds") or isinstance(value, float)], checks
    texts = [(asset, label, value) for asset, events in shown.items() for entries, _ in events for label, value in entries.items()
             if isinstance(value, str)] + [("checks", label, value) for label, value in checks.items() if isinstance(value, str)]
    assert not [t for t in texts if SUB_SECOND_TIME.search(t[2])], [t for t in texts if SUB_SECOND_TIME.search(t[2])][:5]
    print(f"ids read back exactly through GraphQL: {checked}")
    assert set(checked) == {"base_snapshot_id", "cdc_snapshot_id", "late_commits", "snapshot_id", "checkpoint_id", "cdc_sequence_number"}
