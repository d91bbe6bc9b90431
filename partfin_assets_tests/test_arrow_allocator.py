"""Arrow's buffers come from the C library's allocator in every process that imports partfin (package __init__),
unless the user chose one: mimalloc's huge-page churn cost four Kafka ingest processes on two cores 5.5 % of all CPU
(docs/benchmarks.md, "Arrow's allocator")."""

import os
import subprocess
import sys

import pytest

PROGRAM = "import {module}, pyarrow as pa; print(pa.default_memory_pool().backend_name)"


def backend_in_fresh_process(module: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"} | env
    return subprocess.run([sys.executable, "-c", PROGRAM.format(module=module)], env=environ, capture_output=True,
                          text=True, check=True).stdout.strip()


@pytest.mark.parametrize("module", ["partfin_assets.cli", "partfin_assets.definitions"])
def test_the_cli_and_the_code_location_allocate_arrow_buffers_with_the_system_allocator(module):
    assert backend_in_fresh_process(module) == "system"


def test_an_allocator_the_user_chose_is_kept():
    assert backend_in_fresh_process("partfin_assets.cli", ARROW_DEFAULT_MEMORY_POOL="jemalloc") == "jemalloc"
