"""The admin JSON API of recent activity (:mod:`switchyard.gateway.activity`, as
:mod:`switchyard.admin.overview` shows it): ``/admin/api/activity``, ``/admin/api/requests`` and
``/admin/api/requests/{request_id}``.

What they show is this gateway process's memory: the last minutes of its own traffic (each replica
answers for itself), for the console's Overview and Requests pages.
"""

from __future__ import annotations

from typing import Annotated, Any

from litestar import get
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, QueryParameter

from switchyard.admin import openapi_docs as docs
from switchyard.admin import overview
from switchyard.admin.policy_api import Limit
from switchyard.api.errors import BadRequest, NotFound
from switchyard.api.openapi import admin_operation, ok
from switchyard.gateway.activity import HORIZON_S, Activity

Window = Annotated[float, QueryParameter(gt=0, le=HORIZON_S, description="Seconds to look back (at most 900).")]


@get("/activity", operation_id="adminActivity",
     operation_class=admin_operation(ok("This process's traffic.", docs.ACTIVITY), 400))
async def activity(activity: NamedDependency[Activity], window: Window = 300) -> dict[str, Any]:
    """This process's traffic over the last ``window`` seconds, per pool and in total: requests/s, TTFT p50 and
    p99 (ms), error, shed, limited, fallback and cache hit rates, and sparkline series (10-second points)."""
    return overview.summary(activity, window)


@get("/requests", operation_id="adminRequests",
     operation_class=admin_operation(ok("Recent requests, newest first.", docs.REQUESTS), 400))
async def recent_requests(activity: NamedDependency[Activity], tenant: FromQuery[str | None] = None,
                          model: FromQuery[str | None] = None, status: FromQuery[str | None] = None,
                          limit: Limit = 100, lane: FromQuery[str | None] = None) -> dict[str, Any]:
    """The requests this process finished lately (the last 500, and apart from them the last 500 batch
    lines), newest first, with their decision traces.

    ``tenant``: a tenant name or id; ``model``: the model asked for, resolved to or served by;
    ``status``: a code (``429``), a class (``5xx``) or an outcome (``ok``, ``error``, ``shed``,
    ``limited``, ``refused``, ``client_closed``); ``lane``: ``interactive`` or ``batch`` only.
    """
    try:
        records = overview.recent_requests(activity, tenant=tenant or None, model=model or None,
                                           status=status or None, limit=limit, lane=lane or None)
    except ValueError as exc:
        raise BadRequest(str(exc), param="lane" if str(exc).startswith("lane") else "status") from None
    return {"requests": [r.as_dict() for r in records]}


@get("/requests/{request_id:str}", operation_id="adminRequest",
     operation_class=admin_operation(ok("The request and its decision trace.", docs.REQUEST), 404))
async def one_request(activity: NamedDependency[Activity], request_id: FromPath[str]) -> dict[str, Any]:
    """One recent request by its ``x-request-id`` (the newest, if a client reused the id)."""
    record = activity.get(request_id)
    if record is None:
        raise NotFound(f"no recent request with id {request_id!r} in this gateway process (it keeps the last 500)")
    return record.as_dict()


ROUTES = [activity, recent_requests, one_request]
