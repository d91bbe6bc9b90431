"""partfin: a completeness signal for stream-ingested Iceberg tables (see docs/index.md)."""

import os

# Arrow's buffers come from the C library's allocator unless the user chose one: Arrow's default, mimalloc, backs
# its heap with transparent huge pages that it hands back to the kernel and faults in again, zeroed 2 MB at a time,
# for every checkpoint's records; that kernel time grew with the processes sharing the cores (4 Kafka ingest
# processes on 2 cores: 5.5 % of all CPU). Set here, before anything imports pyarrow: Arrow reads it once, at load.
os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
