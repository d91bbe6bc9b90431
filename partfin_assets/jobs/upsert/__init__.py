"""The base-table upsert: merge new CDC snapshots into base.<table>, last writer wins.

One run is one UPDATE/DELETE `Job` on base.<table> (docs/concurrency.md), in four steps, one module each:

1. plan.py: which CDC data files are new since the position base.<table> merged up to,
   read at one pinned snapshot of each table;
2. decode.py (+ payload.py): CDC rows -> typed change rows, the latest per primary key and change
   log; a change that does not decode goes to base.<table>__rejected (quarantine.py) with its
   reason, once, and the rest merges;
3. merge.py: those against the base rows of the buckets they touch (polars): within one change log
   the log's order decides, between logs the event time (decode.py `ORDER_KEY`); deletes become
   tombstones;
4. commit.py: one overwrite commit that swaps the rewritten buckets' files and sets position and
   watermark, then tags the merged CDC snapshot so expiry keeps the next run's starting point.

run.py strings them together. A run that loses a race raises `CommitConflictError`; it is
re-run from fresh data by the one retry policy (jobs/retry.py), never retried inside.
"""

from partfin_assets.jobs.upsert.commit import sync_merged_tag
from partfin_assets.jobs.upsert.run import UpsertResult, run_upsert

__all__ = ["UpsertResult", "run_upsert", "sync_merged_tag"]
