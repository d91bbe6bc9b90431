"""Catalog configuration: one place that turns the environment into an Iceberg catalog.

- default: a PyIceberg SqlCatalog on SQLite plus a file warehouse, both under PARTFIN_HOME
  (default ./.partfin): zero setup;
- PARTFIN_CATALOG_URI: any SQLAlchemy URI (e.g. postgresql+psycopg://...) for the SqlCatalog;
- PARTFIN_CATALOG=<name>: a named PyIceberg catalog (REST, Glue, Hive...) configured the
  PyIceberg way (~/.pyiceberg.yaml or PYICEBERG_CATALOG__<NAME>__* variables).

Misconfiguration raises PartfinConfigError with one line naming what to fix. Only a command that
writes creates the default catalog (`load(create=True)`); any other finds there is none
(NoCatalog) and leaves the directory as it was.

A table whose current metadata file is missing cannot be loaded: BrokenTable, one line naming
the file, for that table alone (SqlCatalog otherwise raises a bare FileNotFoundError).

A catalog database another process holds locked (SQLite: a writer frozen inside its commit) is waited for, with a
log line, up to PARTFIN_CATALOG_LOCK_WAIT (60 s); then the lock error ends the command (exit 75). A commit that
applied to the metadata it was built on but not to the current one (a concurrent expiry removed a snapshot it
names) is a lost compare-and-set: CommitFailedException, retried like any other.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import CommitFailedException, NamespaceAlreadyExistsError, NoSuchNamespaceError, NoSuchTableError
from pyiceberg.table import CommitTableResponse, StagedTable, Table
from pyiceberg.table.locations import load_location_provider
from pyiceberg.table.metadata import TableMetadata
from sqlalchemy import event
from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError

from partfin_assets.iceberg.commit import updated_metadata
from partfin_assets.model.errors import BrokenTable, PartfinConfigError, first_line, one_line
from partfin_assets.model.faults import faults
from partfin_assets.model.redaction import redact, secrets_redacted
from partfin_assets.model.settings import Settings

CATALOG_NAME = "partfin"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CatalogConfig:
    home: Path
    uri: str | None = None  # SQLAlchemy URI for the SqlCatalog
    named: str | None = None  # a PyIceberg catalog name
    lock_wait_s: float = Settings.catalog_lock_wait_s  # how long to wait for a catalog database another process locked

    @classmethod
    def from_env(cls, home: str | os.PathLike | None = None) -> CatalogConfig:
        settings = Settings.from_env()
        return cls(
            home=Path(home or settings.home or ".partfin").absolute(),
            uri=settings.catalog_uri,
            named=settings.catalog_name,
            lock_wait_s=settings.catalog_lock_wait_s,
        )

    @property
    def warehouse(self) -> str:
        return (self.home / "warehouse").as_uri()

    @property
    def sql_uri(self) -> str:
        return self.uri or f"sqlite:///{self.home / 'catalog.db'}"

    def describe(self) -> str:
        if self.named:
            return f"PyIceberg catalog {self.named!r} (PARTFIN_CATALOG)"
        return f"SQL catalog at {redact(self.sql_uri)}"

    @property
    def sqlite_path(self) -> Path | None:
        """The default catalog's database file (None for PARTFIN_CATALOG_URI or PARTFIN_CATALOG)."""
        return None if self.uri or self.named else self.home / "catalog.db"

    def exists(self) -> bool:
        """Whether the catalog is there to read: a configured one always is; the default one once a command created it."""
        return self.sqlite_path is None or self.sqlite_path.is_file()

    def load(self, create: bool = True) -> Catalog:
        """The catalog; without `create`, NoCatalog if the default one does not exist yet (nothing is created)."""
        if not create and not self.exists():
            raise NoCatalog(f"no partfin catalog at {self.home} (PARTFIN_HOME): nothing ingested there yet; "
                            "run `partfin ingest --table T --source ...` first, or set PARTFIN_HOME")
        if self.named:
            try:
                with secrets_redacted():
                    return load_catalog(self.named)
            except Exception as exc:  # pyiceberg raises several types for a bad config
                raise PartfinConfigError(
                    f"cannot load PyIceberg catalog {self.named!r} set by PARTFIN_CATALOG: {redact(one_line(exc))} "
                    f"(configure it in ~/.pyiceberg.yaml or PYICEBERG_CATALOG__{self.named.upper()}__* variables)"
                ) from exc

        if not self.uri:
            self.home.mkdir(parents=True, exist_ok=True)
        try:
            with secrets_redacted(self.uri):
                return self._sql_catalog()
        except Exception as exc:  # sqlalchemy raises driver-specific errors
            source = "PARTFIN_CATALOG_URI" if self.uri else "PARTFIN_HOME"
            raise PartfinConfigError(
                f"cannot reach the Iceberg catalog at {redact(self.sql_uri)}: {redact(one_line(exc), self.uri)} (check {source})"
            ) from exc  # a cause that showed a secret is already a RedactedError


    def _sql_catalog(self) -> SqlCatalog:
        """PyIceberg's SqlCatalog, safe when several processes create its tables at once.

        SqlCatalog checks whether its tables exist, then creates them: of processes starting together
        on a fresh catalog, the losers fail ("table iceberg_tables already exists" on SQLite, a
        unique violation on PostgreSQL). Once a winner has created them, a fresh attempt finds them.
        """
        attempts = 0
        while True:
            try:
                return _PartfinSqlCatalog(CATALOG_NAME, uri=self.sql_uri, warehouse=self.warehouse, lock_wait_s=self.lock_wait_s)
            except SQLAlchemyError as exc:
                attempts += 1
                if attempts == _INIT_ATTEMPTS or not _lost_creation_race(exc):
                    raise
                time.sleep(0.05 * attempts)


_INIT_ATTEMPTS = 5


class _LockWait(threading.local):
    """How long catalog calls wait for a database another process holds locked, and whether one is waiting already
    (per thread: a call made inside another one, as commit_table loads the table, leaves the waiting to the outer)."""

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s
        self.depth = 0
        self.gave_up = False  # a wait ran out and no call got through since: the calls that clean up do not wait again


def _locked(exc: BaseException) -> bool:
    return isinstance(exc, OperationalError) and "database is locked" in str(exc).lower()


def _waits_for_lock(method):
    """A catalog call that, while another process holds the SQLite catalog database locked, tries again (each try is
    SQLite's own 5 s wait) for up to the catalog's bound, saying so once, and then raises the lock error (exit 75).

    Nothing of a call that failed on the lock is in the database, so trying it again is the call as if it came later;
    a commit whose metadata file was written is one more unreferenced file, which orphan removal deletes.
    """

    @functools.wraps(method)
    def waiting(self, *args, **kwargs):
        wait = self._lock_wait
        if wait.depth or wait.gave_up:
            result = method(self, *args, **kwargs)
            wait.gave_up = False
            return result
        wait.depth += 1
        started: float | None = None
        try:
            while True:
                try:
                    result = method(self, *args, **kwargs)
                except Exception as exc:
                    if not _locked(exc):
                        _free_again(started)
                        raise
                    now = time.monotonic()
                    if started is None:
                        started = now - _SQLITE_BUSY_TIMEOUT_S
                        log.warning("the catalog database is locked by another process: waiting for it (up to %g s, "
                                    "PARTFIN_CATALOG_LOCK_WAIT)", wait.bound_s)
                    if now - started >= wait.bound_s:
                        wait.gave_up = True
                        raise
                    continue
                _free_again(started)
                return result
        finally:
            wait.depth -= 1

    return waiting


def _free_again(waiting_since: float | None) -> None:
    if waiting_since is not None:
        log.warning("the catalog database is free again after %.0f s: going on", time.monotonic() - waiting_since)


_SQLITE_BUSY_TIMEOUT_S = 5.0  # Python's sqlite3 waits this long for a lock before it reports one (its default timeout)


class NoCatalog(PartfinConfigError):
    """The default catalog does not exist yet: nothing was ingested under this PARTFIN_HOME."""


class _PartfinSqlCatalog(SqlCatalog):
    """PyIceberg's SqlCatalog, with a table whose current metadata file is gone reported as BrokenTable, and the
    metadata it read or committed last kept by location.

    A metadata file never changes once written (every commit writes a new one under a new name), so the catalog row's
    location says whether the metadata in hand is still current. PyIceberg reads and parses the whole file on every
    `load_table`, and `commit_table` loads the table once more to apply the updates to: two reads and parses per
    commit, each growing with the retained snapshots and properties. With the cache a writer that committed last
    reads only the catalog row.
    """

    _CACHED_METADATA = 8  # the tables one process commits to in turn: cdc, its ledger, its rejects, base, ...

    def __init__(self, *args, lock_wait_s: float = Settings.catalog_lock_wait_s, **kwargs) -> None:
        self._lock_wait = _LockWait(lock_wait_s)
        super().__init__(*args, **kwargs)
        self._metadata_by_location: OrderedDict[str, TableMetadata] = OrderedDict()
        # a fault point inside the catalog's write transaction, after its UPDATE took SQLite's write lock: a test
        # parks (and freezes) a process there to hold the lock the way a frozen member would
        event.listen(self.engine, "after_cursor_execute", _after_catalog_statement)

    def _remember(self, location: str, metadata: TableMetadata) -> None:
        cache = self._metadata_by_location
        cache[location] = metadata
        cache.move_to_end(location)
        while len(cache) > self._CACHED_METADATA:
            cache.popitem(last=False)

    def _convert_orm_to_iceberg(self, orm_table) -> Table:
        metadata = self._metadata_by_location.get(orm_table.metadata_location or "")
        if metadata is None:
            table = super()._convert_orm_to_iceberg(orm_table)
            self._remember(table.metadata_location, table.metadata)
            return table
        location = orm_table.metadata_location
        return Table(
            identifier=Catalog.identifier_to_tuple(orm_table.table_namespace) + (orm_table.table_name,),
            metadata=metadata,
            metadata_location=location,
            io=self._load_file_io(metadata.properties, location),
            catalog=self,
        )

    def _update_and_stage_table(self, current_table, table_identifier, requirements, updates) -> StagedTable:
        if current_table is None:  # a table being created: PyIceberg's own validation of the new metadata
            return super()._update_and_stage_table(current_table, table_identifier, requirements, updates)
        for requirement in requirements:
            requirement.validate(current_table.metadata)
        metadata = updated_metadata(current_table.metadata, updates, current_table.metadata_location)
        location = load_location_provider(metadata.location, metadata.properties).new_table_metadata_file_location(
            self._parse_metadata_version(current_table.metadata_location) + 1
        )
        return StagedTable(identifier=table_identifier, metadata=metadata, metadata_location=location,
                           io=self._load_file_io(properties=metadata.properties, location=location), catalog=self)

    def commit_table(self, table: Table, requirements, updates) -> CommitTableResponse:
        try:
            response = super().commit_table(table, requirements, updates)
        except ValueError as exc:
            if not _applies_to(table.metadata, updates):
                raise  # the update is wrong on the metadata it was built on too: a bug, not a race
            # It applied to the metadata the commit was built on, not to the current one: a concurrent commit changed
            # what it refers to (an expiry removed the snapshot a tag was to point at, or snapshots this expiry was to
            # remove). Nothing was written: a lost compare-and-set, retried on fresh metadata like any other.
            raise CommitFailedException(f"{'.'.join(table.name())} changed under this commit: {first_line(str(exc))}") from exc
        self._remember(response.metadata_location, response.metadata)
        return response

    def load_table(self, identifier) -> Table:
        try:
            return super().load_table(identifier)
        except FileNotFoundError as exc:
            name = identifier if isinstance(identifier, str) else ".".join(identifier)
            quoted = re.search(r"'([^']+\.metadata\.json)'", str(exc))  # pyarrow names it in its message only
            missing = exc.filename or (quoted[1] if quoted else first_line(str(exc)))
            raise BrokenTable(
                f"table {name} is broken: its current metadata file {missing} is missing; restore it from a backup "
                "(other tables are not affected)"
            ) from None


# Every catalog call that reads or writes the catalog database waits while another process holds it locked.
for _method in ("_init_catalog", "load_table", "commit_table", "table_exists", "create_table", "list_tables", "create_namespace",
                "load_namespace_properties", "list_namespaces", "drop_table", "purge_table", "rename_table", "register_table"):
    setattr(_PartfinSqlCatalog, _method, _waits_for_lock(getattr(_PartfinSqlCatalog, _method)))


def _after_catalog_statement(conn, cursor, statement: str, parameters, context, executemany) -> None:
    if statement.lstrip().upper().startswith("UPDATE ICEBERG_TABLES"):
        faults().pause_point("catalog-commit-locked")


def _applies_to(metadata: TableMetadata, updates) -> bool:
    try:
        updated_metadata(metadata, tuple(updates))
    except ValueError:
        return False
    return True


def _lost_creation_race(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, IntegrityError) or "already exists" in text  # a locked database is waited for (_waits_for_lock)


def load_partfin_catalog(home: str | os.PathLike | None = None, *, create: bool = True) -> Catalog:
    return CatalogConfig.from_env(home).load(create)


def ensure_namespaces(catalog: Catalog, *namespaces: str) -> None:
    for namespace in namespaces:
        try:
            catalog.create_namespace(namespace)
        except NamespaceAlreadyExistsError:
            pass
        except Exception:
            # Two processes creating it at once: PyIceberg's SqlCatalog checks, then inserts, and the
            # loser sees the database's unique-key violation instead of NamespaceAlreadyExistsError.
            if not _namespace_exists(catalog, namespace):
                raise


def _namespace_exists(catalog: Catalog, namespace: str) -> bool:
    try:
        catalog.load_namespace_properties(namespace)
        return True
    except NoSuchNamespaceError:
        return False


def load_table_if_exists(catalog: Catalog, identifier: str) -> Table | None:
    """The table, or None when it (or its namespace) does not exist yet."""
    try:
        return catalog.load_table(identifier)
    except (NoSuchTableError, NoSuchNamespaceError):
        return None


def load_existing_table(catalog: Catalog, identifier: str, hint: str = "") -> Table:
    """Load a table or raise one clear line saying which table or namespace is missing."""
    try:
        return catalog.load_table(identifier)
    except NoSuchNamespaceError as exc:
        namespace = identifier.split(".")[0]
        raise PartfinConfigError(
            f"namespace {namespace!r} does not exist in {catalog.name!r}; {hint or 'ingest into the table first'}"
        ) from exc
    except NoSuchTableError as exc:
        raise PartfinConfigError(
            f"table {identifier} does not exist in catalog {catalog.name!r}; {hint or 'ingest into it first'}"
        ) from exc
