"""``switchyard keys``: API keys, their own limits and home regions."""

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
from switchyard.store.errors import StoreError

if TYPE_CHECKING:
    from sqlmodel import Session

    from switchyard.store.models import ApiKeyPublic


@click.group()
def keys() -> None:
    """API keys (stored hashed; a key is shown once, when it is created)."""


@keys.command("create")
@click.option("--tenant", required=True, help="The tenant the key speaks for (created if new).")
@click.option("--tier", default=None, help="The tier of a new tenant.")
@click.option("--name", default=None, help="A label for the key.")
@click.option("--region", default=None, callback=region_option,
              help="The key's own home region [default: none; its tenant's applies].")
def keys_create(tenant: str, tier: str | None, name: str | None, region: str | None) -> None:
    """Create a key; prints the secret once on stdout, details on stderr."""
    from switchyard.store.keys import create_key
    from switchyard.store.models import TenantCreate
    from switchyard.store.tenants import create_tenant, get_tenant

    with open_session() as session:
        try:
            existing = get_tenant(session, tenant)
        except StoreError:
            existing = None
        if existing is None:
            if tier is None:
                raise click.ClickException(f"tenant {tenant!r} does not exist; give --tier to create it")
            check_tier(session, tier)
            create_tenant(session, TenantCreate(name=tenant, tier=tier))
        elif tier is not None and tier != existing.tier:
            raise click.ClickException(
                f"tenant {tenant!r} is in tier {existing.tier!r}; move it with "
                f"`switchyard tenants set-tier {tenant} {tier}`")
        secret, record = create_key(session, tenant, name, region)
        warn_unknown_region(session, record.region)
    click.echo(secret)
    where = f", home region {record.home_region}" if record.home_region is not None else ""
    click.echo(f"created key {record.id} ({record.prefix}…) for tenant {record.tenant} (tier {record.tier}{where}); "
               "it is shown only this once", err=True)


@keys.command("create-many")
@click.option("--name", default=None, help="A label for every key.")
def keys_create_many(name: str | None) -> None:
    """Create one key for each TENANT TIER line on stdin (new tenants are created in TIER), in one transaction;
    prints {"tenant": secret, ...} as JSON once.

    Blank lines and lines starting with # are skipped. An existing tenant must be in the tier its line names.
    Nothing is written when one line fails.
    """
    import sys

    from switchyard.store.keys import create_key
    from switchyard.store.models import TenantCreate
    from switchyard.store.tenants import create_tenant, get_tenant

    wanted: list[tuple[str, str]] = []
    for number, line in enumerate(sys.stdin.read().splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) != 2:
            raise click.ClickException(f"line {number}: give TENANT TIER, got {line.strip()!r}")
        wanted.append((words[0], words[1]))
    secrets: dict[str, str] = {}
    with open_session() as session:
        checked: set[str] = set()
        for tenant, tier in wanted:
            if tenant in secrets:
                raise click.ClickException(f"tenant {tenant!r} is named twice")
            try:
                existing = get_tenant(session, tenant)
            except StoreError:
                existing = None
            if existing is None:
                if tier not in checked:
                    check_tier(session, tier)
                    checked.add(tier)
                create_tenant(session, TenantCreate(name=tenant, tier=tier))
            elif tier != existing.tier:
                raise click.ClickException(f"tenant {tenant!r} is in tier {existing.tier!r}, not {tier!r}")
            secrets[tenant], _ = create_key(session, tenant, name)
    click.echo(json.dumps(secrets))
    click.echo(f"created {len(secrets)} keys; each is shown only this once", err=True)


@keys.command("list")
@click.option("--tenant", default=None, help="Only this tenant's keys.")
@click.option("--json", "as_json", is_flag=True)
def keys_list(tenant: str | None, as_json: bool) -> None:
    """List keys (never their secrets)."""
    from switchyard.store.keys import list_keys

    with open_session() as session:
        rows = list_keys(session, tenant)
    if as_json:
        click.echo(json.dumps([r.model_dump(mode="json") for r in rows], indent=2))
        return
    for r in rows:
        state = f"revoked {r.revoked_at:%Y-%m-%d %H:%M}" if r.revoked_at else "active"
        # The home region routing uses; "(tenant)" when it comes from the tenant, not the key.
        home = "-" if r.home_region is None else r.home_region + ("" if r.region is not None else " (tenant)")
        click.echo(f"{r.id:>5}  {r.prefix}…  {r.tenant:<20} {r.tier:<12} {home:<24} {state:<24} {r.name or ''}")


@keys.command("revoke")
@click.argument("key_id", type=int)
@click.option("--author", default=None, help="Who revokes it, for the audit log [default: cli:<OS user>].")
def keys_revoke(key_id: int, author: str | None) -> None:
    """Revoke key KEY_ID for good: every running gateway process refuses it from its next request."""
    from switchyard.store.audit import append_event
    from switchyard.store.keys import revoke_key

    actor, origin = cli_author(author), cli_origin()

    def revoke(session: Session) -> ApiKeyPublic:
        record = revoke_key(session, key_id)
        append_event(session, actor=actor, origin=origin, action="key.revoke", target=f"key:{key_id}",
                     detail={"tenant": record.tenant, "prefix": record.prefix})
        return record

    record = change_keys(revoke)
    click.echo(f"revoked key {record.id} ({record.prefix}…) of tenant {record.tenant}")


@keys.command("set-limits")
@click.argument("key_id", type=int)
@click.argument("limits", required=False)
@click.option("--clear", is_flag=True, help="Remove the key's own limits.")
@click.option("--author", default=None, help="Who changes it, for the audit log [default: cli:<OS user>].")
def keys_set_limits(key_id: int, limits: str | None, clear: bool, author: str | None) -> None:
    """Give key KEY_ID limits of its own (JSON like a tier's `limits`), charged on top of its tenant's."""
    from switchyard.store.usage import set_limits

    with open_session() as session:
        checked = set_limits(session, key_id=key_id, limits=limits_arg(limits, clear), actor=cli_author(author),
                             origin=cli_origin())
    click.echo(f"key {key_id}: {shown_limits(checked)}")


@keys.command("set-region")
@click.argument("key_id", type=int)
@click.argument("region", required=False, callback=region_option)
@click.option("--clear", is_flag=True, help="Remove the key's own home region: its tenant's applies again.")
@click.option("--author", default=None, help="Who changes it, for the audit log [default: cli:<OS user>].")
def keys_set_region(key_id: int, region: str | None, clear: bool, author: str | None) -> None:
    """Give key KEY_ID a home region of its own (it takes precedence over its tenant's)."""
    from switchyard.store.keys import set_key_region

    with open_session() as session:
        record = set_key_region(session, key_id, region_arg(region, clear), actor=cli_author(author),
                                origin=cli_origin())
        warn_unknown_region(session, record.region)
    own = shown_region(record.region)
    click.echo(f"key {key_id}: {own}" + ("" if record.region is not None or record.home_region is None
                                        else f" (its tenant's region {record.home_region} applies)"))
