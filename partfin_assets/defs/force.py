"""Refuse unless forced: an asset run that would do something a user should confirm fails at once, saying how to force it."""

from __future__ import annotations

from dagster import AssetKey, Config, Failure


class ForceConfig(Config):
    force: bool = False  # do it anyway (the refusal says what that means)


def refused(reason: str, key: AssetKey, failure: type[Failure] = Failure) -> Failure:
    """The failure (never retried) for `reason`, naming the run config that forces the asset `key`."""
    return failure(
        description=f"{reason}. To do it anyway, set run config ops.{key.to_python_identifier()}.config.force: true.",
        allow_retries=False,
    )


def refuse_unless_forced(config: ForceConfig, reason: str | None, key: AssetKey, failure: type[Failure] = Failure) -> None:
    """Raise `refused(reason, key)` when there is a reason and the run is not forced."""
    if reason and not config.force:
        raise refused(reason, key, failure)
