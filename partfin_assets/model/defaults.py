"""Defaults the jobs and the `partfin` command share, kept free of heavy imports.

The command's argument parser shows them in `--help` and is built before any command runs
(cli/__init__.py): a default defined here costs it nothing, one defined beside PyIceberg or Polars
would load them for every `--help` and every refused argument.
"""

from __future__ import annotations

# How long the checkpoints of a partitioned source's partitions may wait for each other to land in one commit.
DEFAULT_COMMIT_INTERVAL_S = 1.0
# What one bucket should hold at most: the file size compaction aims at (unless `write.target-file-size-bytes` says).
DEFAULT_TARGET_FILE_SIZE = 128 * 1024 * 1024
KEEP_LAST_SNAPSHOTS = 10  # snapshot expiry: the newest snapshots of main always kept
MAINTENANCE_ORPHAN_AGE_S = 24 * 3600  # the maintenance job's (and `partfin maintain`'s) orphan-file safety age: a day
# `partfin policy-lab`: the simulated streams, and the policies it compares besides the one for its late budget
POLICY_LAB_SCENARIOS = ("steady", "outage", "idle", "bad-clocks", "shift", "backfill")
POLICY_LAB_POLICIES = ("min-of-last:3", "min-of-last:10", "min-of-last:30m", "percentile:0.001:last:3",
                       "percentile:0.001:last:30m")
