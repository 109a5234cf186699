"""Console page: tenants, as read.

``/admin/tenants`` lists tenants (with the form that creates one); ``/admin/tenants/{name}`` shows
one: its tier, its effective limits (the tier's, replaced field by field by the tenant's override)
with how much of each is in use, its keys, and the forms that change them. The forms post to
:mod:`switchyard.admin.pages.tenant_forms`, which answers with these pages. Reading needs ``viewer``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any, TypeVar
from urllib.parse import quote

import anyio
from litestar import get
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, FromQuery
from litestar.plugins.htmx import HTMXRequest
from litestar.response import Template
from sqlalchemy import Engine
from sqlmodel import Session

from switchyard.admin.common import PageError, in_db
from switchyard.admin.dependencies import KeyChanger
from switchyard.admin.reveal import REVEAL_COOKIE, forget_revealed, take_revealed
from switchyard.admin.session import current_user
from switchyard.api.errors import ApiError
from switchyard.decide.admit import LIMIT_PERIODS, Estimate, LimitCharge, limit_charges
from switchyard.figures import fixed, limit_amount, limit_label
from switchyard.gateway.admission import Admitter
from switchyard.gateway.policy_state import PolicyHolder
from switchyard.policy.snapshot import PolicySnapshot
from switchyard.policy.tiers import Limits
from switchyard.settings import Settings
from switchyard.store import errors as store_errors
from switchyard.store.admin_users import RANK
from switchyard.store.keys import key_limit_overrides, list_keys
from switchyard.store.limits import BucketState, charges_of
from switchyard.store.models import ApiKeyPublic, TenantPublic, UsageDailyPublic
from switchyard.store.tenants import get_tenant, limit_overrides, list_tenants
from switchyard.store.usage import usage

T = TypeVar("T")

#: Seconds the page waits for the limit store's counters before showing the page without them.
PEEK_TIMEOUT_S = 1.5
#: Days of the ledger the tenant page reads (the spend_per_month bucket refills over 30 days).
LEDGER_DAYS = 30

LIMIT_FIELDS = tuple(LIMIT_PERIODS)
_PERIOD_WORDS = {60.0: "minute", 86_400.0: "day", 30 * 86_400.0: "30 days"}


@dataclass(frozen=True, slots=True)
class TenantPages:
    """What the tenant pages read (injected as ``pages``, made of the console's own dependencies)."""

    settings: NamedDependency[Settings]
    policy: NamedDependency[PolicyHolder]
    db: NamedDependency[Engine]
    limits: NamedDependency[Admitter]


#: The ``dependencies`` of a tenant page's handler: its :class:`TenantPages`.
PAGES_DEPENDENCY = {"pages": Provide(TenantPages, sync_to_thread=False)}


async def page_db(db: Engine, work: Callable[[Session], T], *, keys: KeyChanger | None = None) -> T:
    """``in_db`` with the store's refusals as :class:`PageError` (a duplicate is 409, a missing record 404);
    ``keys``: a change of what key lookups answer, done through it once every gateway process dropped it."""
    try:
        return await in_db(db, work, keys=keys)
    except ApiError as exc:
        if exc.status_code >= 500:
            raise
        status = 409 if isinstance(exc.__context__, store_errors.Conflict) else exc.status_code
        raise PageError(exc.message, status) from None


def _num(value: float | None, unit: str = "tokens") -> str:
    return fixed(value, decimals=2 if unit == "spend" else 0, grouped=True, missing="unlimited")


def _shown_limits(limits: Mapping[str, Any] | None) -> str:
    """An override as one line: ``tokens per minute 5,000 tokens; tokens per day none``."""
    if not limits:
        return ""
    return "; ".join(f"{limit_label(name)} {limit_amount(name, value, missing='none')}"
                     for name, value in limits.items())


def _can(request: HTMXRequest, role: str) -> bool:
    return RANK[current_user(request).role] >= RANK[role]


# --- reading -------------------------------------------------------------------------------------

@dataclass
class _TenantData:
    tenant: TenantPublic
    limits: dict[str, Any] | None
    keys: list[ApiKeyPublic]
    key_limits: dict[int, Mapping[str, Any] | None]
    rows: list[UsageDailyPublic]  # the ledger's rows of the last LEDGER_DAYS days
    today: date


def _read_tenant(session: Session, name: str) -> _TenantData:
    row = get_tenant(session, name)
    keys = list_keys(session, name)
    key_limits = key_limit_overrides(session, row.id or 0)
    today = datetime.now(UTC).date()
    report = usage(session, tenant=name, since=today - timedelta(days=LEDGER_DAYS - 1))
    return _TenantData(TenantPublic.model_validate(row), row.limits, keys, key_limits, list(report.rows), today)


def _read_list(session: Session) -> dict[str, Any]:
    tenants = list_tenants(session)
    overrides = limit_overrides(session)
    active: dict[str, int] = {}
    for key in list_keys(session):
        if key.revoked_at is None:
            active[key.tenant] = active.get(key.tenant, 0) + 1
    rows = [{"tenant": t, "url": tenant_url(t.name), "active_keys": active.get(t.name, 0),
             "overrides": _shown_limits(overrides.get(t.name))} for t in tenants]
    return {"rows": rows}


@dataclass
class _Live:
    """The limit store's counters for some buckets, or why there are none."""

    states: dict[str, BucketState] = field(default_factory=dict)
    note: str | None = None


async def _peek(admitter: Admitter, settings: Settings, charges: list[LimitCharge]) -> _Live:
    """What the limit store's buckets of ``charges`` hold now (changing nothing)."""
    if not charges:
        return _Live()
    store = admitter.store
    if settings.redis_url is None:
        note = "Live counters of this gateway process (no Redis configured: each process counts its own)."
    else:
        note = "Live counters from the shared limit store (Redis)."
    if admitter.store_down:
        store = admitter.local
        note = "The shared limit store is unreachable: these are this process's fallback counters."
    try:
        with anyio.fail_after(PEEK_TIMEOUT_S):
            states = await store.peek([c.bucket for c in charges_of(charges)])
    except Exception as exc:  # the page still shows the ledger's figures
        return _Live(note=f"Live counters cannot be read right now ({exc.__class__.__name__}); "
                          "the usage ledger's figures are shown.")
    return _Live({s.bucket.key: s for s in states}, note)


def _charges(snapshot: PolicySnapshot, tenant: TenantPublic, tenant_limits: Limits | None,
             key_limits: Mapping[int, Limits]) -> tuple[list[LimitCharge], list[LimitCharge], list[LimitCharge]]:
    """The gateway's own charges for this tenant (the same function the gateway admits with): the
    tenant's, its tier's per-model ones, and its keys' own."""
    est = Estimate(0, 0, 0.0)
    subject = str(tenant.id)
    tier = snapshot.tiers[tenant.tier]
    any_model = next(iter(snapshot.models.values()))
    base = [c for c in limit_charges(snapshot, tier.name, any_model, est, tenant=subject, key="-",
                                     tenant_limits=tenant_limits) if c.key.count(":") == 2]
    per_model = []
    for model_name in tier.model_limits:
        model = snapshot.models.get(model_name)
        if model is not None:
            per_model += [c for c in limit_charges(snapshot, tier.name, model, est, tenant=subject, key="-",
                                                   tenant_limits=tenant_limits)
                          if c.key.startswith(f"t:{subject}:m:")]
    keys = []
    for key_id, limits in key_limits.items():
        keys += [c for c in limit_charges(snapshot, tier.name, any_model, est, tenant=subject, key=str(key_id),
                                          tenant_limits=tenant_limits, key_limits=limits)
                 if c.key.startswith(f"k:{key_id}:")]
    return base, per_model, keys


def _drawn(charge: LimitCharge, live: _Live) -> dict[str, Any] | None:
    state = live.states.get(charge.key)
    if state is None:
        return None
    used = max(0.0, state.limit - state.level)
    return {"used": used, "limit": state.limit,
            "text": f"{_num(used, charge.unit)} of {_num(state.limit, charge.unit)}",
            "percent": min(100.0, 100.0 * used / state.limit) if state.limit else 0.0}


async def _tenant_context(request: HTMXRequest, pages: TenantPages, name: str) -> dict[str, Any]:
    data = await page_db(pages.db, lambda s: _read_tenant(s, name))
    snapshot = pages.policy.snapshot
    tenant = data.tenant
    tier = snapshot.tiers.get(tenant.tier)
    override = Limits.model_validate(data.limits) if data.limits is not None else None
    key_overrides = {kid: Limits.model_validate(lim) for kid, lim in data.key_limits.items() if lim is not None}

    today_rows = [r for r in data.rows if r.day == data.today]
    ledger = {
        "tokens_today": sum(r.prompt_tokens + r.completion_tokens for r in today_rows),
        "requests_today": sum(r.requests for r in today_rows),
        "spend_30d": sum(r.spend for r in data.rows),
    }
    key_tokens_today: dict[int, int] = {}
    for r in today_rows:
        key_tokens_today[r.key_id] = key_tokens_today.get(r.key_id, 0) + r.prompt_tokens + r.completion_tokens

    limit_rows: list[dict[str, Any]] = []
    model_rows: list[dict[str, Any]] = []
    key_rows: dict[int, list[dict[str, Any]]] = {}
    live = _Live()
    if tier is not None:
        base, per_model, key_charges = _charges(snapshot, tenant, override, key_overrides)
        live = await _peek(pages.limits, pages.settings, base + per_model + key_charges)
        effective = {c.limit: c for c in base}
        own = override.model_fields_set if override is not None else set()
        for name_, (period, unit) in LIMIT_PERIODS.items():
            charge = effective.get(name_)
            tier_value = getattr(tier.limits, name_)
            if name_ in own:
                value = getattr(override, name_)
                shown_override = "none (lifted)" if value is None else _num(value, unit)
            else:
                shown_override = ""
            if name_ == "tokens_per_day":
                ledger_text = f"{_num(ledger['tokens_today'])} tokens today (UTC)"
            elif name_ == "spend_per_month":
                ledger_text = f"{_num(ledger['spend_30d'], 'spend')} spent in the last 30 days"
            else:
                ledger_text = ""
            limit_rows.append({"name": name_, "period": _PERIOD_WORDS.get(period, f"{period:.0f} s"), "unit": unit,
                               "tier": _num(tier_value, unit) if tier_value is not None else "unlimited",
                               "override": shown_override,
                               "effective": _num(charge.capacity, unit) if charge is not None else "unlimited",
                               "drawn": _drawn(charge, live) if charge is not None else None,
                               "ledger": ledger_text})
        model_rows = [{"model": c.key.split(":")[3], "name": c.limit, "effective": _num(c.capacity, c.unit),
                       "drawn": _drawn(c, live)} for c in per_model]
        for c in key_charges:
            key_rows.setdefault(int(c.key.split(":")[1]), []).append(
                {"name": c.limit, "effective": _num(c.capacity, c.unit), "drawn": _drawn(c, live)})

    keys = [{"key": k, "own_limits": key_rows.get(k.id, []), "override": data.key_limits.get(k.id),
             "shown_override": _shown_limits(data.key_limits.get(k.id)),
             "tokens_today": key_tokens_today.get(k.id, 0)} for k in data.keys]
    return {
        "tenant": tenant,
        "url": tenant_url(tenant.name),
        "tier": tier,
        "tiers": list(snapshot.tiers),
        "regions": list(snapshot.document.regions),
        "override": data.limits,
        "limit_fields": LIMIT_FIELDS,
        "limit_rows": limit_rows,
        "model_rows": model_rows,
        "keys": keys,
        "ledger": {k: _num(v, "spend" if k == "spend_30d" else "tokens") for k, v in ledger.items()},
        "flush_s": pages.settings.usage_flush_interval_s,
        "live_note": live.note,
        "can_admin": _can(request, "admin"),
        "can_operate": _can(request, "operator"),
        "new_key": None,
        "error": None,
        "values": {},
    }


async def _list_context(request: HTMXRequest, pages: TenantPages) -> dict[str, Any]:
    context = await page_db(pages.db, _read_list)
    snapshot = pages.policy.snapshot
    return context | {"tiers": list(snapshot.tiers), "regions": list(snapshot.document.regions),
                      "can_admin": _can(request, "admin"), "error": None, "values": {}}


async def show_tenants(request: HTMXRequest, pages: TenantPages, *, error: str | None = None, status: int = 200,
                       values: Mapping[str, str] | None = None) -> Template:
    """The tenant list, with ``error`` (answered with ``status``) and the create form's ``values``."""
    context = await _list_context(request, pages)
    context |= {"error": error, "values": dict(values or {})}
    return Template(template_name="admin/tenants.html.j2", context=context, status_code=status)


async def show_tenant(request: HTMXRequest, pages: TenantPages, name: str, *, error: str | None = None,
                      status: int = 200, new_key: Mapping[str, Any] | None = None,
                      values: Mapping[str, str] | None = None, note: str | None = None) -> Template:
    """One tenant's page (the list with the error when there is no such tenant), with ``error``
    (answered with ``status``), a key just created (its secret shown this once) and the forms' ``values``."""
    try:
        context = await _tenant_context(request, pages, name)
    except PageError as exc:  # no such tenant
        return await show_tenants(request, pages, error=exc.message, status=exc.status)
    context |= {"error": error, "new_key": new_key, "values": dict(values or {}), "note": note}
    return Template(template_name="admin/tenant.html.j2", context=context, status_code=status)


def tenant_url(name: str) -> str:
    """The console URL of tenant ``name``."""
    return f"/admin/tenants/{quote(name, safe='')}"


# --- handlers ------------------------------------------------------------------------------------

@get("/tenants", name="admin:tenants", include_in_schema=False, dependencies=PAGES_DEPENDENCY)
async def tenants_page(request: HTMXRequest, pages: NamedDependency[TenantPages]) -> Template:
    """Every tenant, and the form that creates one."""
    return await show_tenants(request, pages)


@get("/tenants/{name:str}", name="admin:tenant", include_in_schema=False, dependencies=PAGES_DEPENDENCY)
async def tenant_page(request: HTMXRequest, pages: NamedDependency[TenantPages], name: FromPath[str],
                      revoked: FromQuery[str | None] = None) -> Template:
    """One tenant: tier, effective limits and their use, keys, and the forms that change them (and, right
    after a key was created, its secret, this once; after a revocation, a note saying so)."""
    new_key = take_revealed(pages.settings, request, name)
    note = f"Key {revoked}… revoked: its next request is refused, on every replica." if revoked else None
    page = await show_tenant(request, pages, name, status=200, new_key=new_key, note=note)
    if REVEAL_COOKIE in request.cookies:
        forget_revealed(page, tenant_url(name))
    return page


ROUTES: list[Any] = [tenants_page, tenant_page]
