"""Console page: the response cache. Its state (what ``GET /admin/api/cache`` answers, with each
rule's lookups as this process counted them) and a purge by tenant, by model or of everything
(operator role), done and audited by the admin API's own purge (:func:`switchyard.admin.cache_api.purge_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from litestar import get, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromQuery
from litestar.plugins.htmx import HTMXRequest
from litestar.response import Redirect, Response, Template
from sqlalchemy import Engine

from switchyard.admin.cache_api import cache_state, purge_cache
from switchyard.admin.common import in_db
from switchyard.admin.session import console_origin, current_user
from switchyard.api.errors import ApiError
from switchyard.gateway.policy_state import PolicyHolder
from switchyard.gateway.response_cache import CacheRunner
from switchyard.settings import Settings
from switchyard.store.tenants import list_tenants

TEMPLATE = "admin/cache.html.j2"
SCOPES = ("tenant", "model", "all")



def _counts(cache: CacheRunner) -> dict[str, dict[str, float]]:
    """This process's lookups (hit, miss, error) and stores (stored) by rule label, from its metrics."""
    metrics = cache.metrics
    counts: dict[str, dict[str, float]] = {}
    for counter in (metrics.cache_lookups, metrics.cache_stores):
        for family in counter.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    rule = counts.setdefault(sample.labels["rule"], {})
                    key = sample.labels["result"]
                    rule[key] = rule.get(key, 0.0) + sample.value
    return counts


@dataclass(frozen=True, slots=True)
class CachePage:
    """What the cache page reads (injected as ``page``, made of the console's own dependencies)."""

    db: NamedDependency[Engine]
    cache: NamedDependency[CacheRunner]
    settings: NamedDependency[Settings]
    policy: NamedDependency[PolicyHolder]


async def _page(request: HTMXRequest, page: CachePage, *, status: int = 200, error: str | None = None,
                note: str | None = None, scope: str = "tenant", tenant: str = "", model: str = "") -> Template:
    snapshot = page.policy.snapshot
    state = await cache_state(page.cache, page.settings, page.policy)
    counts = _counts(page.cache)
    rules = []
    for index, rule in enumerate(snapshot.document.cache):
        label = rule.name or f"cache[{index}]"
        rules.append({"label": label, "rule": rule, "counts": counts.get(label, {})})
    tenants = await in_db(page.db, list_tenants)
    context = {"state": state, "rules": rules, "tenants": tenants, "models": list(snapshot.models),
               "can_purge": current_user(request).may("operator"), "error": error, "note": note,
               "form": {"scope": scope, "tenant": tenant, "model": model}, "scopes": SCOPES}
    return Template(template_name=TEMPLATE, status_code=status, context=context)


#: The ``dependencies`` of a cache page's handler: its :class:`CachePage`.
PAGE_DEPENDENCY = {"page": Provide(CachePage, sync_to_thread=False)}


@get("/cache", name="admin:cache", include_in_schema=False, dependencies=PAGE_DEPENDENCY)
async def cache_page(request: HTMXRequest, page: NamedDependency[CachePage], purged: FromQuery[int | None] = None,
                     what: FromQuery[str | None] = None) -> Template:
    """The cache's state and the purge form (after a purge, a note of what it removed)."""
    note = None
    if purged is not None:
        note = f"Purged {purged} {'entry' if purged == 1 else 'entries'} ({what or 'everything'})."
    return await _page(request, page, note=note)


@post("/cache/purge", include_in_schema=False, opt={"role": "operator"}, dependencies=PAGE_DEPENDENCY)
async def cache_purge(request: HTMXRequest, page: NamedDependency[CachePage]) -> Response[Any]:
    """Purge by tenant, by model or everything; audited; then back to the cache page (303) with a note."""
    form = await request.form()
    scope, tenant, model = (str(form.get(name, "")).strip() for name in ("scope", "tenant", "model"))
    error = None
    if scope not in SCOPES:
        error = f"choose what to purge: {', '.join(SCOPES)}"
    elif scope == "tenant" and not tenant:
        error = "choose the tenant whose entries to purge"
    elif scope == "model" and not model:
        error = "choose the model whose entries to purge"
    if error is None:
        actor, origin = console_origin(request)
        try:
            removed = await purge_cache(page.db, page.cache, tenant=tenant if scope == "tenant" else None,
                                        model=model if scope == "model" else None, actor=actor, origin=origin)
        except ApiError as failed:
            error = str(failed)
        else:
            what = f"tenant {tenant}" if scope == "tenant" else f"model {model}" if scope == "model" else "everything"
            return Redirect(path="/admin/cache?" + urlencode({"purged": removed, "what": what}), status_code=303)
    return await _page(request, page, status=400, error=error, scope=scope, tenant=tenant, model=model)


ROUTES: list[Any] = [cache_page, cache_purge]
