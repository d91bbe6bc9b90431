"""Tables are declared once here; every asset, check, job and sensor is generated from a declaration.

Adding a table = adding one PartfinTable to TABLES.
"""

from __future__ import annotations

from dataclasses import dataclass

from dagster import AssetKey, DefaultScheduleStatus, DefaultSensorStatus, HourlyPartitionsDefinition, sensor

from partfin_assets.finalization.hours import hour_from_key
from partfin_assets.model.defaults import MAINTENANCE_ORPHAN_AGE_S
from partfin_assets.model.settings import DEFAULT_PARTITIONS_START, Settings
from partfin_assets.model.tablespec import TableSpec
from partfin_assets.sources.synthetic import ORDERS_SPEC


@dataclass(frozen=True)
class PartfinTable:
    spec: TableSpec  # name, primary key, typed columns, watermark policy
    source: str  # CDC source spec: `synthetic[:opt=v,...]` or `debezium:PATH` (PARTFIN_SOURCE overrides)
    partitions_start: str = DEFAULT_PARTITIONS_START  # PARTFIN_PARTITIONS_START overrides
    # asset-check thresholds
    lag_warn_seconds: int = 3 * 3600  # cdc watermark older than this -> WARN
    lag_error_seconds: int = 6 * 3600  # ... -> ERROR
    base_max_lag_seconds: int = 2 * 3600  # cdc watermark - base watermark bound
    # cadence
    sync_interval_seconds: int = 30
    finalization_interval_seconds: int = 15
    checks_interval_seconds: int = 60
    # table maintenance jobs (defs/maintenance): cron schedules in UTC
    compaction_cron: str = "15 * * * *"  # compact_<name>: hourly, a quarter past (hours finalize on the hour)
    maintenance_cron: str = "30 3 * * *"  # maintain_<name>: daily
    policy_measurement_cron: str = "45 * * * *"  # measure_policy_<name>: the policy lab over the ledger, hourly
    orphan_min_age_seconds: int = MAINTENANCE_ORPHAN_AGE_S  # orphan-file removal never deletes younger files
    # ownership
    platform_owner: str = "team:platform"
    downstream_owner: str = "team:analytics"

    @property
    def name(self) -> str:
        return self.spec.name

    # Asset keys are one component, `<layer>_<table>`: Dagster 1.13's graph nodes show only a key's last component
    # and it has no display name for assets, so keys `cdc_orders` and `base_orders` both read "orders" (docs/dagster.md).
    def layer_key(self, layer: str, suffix: str = "") -> AssetKey:
        return AssetKey(f"{layer}_{self.name}{suffix}")

    @property
    def cdc_key(self) -> AssetKey:
        return self.layer_key("cdc")

    @property
    def base_key(self) -> AssetKey:
        return self.layer_key("base")

    @property
    def finalized_key(self) -> AssetKey:
        """The well-known key downstream teams subscribe to: one runless event per finalized hour."""
        return self.layer_key("finalized")

    @property
    def report_key(self) -> AssetKey:
        """The finalization report: an observable asset whose latest observation is the report (sync runs refresh it)."""
        return self.layer_key("report")

    @property
    def activity_key(self) -> AssetKey:
        return self.layer_key("activity", "_hourly")

    def previous_key(self, key: AssetKey) -> AssetKey | None:
        """The key the release before flat keys recorded `key`'s events under (`cdc/orders` for `cdc_orders`): an
        upgraded instance keeps those events, and they still count (docs/dagster.md, "Upgrading from `cdc/<table>` keys")."""
        previous = {self.cdc_key: AssetKey(["cdc", self.name]), self.base_key: AssetKey(["base", self.name]),
                    self.finalized_key: AssetKey(["finalized", self.name]),
                    self.activity_key: AssetKey(["activity", f"{self.name}_hourly"])}
        return previous.get(key)

    @property
    def platform_op_name(self) -> str:
        """The one op (a multi-asset) that writes cdc_<table> and base_<table>: the sync, or a manual partition."""
        return f"cdc_and_base_{self.name}"

    @property
    def downstream_tags(self) -> dict[str, str]:
        """Run tags of every downstream run of the table (dagster.yaml limits `partfin/downstream` per table)."""
        return {"partfin/table": self.name, "partfin/downstream": self.name}

    @property
    def start_key(self) -> str:
        return Settings.from_env().partitions_start or self.partitions_start

    @property
    def start_us(self) -> int:
        return hour_from_key(self.start_key)

    def partitions_def(self) -> HourlyPartitionsDefinition:
        # end_offset=1: the current (open) hour exists as a partition, so the CDC writer can
        # report it; downstream runs are gated by the watermark, not by the partition set.
        return HourlyPartitionsDefinition(start_date=self.start_key, end_offset=1, timezone="UTC")


SENSOR_KINDS = ("sync", "finalize", "checks")
SCHEDULE_KINDS = ("compact", "maintain", "measure")


def _enabled(kind: str, kinds: tuple[str, ...], wanted: str | None) -> bool:
    """All `kinds` start on unless `wanted` lists a subset (comma separated; empty: none)."""
    return kind in kinds if wanted is None else kind in {w.strip() for w in wanted.split(",")}


def sensor_default_status(kind: str):
    """Sensors start RUNNING; PARTFIN_SENSORS=finalize,checks (a subset of sync,finalize,checks) starts only those."""

    return DefaultSensorStatus.RUNNING if _enabled(kind, SENSOR_KINDS, Settings.from_env().sensors) else DefaultSensorStatus.STOPPED


def schedule_default_status(kind: str):
    """Schedules start RUNNING; PARTFIN_SCHEDULES=maintain (a subset of compact,maintain,measure; empty: none) starts only those."""

    enabled = _enabled(kind, SCHEDULE_KINDS, Settings.from_env().schedules)
    return DefaultScheduleStatus.RUNNING if enabled else DefaultScheduleStatus.STOPPED


def sensor_interval(kind: str, declared: int) -> int:
    """PARTFIN_<KIND>_INTERVAL (seconds) overrides a table's declared sensor interval (tests use short ones)."""
    return Settings.from_env().intervals.get(kind, declared)


TABLES: list[PartfinTable] = [
    PartfinTable(
        # the project's default policy (late-budget:0.001): the demo keeps the budget it states
        spec=ORDERS_SPEC,
        # orders are mostly new rows (a large key space), so base keeps rows in every hour
        source="synthetic:rate=2,hours=24,key_space=1000000",
    ),
]


def table_sensor(table: PartfinTable, kind: str, declared_interval: int, description: str, *, job=None, asset_selection=None):
    """The `@sensor` of one kind for one table: `<kind>_<table>_sensor`, its interval (overridable) and default status.
    It targets a `job`, or an `asset_selection` (the UI lists the sensor on those assets' pages; a job cannot hold an
    asset that only a sensor records, such as finalized_<table>)."""
    return sensor(name=f"{kind}_{table.name}_sensor", job=job, asset_selection=asset_selection,
                  minimum_interval_seconds=sensor_interval(kind, declared_interval),
                  default_status=sensor_default_status(kind), description=description)
