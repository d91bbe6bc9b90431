"""The names of progress streams a user gives (`partfin ingest --writer-id`, `partfin streams retire --stream`).

A writer id names a stream, the table properties and the ledger's rows of its writer, and begins its partition
streams' ids (`<writer id>/<partition>`). Kept free of heavy imports: the `partfin` argument parser checks a
writer id before any command runs (iceberg/streams.py holds the streams themselves).
"""

from __future__ import annotations

import re

from partfin_assets.model.errors import InvalidInput

RESERVED_STREAM_PREFIX = "partfin."  # partfin's own streams; no writer id starts with it (in any case)
PARTITION_SEPARATOR = "/"  # a partition's stream: <writer id>/<partition>
_WRITER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_PARTITION = re.compile(r"[A-Za-z0-9._-]{1,300}")  # Kafka: <topic>-<partition> (topic names use these characters)
WRITER_ID_FORM = ("1-128 ASCII letters, digits, '.', '_' or '-', starting with a letter or digit, "
                  f"not starting with {RESERVED_STREAM_PREFIX!r} (partfin's own streams)")


def check_writer_id(writer_id: str) -> str:
    """A writer id a user gives, if partfin can use it (see Names in the module docstring); else InvalidInput."""
    if not _WRITER_ID.fullmatch(writer_id) or writer_id.lower().startswith(RESERVED_STREAM_PREFIX):
        raise InvalidInput(f"writer id {writer_id!r} is not one partfin can use: {WRITER_ID_FORM}")
    return writer_id


def check_stream_id(stream_id: str) -> str:
    """A stream id a user gives: a writer id, or a writer's partition stream `<writer id>/<partition>`."""
    writer_id, separator, partition = stream_id.partition(PARTITION_SEPARATOR)
    try:
        check_writer_id(writer_id)
    except InvalidInput:
        pass
    else:
        if not separator or _PARTITION.fullmatch(partition):
            return stream_id
    raise InvalidInput(f"stream {stream_id!r} is not one partfin names: a writer id ({WRITER_ID_FORM}), "
                       f"or <writer id>/<partition> (letters, digits, '.', '_', '-')")
