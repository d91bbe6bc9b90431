"""The UI's "Automations" of each asset, as Dagster itself computes them from the loaded code location.

An asset page lists a sensor when the sensor's asset selection includes the asset, or when it targets
an asset job that materializes it (RemoteRepository.get_sensors_targeting). So the sync sensor must
drive a real asset run of cdc_<table> and base_<table>, and the finalization sensor targets the
downstream job (finalized_<table>, recorded only by that sensor, names it in its metadata instead).
"""

from __future__ import annotations

import pytest
from dagster import DagsterInstance
from dagster._core.workspace.context import WorkspaceProcessContext
from dagster._core.workspace.load_target import WorkspaceFileTarget
from dagster_graphql.test.utils import execute_dagster_graphql

from partfin_assets.defs.tables import TABLES
from partfin_assets.testing.dagster_processes import REPO

TARGETING = """query ($path: [String!]!) { assetNodeOrError(assetKey: {path: $path}) {
  ... on AssetNode { targetingInstigators { __typename ... on Sensor { name } ... on Schedule { name } } } } }"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The code location of workspace.yaml, loaded as `dagster dev` loads it (a code server subprocess)."""
    home = tmp_path_factory.mktemp("dagster")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DAGSTER_HOME", str(home))
        mp.setenv("PARTFIN_HOME", str(tmp_path_factory.mktemp("partfin")))
        with DagsterInstance.local_temp(str(home)) as instance, WorkspaceProcessContext(
            instance, WorkspaceFileTarget([str(REPO / "workspace.yaml")])
        ) as process_context:
            yield process_context.create_request_context()


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_each_asset_lists_the_sensor_that_drives_it(workspace, table):
    (location,) = workspace.code_location_names
    (repository,) = workspace.get_code_location(location).get_repositories().values()
    expected = {
        table.cdc_key: f"sync_{table.name}_sensor",
        table.base_key: f"sync_{table.name}_sensor",
        table.activity_key: f"finalize_{table.name}_sensor",
    }
    for key, sensor in expected.items():
        assert sensor in [s.name for s in repository.get_sensors_targeting(key)], key.to_user_string()
        # what the asset page's Automations tab renders
        answer = execute_dagster_graphql(workspace, TARGETING, variables={"path": key.path}).data
        assert {"__typename": "Sensor", "name": sensor} in answer["assetNodeOrError"]["targetingInstigators"], key.to_user_string()
