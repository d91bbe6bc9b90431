"""Turning core's plain partition metadata into Dagster metadata values."""

from __future__ import annotations

from typing import Any

from dagster import MetadataValue


def dagster_metadata(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if value is None:
            out[key] = MetadataValue.text("-")
        elif isinstance(value, bool):
            out[key] = MetadataValue.bool(value)
        elif isinstance(value, int):
            out[key] = MetadataValue.int(value)
        elif isinstance(value, float):
            out[key] = MetadataValue.float(value)
        elif isinstance(value, (dict, list)):
            out[key] = MetadataValue.json(value)
        else:
            out[key] = MetadataValue.text(str(value))
    return out
