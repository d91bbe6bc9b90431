"""Snapshot-summary keys and table properties: the contract, in one place.

Every key partfin writes is named here and documented in docs/contracts.md."""

from __future__ import annotations

import enum

# snapshot summary (every CDC checkpoint commit)
CHECKPOINT_ID = "partfin.checkpoint-id"
WRITER_ID = "partfin.writer-id"
SOURCE_OFFSET = "partfin.source-offset"
EVENT_TIME_COUNT = "partfin.event-time.count"
EVENT_TIME_MIN = "partfin.event-time.min"
EVENT_TIME_MAX = "partfin.event-time.max"
EVENT_TIME_TDIGEST = "partfin.event-time.tdigest"
EVENT_TIME_HEARTBEAT = "partfin.event-time.heartbeat"
LATE_RECORDS = "partfin.late-records"
WATERMARK = "partfin.watermark"
# more keys of the checkpoint commit
LATE_RECORDS_TOTAL = "partfin.late-records.total"  # running total over the table's history
LATE_RECORDS_BY_HOUR = "partfin.late-records.by-hour"  # JSON {"<hour iso Z>": count}
# JSON {"<hour iso Z>": {"n", "min", "max", "p50", "p99" (iso Z), "c": [[mean_s, count], ...]}}
EVENT_TIME_BY_HOUR = "partfin.event-time.by-hour"
REJECTED_RECORDS = "partfin.rejected-records"
# only when the commit has some: JSON {"records", "by-hour": {"<hour iso Z>": n}, "max", "heartbeat",
# "clock", "tolerance-s"}: event times (or the heartbeat) beyond the commit's clock + tolerance
SUSPECT_FUTURE = "partfin.suspect-future"
# the source's processing time as of the checkpoint (ISO Z): its heartbeat, else its records' latest arrival
# time, else their latest plausible event time; heartbeats are rate-limited on it, never on event times
SOURCE_CLOCK = "partfin.source-clock"
STREAM = "partfin.stream"  # the progress stream a checkpoint belongs to, when not its writer's own (Kafka: <writer id>/<topic>-<partition>)
SOURCE = "partfin.source"  # JSON SourceIdentity of the history the writer reads (model/source_identity.py), beside its offset
# the watermark policy that computed this checkpoint's watermark (the table property's text when it ran)
WATERMARK_POLICY_APPLIED = "partfin.watermark.policy"
COMMIT_CLOCK = "partfin.commit-clock"  # ISO Z: the writer's clock for this checkpoint (the ledger's commit_time)
COMMIT_ID = "partfin.commit-id"  # unique per commit attempt series: resolves unknown outcomes
JOB_KIND = "partfin.job-kind"
# the conflict layer (jobs/job.py, docs/concurrency.md)
JOB_ID = "partfin.job-id"  # the job that made the commit (caller-supplied, e.g. a Dagster run, or random)
JOB_PARTITIONS = "partfin.job.partitions"  # JSON list of the partition paths a job targeted (omitted past 200)
JOB_START_SNAPSHOT = "partfin.job.start-snapshot-id"  # the snapshot an OVERWRITE, UPDATE/DELETE or MERGE job read
# compaction (jobs/compaction.py)
COMPACTION_FILES_BEFORE = "partfin.compaction.files-before"
COMPACTION_FILES_AFTER = "partfin.compaction.files-after"
# the spec change of `partfin base rebucket` (jobs/rebucket.py): bucket counts before and after
REBUCKET_FROM = "partfin.rebucket.from"
REBUCKET_TO = "partfin.rebucket.to"
# replay / backfill of an hour (jobs/replay.py): stats of what the replay wrote, under its own keys,
# so that the watermark policy skips the commit (it carries no partfin.event-time.* entries)
REPLAY_HOUR = "partfin.replay.hour"
REPLAY_RECORDS = "partfin.replay.records"  # records the hour holds after the replay
REPLAY_REPLACED_RECORDS = "partfin.replay.replaced-records"  # records the hour held before (at the head it replaced)
REPLAY_ADDED_RECORDS = "partfin.replay.added-records"  # records new to the hour (not there before: model/records.py RECORD_IDENTITY)
REPLAY_REMOVED_RECORDS = "partfin.replay.removed-records"  # records gone from the hour
REPLAY_BY_LOG = "partfin.replay.by-log"  # JSON {"<change log>": {"records", "added", "removed"}}: the same figures per log
REPLAY_KEPT_RECORDS = "partfin.replay.kept-records"  # records writers appended to the hour after the replay started: kept
REPLAY_SOURCE = "partfin.replay.source"  # JSON [{"source": spec, "until": offset}]: the history the replay read
REPLAY_EVENT_TIME_MIN = "partfin.replay.event-time.min"
REPLAY_EVENT_TIME_MAX = "partfin.replay.event-time.max"
# the upsert into base.<table> (jobs/upsert): what one run merged
UPSERT_CDC_SNAPSHOTS = "partfin.upsert.cdc-snapshots"
UPSERT_INSERTED = "partfin.upsert.inserted"
UPSERT_UPDATED = "partfin.upsert.updated"
UPSERT_DELETED = "partfin.upsert.deleted"
UPSERT_STALE = "partfin.upsert.stale"
UPSERT_HOURS = "partfin.upsert.hours-touched"  # JSON list of hours (ISO Z) whose visible rows changed
UPSERT_QUARANTINED = "partfin.upsert.quarantined"  # changes this run could not decode (in base.<table>__rejected)
QUARANTINED_RECORDS = "partfin.quarantined-records"  # on base.<table>__rejected: changes a commit added
# privacy delete (jobs/privacy.py): never the keys themselves, only the request
PRIVACY_REQUEST_ID = "partfin.privacy.request-id"
PRIVACY_DELETED_RECORDS = "partfin.privacy.deleted-records"
# a write that left out changes of erased keys (ingest, replay, upsert, quarantine) / removed the text of raw lines naming one
PRIVACY_ERASED_RECORDS = "partfin.privacy.erased-records"
PRIVACY_REDACTED_LINES = "partfin.privacy.redacted-lines"
# on every table partfin writes for a table: the erasure registry version its writers must have filtered with
# (iceberg/erasures.py); on cdc.<table>__erasures: the random salt of its key hashes
PROP_ERASURES_FENCE = "partfin.privacy.erasures"
PROP_ERASURES_SALT = "partfin.privacy.salt"

# table properties
# the table declaration (model/tablespec.py) travels with cdc.<name>, so `partfin upsert --table T`
# and the Dagster layer need nothing but the table name
PROP_PRIMARY_KEY = "partfin.primary-key"  # comma-separated primary-key columns
PROP_COLUMNS = "partfin.columns"  # JSON {"<column>": "<type text>"}
PROP_WATERMARK = "partfin.watermark"
PROP_WATERMARK_POLICY = "partfin.watermark.policy"
# JSON {"from", "to", "requested-at", "effective-at"}: the last change of the policy, as the first checkpoint
# after it saw it (requested-at: that checkpoint's clock; effective-at: when the new policy had the history it needs)
PROP_WATERMARK_POLICY_CHANGE = "partfin.watermark-policy.change"
# JSON {"budget", "delay-s", "records", "learned-at-us"}: what a late-budget policy learned from the ledger, and when
PROP_LATE_BUDGET_LEARNED = "partfin.watermark.late-budget"
PROP_SOURCE_TABLE = "partfin.source-table"
PROP_SOURCE_SNAPSHOT_ID = "partfin.source-snapshot-id"
PROP_FUTURE_TOLERANCE = "partfin.event-time.future-tolerance"  # cdc: how far past the commit clock an event time is plausible (default 5m)
PROP_BASE_BUCKETS = "partfin.base.buckets"  # on base.<table>: bucket count of the current spec (`partfin base rebucket` grows it)
PROP_DELTA_COLUMNS = "partfin.write.parquet.delta-columns"  # comma-separated columns partfin writes DELTA_BINARY_PACKED (base: key, ordering)
PROP_FINALIZED_TAG_MAX_AGE = "partfin.finalized-tag.max-age"  # on base.<table>: how long a finalized-<hour> tag is kept (default 7d; finalization/tags.py)

# snapshot refs
MERGED_TAG = "partfin-base-merged"  # on cdc.<table>: the snapshot base.<table> merged up to (expiry keeps it)

# writers and progress streams of cdc.<table> (iceberg/streams.py): one property per writer / stream
PROP_WRITER_PREFIX = "partfin.writer."  # + writer id: JSON {"checkpoint", "offset"}, the committed position
PROP_STREAM_PREFIX = "partfin.stream."  # + stream id: JSON {"writer", "progress", "seen", "state", "since", "steady"}
PROP_WRITER_CLOCK_PREFIX = "partfin.writer-clock."  # + writer id: JSON {"ahead-of", "ahead-by-s", "found"}: its clock found ahead
PROP_STREAMS_IDLE_TIMEOUT = "partfin.streams.idle-timeout"  # e.g. 15m (default): a stream silent this long stops holding the watermark


# the late-data ledger <cdc table>__ledger (iceberg/ledger.py)
PROP_LATE_ACK_PREFIX = "partfin.late-data.ack."  # + hour (ISO Z), on cdc.<table>: JSON {"through_sequence", "through_commit", "late_records", "by", "at", "reason"}
PROP_LEDGER_PREFIX = "partfin.ledger."  # + writer id: the last checkpoint id the ledger holds for that writer
LEDGER_CHECKPOINTS = "partfin.ledger.checkpoints"  # ledger commit summary: JSON {writer id: last checkpoint id recorded}


# values of partfin.job-kind: the job kinds of the conflict matrix (docs/concurrency.md)
class JobKind(enum.StrEnum):
    INTO = "INTO"
    OVERWRITE = "OVERWRITE"
    UPDATE_DELETE = "UPDATE/DELETE"
    MERGE = "MERGE"
