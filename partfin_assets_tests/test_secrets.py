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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path

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


# A Kafka property whose name says its value is a secret (a password, passphrase, secret, credentials or private key
# material), whatever librdkafka calls it: refused in the spec (it is recorded and shown), named with the variable to use.
SECRET_KAFKA_PROPERTIES = [
    "sasl.password",
    "ssl.key.password",
    "sasl.oauthbearer.client.secret",
    "sasl.oauthbearer.assertion.private.key.passphrase",
    "sasl.oauthbearer.assertion.private.key.pem",
    "ssl.keystore.password",
    "some.future.credentials",
    "https.client.private.key",
]


@pytest.mark.parametrize("name", SECRET_KAFKA_PROPERTIES)
def test_a_kafka_property_naming_a_secret_is_refused_in_the_source_spec(tmp_path, name):
    source = f"kafka:127.0.0.1:1#dbserver1.public.orders,{name}={SECRET}"
    result = partfin(tmp_path, "ingest", "--table", "orders", "--source", source, "--primary-key", "id", timeout=120)
    variable = "PARTFIN_KAFKA_" + name.replace(".", "_").upper()
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"partfin: error: kafka property {name} is a secret: not in the source spec (it is recorded and shown), "
        f"but in the environment as {variable}"
    ], result.stderr
    assert not leaks(result.stdout + result.stderr)


# --------------------------------------------------------------------------- Dagster: UI snapshot and run logs


def dagster_subprocess(tmp_path, script: str, env_extra: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PARTFIN_", "DAGSTER_"))}
    dagster_home = tmp_path / "dagster"
    dagster_home.mkdir(exist_ok=True)
    env.update({"PARTFIN_HOME": str(tmp_path / "home"), "DAGSTER_HOME": str(dagster_home), **env_extra})
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)


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


@contextmanager
def running_webserver(tmp_path, env_extra: dict[str, str]) -> Iterator[tuple[str, Callable[..., str], Path]]:
    """A real dagster-webserver serving the code location: (its workspace answer once loaded, graphql(query, **variables), its log)."""
    import socket
    import urllib.request

    from partfin_assets.testing import dagster_processes

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dagster_processes.dagster_env(tmp_path / "home", tmp_path / "dagster", **env_extra)
    log = tmp_path / "webserver.log"
    server = dagster_processes.DagsterProcess(
        [dagster_processes.bin_path("dagster-webserver"), "-w", str(dagster_processes.REPO / "workspace.yaml"), "-h", "127.0.0.1", "-p", str(port)],
        env, log,
    ).start()

    def graphql(query: str, **variables) -> str:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/graphql", data=json.dumps({"query": query, "variables": variables}).encode(),
            headers={"Content-Type": "application/json"},
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
        yield dagster_processes.wait_for(loaded, 240, "the webserver to load the code location", on_timeout=server.log_tail), graphql, log
    finally:
        server.stop()


def test_webserver_never_shows_a_planted_secret(tmp_path):
    """A real dagster-webserver serves the code location: its GraphQL answers (what the UI renders) name the variables only."""
    with running_webserver(tmp_path, SECRET_ENV) as (workspace, graphql, log):
        resources = graphql(RESOURCES_QUERY)
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


# --------------------------------------------------------------------------- every form libpq takes a password in
#
# One distinct password per form, each in pieces around its special characters: whichever piece shows,
# the test names the form. The forms point at a real PostgreSQL (trust authentication: libpq sends no
# password, the server accepts), so every path a reachable source takes runs too: the source identity in
# each checkpoint summary, the table properties, `partfin status`, the Dagster event log and the webserver.

PASSWORD_FORMS = {
    "pair": ("host={host} port={port} user={user} password=Pair1Plain dbname={db}", ["Pair1Plain"]),
    "sslpassword-hash": ("host={host} port={port} user={user} sslpassword=Ssl2Left#Ssl2Right dbname={db}", ["Ssl2Left", "Ssl2Right"]),
    "backslash-escape": (r"host={host} port={port} user={user} password=Bsl3Left\ Bsl3Right dbname={db}", ["Bsl3Left", "Bsl3Right"]),
    "quoted-space-backslash": (
        r"host={host} port={port} user={user} password='Quo4Left \\ Quo4Mid \' Quo4Right' dbname={db}",
        ["Quo4Left", "Quo4Mid", "Quo4Right"],
    ),
    "uri-userinfo-encoded": (
        "postgresql://{user}:Enc5Left%40Enc5Mid%23Enc5Pct%25Enc5Right@{host}:{port}/{db}", ["Enc5Left", "Enc5Mid", "Enc5Pct", "Enc5Right"]
    ),
    "uri-userinfo-hash": ("postgresql://{user}:Raw6Left#Raw6Right@{host}:{port}/{db}", ["Raw6Left", "Raw6Right"]),
    "uri-query-encoded-name": ("postgresql://{user}@{host}:{port}/{db}?pass%77ord=Qry7Secret", ["Qry7Secret"]),
    "uri-query-sslpassword-hash": ("postgresql://{user}@{host}:{port}/{db}?sslpassword=Qry8Left#Qry8Right", ["Qry8Left", "Qry8Right"]),
    "uri-query-encoded-ssl-name": ("postgresql://{user}@{host}:{port}/{db}?ssl%70assword=Qry9Secret", ["Qry9Secret"]),
}
# user info with an unencoded '@': libpq ends the user info at the first '@' and would take the rest as the host
# name (`At#9x@127.0.0.1`): refused in one line, nothing of it shown
AMBIGUOUS_FORMS = {
    "uri-userinfo-at-hash": ("postgresql://{user}:Amb1Left@Amb1Mid#Amb1Right@{host}:{port}/{db}", ["Amb1Left", "Amb1Mid", "Amb1Right"]),
}
ALL_FORMS = {**PASSWORD_FORMS, **AMBIGUOUS_FORMS}
EVERY_PIECE = [piece for _, pieces in ALL_FORMS.values() for piece in pieces]


def shown_pieces(text: str) -> list[str]:
    lowered = text.lower()
    return [piece for piece in EVERY_PIECE if piece.lower() in lowered]


def form_dsn(form: str, host: str = "127.0.0.1", port: int = 1, user: str = "cdc", db: str = "shop") -> str:
    return ALL_FORMS[form][0].format(host=host, port=port, user=user, db=db)


ERROR_SUFFIXES = {"bare": "", "fragment": "#public.orders,slot=s1", "unknown-option": "#orders,bogus=1",
                  "bad-value": "#orders,heartbeat_interval=soon"}
ERROR_CASES = [
    (form, suffix)
    for form in ALL_FORMS
    for suffix in (ERROR_SUFFIXES if form in ("sslpassword-hash", "backslash-escape") else ("bare", "fragment"))
]


@pytest.mark.parametrize("form, suffix", ERROR_CASES, ids=[f"{form}-{suffix}" for form, suffix in ERROR_CASES])
def test_unreachable_source_errors_never_show_a_password_in_any_libpq_form(tmp_path, form, suffix):
    result = partfin(tmp_path, "-v", "ingest", "--table", "orders", "--source", f"postgres:{form_dsn(form)}{ERROR_SUFFIXES[suffix]}", timeout=120)
    output = result.stdout + result.stderr
    print(f"\nexit {result.returncode}: {result.stderr.strip().splitlines()[-1:]}")
    assert not shown_pieces(output), f"{shown_pieces(output)} show:\n{output}"
    assert result.returncode == 2, output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("partfin: error: "), output
    if suffix in ("bare", "fragment"):  # refused for the password form or unreachable: the error says where passwords belong
        assert "PGPASSWORD" in last and ".pgpass" in last, last
    assert not (tmp_path / "catalog.db").exists() or "cdc.orders" not in (tmp_path / "catalog.db").read_bytes().decode(errors="replace")


@pytest.mark.parametrize("form", list(ALL_FORMS))
def test_fragment_after_a_password_in_any_libpq_form_is_split_where_libpq_ends_the_password(form):
    from partfin_assets.sources.postgres import parse_postgres_spec

    if form in AMBIGUOUS_FORMS:
        pytest.skip("refused before it is split (see the CLI test)")
    dsn = form_dsn(form)
    assert parse_postgres_spec(f"{dsn}#sales.o,slot=s", "orders") == (dsn, "sales.o", {"slot": "s"})
    assert parse_postgres_spec(dsn, "orders") == (dsn, "public.orders", {})


ORDERS_DDL = "CREATE TABLE orders (id bigint PRIMARY KEY, user_id bigint, amount double precision, status text)"


def insert_orders(postgres, database: str, first: int, count: int) -> None:
    import psycopg

    with psycopg.connect(postgres.dsn(database), autocommit=True) as conn:
        for i in range(first, first + count):
            conn.execute("INSERT INTO orders VALUES (%s, %s, %s, 'paid')", (i, i % 7, i * 1.5))


def every_file_text(root) -> str:
    """Every byte under root (catalog.db, metadata JSON, manifests, data files) as text."""
    return "\n".join(p.read_bytes().decode("latin-1") for p in sorted(root.rglob("*")) if p.is_file())


def test_checkpoint_summaries_table_properties_and_status_never_show_a_password_in_any_libpq_form(tmp_path, postgres):
    database = "secrets_cli"
    postgres.create_database(database)
    import psycopg

    with psycopg.connect(postgres.dsn(database), autocommit=True) as conn:
        conn.execute(ORDERS_DDL)
    home = tmp_path / "home"
    outputs, refused = [], {}
    for number, form in enumerate(ALL_FORMS):
        insert_orders(postgres, database, number * 10, 10)
        dsn = form_dsn(form, postgres.host, postgres.port, postgres.user, database)
        result = partfin(home, "-v", "ingest", "--table", "orders", "--source", f"postgres:{dsn}#orders,heartbeat_settle=0s", timeout=120)
        outputs.append(result.stdout + result.stderr)
        if form in AMBIGUOUS_FORMS:
            refused[form] = (result.returncode, result.stderr.strip().splitlines()[-1])
        else:
            assert result.returncode == 0, f"{form}: {result.stderr}"
    outputs.append(partfin(home, "status").stdout)
    outputs.append(partfin(home, "status", "--json").stdout)
    stored = every_file_text(home)  # raw: every snapshot summary, table property, manifest and data file
    summaries = stored.count('"partfin.source"')
    print(f"\n{len(ALL_FORMS)} forms; {len(stored):,} bytes stored, partfin.source seen {summaries}x; refused: {refused}")
    assert summaries >= len(PASSWORD_FORMS)  # every checkpoint recorded its source identity
    assert not shown_pieces(stored), f"{shown_pieces(stored)} stored in the warehouse or catalog"
    text = "\n".join(outputs)
    assert not shown_pieces(text), f"{shown_pieces(text)} shown by the CLI"
    for form, (code, last) in refused.items():
        assert code == 2 and last.startswith("partfin: error: ") and "%40" in last, (form, last)


DAGSTER_RUN = """
import os
import psycopg
from dagster import DagsterInstance
from dagster._serdes import serialize_value
from partfin_assets.definitions import defs

with psycopg.connect(os.environ["INSERT_DSN"], autocommit=True) as conn:
    start = conn.execute("SELECT coalesce(max(id), 0) + 1 FROM orders").fetchone()[0]
    for i in range(start, start + 10):
        conn.execute("INSERT INTO orders VALUES (%s, 1, 2.5, 'paid')", (i,))
instance = DagsterInstance.get()
result = defs.get_job_def("sync_orders").execute_in_process(instance=instance, raise_on_error=False)
print("RUN", result.success, result.run_id)
for record in instance.all_logs(result.run_id):
    print(serialize_value(record))
print(serialize_value(instance.get_run_by_id(result.run_id)))
"""

RUNS_QUERY = """
{ runsOrError { ... on Runs { results { runId status runConfigYaml tags { key value } } } } }
"""

RUN_LOGS_QUERY = """
query ($runId: ID!) {
  logsForRun(runId: $runId) {
    __typename
    ... on EventConnection { events {
      __typename
      ... on MessageEvent { message level }
      ... on DisplayableEvent { label description metadataEntries { label description
        ... on TextMetadataEntry { text } ... on JsonMetadataEntry { jsonString } ... on PathMetadataEntry { path }
        ... on MarkdownMetadataEntry { mdStr } ... on UrlMetadataEntry { url } } }
      ... on ExecutionStepFailureEvent { error { message stack } }
      ... on RunFailureEvent { pipelineFailureError: error { message stack } }
    } }
    ... on PythonError { message }
  }
}
"""


# one run per form is minutes on a busy machine; these take every path a run can (a reachable source whose identity is
# recorded, a refused one whose failure is in the event log) with the forms of the most pieces
DAGSTER_FORMS = ["sslpassword-hash", "quoted-space-backslash", "uri-query-encoded-name", "uri-userinfo-at-hash"]


@pytest.mark.timeout(1800)
def test_dagster_event_log_and_webserver_never_show_a_password_in_any_libpq_form(tmp_path, postgres):
    """Sync runs read the source in each form (PARTFIN_SOURCE); their event logs, and what a real webserver answers
    about them (runs, their logs, the asset nodes), show no piece of any password."""
    import psycopg

    database = "secrets_dagster"
    postgres.create_database(database)
    with psycopg.connect(postgres.dsn(database), autocommit=True) as conn:
        conn.execute(ORDERS_DDL)
    # replication slot names are global to the cluster, which the CLI test above shares: a slot of this test's own
    sources = [f"postgres:{form_dsn(f, postgres.host, postgres.port, postgres.user, database)}#orders,slot=partfin_secrets_dagster,"
               "heartbeat_settle=0s" for f in DAGSTER_FORMS]
    # hourly partitions from two hours ago: a first run reports every hour since the partitions' start
    recent = (datetime.now(timezone.utc) - timedelta(hours=2)).strftime("%Y-%m-%d-%H:00")
    # one process per form: the code location reads PARTFIN_SOURCE when it loads
    runs = [dagster_subprocess(tmp_path, DAGSTER_RUN, {
        "PARTFIN_SOURCE": source, "INSERT_DSN": postgres.dsn(database), "PARTFIN_MAX_SECONDS_PER_RUN": "20",
        "PARTFIN_PARTITIONS_START": recent}) for source in sources]
    event_log = "\n".join(run.stdout + run.stderr for run in runs)
    outcomes = [line.split()[1] for run in runs for line in run.stdout.splitlines() if line.startswith("RUN ")]
    print(f"\nruns: {outcomes}")
    assert all(run.returncode == 0 for run in runs), event_log[-3000:]
    assert outcomes == [str(form not in AMBIGUOUS_FORMS) for form in DAGSTER_FORMS], [
        sorted({line.strip()[:300] for line in (run.stdout + run.stderr).replace("\\n", "\n").splitlines() if "Error:" in line})
        for run in runs]
    assert not shown_pieces(event_log), f"{shown_pieces(event_log)} in the event log: " + next(
        line for line in event_log.splitlines() if shown_pieces(line))[:500]
    assert not shown_pieces(every_file_text(tmp_path / "home")), "a piece of a password is stored in the warehouse or catalog"

    with running_webserver(tmp_path, {"PARTFIN_SOURCE": sources[0], "PARTFIN_PARTITIONS_START": recent}) as (workspace, graphql, log):
        answers = [workspace, graphql(RUNS_QUERY)]
        run_ids = [run["runId"] for run in json.loads(answers[-1])["data"]["runsOrError"]["results"]]
        answers += [graphql(RUN_LOGS_QUERY, runId=run_id) for run_id in run_ids]
        answers.append(graphql(RESOURCES_QUERY))
    answers.append(log.read_text(errors="replace"))
    text = "\n".join(answers)
    print(f"webserver: {len(run_ids)} runs, {len(text):,} chars answered")
    assert len(run_ids) == len(DAGSTER_FORMS)
    assert "MaterializationEvent" in text or "ObservationEvent" in text or "AssetMaterialization" in text
    assert not shown_pieces(text), f"{shown_pieces(text)} in the webserver's answers"
