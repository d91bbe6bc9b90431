"""Test-only table helpers: a plain INTO job that appends files, and a file count per partition.

Production appends through the CDC writer (ingest/writer.py), which commits its checkpoints
itself; tests that need "some other INTO job committed here" build one on `Job.commit`.
"""

from __future__ import annotations

from pyiceberg.catalog import Catalog
from pyiceberg.manifest import DataFile

from partfin_assets.iceberg.files import live_files
from partfin_assets.jobs.job import Job, JobResult


def commit_append(job: Job, add: list[DataFile]) -> JobResult:
    """Commit `job` (an INTO job) as one append of `add` on top of whatever the head is."""

    def stage(head, tx, snapshot_summary):
        if not add:
            return False
        with tx.update_snapshot(snapshot_properties=snapshot_summary).fast_append() as append:
            for data_file in add:
                append.append_data_file(data_file)
        return True

    return job.commit(stage)


def files_per_partition(catalog: Catalog, identifier: str) -> dict[str, int]:
    """Live data files per partition at the head."""
    table = catalog.load_table(identifier)
    return {p: len(f) for p, f in sorted(live_files(table).items())}
