"""``switchyard db|keys|tenants|usage``: the database, API keys, tenants, their limits and home regions, the
usage ledger."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, TypeVar

import click
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError
from sqlmodel import Session

from switchyard.cli.context import cli_author, cli_context, cli_origin
from switchyard.decide.policy_tests import compile_checked
from switchyard.policy import PolicyError, PolicySnapshot, read_policy_file
from switchyard.policy.schema import Limits
from switchyard.settings import Settings
from switchyard.store import db as store_db
from switchyard.store.audit import append_event
from switchyard.store.errors import StoreError
from switchyard.store.key_changes import ACK_WAIT_S, Propagation, changing_keys
from switchyard.store.keys import create_key, list_keys, revoke_key, set_key_region
from switchyard.store.models import ApiKeyPublic, TenantCreate
from switchyard.store.policy_versions import active_version
from switchyard.store.regions import check_region
from switchyard.store.tenants import (
    create_tenant,
    delete_tenant,
    get_tenant,
    list_tenants,
    set_tenant_region,
    set_tier,
)
from switchyard.store.usage import set_limits, usage

T = TypeVar("T")


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


def change_keys(work: Callable[[Session], T]) -> T:
    """Run ``work`` (it revokes a key, deletes a tenant, moves one) in one transaction and wait until every
    running gateway process dropped what it changed from its key cache; says so on stderr."""
    engine = _engine(cli_context().settings())
    try:
        result, propagation = changing_keys(engine, work)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        engine.dispose()
    _propagated(propagation, engine.dialect.name)
    return result


def _propagated(propagation: Propagation, dialect: str) -> None:
    if not propagation.targets:
        return
    if dialect != "postgresql":
        click.echo("gateway processes on this database see the change at their next request", err=True)
    elif propagation.listeners == 0:
        click.echo("no gateway process listens on this database now (those that start see the change)", err=True)
    elif propagation.complete:
        click.echo(f"{propagation.listeners} gateway process(es) dropped it from their key cache "
                   f"({propagation.waited_s * 1000:.0f} ms)", err=True)
    else:
        click.echo(f"warning: {propagation.listeners - propagation.confirmed} of {propagation.listeners} gateway "
                   f"processes did not confirm within {ACK_WAIT_S:.0f} s; they may answer from their key cache until "
                   "it expires (SWITCHYARD_KEY_CACHE_TTL_S)", err=True)


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


def _warn_unknown_region(session: Session, region: str | None) -> None:
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


def _region_option(_ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A ``--region``/``REGION`` value, checked for its form before anything is written."""
    try:
        return check_region(value)
    except StoreError as exc:
        raise click.BadParameter(str(exc), param=param) from None


def _region_arg(region: str | None, clear: bool) -> str | None:
    if clear == (region is not None):
        raise click.UsageError("give REGION, or --clear")
    return region


def _shown_region(region: str | None) -> str:
    return "no region" if region is None else f"region {region}"


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
@click.option("--region", default=None, callback=_region_option,
              help="The home region of the tenant's keys (those without one of their own).")
def tenants_create(name: str, tier: str, region: str | None) -> None:
    """Create tenant NAME in a tier."""
    with open_session() as session:
        _check_tier(session, tier)
        tenant = create_tenant(session, TenantCreate(name=name, tier=tier, region=region))
        _warn_unknown_region(session, tenant.region)
    where = f", region {tenant.region}" if tenant.region is not None else ""
    click.echo(f"created tenant {tenant.name} (tier {tenant.tier}{where})")


@tenants.command("set-tier")
@click.argument("name")
@click.argument("tier")
@click.option("--author", default=None, help="Who changes it, for the audit log [default: cli:<OS user>].")
def tenants_set_tier(name: str, tier: str, author: str | None) -> None:
    """Move tenant NAME to TIER (every running gateway process applies it from its next request)."""
    actor, origin = cli_author(author), cli_origin()

    def move(session: Session) -> tuple[str, str]:
        _check_tier(session, tier)
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
    if not yes:
        click.confirm(f"delete tenant {name!r} with its keys, files, batches, usage and request log?", abort=True)
    actor, origin = cli_author(author), cli_origin()
    gone = change_keys(lambda session: delete_tenant(session, name, actor=actor, origin=origin))
    click.echo(f"deleted tenant {name}: {gone['keys']} key(s), {gone['files']} file(s), {gone['batches']} batch(es), "
               f"{gone['usage_rows']} usage row(s), {gone['request_log_rows']} request-log row(s)")


@tenants.command("set-region")
@click.argument("name")
@click.argument("region", required=False, callback=_region_option)
@click.option("--clear", is_flag=True, help="Remove the tenant's home region.")
@click.option("--author", default=None, help="Who changes it, for the audit log [default: cli:<OS user>].")
def tenants_set_region(name: str, region: str | None, clear: bool, author: str | None) -> None:
    """Set tenant NAME's home region: routing prefers REGION for its keys that have none of their own."""
    with open_session() as session:
        tenant = set_tenant_region(session, name, _region_arg(region, clear), actor=cli_author(author),
                                   origin=cli_origin())
        _warn_unknown_region(session, tenant.region)
    click.echo(f"tenant {tenant.name}: {_shown_region(tenant.region)}")


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
        click.echo(f"{r.name:<24} {r.tier:<16} {r.region or '-':<16} created {r.created_at:%Y-%m-%d %H:%M}")


@tenants.command("set-limits")
@click.argument("name")
@click.argument("limits", required=False)
@click.option("--clear", is_flag=True, help="Remove the override: the tier's limits apply again.")
@click.option("--author", default=None, help="Who changes it, for the audit log [default: cli:<OS user>].")
def tenants_set_limits(name: str, limits: str | None, clear: bool, author: str | None) -> None:
    """Override tenant NAME's limits: LIMITS is a JSON object shaped like a tier's `limits`
    (e.g. '{"tokens_per_minute": 50000, "tokens_per_day": null}'; null lifts that limit)."""
    with open_session() as session:
        checked = set_limits(session, tenant=name, limits=_limits_arg(limits, clear), actor=cli_author(author),
                             origin=cli_origin())
    click.echo(f"tenant {name}: {_shown(checked)}")


# --- keys ------------------------------------------------------------------------------------

@click.group()
def keys() -> None:
    """API keys (stored hashed; a key is shown once, when it is created)."""


@keys.command("create")
@click.option("--tenant", required=True, help="The tenant the key speaks for (created if new).")
@click.option("--tier", default=None, help="The tier of a new tenant.")
@click.option("--name", default=None, help="A label for the key.")
@click.option("--region", default=None, callback=_region_option,
              help="The key's own home region [default: none; its tenant's applies].")
def keys_create(tenant: str, tier: str | None, name: str | None, region: str | None) -> None:
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
        secret, record = create_key(session, tenant, name, region)
        _warn_unknown_region(session, record.region)
    click.echo(secret)
    where = f", home region {record.home_region}" if record.home_region is not None else ""
    click.echo(f"created key {record.id} ({record.prefix}…) for tenant {record.tenant} (tier {record.tier}{where}); "
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
        # The home region routing uses; "(tenant)" when it comes from the tenant, not the key.
        home = "-" if r.home_region is None else r.home_region + ("" if r.region is not None else " (tenant)")
        click.echo(f"{r.id:>5}  {r.prefix}…  {r.tenant:<20} {r.tier:<12} {home:<24} {state:<24} {r.name or ''}")


@keys.command("revoke")
@click.argument("key_id", type=int)
@click.option("--author", default=None, help="Who revokes it, for the audit log [default: cli:<OS user>].")
def keys_revoke(key_id: int, author: str | None) -> None:
    """Revoke key KEY_ID for good: every running gateway process refuses it from its next request."""
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
    with open_session() as session:
        checked = set_limits(session, key_id=key_id, limits=_limits_arg(limits, clear), actor=cli_author(author),
                             origin=cli_origin())
    click.echo(f"key {key_id}: {_shown(checked)}")


@keys.command("set-region")
@click.argument("key_id", type=int)
@click.argument("region", required=False, callback=_region_option)
@click.option("--clear", is_flag=True, help="Remove the key's own home region: its tenant's applies again.")
@click.option("--author", default=None, help="Who changes it, for the audit log [default: cli:<OS user>].")
def keys_set_region(key_id: int, region: str | None, clear: bool, author: str | None) -> None:
    """Give key KEY_ID a home region of its own (it takes precedence over its tenant's)."""
    with open_session() as session:
        record = set_key_region(session, key_id, _region_arg(region, clear), actor=cli_author(author),
                                origin=cli_origin())
        _warn_unknown_region(session, record.region)
    own = _shown_region(record.region)
    click.echo(f"key {key_id}: {own}" + ("" if record.region is not None or record.home_region is None
                                        else f" (its tenant's region {record.home_region} applies)"))


def _limits_arg(limits: str | None, clear: bool) -> dict[str, Any] | None:
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


def _shown(checked: Limits | None) -> str:
    return "no override" if checked is None else "limits " + json.dumps(checked.model_dump(exclude_unset=True))


# --- usage -----------------------------------------------------------------------------------

@click.command("usage")
@click.option("--tenant", default=None, help="Only this tenant.")
@click.option("--model", default=None, help="Only this model.")
@click.option("--since", type=click.DateTime(["%Y-%m-%d"]), default=None, help="First UTC day (YYYY-MM-DD).")
@click.option("--until", type=click.DateTime(["%Y-%m-%d"]), default=None, help="Last UTC day (YYYY-MM-DD).")
@click.option("--json", "as_json", is_flag=True)
def usage_cmd(tenant: str | None, model: str | None, since: datetime | None, until: datetime | None,
              as_json: bool) -> None:
    """The usage ledger: requests, tokens and spend per UTC day, tenant, key and model."""
    with open_session() as session:
        report = usage(session, tenant=tenant, model=model, since=since.date() if since else None,
                       until=until.date() if until else None)
    if as_json:
        click.echo(json.dumps(report.model_dump(mode="json"), indent=2))
        return
    click.echo(f"{'day':<10}  {'tenant':<20} {'key':>5}  {'model':<16} {'requests':>9} {'prompt':>10} "
               f"{'completion':>10} {'cached':>9} {'spend':>10}")
    for r in report.rows:
        click.echo(f"{r.day:%Y-%m-%d}  {r.tenant:<20} {r.key_id:>5}  {r.model:<16} {r.requests:>9} "
                   f"{r.prompt_tokens:>10} {r.completion_tokens:>10} {r.cached_tokens:>9} {r.spend:>10.4f}")
    t = report.totals
    click.echo(f"{'total':<10}  {'':<20} {'':>5}  {'':<16} {t.requests:>9} {t.prompt_tokens:>10} "
               f"{t.completion_tokens:>10} {t.cached_tokens:>9} {t.spend:>10.4f}")
