"""A planted secret never shows: not in the Dagster UI's repository snapshot, the run logs, or any CLI error.

The secret is planted in PARTFIN_CATALOG_URI, PARTFIN_SOURCE and `--source` in every form a password
takes: URI user info, a `?password=` query parameter, a libpq `password=` pair, a `#` inside the
password, a quoted password with a space. The commands fail (nothing listens on port 1), so every
error path is taken; their whole output is searched for the secret.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from partfin_assets_tests.test_cli import partfin

SECRET = "S3cretPw"
HASHED = f"{SECRET}#{SECRET}"  # whatever side of the '#' leaks, the secret shows

CATALOG_URIS = {
    "uri-userinfo": f"postgresql+psycopg://iceberg:{SECRET}@127.0.0.1:1/iceberg",
    "uri-query": f"postgresql+psycopg://iceberg@127.0.0.1:1/iceberg?password={SECRET}",
    "uri-query-second": f"postgresql+psycopg://iceberg@127.0.0.1:1/iceberg?connect_timeout=5&password={SECRET}",
    "uri-hash-encoded": f"postgresql+psycopg://iceberg:{SECRET}%23{SECRET}@127.0.0.1:1/iceberg",
}

SOURCES = {
    "dsn-pair": f"postgres:host=127.0.0.1 port=1 user=cdc password={SECRET} dbname=shop",
    "dsn-hash": f"postgres:host=127.0.0.1 port=1 user=cdc password={HASHED} dbname=shop",
    "dsn-quoted": f"postgres:host=127.0.0.1 port=1 user=cdc password='{SECRET} #{SECRET}' dbname=shop",
    "dsn-spaced-equals": f"postgres:host=127.0.0.1 port=1 user=cdc password = {SECRET} dbname=shop",
    "uri-userinfo": f"postgres:postgresql://cdc:{SECRET}@127.0.0.1:1/shop",
    "uri-query": f"postgres:postgresql://cdc@127.0.0.1:1/shop?password={SECRET}",
    "unknown-option": f"postgres:host=127.0.0.1 port=1 user=cdc password={SECRET} dbname=shop#orders,bogus=1",
    "bad-option-value": f"postgres:host=127.0.0.1 port=1 user=cdc password={SECRET} dbname=shop#orders,heartbeat_interval=soon",
    "bad-slot": f"postgres:postgresql://cdc:{SECRET}@127.0.0.1:1/shop#orders,slot=Bad Slot",
    "kafka-userinfo": f"kafka://cdc:{SECRET}@127.0.0.1:1/orders",
    "unknown-kind": f"mysql://cdc:{SECRET}@127.0.0.1:1/orders",
}


def leaks(text: str) -> bool:
    return SECRET in text or SECRET.lower() in text.lower()


# --------------------------------------------------------------------------- CLI errors and logs

CLI_CASES = [
    *[
        pytest.param({"PARTFIN_CATALOG_URI": uri}, command, id=f"catalog-{name}-{command[0]}")
        for name, uri in CATALOG_URIS.items()
        for command in (
            ["status"], ["upsert", "--table", "orders"], ["ingest", "--table", "orders", "--source", "synthetic"],
            ["streams", "list", "--table", "orders"],
        )
    ],
    pytest.param(
        {
            "PARTFIN_CATALOG": "lake",
            "PYICEBERG_CATALOG__LAKE__TYPE": "sql",
            "PYICEBERG_CATALOG__LAKE__URI": CATALOG_URIS["uri-query"],
        },
        ["status"],
        id="named-catalog-uri-query",
    ),
    *[pytest.param({}, ["ingest", "--table", "orders", "--source", source], id=f"source-{name}") for name, source in SOURCES.items()],
]

@pytest.mark.parametrize("env, command", CLI_CASES)
def test_cli_error_and_logs_never_show_a_planted_secret(tmp_path, env, command):
    result = partfin(tmp_path, "-v", *command, env_extra=env, timeout=120)
    output = result.stdout + result.stderr
    print(f"\nexit {result.returncode}: {result.stderr.strip().splitlines()[-1:]}")
    assert not leaks(output), f"the secret shows:\n{output}"
    assert result.returncode == 2, output
    assert result.stderr.strip().splitlines()[-1].startswith("partfin: error: "), output


# --------------------------------------------------------------------------- Dagster: UI snapshot and run logs


def dagster_subprocess(tmp_path, script: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PARTFIN_", "DAGSTER_"))}
    dagster_home = tmp_path / "dagster"
    dagster_home.mkdir(exist_ok=True)
    env.update({"PARTFIN_HOME": str(tmp_path / "home"), "DAGSTER_HOME": str(dagster_home), **env_extra})
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


SNAPSHOT = """
from dagster._core.remote_representation.external_data import RepositorySnap
from dagster._serdes import serialize_value
from partfin_assets.definitions import defs
print(serialize_value(RepositorySnap.from_def(defs.get_repository_def())))
"""

SECRET_ENV = {
    "PARTFIN_CATALOG_URI": f"postgresql+psycopg://iceberg:{SECRET}@127.0.0.1:1/iceberg?password={SECRET}",
    "PARTFIN_SOURCE": SOURCES["dsn-hash"],
}


def test_ui_repository_snapshot_never_shows_a_planted_secret(tmp_path):
    result = dagster_subprocess(tmp_path, SNAPSHOT, SECRET_ENV)
    assert result.returncode == 0, result.stderr
    snapshot = result.stdout
    assert "ResourceSnap" in snapshot or "resources" in snapshot  # the snapshot the webserver serves
    shown = [k for k, v in SECRET_ENV.items() if v in snapshot]
    print(f"\nsnapshot {len(snapshot):,} chars; secret shown: {leaks(snapshot)} ({shown} verbatim)")
    assert not leaks(snapshot)


SYNC_RUN = """
from dagster import DagsterInstance
from dagster._serdes import serialize_value
from partfin_assets.definitions import defs

instance = DagsterInstance.get()
result = defs.get_job_def("sync_orders").execute_in_process(instance=instance, raise_on_error=False)
print("RUN SUCCESS", result.success)
for record in instance.all_logs(result.run_id):
    print(serialize_value(record))
print(serialize_value(instance.get_run_by_id(result.run_id)))
"""

RUN_CASES = {
    "catalog-uri": {"PARTFIN_CATALOG_URI": SECRET_ENV["PARTFIN_CATALOG_URI"]},
    "source-dsn-hash": {"PARTFIN_SOURCE": SOURCES["dsn-hash"]},
    "source-dsn-quoted": {"PARTFIN_SOURCE": SOURCES["dsn-quoted"]},
    "source-uri-query": {"PARTFIN_SOURCE": SOURCES["uri-query"]},
}


@pytest.mark.parametrize("case", list(RUN_CASES))
def test_sync_run_logs_never_show_a_planted_secret(tmp_path, case):
    result = dagster_subprocess(tmp_path, SYNC_RUN, RUN_CASES[case])
    output = result.stdout + result.stderr  # event log records, the run record, Dagster's and Python's log lines
    print(f"\n{case}: exit {result.returncode}; secret shown: {leaks(output)}")
    assert "RUN SUCCESS False" in result.stdout, output[-3000:]
    assert not leaks(output), "the secret shows in: " + next(line for line in output.splitlines() if leaks(line))[:500]


RESOURCES_QUERY = """
{
  allTopLevelResourceDetailsOrError(repositorySelector: {repositoryLocationName: "partfin_assets", repositoryName: "__repository__"}) {
    __typename
    ... on ResourceDetailsList { results { name description configFields { name description defaultValueAsJson } configuredValues { key value type } } }
    ... on PythonError { message }
  }
}
"""

WORKSPACE_QUERY = """
{
  workspaceOrError {
    __typename
    ... on Workspace { locationEntries { name loadStatus locationOrLoadError {
      __typename
      ... on RepositoryLocation { repositories { name jobs { name description } sensors { name description }
        assetNodes { id description metadataEntries { label description ... on TextMetadataEntry { text } } } } }
      ... on PythonError { message stack }
    } } }
  }
}
"""


def test_webserver_never_shows_a_planted_secret(tmp_path):
    """A real dagster-webserver serves the code location: its GraphQL answers (what the UI renders) name the variables only."""
    import socket
    import urllib.request

    from partfin_assets.testing import dagster_processes

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dagster_processes.dagster_env(tmp_path / "home", tmp_path / "dagster", **SECRET_ENV)
    log = tmp_path / "webserver.log"
    server = dagster_processes.DagsterProcess(
        [dagster_processes.bin_path("dagster-webserver"), "-w", str(dagster_processes.REPO / "workspace.yaml"), "-h", "127.0.0.1", "-p", str(port)],
        env, log,
    ).start()

    def graphql(query: str) -> str:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/graphql", data=json.dumps({"query": query}).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.read().decode()

    def loaded() -> str | None:
        try:
            answer = graphql(WORKSPACE_QUERY)
        except OSError:
            return None
        return answer if '"loadStatus": "LOADED"' in answer.replace('":"', '": "') else None

    try:
        workspace = dagster_processes.wait_for(loaded, 240, "the webserver to load the code location", on_timeout=server.log_tail)
        resources = graphql(RESOURCES_QUERY)
    finally:
        server.stop()
    configured = {
        (resource["name"], value["key"]): (value["type"], value["value"])
        for resource in json.loads(resources)["data"]["allTopLevelResourceDetailsOrError"]["results"]
        for value in resource["configuredValues"]
    }
    print(f"\nworkspace {len(workspace):,} chars, resources {len(resources):,} chars; configured: {configured}")
    assert configured[("catalog", "uri")] == ("ENV_VAR", "PARTFIN_CATALOG_URI")
    assert configured[("cdc_source", "source")] == ("ENV_VAR", "PARTFIN_SOURCE")
    assert "RepositoryLocation" in workspace and "sync_orders" in workspace
    for name, text in (("workspace", workspace), ("resources", resources), ("webserver log", log.read_text(errors="replace"))):
        assert not leaks(text), f"the secret shows in the {name}"


@pytest.mark.parametrize(
    "argument, dsn, table, options",
    [
        (f"password={HASHED} dbname=shop", f"password={HASHED} dbname=shop", "public.orders", {}),
        (f"password='{SECRET} #x' dbname=shop#sales.o", f"password='{SECRET} #x' dbname=shop", "sales.o", {}),
        (f"password={HASHED} dbname=shop #o,slot=s", f"password={HASHED} dbname=shop", "public.o", {"slot": "s"}),
        (f"postgresql://cdc:{HASHED}@db/shop#o", f"postgresql://cdc:{HASHED}@db/shop", "public.o", {}),
        (f"postgresql://cdc@db/shop?password={HASHED}", f"postgresql://cdc@db/shop?password={HASHED}", "public.orders", {}),
        ("host=db dbname=shop#o,heartbeat_interval=5s", "host=db dbname=shop", "public.o", {"heartbeat_interval": "5s"}),
    ],
)
def test_a_hash_inside_a_password_belongs_to_the_password(argument, dsn, table, options):
    from partfin_assets.sources.postgres import parse_postgres_spec

    assert parse_postgres_spec(argument, "orders") == (dsn, table, options)
