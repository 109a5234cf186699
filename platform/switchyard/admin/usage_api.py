"""The admin JSON API for usage, limit overrides, home regions and the audit log: ``/admin/api/usage``,
``…/tenants/{name}/limits``, ``…/keys/{id}/limits``, ``…/tenants/{name}/region``, ``…/keys/{id}/region``,
``…/audit``.

Reads are open like the rest of the admin API's reads; changing an override or a home region
needs the admin token (the same guard as a policy publish) and is written to the audit log in the
same transaction. A change reaches requests within ``SWITCHYARD_KEY_CACHE_TTL_S`` (the gateway's
key lookups are cached that long), on every replica.
"""

from __future__ import annotations

from datetime import date
from typing import Any

import msgspec
from litestar import Request, get, put
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from sqlalchemy import Engine

from switchyard.admin import openapi_docs as docs
from switchyard.admin.common import in_db, json_body, origin_of
from switchyard.admin.policy_api import Author, Id, Limit
from switchyard.api.openapi import admin_operation, ok
from switchyard.store.audit import list_events
from switchyard.store.keys import set_key_region
from switchyard.store.tenants import set_tenant_region
from switchyard.store.usage import set_limits, usage


class LimitsBody(msgspec.Struct, forbid_unknown_fields=True):
    """An override: the shape of a tier's ``limits`` (a null lifts that limit), or null for none."""

    limits: dict[str, Any] | None
    author: Author = None


class RegionBody(msgspec.Struct, forbid_unknown_fields=True):
    """A home region (a region name, e.g. ``"eu-west"``), or null for none."""

    region: str | None
    author: Author = None


@get("/usage", operation_id="adminUsage",
     operation_class=admin_operation(ok("Ledger rows and their totals.", docs.USAGE), 400, 404))
async def usage_report(db: NamedDependency[Engine], tenant: FromQuery[str | None] = None,
                       model: FromQuery[str | None] = None, since: FromQuery[date | None] = None,
                       until: FromQuery[date | None] = None) -> dict[str, Any]:
    """The usage ledger: rows per UTC day, tenant, key and model, and their totals."""
    report = await in_db(db, lambda s: usage(s, tenant=tenant, model=model, since=since, until=until))
    return report.model_dump(mode="json")


async def _set(request: Request[Any, Any, Any], db: Engine, *, tenant: str | None = None,
               key_id: int | None = None) -> dict[str, Any]:
    data = await json_body(request, LimitsBody)
    origin = origin_of(request)
    checked = await in_db(db, lambda s: set_limits(
        s, tenant=tenant, key_id=key_id, limits=data.limits, actor=data.author or "api", origin=origin))
    return {"limits": None if checked is None else checked.model_dump(exclude_unset=True)}


@put("/tenants/{name:str}/limits", operation_id="adminTenantLimits",
     operation_class=admin_operation(ok("The override now.", docs.LIMITS), 400, 404, 413,
                                     body=docs.LIMITS_BODY))
async def tenant_limits(request: Request[Any, Any, Any], db: NamedDependency[Engine],
                        name: FromPath[str]) -> dict[str, Any]:
    """Set (or clear, with ``{"limits": null}``) a tenant's override of its tier's limits."""
    return await _set(request, db, tenant=name)


@put("/keys/{key_id:int}/limits", operation_id="adminKeyLimits",
     operation_class=admin_operation(ok("The override now.", docs.LIMITS), 400, 404, 413,
                                     body=docs.LIMITS_BODY))
async def key_limits(request: Request[Any, Any, Any], db: NamedDependency[Engine], key_id: Id) -> dict[str, Any]:
    """Set (or clear) an API key's own limits, charged on top of its tenant's."""
    return await _set(request, db, key_id=key_id)


@put("/tenants/{name:str}/region", operation_id="adminTenantRegion",
     operation_class=admin_operation(ok("The home region now.", docs.TENANT_REGION), 400, 404, 413,
                                     body=docs.REGION_BODY))
async def tenant_region(request: Request[Any, Any, Any], db: NamedDependency[Engine],
                        name: FromPath[str]) -> dict[str, Any]:
    """Set (or clear, with ``{"region": null}``) a tenant's home region, used by its keys that have none."""
    data = await json_body(request, RegionBody)
    origin = origin_of(request)
    record = await in_db(db, lambda s: set_tenant_region(
        s, name, data.region, actor=data.author or "api", origin=origin))
    return {"region": record.region}


@put("/keys/{key_id:int}/region", operation_id="adminKeyRegion",
     operation_class=admin_operation(ok("The key's region and the home region it routes by.",
                                        docs.KEY_REGION), 400, 404, 413, body=docs.REGION_BODY))
async def key_region(request: Request[Any, Any, Any], db: NamedDependency[Engine], key_id: Id) -> dict[str, Any]:
    """Set (or clear) an API key's own home region; ``home_region`` is what routing then prefers
    (the key's own, else its tenant's)."""
    data = await json_body(request, RegionBody)
    origin = origin_of(request)
    record = await in_db(db, lambda s: set_key_region(
        s, key_id, data.region, actor=data.author or "api", origin=origin))
    return {"region": record.region, "home_region": record.home_region}


@get("/audit", operation_id="adminAudit",
     operation_class=admin_operation(ok("Audit entries, newest first.", docs.EVENTS), 400))
async def audit_log(db: NamedDependency[Engine], limit: Limit = 50,
                    action: FromQuery[str | None] = None) -> dict[str, Any]:
    """The whole audit log (policy changes, limit overrides, ...), newest first; ``action`` filters by prefix."""
    rows = await in_db(db, lambda s: list_events(s, limit, action=action))
    return {"events": [r.model_dump(mode="json") for r in rows]}


ROUTES = [usage_report, tenant_limits, key_limits, tenant_region, key_region, audit_log]
