"""The console: every page under ``/admin`` behind a login session (:mod:`switchyard.admin.session`),
and the overview of the active policy, its recent versions, the engines this gateway sends to and
its traffic over the last minutes (:mod:`switchyard.admin.overview`, from :mod:`switchyard.gateway.activity`).

The overview's live part (``#engines``: traffic totals and per-pool figures in ``#live-stats``, then
the endpoints per region) is the partial an htmx request gets; the page polls it every 2 seconds.
"""

from __future__ import annotations

import time
from typing import Any

import anyio.to_thread
from litestar import Router, get
from litestar.di import NamedDependency
from litestar.plugins.htmx import HTMXRequest, HTMXTemplate
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.response import Template
from sqlalchemy import Engine

from switchyard.admin.api import endpoint_row
from switchyard.admin.dependencies import AdminDependencies
from switchyard.admin.login import logout
from switchyard.admin.overview import live_stats
from switchyard.admin.pages import (
    audit,
    batches,
    cache,
    dryrun,
    policy,
    policy_canary,
    policy_edit,
    policy_replay,
    requests,
    tenant_forms,
    tenants,
    usage,
)
from switchyard.admin.session import CONSOLE_EXCEPTION_HANDLERS, console_guard, security_headers
from switchyard.engines.endpoints import EndpointRegistry
from switchyard.figures import limit_amount, limit_label
from switchyard.gateway.activity import Activity
from switchyard.gateway.policy_state import PolicyHolder
from switchyard.policy import PolicyError, policy_sha256, read_policy_file
from switchyard.settings import Settings
from switchyard.state.kvindex import EngineCaches
from switchyard.store.db import session_scope
from switchyard.store.policy_versions import list_versions

#: Versions the overview lists.
HISTORY = 10


def _overview_context(policy: PolicyHolder, endpoints: EndpointRegistry, engine_caches: EngineCaches,
                      activity: Activity, settings: Settings) -> dict[str, Any]:
    snapshot = policy.snapshot
    now = time.monotonic()
    regions = []
    for region in snapshot.document.regions:
        pools = [
            {"name": p.name, "served_model": p.served_model, "kv_cache_tokens": p.kv_cache_tokens,
             "endpoints": [endpoint_row(endpoints, engine_caches, p, u, now) for u in p.endpoints],
             "kv_events": p.kv_events is not None,
             "models": [m.name for m in snapshot.models.values() if p.name in m.pools]}
            for p in snapshot.pools.values() if p.region == region
        ]
        regions.append({"name": region, "pools": pools})
    return {
        "snapshot": snapshot,
        "policy_error": policy.last_error,
        "policy_error_source": policy.error_source,
        "regions": regions,
        "live": live_stats(activity, regions),
        "settings": settings,
    }


def _history(settings: Settings, db: Engine, policy: PolicyHolder) -> dict[str, Any]:
    """The last versions, and in file mode whether the file holds what is running."""
    with session_scope(db) as session:
        versions = list_versions(session, HISTORY)
    file_matches: bool | None = None
    if settings.policy_source == "file":
        try:
            file_matches = policy_sha256(read_policy_file(settings.policy_file)) == policy.snapshot.sha256
        except PolicyError:
            file_matches = False
    return {"versions": versions, "file_matches": file_matches}



def template_globals(engine: JinjaTemplateEngine) -> None:
    """What every console template may call: one wording and one number format for limits."""
    engine.engine.globals.update(limit_label=limit_label, limit_amount=limit_amount)

@get("/", name="admin:overview", operation_id="adminOverview", include_in_schema=False)
async def overview(request: HTMXRequest, settings: NamedDependency[Settings], policy: NamedDependency[PolicyHolder],
                   db: NamedDependency[Engine], activity: NamedDependency[Activity],
                   endpoints: NamedDependency[EndpointRegistry],
                   engine_caches: NamedDependency[EngineCaches]) -> Template:
    """The overview page (or just its live part, ``#engines``, for htmx polling)."""
    context = _overview_context(policy, endpoints, engine_caches, activity, settings)
    if request.htmx:
        return HTMXTemplate(template_name="admin/partials/_engines.html.j2", context=context)
    context |= await anyio.to_thread.run_sync(_history, settings, db, policy)
    return Template(template_name="admin/overview.html.j2", context=context)


PAGES = [overview, logout, *policy.ROUTES, *policy_edit.ROUTES, *policy_canary.ROUTES, *policy_replay.ROUTES,
         *tenants.ROUTES, *tenant_forms.ROUTES, *usage.ROUTES, *requests.ROUTES,
         *dryrun.ROUTES, *cache.ROUTES, *audit.ROUTES, *batches.ROUTES]


def admin_router(dependencies: AdminDependencies) -> Router:
    """The console's routes under ``/admin``, behind its login guard, given ``dependencies``."""
    return Router(path="/admin", route_handlers=PAGES, request_class=HTMXRequest,
                  guards=[console_guard(dependencies.db)], exception_handlers=CONSOLE_EXCEPTION_HANDLERS,
                  after_request=security_headers, dependencies=dependencies.providers())
