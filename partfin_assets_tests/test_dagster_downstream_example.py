"""The downstream team's example sensor sees every finalized hour, even several per tick, once."""

from __future__ import annotations

import importlib.util

from dagster import AssetMaterialization, DagsterInstance, build_sensor_context

from partfin_assets.testing import dagster_processes


def load_example():
    path = dagster_processes.REPO / "examples" / "downstream_team" / "definitions.py"
    spec = importlib.util.spec_from_file_location("downstream_team_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def finalize(instance, *hours):
    for hour in hours:  # what partfin's finalization sensor records, as runless events
        instance.report_runless_asset_event(AssetMaterialization(asset_key="finalized_orders", partition=hour))


def test_sensor_requests_every_finalized_hour_once():
    example = load_example()
    sensor = example.on_orders_hour_finalized
    with DagsterInstance.ephemeral() as instance:
        with build_sensor_context(instance=instance) as ctx:
            assert sensor(ctx).run_requests == []
        # three hours finalize between two ticks (e.g. after the daemon was down)
        finalize(instance, "2026-01-01-00:00", "2026-01-01-01:00", "2026-01-01-02:00")
        instance.report_runless_asset_event(AssetMaterialization(asset_key="base_orders", partition="2026-01-01-03:00"))
        with build_sensor_context(instance=instance) as ctx:
            first = sensor(ctx)
        assert [r.partition_key for r in first.run_requests] == ["2026-01-01-00:00", "2026-01-01-01:00", "2026-01-01-02:00"]
        assert len({r.run_key for r in first.run_requests}) == 3
        # next tick: nothing new -> nothing requested
        with build_sensor_context(instance=instance, cursor=first.cursor) as ctx:
            again = sensor(ctx)
        assert again.run_requests == []
        finalize(instance, "2026-01-01-03:00")
        with build_sensor_context(instance=instance, cursor=again.cursor) as ctx:
            later = sensor(ctx)
        assert [r.partition_key for r in later.run_requests] == ["2026-01-01-03:00"]


def test_example_is_a_valid_code_location():
    example = load_example()
    repo = example.defs.get_repository_def()
    asset = repo.asset_graph.get(example.orders_revenue_hourly.key)
    assert ("finalized_orders",) in {tuple(k.path) for k in asset.parent_keys}
