"""The admin JSON API: what the gateway knows about its engines, and the policy's lifecycle
(:mod:`switchyard.admin.policy_api`), for operators and scripts. Every route wants the admin token."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from litestar import Router, get
from litestar.di import NamedDependency

from switchyard.admin import activity_api, cache_api, canary_api, kv_api, policy_api, usage_api
from switchyard.admin import openapi_docs as docs
from switchyard.admin.common import admin_token_guard
from switchyard.admin.dependencies import AdminDependencies
from switchyard.api.openapi import admin_operation, ok
from switchyard.engines.breakers import CircuitBreaker
from switchyard.engines.endpoints import EndpointRegistry
from switchyard.gateway.policy_state import PolicyHolder
from switchyard.policy.fleet import Pool
from switchyard.state.kvindex import EngineCaches


def kv_events_row(caches: EngineCaches, pool: Pool, url: str, now: float) -> dict[str, Any] | None:
    """The state of one endpoint's KV-cache event stream as this process follows it (None: its pool declares
    no ``kv_events``)."""
    if pool.kv_events is None:
        return None
    cache = caches.get(url)
    if cache is None:
        return {"state": "disconnected", "events_url": pool.kv_events.addresses(url)[0], "blocks": 0,
                "block_size": None, "last_seq": None, "batches": 0, "events": 0, "gaps": 0, "gaps_recovered": 0,
                "restarts": 0, "orphans": 0, "digest": None, "last_event_age_s": None, "reason": "not followed yet"}
    at = cache.last_event_at
    return {
        "state": cache.state(now),
        "events_url": cache.events_url,
        "blocks": len(cache.blocks),
        "block_size": cache.blocks.block_size,
        "last_seq": cache.last_seq,
        "batches": cache.batches,
        "events": cache.events,
        "gaps": cache.gaps,
        "gaps_recovered": cache.gaps_recovered,
        "restarts": cache.restarts,
        "orphans": cache.blocks.orphans,
        "digest": hashlib.sha256(b"".join(sorted(cache.blocks.keys()))).hexdigest()[:16],
        "last_event_age_s": round(now - at, 3) if at is not None else None,
        "reason": cache.reason or None,
    }


def endpoint_row(registry: EndpointRegistry, caches: EngineCaches, pool: Pool, url: str,
                 now: float) -> dict[str, Any]:
    """What the gateway knows of one endpoint (in ``registry``): health, in-flight count, its last scrape, and
    its KV-cache events (in ``caches``)."""
    state = registry.state(url)
    signals = state.signals
    age = now - state.scraped_at if signals is not None else None
    healthy = state.healthy(now) and registry.pool_breaker(pool.name).allows(now)
    return {
        "url": url,
        "pool": pool.name,
        "region": pool.region,
        "healthy": healthy,
        "up": state.up,
        "failure": None if state.up else state.failure,
        "down_for_s": round(now - state.down_since, 3) if state.down_since is not None else None,
        "probe_streak": state.probe_streak,
        "breaker": breaker_row(state.breaker, now),
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
            "lora_adapters": sorted(signals.adapters) if signals and signals.adapters is not None else None,
            "max_loras": signals.max_loras if signals else None,
        },
        "adapters_loaded": sorted(state.adapters_loaded),
        "kv_events": kv_events_row(caches, pool, url, now),
    }


def breaker_row(breaker: CircuitBreaker, now: float) -> dict[str, Any]:
    """A circuit breaker's state: closed, open (for how much longer) or half-open, and its recent counts."""
    state = breaker.state(now)
    ok, failed = breaker.window_counts(now)
    return {
        "state": state,
        "reopens_in_s": round(breaker.retry_in(now), 3) if state == "open" else None,
        "consecutive_failures": breaker.consecutive,
        "window": {"ok": ok, "failed": failed},
        "trials_in_flight": breaker.trials_in_flight if state == "half_open" else None,
        "last_reason": breaker.last_reason,
    }


@get("/endpoints", name="admin:api:endpoints", operation_id="adminEndpoints",
     operation_class=admin_operation(ok("Every endpoint and pool.", docs.ENDPOINTS)))
async def endpoints(policy: NamedDependency[PolicyHolder], endpoints: NamedDependency[EndpointRegistry],
                    engine_caches: NamedDependency[EngineCaches]) -> dict[str, Any]:
    """Every endpoint of the active policy (pool, health, breaker, in-flight count, scraped load signals, its
    KV-cache events: connected/stale, blocks held, last sequence, gaps recovered) and every pool's breaker."""
    snapshot = policy.snapshot
    now = time.monotonic()
    rows = [endpoint_row(endpoints, engine_caches, pool, url, now)
            for pool in snapshot.pools.values() for url in pool.endpoints]
    pools = [{"pool": pool.name, "region": pool.region,
              "breaker": breaker_row(endpoints.pool_breaker(pool.name), now)}
             for pool in snapshot.pools.values()]
    return {"policy": snapshot.label, "endpoints": rows, "pools": pools}


def admin_api_router(dependencies: AdminDependencies) -> Router:
    """The admin API's routes under ``/admin/api``, behind the admin token, given ``dependencies``."""
    return Router(path="/admin/api",
                  route_handlers=[endpoints, *policy_api.ROUTES, *canary_api.ROUTES, *usage_api.ROUTES,
                                  *cache_api.ROUTES, *activity_api.ROUTES, *kv_api.ROUTES],
                  tags=["admin"], guards=[admin_token_guard(dependencies.settings)],
                  dependencies=dependencies.providers())
