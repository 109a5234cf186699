"""What the gateway would decide for a request, without sending it or changing any state.

The policy tests, the console's dry-run and ``switchyard policy test`` ask this; it runs the
gateway's own decisions (:func:`~switchyard.decide.resolve.resolve_model`, the fallback plan,
:func:`~switchyard.decide.pick.pick_endpoint` with the model's endpoint profile) with every
endpoint seen idle and healthy, no prefix or session history and ties going to the first
endpoint, so its answer is the one a quiet fleet would give (no queue, nothing shed or
downgraded), and with fresh limit buckets (only a request larger than a limit is refused by it).
Stages of the request path that have not landed (caches) add their answers here as they land.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from switchyard.decide.admit import estimate, limit_charges
from switchyard.decide.cache import plan_cache
from switchyard.decide.features import RequestFeatures
from switchyard.decide.flow import PRIORITY_HEADER, BadPriority, classify
from switchyard.decide.pick import Strategy, fallback_plan, pick_endpoint, plan_trace, profile_for, usable_stages
from switchyard.decide.plugins import EndpointView, PickRequest
from switchyard.decide.regions import REGION_HEADER, place
from switchyard.decide.resolve import Refused, resolve_offline
from switchyard.policy.snapshot import PolicySnapshot

_IDLE = EndpointView()


@dataclass(frozen=True, slots=True)
class DryRun:
    """The decisions for one request.

    Attributes:
        status: 200 when it would be admitted, else the status of the refusal.
        code: The refusal's error code.
        model: The resolved model (None when refused).
        priority: The priority class it is served in (None when refused before classifying).
        pool, region, endpoint: Where an idle fleet would send it (None when refused).
        limit: The limit that refuses it (429).
        trace: Each stage's reason, in order.
    """

    status: int
    code: str | None = None
    model: str | None = None
    pool: str | None = None
    region: str | None = None
    endpoint: str | None = None
    limit: str | None = None
    priority: str | None = None
    trace: tuple[str, ...] = ()


def dry_run(snapshot: PolicySnapshot, tier: str, features: RequestFeatures,
            strategy: Strategy = "prefix-aware", priority: object = None, key_region: str | None = None,
            gateway_region: str | None = None, body: Mapping[str, Any] | None = None) -> DryRun:
    """Every decision the gateway would take for ``features`` from a tenant of ``tier``.

    ``priority`` is the body's ``priority`` (a class name or vLLM number); the headers that lower
    the class and name a home region are read from ``features.headers``. ``key_region``: the API
    key's (or tenant's) home region; ``gateway_region``: the gateway's. Classifiers that call an
    engine (embeddings) are not run: their rules do not match, and the trace says so.
    """
    try:
        decision = resolve_offline(snapshot, tier, features)
        placement = place(snapshot, tier, decision.model, features.headers.get(REGION_HEADER), key_region,
                          gateway_region)
    except Refused as refusal:
        return DryRun(refusal.status, refusal.code, trace=(refusal.message,))
    trace = [*decision.trace, placement.trace]
    try:
        cls = classify(snapshot, tier, features.headers.get(PRIORITY_HEADER), priority)
    except BadPriority as bad:
        return DryRun(400, "invalid_priority", decision.model.name, trace=(*trace, bad.message))
    trace.append(cls.trace)
    if body is not None and snapshot.document.cache:
        plan = plan_cache(snapshot, kind="chat", model=decision.model.name, route=decision.route, tier=tier,
                          tenant="dry-run", body=body)
        trace.append(plan.trace if plan is not None else "response cache: no rule applies (a rule's match, or "
                     "not deterministic: temperature 0 or a seed)")
    klass = cls.name
    est = estimate(decision.model, features.prompt_tokens, features.max_tokens)
    for charge in limit_charges(snapshot, tier, decision.model, est, tenant="dry-run", key="dry-run"):
        if charge.amount > charge.capacity:  # fresh buckets admit anything else
            return DryRun(429, "request_too_large", decision.model.name, limit=charge.limit, priority=klass,
                          trace=(*trace, f"{charge.limit} ({charge.scope}): {charge.amount:.6g} {charge.unit} "
                                         f"> limit {charge.capacity:.6g}"))
    stages, skipped = usable_stages(fallback_plan(snapshot, decision.model, placement.allowed),
                                    features.prompt_tokens + (features.max_tokens or 0))
    trace += skipped
    for stage in stages:
        pick = PickRequest({}, home_region=placement.home, ceiling=cls.cls.dispatch_ceiling)
        choice = pick_endpoint(profile_for(snapshot, stage.model, strategy), stage.candidates(), lambda _c: _IDLE,
                               pick)
        if choice is not None:
            trace.append(choice.trace)
            trace.append(plan_trace(snapshot, stages, decision.model))
            return DryRun(200, None, decision.model.name, choice.pool.name, choice.pool.region, choice.url,
                          priority=klass, trace=tuple(trace))
    return DryRun(503, "no_endpoint", decision.model.name, priority=klass,
                  trace=(*trace, "no endpoint in any stage"))
