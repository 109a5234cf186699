"""The admin JSON API: what the gateway knows about its engines, and the policy's lifecycle
(:mod:`switchyard.admin.policy_api`), for operators and scripts."""

from __future__ import annotations

import time
from typing import Any

from litestar import Request, Router, get

from switchyard.admin import policy_api, usage_api
from switchyard.gateway.runtime import GatewayRuntime
from switchyard.policy.schema import Pool


def endpoint_row(runtime: GatewayRuntime, pool: Pool, url: str, now: float) -> dict[str, Any]:
    """What the gateway knows of one endpoint: health, in-flight count and its last scrape."""
    registry = runtime.endpoints
    state = registry.state(url)
    signals = state.signals
    age = now - state.scraped_at if signals is not None else None
    healthy = state.healthy(now)
    return {
        "url": url,
        "pool": pool.name,
        "region": pool.region,
        "healthy": healthy,
        "failure": None if healthy else state.failure,
        "in_flight": state.outstanding,
        "load": state.load(now, registry.signal_max_age),
        "scrape": {
            "age_s": round(age, 3) if age is not None else None,
            "fresh": age is not None and age <= registry.signal_max_age,
            "error": state.scrape_error,
            "running": signals.running if signals else None,
            "waiting": signals.waiting if signals else None,
            "kv_usage": signals.kv_usage if signals else None,
            "prefix_cache_queries": signals.prefix_queries if signals else None,
            "prefix_cache_hits": signals.prefix_hits if signals else None,
        },
    }


@get("/endpoints", name="admin:api:endpoints", operation_id="adminEndpoints")
async def endpoints(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """Every endpoint of the active policy: pool, health, in-flight count and scraped load signals."""
    runtime: GatewayRuntime = request.app.state.runtime
    snapshot = runtime.policy.snapshot
    now = time.monotonic()
    rows = [endpoint_row(runtime, pool, url, now) for pool in snapshot.pools.values() for url in pool.endpoints]
    return {"policy": snapshot.label, "endpoints": rows}


admin_api_router = Router(path="/admin/api", route_handlers=[endpoints, *policy_api.ROUTES, *usage_api.ROUTES],
                          tags=["admin"])
