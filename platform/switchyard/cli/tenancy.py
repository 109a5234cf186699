"""What ``switchyard tenants`` and ``switchyard keys`` share: tiers and regions checked against the policy,
and the REGION and LIMITS arguments."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from switchyard.cli.context import cli_context
from switchyard.store.errors import StoreError
from switchyard.store.regions import check_region

if TYPE_CHECKING:
    from sqlmodel import Session

    from switchyard.policy import PolicySnapshot
    from switchyard.policy.tiers import Limits
    from switchyard.settings import Settings


def _policy(settings: Settings, session: Session) -> PolicySnapshot:
    """The policy tenants are checked against: the active version, else the policy file."""
    from switchyard.decide.policy_tests import compile_checked
    from switchyard.policy import PolicyError, read_policy_file
    from switchyard.store.policy_versions import active_version

    row = active_version(session)
    try:
        if row is not None and (settings.policy_source == "db" or not settings.policy_file.exists()):
            return compile_checked(row.yaml_text, f"policy version {row.number}", row.number)
        return compile_checked(read_policy_file(settings.policy_file), str(settings.policy_file))
    except PolicyError as error:
        raise click.ClickException(f"cannot check the tier against an invalid policy:\n{error}") from None


def check_tier(session: Session, tier: str) -> None:
    """Refuse a tier the policy does not have.

    Raises:
        click.ClickException: Unknown tier (the message lists the policy's), or no valid policy to ask.
    """
    snapshot = _policy(cli_context().settings(), session)
    if tier not in snapshot.tiers:
        raise click.ClickException(f"unknown tier {tier!r}; the policy ({snapshot.label}) has: "
                                   + ", ".join(snapshot.tiers))


def warn_unknown_region(session: Session, region: str | None) -> None:
    """Warn (on stderr) when ``region`` is not one of the policy's regions.

    Only a warning: a home region may be stored ahead of the policy version that adds it; until
    then routing cannot prefer it.
    """
    if region is None:
        return
    try:
        snapshot = _policy(cli_context().settings(), session)
    except click.ClickException as exc:
        click.echo(f"warning: cannot check region {region!r} against the policy: {exc.message}", err=True)
        return
    regions = snapshot.document.regions
    if region not in regions:
        click.echo(f"warning: region {region!r} is not among the regions of the policy ({snapshot.label}): "
                   f"{', '.join(regions)}; it is stored, but routing cannot prefer it until the policy has it",
                   err=True)


def region_option(_ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A ``--region``/``REGION`` value, checked for its form before anything is written."""
    try:
        return check_region(value)
    except StoreError as exc:
        raise click.BadParameter(str(exc), param=param) from None


def region_arg(region: str | None, clear: bool) -> str | None:
    """The REGION argument, or None with ``--clear``; exactly one of the two must be given."""
    if clear == (region is not None):
        raise click.UsageError("give REGION, or --clear")
    return region


def shown_region(region: str | None) -> str:
    """A home region as the commands print it."""
    return "no region" if region is None else f"region {region}"


def limits_arg(limits: str | None, clear: bool) -> dict[str, Any] | None:
    """The LIMITS argument as a JSON object, or None with ``--clear``; exactly one of the two must be given."""
    if clear == (limits is not None):
        raise click.UsageError("give LIMITS as a JSON object, or --clear")
    if limits is None:
        return None
    try:
        value = json.loads(limits)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="LIMITS") from None
    if not isinstance(value, dict):
        raise click.BadParameter("must be a JSON object such as {\"tokens_per_minute\": 5000}", param_hint="LIMITS")
    return value


def shown_limits(checked: Limits | None) -> str:
    """A limits override as the commands print it."""
    return "no override" if checked is None else "limits " + json.dumps(checked.model_dump(exclude_unset=True))
