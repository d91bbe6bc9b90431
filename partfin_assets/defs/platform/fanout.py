"""What the fan-out jobs share: a plan step, one step per share of the work on `multiprocess_executor`, one commit step.

`upsert_<table>_fanout`, `compact_<table>_fanout` and `ingest_<table>_fanout` are declared through
`fanout_job`: the executor, its step processes and the run retry (a lost race or a failed step
leaves nothing committed and nothing written, and the run is retried whole from a fresh plan).
"""

from dagster import job, multiprocess_executor

# Step processes fork from a server that has imported partfin and Dagster once, instead of each
# starting a fresh interpreter (seconds per step on a busy machine). They keep the environment the
# server started with: one per run worker, so one per run under Dagster; `{"spawn": {}}` otherwise.
FORKSERVER = {"forkserver": {"preload_modules": [
    "partfin_assets.defs.platform.upsert_fanout", "partfin_assets.defs.platform.compaction_fanout",
    "partfin_assets.defs.platform.ingest_fanout", "partfin_assets.defs.platform.ingest_members",
    "dagster._core.storage.base_storage", "dagster._core.secrets.env_file", "upath.core", "upath.implementations.local",
    "pyiceberg_core.transform", "pyarrow.acero",
]}}
DEFAULT_MAX_GROUPS = 8  # a few steps per process: balanced, each worth its start-up
RETRIED_WHOLE = {"dagster/max_retries": "3", "dagster/retry_strategy": "ALL_STEPS"}


def fanout_job(name: str, description: str, tags: dict[str, str], *, max_concurrent: int = 2):
    """The `@job` decorator of a fan-out job: steps on `max_concurrent` processes forked from FORKSERVER
    (swap the executor for k8s_job_executor / celery_executor in production), the run retried whole."""
    return job(
        name=name,
        executor_def=multiprocess_executor,
        config={"execution": {"config": {"max_concurrent": max_concurrent, "start_method": FORKSERVER}}},
        description=description,
        tags={**tags, **RETRIED_WHOLE},
    )
