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
