"""The write jobs of DESIGN §6 beside the writer: the Job and its conflict rules, upsert, replay, compaction, privacy delete, maintenance."""
