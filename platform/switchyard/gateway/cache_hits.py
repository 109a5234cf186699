"""The response cache on the request path: the lookup before admission, and the answer to a hit.

A hit never reaches flow control or an engine. It costs the tenant the rule's ``hit_charge`` of the
cached answer's tokens and price (0 by default: no limit is touched), and its usage is recorded as
cached tokens (``switchyard_tokens_total{kind="cache_hit"}``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from litestar import Response

from switchyard.decide.admit import estimate, limit_charges, spend_of
from switchyard.decide.cache import CACHE_CONTROL_HEADER, BadCacheControl, parse_cache_control, plan_cache
from switchyard.decide.resolve import ModelDecision
from switchyard.gateway.activity import CACHE_POOL, RequestRecord
from switchyard.gateway.errors import ApiError, BadRequest
from switchyard.gateway.request import Kind
from switchyard.gateway.response_cache import CACHE_HEADER, Lookup
from switchyard.gateway.runtime import GatewayRuntime
from switchyard.policy import PolicySnapshot
from switchyard.store.keys import KeyIdentity


async def cache_lookup(runtime: GatewayRuntime, headers: Mapping[str, str], snapshot: PolicySnapshot,
                       kind: Kind, decision: ModelDecision, identity: KeyIdentity,
                       body: dict[str, Any]) -> Lookup | None:
    """The response cache's answer for this request (None: no cache rule applies)."""
    try:
        read, write = parse_cache_control(headers.get(CACHE_CONTROL_HEADER))
    except BadCacheControl as bad:
        raise BadRequest(str(bad), code="invalid_cache_control", param=CACHE_CONTROL_HEADER) from None
    if not snapshot.document.cache:
        return None
    tenant = str(identity.tenant_id)
    plan = plan_cache(snapshot, kind=kind, model=decision.model.name, route=decision.route, tier=identity.tier,
                      tenant=tenant, body=body, read=read, write=write)
    return None if plan is None else await runtime.cache.lookup(snapshot, plan, tenant, decision.model.name)


async def serve_hit(runtime: GatewayRuntime, kind: Kind, body: dict[str, Any], found: Lookup,
                    identity: KeyIdentity, decision: ModelDecision, snapshot: PolicySnapshot, rid: str,
                    cls: str, record: RequestRecord) -> Response[Any]:
    """Answer from the cache: charge the tenant the rule's ``hit_charge`` of the answer, record its usage as
    cached."""
    entry, model = found.entry, decision.model
    assert entry is not None
    charge = found.plan.rule.hit_charge
    headers = {"x-request-id": rid, CACHE_HEADER: found.header, "x-switchyard-class": cls,
               "x-switchyard-route": "; ".join([f"model={model.name}",
                                                *([f"route={decision.route}", f"rule={decision.rule}"]
                                                  if decision.route else []),
                                                f"cache={found.plan.label}", f"policy={snapshot.label}"])}
    record.served_model, record.pool = model.name, CACHE_POOL
    record.trace.append(f"route: {headers['x-switchyard-route']}")
    lease = None
    if charge > 0:
        est = estimate(model, round(charge * entry.prompt_tokens), round(charge * entry.completion_tokens))
        charges = limit_charges(snapshot, identity.tier, model, est, tenant=str(identity.tenant_id),
                                key=str(identity.key_id), tenant_limits=identity.tenant_limits,
                                key_limits=identity.key_limits)
        try:
            lease = await runtime.admitter.admit(charges, snapshot.document.resilience.dependencies.redis)
        except ApiError as refused:
            runtime.finished(record, model.name, CACHE_POOL, refused.status_code)
            raise
        headers.update(lease.headers)
    spend = charge * spend_of(model, entry.prompt_tokens, entry.completion_tokens, 0)
    runtime.usage.record(identity.tenant_id, identity.key_id, model.name, entry.prompt_tokens,
                         entry.completion_tokens, entry.prompt_tokens, spend)
    runtime.metrics.tokens.labels(model.name, "cache_hit").inc(entry.prompt_tokens + entry.completion_tokens)
    runtime.metrics.spend.labels(model.name).inc(spend)
    if lease is not None and lease.reservation is not None:
        runtime.spawn(lease.settle(round(charge * (entry.prompt_tokens + entry.completion_tokens)), spend))
    response = runtime.cache.hit_response(kind, body, found, headers)
    record.prompt_tokens, record.completion_tokens = entry.prompt_tokens, entry.completion_tokens
    record.cached_tokens = entry.prompt_tokens
    record.ttft_s = time.perf_counter() - record.started
    runtime.finished(record, model.name, CACHE_POOL, 200)
    return response
