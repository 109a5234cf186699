"""Console page: the forms that change tenants and their API keys.

Creating a tenant, moving it to another tier, deleting it, its limit override; creating a key,
revoking one, a key's own limits. Every change goes through the store's functions and is written to
the audit log in the same transaction; each answers with the pages of
:mod:`switchyard.admin.pages.tenants` (with the error, or a redirect: post/redirect/get, so a reload
repeats nothing). A new key's secret reaches the page the creating POST redirects to in a sealed,
short-lived cookie that page deletes (:mod:`switchyard.admin.reveal`), and nowhere else: not stored
(only its hash), not logged, not in a URL.

Roles: creating tenants and keys, revoking keys and changing a tier need ``admin``; limit
overrides need ``operator``.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlencode

from litestar import Response, post
from litestar.datastructures import FormMultiDict
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.plugins.htmx import HTMXRequest
from litestar.response import Redirect, Template
from sqlmodel import Session

from switchyard.admin.common import PageError
from switchyard.admin.dependencies import KeyChanger
from switchyard.admin.pages.tenants import (
    LIMIT_FIELDS,
    PAGES_DEPENDENCY,
    TenantPages,
    page_db,
    show_tenant,
    show_tenants,
    tenant_url,
)
from switchyard.admin.reveal import reveal_cookie
from switchyard.admin.session import console_origin
from switchyard.policy.snapshot import PolicySnapshot
from switchyard.store.audit import append_event
from switchyard.store.keys import create_key, revoke_key, tenant_of_key
from switchyard.store.models import ApiKeyPublic, TenantCreate, TenantPublic
from switchyard.store.tenants import create_tenant, delete_tenant, get_tenant, set_tier
from switchyard.store.usage import set_limits

#: Names the console accepts for a new tenant (they appear in console URLs).
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
KEY_NAME_MAX = 128
#: A form value that lifts a limit (stored as null: no limit, whatever the tier says).
UNLIMITED = ("none", "unlimited")


def _text(form: FormMultiDict, name: str) -> str:
    value = form.get(name)
    return value.strip() if isinstance(value, str) else ""


# --- checks --------------------------------------------------------------------------------------

def _check_tier(snapshot: PolicySnapshot, tier: str) -> str:
    """The CLI's check: a tier must be one of the active policy's."""
    if not tier:
        raise PageError("choose a tier")
    if tier not in snapshot.tiers:
        raise PageError(f"unknown tier {tier!r}; the policy ({snapshot.label}) has: {', '.join(snapshot.tiers)}")
    return tier


def _check_region(snapshot: PolicySnapshot, region: str) -> str | None:
    if not region:
        return None
    if region not in snapshot.document.regions:
        raise PageError(f"unknown region {region!r}; the policy ({snapshot.label}) has: "
                        f"{', '.join(snapshot.document.regions)}")
    return region


def _limits_of(form: FormMultiDict) -> dict[str, Any] | None:
    """The override a limits form asks for: a field left empty is not overridden, ``none`` lifts the
    limit, anything else is the limit's value (the store validates it); ``None`` clears the override."""
    if _text(form, "clear"):
        return None
    limits: dict[str, Any] = {}
    for name in LIMIT_FIELDS:
        value = _text(form, name)
        if not value:
            continue
        limits[name] = None if value.lower() in UNLIMITED else value.replace(",", "").replace("_", "")
    return limits or None


# --- handlers ------------------------------------------------------------------------------------

@post("/tenants", opt={"role": "admin"}, include_in_schema=False, dependencies=PAGES_DEPENDENCY)
async def tenants_create(request: HTMXRequest, pages: NamedDependency[TenantPages]) -> Response[Any]:
    """Create a tenant in a tier of the active policy (audited as ``tenant.create``)."""
    form = await request.form()
    values = {"name": _text(form, "name"), "tier": _text(form, "tier"), "region": _text(form, "region")}
    snapshot = pages.policy.snapshot
    actor, origin = console_origin(request)
    try:
        name = values["name"]
        if TENANT_NAME.fullmatch(name) is None:
            raise PageError(f"invalid tenant name {name!r}: 1 to 64 letters, digits, '.', '_' or '-', "
                            "starting with a letter or digit")
        tier = _check_tier(snapshot, values["tier"])
        region = _check_region(snapshot, values["region"])

        def create(session: Session) -> TenantPublic:
            tenant = create_tenant(session, TenantCreate(name=name, tier=tier, region=region))
            append_event(session, actor=actor, origin=origin, action="tenant.create", target=f"tenant:{name}",
                         detail={"tier": tier, "region": region})
            return tenant

        await page_db(pages.db, create)
    except PageError as exc:
        return await show_tenants(request, pages, error=exc.message, status=exc.status, values=values)
    return Redirect(path=tenant_url(name), status_code=303)


@post("/tenants/{name:str}/tier", opt={"role": "admin"}, include_in_schema=False, dependencies=PAGES_DEPENDENCY)
async def tenant_tier(request: HTMXRequest, pages: NamedDependency[TenantPages],
                      change_keys: NamedDependency[KeyChanger], name: FromPath[str]) -> Response[Any]:
    """Move a tenant to another tier of the active policy (audited as ``tenant.tier``)."""
    form = await request.form()
    actor, origin = console_origin(request)
    try:
        tier = _check_tier(pages.policy.snapshot, _text(form, "tier"))

        def move(session: Session) -> None:
            previous = get_tenant(session, name).tier
            set_tier(session, name, tier)
            append_event(session, actor=actor, origin=origin, action="tenant.tier", target=f"tenant:{name}",
                         detail={"tier": tier, "previous": previous})

        await page_db(pages.db, move, keys=change_keys)
    except PageError as exc:
        return await show_tenant(request, pages, name, error=exc.message, status=exc.status)
    return Redirect(path=tenant_url(name), status_code=303)


@post("/tenants/{name:str}/delete", opt={"role": "admin"}, include_in_schema=False, dependencies=PAGES_DEPENDENCY)
async def tenant_delete(request: HTMXRequest, pages: NamedDependency[TenantPages],
                        change_keys: NamedDependency[KeyChanger], name: FromPath[str]) -> Response[Any]:
    """Delete a tenant with its keys, files, batches, usage and request log (audited as ``tenant.delete``);
    its keys stop working at the next request on every gateway process. The form repeats the name."""
    form = await request.form()
    actor, origin = console_origin(request)
    try:
        if _text(form, "confirm") != name:
            raise PageError(f"type the tenant's name ({name}) to confirm its deletion")
        await page_db(pages.db, lambda s: delete_tenant(s, name, actor=actor, origin=origin), keys=change_keys)
    except PageError as exc:
        return await show_tenant(request, pages, name, error=exc.message, status=exc.status)
    return Redirect(path="/admin/tenants", status_code=303)


@post("/tenants/{name:str}/limits", opt={"role": "operator"}, include_in_schema=False, dependencies=PAGES_DEPENDENCY)
async def tenant_limits(request: HTMXRequest, pages: NamedDependency[TenantPages],
                        name: FromPath[str]) -> Response[Any]:
    """Set or clear a tenant's override of its tier's limits (``store.usage.set_limits`` audits it)."""
    form = await request.form()
    actor, origin = console_origin(request)
    try:
        limits = _limits_of(form)
        await page_db(pages.db, lambda s: set_limits(s, tenant=name, limits=limits, actor=actor, origin=origin))
    except PageError as exc:
        values = {f: _text(form, f) for f in LIMIT_FIELDS}
        return await show_tenant(request, pages, name, error=exc.message, status=exc.status, values=values)
    return Redirect(path=tenant_url(name), status_code=303)


@post("/tenants/{name:str}/keys", opt={"role": "admin"}, include_in_schema=False, dependencies=PAGES_DEPENDENCY)
async def tenant_key_create(request: HTMXRequest, pages: NamedDependency[TenantPages],
                            name: FromPath[str]) -> Response[Any]:
    """Create a key and redirect to the tenant page, which shows the secret this once (a reload of that
    page shows it no more and creates nothing)."""
    form = await request.form()
    actor, origin = console_origin(request)
    try:
        label = _text(form, "name") or None
        if label is not None and len(label) > KEY_NAME_MAX:
            raise PageError(f"a key's name has at most {KEY_NAME_MAX} characters")
        region = _check_region(pages.policy.snapshot, _text(form, "region"))

        def create(session: Session) -> tuple[str, ApiKeyPublic]:
            secret, record = create_key(session, name, label, region)
            append_event(session, actor=actor, origin=origin, action="key.create", target=f"key:{record.id}",
                         detail={"tenant": name, "prefix": record.prefix, "name": label, "region": region})
            return secret, record

        secret, record = await page_db(pages.db, create)
    except PageError as exc:
        return await show_tenant(request, pages, name, error=exc.message, status=exc.status)
    page = tenant_url(name)
    sealed = reveal_cookie(pages.settings, request, name, page,
                           {"secret": secret, "id": record.id, "prefix": record.prefix, "name": record.name})
    return Redirect(path=page, status_code=303, cookies=[sealed])


async def _key_tenant(pages: TenantPages, key_id: int) -> str | None:
    return await page_db(pages.db, lambda s: tenant_of_key(s, key_id))


async def _key_error(request: HTMXRequest, pages: TenantPages, key_id: int, exc: PageError) -> Template:
    tenant = await _key_tenant(pages, key_id)
    if tenant is None:
        return await show_tenants(request, pages, error=exc.message, status=exc.status)
    return await show_tenant(request, pages, tenant, error=exc.message, status=exc.status)


@post("/keys/{key_id:int}/revoke", opt={"role": "admin"}, include_in_schema=False, dependencies=PAGES_DEPENDENCY)
async def key_revoke(request: HTMXRequest, pages: NamedDependency[TenantPages],
                     change_keys: NamedDependency[KeyChanger], key_id: FromPath[int]) -> Response[Any]:
    """Revoke a key for good (audited as ``key.revoke``)."""
    actor, origin = console_origin(request)

    def revoke(session: Session) -> ApiKeyPublic:
        record = revoke_key(session, key_id)
        append_event(session, actor=actor, origin=origin, action="key.revoke", target=f"key:{key_id}",
                     detail={"tenant": record.tenant, "prefix": record.prefix})
        return record

    try:
        record = await page_db(pages.db, revoke, keys=change_keys)
    except PageError as exc:
        return await _key_error(request, pages, key_id, exc)
    return Redirect(path=f"{tenant_url(record.tenant)}?{urlencode({'revoked': record.prefix})}", status_code=303)


@post("/keys/{key_id:int}/limits", opt={"role": "operator"}, include_in_schema=False, dependencies=PAGES_DEPENDENCY)
async def key_limits(request: HTMXRequest, pages: NamedDependency[TenantPages], key_id: FromPath[int]) -> Response[Any]:
    """Set or clear a key's own limits, charged on top of its tenant's (audited by the store)."""
    form = await request.form()
    actor, origin = console_origin(request)
    try:
        limits = _limits_of(form)
        await page_db(pages.db, lambda s: set_limits(s, key_id=key_id, limits=limits, actor=actor, origin=origin))
        tenant = await _key_tenant(pages, key_id)
    except PageError as exc:
        return await _key_error(request, pages, key_id, exc)
    return Redirect(path=tenant_url(tenant or ""), status_code=303)


ROUTES: list[Any] = [tenants_create, tenant_tier, tenant_delete, tenant_limits, tenant_key_create, key_revoke,
                     key_limits]
