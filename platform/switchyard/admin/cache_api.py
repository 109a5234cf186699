"""The admin API of the response cache: its counts, and purging it by tenant, model or all of it."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, get, post
from litestar.di import NamedDependency
from sqlalchemy import Engine
from sqlmodel import Session

from switchyard.admin import openapi_docs as docs
from switchyard.admin.common import in_db, json_body, origin_of
from switchyard.admin.policy_api import Author
from switchyard.api.openapi import admin_operation, ok
from switchyard.gateway.policy_state import PolicyHolder
from switchyard.gateway.response_cache import CacheRunner
from switchyard.settings import Settings
from switchyard.store.audit import append_event
from switchyard.store.tenants import get_tenant


class PurgeRequest(msgspec.Struct, forbid_unknown_fields=True):
    """What to purge: entries of a tenant (by name), of a model, both, or (neither) everything."""

    tenant: str | None = None
    model: str | None = None
    author: Author = None


@get("/cache", operation_id="adminCache",
     operation_class=admin_operation(ok("The response cache's figures.", docs.CACHE)))
async def cache_stats(cache: NamedDependency[CacheRunner], settings: NamedDependency[Settings],
                      policy: NamedDependency[PolicyHolder]) -> dict[str, Any]:
    """The response cache's backend, entries, bytes and evictions by reason."""
    return await cache_state(cache, settings, policy)


async def cache_state(cache: CacheRunner, settings: Settings, policy: PolicyHolder) -> dict[str, Any]:
    """What ``GET /admin/api/cache`` answers (the console's cache page shows it too)."""
    stats = await cache.cache.stats()
    return {"backend": "redis" if settings.redis_url else "memory", "entries": stats.entries,
            "bytes": stats.bytes, "evictions": dict(stats.evictions),
            "rules": [rule.name or f"cache[{i}]" for i, rule in enumerate(policy.snapshot.document.cache)]}


@post("/cache/purge", operation_id="adminCachePurge", status_code=200,
      operation_class=admin_operation(ok("How many entries were removed.", docs.PURGED), 400, 404, 413,
                                      body=docs.PURGE_BODY))
async def purge(request: Request[Any, Any, Any], db: NamedDependency[Engine],
                cache: NamedDependency[CacheRunner]) -> dict[str, Any]:
    """Remove cached answers: ``{"tenant": NAME}``, ``{"model": NAME}``, both, or ``{}`` for everything.

    With the in-memory backend this purges this gateway process's cache only (each replica has its own);
    with Redis, every replica's. The purge is written to the audit log.
    """
    data = await json_body(request, PurgeRequest)
    removed = await purge_cache(db, cache, tenant=data.tenant, model=data.model, actor=data.author or "api",
                                origin=origin_of(request))
    return {"purged": removed, "tenant": data.tenant, "model": data.model}


async def purge_cache(db: Engine, cache: CacheRunner, *, tenant: str | None, model: str | None, actor: str,
                      origin: str) -> int:
    """Remove the entries of ``tenant`` (by name) and/or ``model`` (both None: everything) from ``cache`` and
    write the purge to the audit log in ``db``; how many were removed. The admin API and the console both
    purge here.

    Raises:
        NotFound: there is no tenant of that name.
    """
    tenant_id: str | None = None
    if tenant is not None:
        name = tenant

        def tenant_of(session: Session) -> str:
            return str(get_tenant(session, name).id)

        tenant_id = await in_db(db, tenant_of)
    removed = await cache.cache.purge(tenant=tenant_id, model=model)
    what = ", ".join(f"{k} {v}" for k, v in (("tenant", tenant), ("model", model)) if v) or "everything"

    def audit(session: Session) -> None:
        target = f"cache:{what}"[:128]  # (the audit log's column holds no more)
        append_event(session, actor=actor, origin=origin, action="cache.purge", target=target,
                     detail={"removed": removed, "tenant": tenant, "model": model})

    await in_db(db, audit)
    return removed


ROUTES = [cache_stats, purge]
