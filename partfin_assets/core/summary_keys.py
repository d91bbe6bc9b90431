"""Snapshot-summary keys and table properties: the contract of DESIGN §4, in one place."""

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
# additions beyond DESIGN §4 (documented in the README)
LATE_RECORDS_TOTAL = "partfin.late-records.total"  # running total over the table's history
LATE_RECORDS_BY_HOUR = "partfin.late-records.by-hour"  # JSON {"<hour iso Z>": count}
REJECTED_RECORDS = "partfin.rejected-records"
COMMIT_ID = "partfin.commit-id"  # unique per commit attempt series: resolves unknown outcomes
JOB_KIND = "partfin.job-kind"

# table properties
PROP_WATERMARK = "partfin.watermark"
PROP_WATERMARK_POLICY = "partfin.watermark.policy"
PROP_SOURCE_TABLE = "partfin.source-table"
PROP_SOURCE_SNAPSHOT_ID = "partfin.source-snapshot-id"
