"""A table is declared once; the CDC table, base table, assets and checks all derive from it."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

DEFAULT_WATERMARK_POLICY = "min-of-last:3"


@dataclass(frozen=True)
class TableSpec:
    name: str  # bare name: cdc.<name> and base.<name>
    primary_key: tuple[str, ...]
    # Typed columns of base.<name> (primary key included), mapped from the CDC payload.
    columns: dict[str, pa.DataType] = field(default_factory=dict)
    watermark_policy: str = DEFAULT_WATERMARK_POLICY

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"table name {self.name!r} must be a plain identifier (it becomes cdc.{self.name})")
        if not self.primary_key:
            raise ValueError(f"table {self.name!r} declares no primary key")
        missing = [c for c in self.primary_key if self.columns and c not in self.columns]
        if missing:
            raise ValueError(f"table {self.name!r}: primary-key column(s) {missing} are not among its columns")

    @property
    def cdc_identifier(self) -> str:
        return f"cdc.{self.name}"

    @property
    def base_identifier(self) -> str:
        return f"base.{self.name}"

    @property
    def rejected_identifier(self) -> str:
        return f"cdc.{self.name}__rejected"
