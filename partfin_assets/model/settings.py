"""partfin's settings: every PARTFIN_* environment variable, read in this one place.

The CLI and the catalog read the values (`Settings.from_env()`); the Dagster resources are
configured with `dagster.EnvVar(<variable>)` for each variable that is set (`Settings.variable`),
so the UI shows the variable's name, never its value. `SECRET_FIELDS` hold connection strings
with passwords: they are only ever shown redacted (model/redaction.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from partfin_assets.model.errors import PartfinConfigError

SECRET_FIELDS = ("catalog_uri", "source")
# the first hour partition of a table declaration that names none (PARTFIN_PARTITIONS_START overrides): the downstream
# runs no hour before it, so late records there need no re-run (finalization/table_checks.py, `partfin status`)
DEFAULT_PARTITIONS_START = "2026-01-01-00:00"
KAFKA_PREFIX = "PARTFIN_KAFKA_"


@dataclass(frozen=True)
class Settings:
    home: str | None = field(default=None, metadata={"env": "PARTFIN_HOME"})  # SQLite catalog + warehouse (default ./.partfin)
    catalog_uri: str | None = field(default=None, metadata={"env": "PARTFIN_CATALOG_URI"})  # SQLAlchemy URI of the SqlCatalog
    catalog_name: str | None = field(default=None, metadata={"env": "PARTFIN_CATALOG"})  # a named PyIceberg catalog
    source: str | None = field(default=None, metadata={"env": "PARTFIN_SOURCE"})  # replaces every table's declared source
    partitions_start: str | None = field(default=None, metadata={"env": "PARTFIN_PARTITIONS_START"})
    max_records: int = field(default=20_000, metadata={"env": "PARTFIN_MAX_RECORDS"})
    max_checkpoints_per_run: int = field(default=500, metadata={"env": "PARTFIN_MAX_CHECKPOINTS_PER_RUN"})
    max_seconds_per_run: float = field(default=45.0, metadata={"env": "PARTFIN_MAX_SECONDS_PER_RUN"})
    # how long a command waits for the SQLite catalog database another process holds locked before it gives up
    # (exit 75): longer than a Kafka member's default session timeout (45 s), so a member frozen while it commits
    # is out of its group before the others give up on it (iceberg/catalog.py)
    catalog_lock_wait_s: float = field(default=60.0, metadata={"env": "PARTFIN_CATALOG_LOCK_WAIT"})
    # a source message (a Debezium line, a Kafka value) longer than this is rejected unparsed (sources/debezium_json.py)
    max_message_bytes: int = field(default=64 * 1024 * 1024, metadata={"env": "PARTFIN_MAX_MESSAGE_BYTES"})
    # the sensor / schedule kinds started on, comma separated; unset: all, empty: none
    sensors: str | None = field(default=None, metadata={"env": "PARTFIN_SENSORS", "empty_is_value": True})
    schedules: str | None = field(default=None, metadata={"env": "PARTFIN_SCHEDULES", "empty_is_value": True})
    intervals: Mapping[str, int] = field(default_factory=dict)  # PARTFIN_<KIND>_INTERVAL: sensor kind -> seconds
    # PARTFIN_KAFKA_<NAME> -> value: librdkafka properties of the Kafka source (sources/kafka.py), secrets among them
    kafka_variables: Mapping[str, str] = field(default_factory=dict, repr=False)
    present: frozenset[str] = frozenset()  # the fields whose variable is set

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        environ = os.environ if environ is None else environ
        values: dict = {}
        for f in dataclasses.fields(cls):
            variable = f.metadata.get("env")
            text = environ.get(variable) if variable else None
            if text is None or (text == "" and not f.metadata.get("empty_is_value")):
                continue
            values[f.name] = _parse(variable, text, f.default)
        intervals = {
            name[len("PARTFIN_") : -len("_INTERVAL")].lower(): _parse(name, text, 0)
            for name, text in environ.items()
            if name.startswith("PARTFIN_") and name.endswith("_INTERVAL") and text and not name.startswith(KAFKA_PREFIX)
        }
        kafka = {name: text for name, text in environ.items() if name.startswith(KAFKA_PREFIX) and len(name) > len(KAFKA_PREFIX)}
        return cls(**values, intervals=intervals, kafka_variables=kafka, present=frozenset(values))

    @staticmethod
    def variable(name: str) -> str:
        """The environment variable of field `name`."""
        return next(f.metadata["env"] for f in dataclasses.fields(Settings) if f.name == name)

    def secrets(self) -> tuple[str, ...]:
        """The configured connection strings (to mask their passwords wherever they appear)."""
        return tuple(value for value in (getattr(self, name) for name in SECRET_FIELDS) if value)


def _parse(variable: str, text: str, default: object) -> object:
    if isinstance(default, bool) or not isinstance(default, (int, float)):
        return text
    try:
        return type(default)(text)
    except ValueError:
        raise PartfinConfigError(f"{variable}={text!r} is not a number") from None
