"""Refuse unless forced: an asset run that would do something a user should confirm fails at once, saying how to force it."""

from __future__ import annotations

from dagster import Config, Failure


class ForceConfig(Config):
    force: bool = False  # do it anyway (the refusal says what that means)


def refused(reason: str, op_name: str, failure: type[Failure] = Failure) -> Failure:
    """The failure (never retried) for `reason`, naming the run config that forces the asset op `op_name`."""
    return failure(
        description=f"{reason}. To do it anyway, set run config ops.{op_name}.config.force: true.",
        allow_retries=False,
    )


def refuse_unless_forced(config: ForceConfig, reason: str | None, op_name: str, failure: type[Failure] = Failure) -> None:
    """Raise `refused(reason, op_name)` when there is a reason and the run is not forced."""
    if reason and not config.force:
        raise refused(reason, op_name, failure)
