"""Live CDC from PostgreSQL: one table's changes through logical decoding (wal2json, format-version 2).

Plugin: wal2json (Debian: `postgresql-15-wal2json`); pgoutput would need a binary-protocol
parser, test_decoding a fragile text parser. Interface: the SQL functions
`pg_logical_slot_peek_changes` and `pg_replication_slot_advance`, not the streaming replication
protocol (psycopg 3 does not speak it). Peeking never consumes, so the slot moves only when told
that a position is committed, which is exactly what exactly-once needs. Each peek decodes from
the slot's confirmed position; because the slot follows the committed offset closely, a peek
re-decodes at most about one batch.

One module per part:

- `source.py`       PostgresSource: batches, on_committed, identity, table_spec
- `position.py`     LSNs and the offset recorded with every checkpoint
- `slot.py`         the replication slot and the commit/advance contract (exactly once)
- `fence.py`        the heartbeat fence: a database time before which everything was delivered
- `wal2json.py`     wal2json rows -> CDC records and rejected records
- `column_types.py` PostgreSQL types -> Arrow types and payload values
- `table.py`        the table's key, columns and replica identity from the catalog
- `connection.py`   sessions (UTC, ISO) and PostgresSourceError
- `spec.py`         the `postgres:DSN#schema.table,options` text

Misconfigurations raise PostgresSourceError (a SourceError: the CLI prints one line):
wal_level not logical, missing table, no usable key or replica identity, a role without
REPLICATION, a missing wal2json plugin, a slot of another plugin or database, a slot that
was dropped or moved past the committed offset.
"""

from partfin_assets.sources.postgres.connection import PostgresSourceError
from partfin_assets.sources.postgres.position import lsn_to_int, lsn_to_text
from partfin_assets.sources.postgres.source import PostgresSource
from partfin_assets.sources.postgres.spec import parse_postgres_spec

__all__ = ["PostgresSource", "PostgresSourceError", "lsn_to_int", "lsn_to_text", "parse_postgres_spec"]
