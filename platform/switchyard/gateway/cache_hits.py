"""The answer to a response-cache hit.

A hit never reaches flow control or an engine. The decision procedure has charged the tenant the
rule's ``hit_charge`` of the cached answer's tokens and price (0 by default: no limit is touched);
this records its usage as cached tokens (``switchyard_tokens_total{kind="cache_hit"}``) and answers.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from litestar import Response

from switchyard.api.headers import CACHE_HEADER, CLASS_HEADER, ROUTE_HEADER
from switchyard.decide.cache import hit_charge
from switchyard.decide.decision import Decision
from switchyard.gateway.activity import CACHE_POOL, RequestRecord
from switchyard.gateway.admission import Lease
from switchyard.gateway.request import Kind
from switchyard.gateway.response_cache import Lookup
from switchyard.store.keys import KeyIdentity

if TYPE_CHECKING:
    from switchyard.gateway.runtime import GatewayRuntime


async def serve_hit(runtime: GatewayRuntime, kind: Kind, body: dict[str, Any], found: Lookup, identity: KeyIdentity,
                    d: Decision, lease: Lease, rid: str, record: RequestRecord) -> Response[Any]:
    """Answer from the cache, and record the answer's usage as cached (settling the hit's charge, if any)."""
    entry, decision, cls = found.entry, d.model, d.cls
    assert entry is not None
    assert decision is not None
    assert cls is not None
    model = decision.model
    headers = {"x-request-id": rid, CACHE_HEADER: found.header, CLASS_HEADER: cls.trace,
               ROUTE_HEADER: "; ".join([f"model={model.name}",
                                         *([f"route={decision.route}", f"rule={decision.rule}"]
                                           if decision.route else []),
                                         f"cache={found.plan.label}", f"policy={d.snapshot.label}"]),
               **lease.headers}
    record.served_model, record.pool = model.name, CACHE_POOL
    record.trace.append(f"route: {headers[ROUTE_HEADER]}")
    tokens, spend = hit_charge(found.plan.rule, model, entry.prompt_tokens, entry.completion_tokens)
    runtime.usage.record(identity.tenant_id, identity.key_id, model.name, entry.prompt_tokens,
                         entry.completion_tokens, entry.prompt_tokens, spend)
    runtime.metrics.tokens.labels(model.name, "cache_hit").inc(entry.prompt_tokens + entry.completion_tokens)
    runtime.metrics.spend.labels(model.name).inc(spend)
    if lease.reservation is not None:
        runtime.spawn(lease.settle(tokens, spend))
    response = runtime.cache.hit_response(kind, body, found, headers)
    record.prompt_tokens, record.completion_tokens = entry.prompt_tokens, entry.completion_tokens
    record.cached_tokens = entry.prompt_tokens
    record.ttft_s = time.perf_counter() - record.started
    runtime.finished(record, model.name, CACHE_POOL, 200)
    return response
