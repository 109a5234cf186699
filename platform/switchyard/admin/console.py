"""The console: every page under ``/admin`` behind a login session (:mod:`switchyard.admin.session`),
and the overview of the active policy, its recent versions, the engines this gateway sends to and
its traffic over the last minutes (:mod:`switchyard.gateway.activity`).

The overview's live part (``#engines``: traffic totals and per-pool figures in ``#live-stats``, then
the endpoints per region) is the partial an htmx request gets; the page polls it every 2 seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import anyio.to_thread
from litestar import Router, get
from litestar.plugins.htmx import HTMXRequest, HTMXTemplate
from litestar.response import Template

from switchyard.admin.api import endpoint_row
from switchyard.admin.common import DASH, percent
from switchyard.admin.login import logout
from switchyard.admin.pages import (
    audit,
    batches,
    cache,
    dryrun,
    policy,
    policy_edit,
    policy_replay,
    requests,
    tenant_forms,
    tenants,
    usage,
)
from switchyard.admin.session import CONSOLE_EXCEPTION_HANDLERS, console_guard, security_headers
from switchyard.gateway.activity import CACHE_POOL, NO_POOL, sparkline_points
from switchyard.gateway.runtime import GatewayRuntime
from switchyard.policy import PolicyError, policy_sha256, read_policy_file
from switchyard.store.db import session_scope
from switchyard.store.policy_versions import list_versions

#: Versions the overview lists.
HISTORY = 10
#: The overview's traffic window and the width of one sparkline point, in seconds.
WINDOW_S = 300
POINT_S = 10
#: A sparkline's box, in CSS pixels.
SPARK_WIDTH, SPARK_HEIGHT = 120, 24
#: What the special series keys stand for.
POOL_LABELS = {CACHE_POOL: "response cache", NO_POOL: "no pool (refused before placement)"}


def per_second(value: float | None) -> str:
    """A requests/s figure with as many decimals as a small rate needs."""
    if value is None:
        return DASH
    if value == 0:
        return "0"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}" if value >= 0.01 else f"{value:.3f}"


def millis(value: float | None) -> str:
    """A latency in milliseconds."""
    if value is None:
        return DASH
    return f"{value:.0f} ms" if value >= 10 else f"{value:.1f} ms"


def _sparkline(values: list[float | None], what: str, fmt: Callable[[float | None], str]) -> dict[str, str]:
    """An SVG polyline of ``values``, its newest point (marked with a dot) and a sentence that says what it
    shows."""
    present = [v for v in values if v is not None]
    window = f"over the last {WINDOW_S // 60} minutes, one point per {POINT_S} seconds"
    if present:
        label = f"{what} {window}: latest {fmt(present[-1])}, peak {fmt(max(present))}"
    else:
        label = f"{what} {window}: no data"
    points = sparkline_points(values, SPARK_WIDTH, SPARK_HEIGHT)
    last_x, _, last_y = points.rpartition(" ")[2].partition(",")
    return {"points": points, "label": label, "last_x": last_x, "last_y": last_y}


def _stat_row(name: str, region: str | None, row: dict[str, Any] | None,
              endpoints: tuple[int, int] | None = None) -> dict[str, Any]:
    """One row of the traffic table (``row``: the summary's, None when the pool saw no requests)."""
    found = row or {}
    series = found.get("series") or {}
    return {
        "pool": name,
        "label": POOL_LABELS.get(name, name),
        "region": region,
        "endpoints": endpoints,
        "requests": found.get("requests", 0),
        "rps": per_second(found.get("requests_per_s")) if row else DASH,
        "ttft_p50": millis(found.get("ttft_p50_ms")),
        "ttft_p99": millis(found.get("ttft_p99_ms")),
        "error_rate": percent(found.get("error_rate")),
        "shed_rate": percent(found.get("shed_rate")),
        "limited_rate": percent(found.get("limited_rate")),
        "fallback_rate": percent(found.get("fallback_rate")),
        "cache_hit_rate": percent(found.get("cache_hit_rate")),
        "spark_rps": _sparkline(series.get("requests_per_s", []), "Requests per second", per_second),
        "spark_ttft": _sparkline(series.get("ttft_p50_ms", []), "Median time to first byte", millis),
    }


def _live_stats(runtime: GatewayRuntime, regions: list[dict[str, Any]]) -> dict[str, Any]:
    """The traffic of the last :data:`WINDOW_S` seconds: totals, and a row per pool of the policy (in
    region order) then the response cache, refusals before placement and pools no longer in the policy."""
    summary = runtime.activity.summary(window_s=WINDOW_S, point_s=POINT_S)
    by_pool = {row["pool"]: row for row in summary["pools"]}
    rows = []
    for region in regions:
        for pool in region["pools"]:
            eps = pool["endpoints"]
            rows.append(_stat_row(pool["name"], region["name"], by_pool.pop(pool["name"], None),
                                  (sum(1 for e in eps if e["healthy"]), len(eps))))
    rows += [_stat_row(name, None, row) for name, row in by_pool.items()]
    total = summary["total"]
    # The window's start, or this process's if it is younger than the window.
    since = max(time.time() - summary["window_s"], runtime.activity.started)
    return {"window_s": summary["window_s"], "point_s": summary["point_s"],
            "since": datetime.fromtimestamp(since, UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
            "requests": total["requests"], "total": _stat_row("total", None, total), "pools": rows}


def _overview_context(runtime: GatewayRuntime) -> dict[str, Any]:
    snapshot = runtime.policy.snapshot
    now = time.monotonic()
    regions = []
    for region in snapshot.document.regions:
        pools = [
            {"name": p.name, "served_model": p.served_model, "kv_cache_tokens": p.kv_cache_tokens,
             "endpoints": [endpoint_row(runtime, p, u, now) for u in p.endpoints],
             "models": [m.name for m in snapshot.models.values() if p.name in m.pools]}
            for p in snapshot.pools.values() if p.region == region
        ]
        regions.append({"name": region, "pools": pools})
    return {
        "snapshot": snapshot,
        "policy_error": runtime.policy.last_error,
        "policy_error_source": runtime.policy.error_source,
        "regions": regions,
        "live": _live_stats(runtime, regions),
        "settings": runtime.settings,
    }


def _history(runtime: GatewayRuntime) -> dict[str, Any]:
    """The last versions, and in file mode whether the file holds what is running."""
    settings = runtime.settings
    with session_scope(runtime.engine) as session:
        versions = list_versions(session, HISTORY)
    file_matches: bool | None = None
    if settings.policy_source == "file":
        try:
            file_matches = policy_sha256(read_policy_file(settings.policy_file)) == runtime.policy.snapshot.sha256
        except PolicyError:
            file_matches = False
    return {"versions": versions, "file_matches": file_matches}


@get("/", name="admin:overview", operation_id="adminOverview", include_in_schema=False)
async def overview(request: HTMXRequest) -> Template:
    """The overview page (or just its live part, ``#engines``, for htmx polling)."""
    runtime: GatewayRuntime = request.app.state.runtime
    context = _overview_context(runtime)
    if request.htmx:
        return HTMXTemplate(template_name="admin/partials/_engines.html.j2", context=context)
    context |= await anyio.to_thread.run_sync(_history, runtime)
    return Template(template_name="admin/overview.html.j2", context=context)


PAGES = [overview, logout, *policy.ROUTES, *policy_edit.ROUTES, *policy_replay.ROUTES, *tenants.ROUTES,
         *tenant_forms.ROUTES, *usage.ROUTES, *requests.ROUTES,
         *dryrun.ROUTES, *cache.ROUTES, *audit.ROUTES, *batches.ROUTES]

admin_router = Router(path="/admin", route_handlers=PAGES, request_class=HTMXRequest, guards=[console_guard],
                      exception_handlers=CONSOLE_EXCEPTION_HANDLERS, after_request=security_headers)
