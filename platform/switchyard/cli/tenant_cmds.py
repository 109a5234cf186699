"""``switchyard tenants``: tenants, their tiers, home regions and limit overrides."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

from switchyard.cli.context import cli_author, cli_origin
from switchyard.cli.database import change_keys, open_session
from switchyard.cli.tenancy import (
    check_tier,
    limits_arg,
    region_arg,
    region_option,
    shown_limits,
    shown_region,
    warn_unknown_region,
)

if TYPE_CHECKING:
    from sqlmodel import Session


@click.group()
def tenants() -> None:
    """Tenants and their tiers."""


@tenants.command("create")
@click.argument("name")
@click.option("--tier", required=True, help="A tier of the active policy.")
@click.option("--region", default=None, callback=region_option,
              help="The home region of the tenant's keys (those without one of their own).")
def tenants_create(name: str, tier: str, region: str | None) -> None:
    """Create tenant NAME in a tier."""
    from switchyard.store.models import TenantCreate
    from switchyard.store.tenants import create_tenant

    with open_session() as session:
        check_tier(session, tier)
        tenant = create_tenant(session, TenantCreate(name=name, tier=tier, region=region))
        warn_unknown_region(session, tenant.region)
    where = f", region {tenant.region}" if tenant.region is not None else ""
    click.echo(f"created tenant {tenant.name} (tier {tenant.tier}{where})")


@tenants.command("set-tier")
@click.argument("name")
@click.argument("tier")
@click.option("--author", default=None, help="Who changes it, for the audit log [default: cli:<OS user>].")
def tenants_set_tier(name: str, tier: str, author: str | None) -> None:
    """Move tenant NAME to TIER (every running gateway process applies it from its next request)."""
    from switchyard.store.audit import append_event
    from switchyard.store.tenants import get_tenant, set_tier

    actor, origin = cli_author(author), cli_origin()

    def move(session: Session) -> tuple[str, str]:
        check_tier(session, tier)
        previous = get_tenant(session, name).tier
        moved = set_tier(session, name, tier)
        append_event(session, actor=actor, origin=origin, action="tenant.tier", target=f"tenant:{name}",
                     detail={"tier": tier, "previous": previous})
        return moved.name, moved.tier

    moved_name, moved_tier = change_keys(move)
    click.echo(f"tenant {moved_name} is now in tier {moved_tier}")


@tenants.command("delete")
@click.argument("name")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--author", default=None, help="Who deletes it, for the audit log [default: cli:<OS user>].")
def tenants_delete(name: str, yes: bool, author: str | None) -> None:
    """Delete tenant NAME and everything it owns: keys (they stop working at the next request on every
    gateway process), files, batches, usage ledger rows, request-log rows. Refused while one of its
    batches may still run lines."""
    from switchyard.store.tenants import delete_tenant

    if not yes:
        click.confirm(f"delete tenant {name!r} with its keys, files, batches, usage and request log?", abort=True)
    actor, origin = cli_author(author), cli_origin()
    gone = change_keys(lambda session: delete_tenant(session, name, actor=actor, origin=origin))
    click.echo(f"deleted tenant {name}: {gone['keys']} key(s), {gone['files']} file(s), {gone['batches']} batch(es), "
               f"{gone['usage_rows']} usage row(s), {gone['request_log_rows']} request-log row(s)")


@tenants.command("set-region")
@click.argument("name")
@click.argument("region", required=False, callback=region_option)
@click.option("--clear", is_flag=True, help="Remove the tenant's home region.")
@click.option("--author", default=None, help="Who changes it, for the audit log [default: cli:<OS user>].")
def tenants_set_region(name: str, region: str | None, clear: bool, author: str | None) -> None:
    """Set tenant NAME's home region: routing prefers REGION for its keys that have none of their own."""
    from switchyard.store.tenants import set_tenant_region

    with open_session() as session:
        tenant = set_tenant_region(session, name, region_arg(region, clear), actor=cli_author(author),
                                   origin=cli_origin())
        warn_unknown_region(session, tenant.region)
    click.echo(f"tenant {tenant.name}: {shown_region(tenant.region)}")


@tenants.command("list")
@click.option("--json", "as_json", is_flag=True)
def tenants_list(as_json: bool) -> None:
    """List tenants."""
    from switchyard.store.tenants import list_tenants

    with open_session() as session:
        rows = list_tenants(session)
    if as_json:
        click.echo(json.dumps([r.model_dump(mode="json") for r in rows], indent=2))
        return
    for r in rows:
        click.echo(f"{r.name:<24} {r.tier:<16} {r.region or '-':<16} created {r.created_at:%Y-%m-%d %H:%M}")


@tenants.command("set-limits")
@click.argument("name")
@click.argument("limits", required=False)
@click.option("--clear", is_flag=True, help="Remove the override: the tier's limits apply again.")
@click.option("--author", default=None, help="Who changes it, for the audit log [default: cli:<OS user>].")
def tenants_set_limits(name: str, limits: str | None, clear: bool, author: str | None) -> None:
    """Override tenant NAME's limits: LIMITS is a JSON object shaped like a tier's `limits`
    (e.g. '{"tokens_per_minute": 50000, "tokens_per_day": null}'; null lifts that limit)."""
    from switchyard.store.usage import set_limits

    with open_session() as session:
        checked = set_limits(session, tenant=name, limits=limits_arg(limits, clear), actor=cli_author(author),
                             origin=cli_origin())
    click.echo(f"tenant {name}: {shown_limits(checked)}")
