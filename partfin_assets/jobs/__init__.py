"""The write jobs (docs/concurrency.md) beside the writer: the Job and its conflict rules, upsert, replay, compaction, privacy delete, maintenance."""
