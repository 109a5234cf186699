"""``switchyard db|keys|tenants``: the database, API keys and tenants."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import click
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError
from sqlmodel import Session

from switchyard.cli.context import cli_context
from switchyard.decide.policy_tests import compile_checked
from switchyard.policy import PolicyError, PolicySnapshot, read_policy_file
from switchyard.settings import Settings
from switchyard.store import db as store_db
from switchyard.store.errors import StoreError
from switchyard.store.keys import create_key, list_keys, revoke_key
from switchyard.store.models import TenantCreate
from switchyard.store.policy_versions import active_version
from switchyard.store.tenants import create_tenant, get_tenant, list_tenants, set_tier


def _engine(settings: Settings) -> Engine:
    engine = store_db.create_db_engine(settings.resolved_database_url)
    try:
        current = store_db.is_current(engine)
    except OperationalError as exc:
        raise click.ClickException(f"cannot reach the database: {exc.orig}") from None
    if not current:
        raise click.ClickException("the database schema is not current; run `switchyard db upgrade` first")
    return engine


@contextmanager
def open_session() -> Iterator[Session]:
    engine = _engine(cli_context().settings())
    try:
        with store_db.session_scope(engine) as session:
            yield session
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        engine.dispose()


def _policy(settings: Settings, session: Session) -> PolicySnapshot:
    """The policy tenants are checked against: the active version, else the policy file."""
    row = active_version(session)
    try:
        if row is not None and (settings.policy_source == "db" or not settings.policy_file.exists()):
            return compile_checked(row.yaml_text, f"policy version {row.number}", row.number)
        return compile_checked(read_policy_file(settings.policy_file), str(settings.policy_file))
    except PolicyError as error:
        raise click.ClickException(f"cannot check the tier against an invalid policy:\n{error}") from None


def _check_tier(session: Session, tier: str) -> None:
    snapshot = _policy(cli_context().settings(), session)
    if tier not in snapshot.tiers:
        raise click.ClickException(f"unknown tier {tier!r}; the policy ({snapshot.label}) has: "
                                   + ", ".join(snapshot.tiers))


# --- db --------------------------------------------------------------------------------------

@click.group()
def db() -> None:
    """The database schema (Alembic migrations; SQLite or PostgreSQL)."""


@db.command()
def upgrade() -> None:
    """Apply every migration up to the newest."""
    settings = cli_context().settings()
    engine = store_db.create_db_engine(settings.resolved_database_url)
    try:
        store_db.upgrade(engine)
        click.echo(f"database at revision {store_db.current_revision(engine)} ({engine.url.render_as_string()})")
    except OperationalError as exc:
        raise click.ClickException(f"cannot reach the database: {exc.orig}") from None
    finally:
        engine.dispose()


@db.command()
def current() -> None:
    """Print the database's revision and whether it is the newest."""
    settings = cli_context().settings()
    engine = store_db.create_db_engine(settings.resolved_database_url)
    try:
        rev, head = store_db.current_revision(engine), store_db.head_revision()
    except OperationalError as exc:
        raise click.ClickException(f"cannot reach the database: {exc.orig}") from None
    finally:
        engine.dispose()
    click.echo(f"{rev or 'empty'} ({'current' if rev == head else f'behind head {head}'})")


# --- tenants ---------------------------------------------------------------------------------

@click.group()
def tenants() -> None:
    """Tenants and their tiers."""


@tenants.command("create")
@click.argument("name")
@click.option("--tier", required=True, help="A tier of the active policy.")
def tenants_create(name: str, tier: str) -> None:
    """Create tenant NAME in a tier."""
    with open_session() as session:
        _check_tier(session, tier)
        tenant = create_tenant(session, TenantCreate(name=name, tier=tier))
    click.echo(f"created tenant {tenant.name} (tier {tenant.tier})")


@tenants.command("set-tier")
@click.argument("name")
@click.argument("tier")
def tenants_set_tier(name: str, tier: str) -> None:
    """Move tenant NAME to TIER."""
    with open_session() as session:
        _check_tier(session, tier)
        tenant = set_tier(session, name, tier)
    click.echo(f"tenant {tenant.name} is now in tier {tenant.tier}")


@tenants.command("list")
@click.option("--json", "as_json", is_flag=True)
def tenants_list(as_json: bool) -> None:
    """List tenants."""
    with open_session() as session:
        rows = list_tenants(session)
    if as_json:
        click.echo(json.dumps([r.model_dump(mode="json") for r in rows], indent=2))
        return
    for r in rows:
        click.echo(f"{r.name:<24} {r.tier:<16} created {r.created_at:%Y-%m-%d %H:%M}")


# --- keys ------------------------------------------------------------------------------------

@click.group()
def keys() -> None:
    """API keys (stored hashed; a key is shown once, when it is created)."""


@keys.command("create")
@click.option("--tenant", required=True, help="The tenant the key speaks for (created if new).")
@click.option("--tier", default=None, help="The tier of a new tenant.")
@click.option("--name", default=None, help="A label for the key.")
def keys_create(tenant: str, tier: str | None, name: str | None) -> None:
    """Create a key; prints the secret once on stdout, details on stderr."""
    with open_session() as session:
        try:
            existing = get_tenant(session, tenant)
        except StoreError:
            existing = None
        if existing is None:
            if tier is None:
                raise click.ClickException(f"tenant {tenant!r} does not exist; give --tier to create it")
            _check_tier(session, tier)
            create_tenant(session, TenantCreate(name=tenant, tier=tier))
        elif tier is not None and tier != existing.tier:
            raise click.ClickException(
                f"tenant {tenant!r} is in tier {existing.tier!r}; move it with "
                f"`switchyard tenants set-tier {tenant} {tier}`")
        secret, record = create_key(session, tenant, name)
    click.echo(secret)
    click.echo(f"created key {record.id} ({record.prefix}…) for tenant {record.tenant} (tier {record.tier}); "
               "it is shown only this once", err=True)


@keys.command("list")
@click.option("--tenant", default=None, help="Only this tenant's keys.")
@click.option("--json", "as_json", is_flag=True)
def keys_list(tenant: str | None, as_json: bool) -> None:
    """List keys (never their secrets)."""
    with open_session() as session:
        rows = list_keys(session, tenant)
    if as_json:
        click.echo(json.dumps([r.model_dump(mode="json") for r in rows], indent=2))
        return
    for r in rows:
        state = f"revoked {r.revoked_at:%Y-%m-%d %H:%M}" if r.revoked_at else "active"
        click.echo(f"{r.id:>5}  {r.prefix}…  {r.tenant:<20} {r.tier:<12} {state:<24} {r.name or ''}")


@keys.command("revoke")
@click.argument("key_id", type=int)
def keys_revoke(key_id: int) -> None:
    """Revoke key KEY_ID for good."""
    with open_session() as session:
        record = revoke_key(session, key_id)
    click.echo(f"revoked key {record.id} ({record.prefix}…) of tenant {record.tenant}")
