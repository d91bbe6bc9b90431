"""The embedded catalog as many processes meet it: the first commands on a fresh PARTFIN_HOME run at once."""

from __future__ import annotations

import multiprocessing

from partfin_assets.iceberg.catalog import ensure_namespaces, load_partfin_catalog

PROCESSES = 8
ROUNDS = 6


def _open_catalog(home: str, barrier, results) -> None:
    barrier.wait()  # all processes create the catalog's tables at the same moment
    try:
        catalog = load_partfin_catalog(home)
        ensure_namespaces(catalog, "cdc", "base")
        results.put("ok")
    except Exception as exc:  # reported to the test, which names it
        results.put(f"{type(exc).__name__}: {exc}")


def test_processes_creating_the_catalog_at_once_all_get_it(tmp_path):
    # PyIceberg's SqlCatalog checks for its tables, then creates them: a process that loses that race
    # failed with "table iceberg_tables already exists" (SQLite) / a unique violation (PostgreSQL)
    context = multiprocessing.get_context("spawn")
    failures = []
    for round_number in range(ROUNDS):
        barrier, results = context.Barrier(PROCESSES), context.Queue()
        home = tmp_path / f"home{round_number}"
        processes = [context.Process(target=_open_catalog, args=(str(home), barrier, results)) for _ in range(PROCESSES)]
        for process in processes:
            process.start()
        outcomes = [results.get(timeout=120) for _ in processes]
        for process in processes:
            process.join(timeout=60)
        failures += [outcome for outcome in outcomes if outcome != "ok"]
    assert not failures, failures


def test_kept_metadata_is_what_the_file_holds_and_never_hides_another_process_commit(tmp_path):
    # the catalog keeps the metadata it read or committed by location, and applies updates without PyIceberg's
    # deep copy: what it hands out must equal what a fresh catalog parses from the file, and a commit by
    # another catalog (another process) must show on the next load
    import pyarrow as pa
    from pyiceberg.schema import Schema
    from pyiceberg.types import LongType, NestedField

    from partfin_assets.iceberg.commit import set_table_properties

    writer, other = load_partfin_catalog(tmp_path), load_partfin_catalog(tmp_path)
    ensure_namespaces(writer, "cdc")
    table = writer.create_table("cdc.t", Schema(NestedField(1, "id", LongType(), required=False)))
    for value in range(3):
        table.append(pa.table({"id": pa.array([value], pa.int64())}))
        set_table_properties(writer, "cdc.t", {"round": str(value)})
    kept = writer.load_table("cdc.t")
    assert kept.metadata == load_partfin_catalog(tmp_path).load_table("cdc.t").metadata
    assert len(kept.metadata.snapshots) == 3 and kept.properties["round"] == "2"

    set_table_properties(other, "cdc.t", {"round": "by another process"})
    other.load_table("cdc.t").append(pa.table({"id": pa.array([9], pa.int64())}))
    seen = writer.load_table("cdc.t")
    assert seen.properties["round"] == "by another process"
    assert len(seen.metadata.snapshots) == 4
    assert sorted(seen.scan().to_arrow().column("id").to_pylist()) == [0, 1, 2, 9]
