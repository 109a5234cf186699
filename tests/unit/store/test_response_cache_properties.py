"""Properties of the response cache over random tenants, prompts and scopes, end to end through
:func:`switchyard.decide.cache.plan_cache` and a store.

A model runs beside the cache: it knows who stored which answer under which rule. Whatever the
sequence of stores and lookups, a lookup finds an answer exactly when the model has one the
asking tenant may see (its own under a tenant-scoped rule, anyone's under a global rule), and
what it finds is that answer: never one another tenant stored under tenant scope, by exact key
or by semantic neighbour.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from switchyard.decide.cache import CachePlan, plan_cache
from switchyard.policy import PolicySnapshot, compile_policy
from switchyard.store.cache import CacheEntry, MemoryResponseCache, RedisResponseCache, ResponseCache
from tests.unit.decide.test_cache import EMBED_POOL
from tests.unit.policy.base import base, to_yaml
from tests.unit.store.redis_support import REDIS_URL, delete_prefix, unique_prefix

PROMPTS = ["What is 2 + 2?", "What is 2+2 ?", "Capital of France?", "capital of france", "Hi", "Write a haiku"]
SEMANTIC = {"mode": "semantic", "min_similarity": 0.95, "embedding_pool": "embed-us"}


def _snapshot() -> PolicySnapshot:
    """Four rules, one per (mode, scope), told apart by model and tier."""
    doc = base()
    doc["pools"].append(EMBED_POOL)
    doc["cache"] = [
        {"name": "exact-tenant", "match": {"models": ["small"], "tiers": ["free"]}, "ttl": "1h"},
        {"name": "exact-global", "match": {"models": ["small"], "tiers": ["pro"]}, "ttl": "1h", "scope": "global"},
        {"name": "semantic-tenant", "match": {"models": ["large"], "tiers": ["free"]}, "ttl": "1h", **SEMANTIC},
        {"name": "semantic-global", "match": {"models": ["large"], "tiers": ["pro"]}, "ttl": "1h",
         "scope": "global", **SEMANTIC},
    ]
    return compile_policy(to_yaml(doc))


SNAPSHOT = _snapshot()
#: (model, tier) selecting each rule of SNAPSHOT.
COMBOS = [("small", "free"), ("small", "pro"), ("large", "free"), ("large", "pro")]


def embed(text: str) -> list[float]:
    """A stand-in embedding: prompts that differ only in case, spaces and punctuation are one point;
    any two others are orthogonal."""
    canonical = sorted({"".join(c for c in p.lower() if c.isalnum()) for p in PROMPTS})
    vector = [0.0] * len(canonical)
    vector[canonical.index("".join(c for c in text.lower() if c.isalnum()))] = 1.0
    return vector


def _same_meaning(a: str, b: str) -> bool:
    return embed(a) == embed(b)


Op = tuple[str, str, int, int]  # (put|get, tenant, prompt index, combo index)

TENANTS = st.one_of(st.sampled_from(["acme", "globex", "initech"]), st.text(min_size=1, max_size=6))


@st.composite
def operations(draw: st.DrawFn) -> list[Op]:
    """Random stores and lookups among two or three tenants (so that they collide often)."""
    tenants = draw(st.lists(TENANTS, min_size=2, max_size=3, unique=True))
    return draw(st.lists(st.tuples(st.sampled_from(["put", "get"]), st.sampled_from(tenants),
                                   st.integers(0, len(PROMPTS) - 1), st.integers(0, len(COMBOS) - 1)),
                         max_size=40))


OPS = operations()


def _plan(tenant: str, prompt: str, combo: int) -> CachePlan:
    model, tier = COMBOS[combo]
    body = {"model": model, "temperature": 0, "messages": [{"role": "user", "content": prompt}]}
    plan = plan_cache(SNAPSHOT, kind="chat", model=model, route=None, tier=tier, tenant=tenant, body=body)
    assert plan is not None and plan.label == SNAPSHOT.document.cache[combo].name
    return plan


async def _check(cache: ResponseCache, ops: list[Op]) -> None:
    # What was stored: (rule, owner or None for global, prompt) of every put.
    stored: list[tuple[str, str | None, str]] = []
    for action, tenant, p, combo in ops:
        prompt = PROMPTS[p]
        plan = _plan(tenant, prompt, combo)
        owner = tenant if plan.rule.scope == "tenant" else None
        if action == "put":
            body = json.dumps({"owner": tenant, "prompt": prompt}).encode()
            entry = CacheEntry(body, COMBOS[combo][0], owner, plan.label, 0.0, 1, 1)
            assert await cache.put(plan.label, plan.key, entry, 3600, 10_000)
            if plan.mode == "semantic":
                assert plan.text == prompt
                await cache.put_vector(plan.label, plan.context, plan.key, embed(prompt), 3600, 10_000)
            stored.append((plan.label, owner, prompt))
            continue
        found: CacheEntry | None
        if plan.mode == "exact":
            found = await cache.get(plan.label, plan.key, tenant)
            visible = [s for s in stored if s[0] == plan.label and s[1] == owner and s[2] == prompt]
        else:
            assert plan.text is not None
            hit = await cache.nearest(plan.label, plan.context, embed(plan.text), 0.95, tenant)
            found = None if hit is None else hit[0]
            visible = [s for s in stored if s[0] == plan.label and s[1] == owner and _same_meaning(s[2], prompt)]
        assert (found is not None) == bool(visible)
        if found is not None:
            answer: dict[str, Any] = json.loads(found.body)
            assert found.tenant in (None, tenant) and found.rule == plan.label
            if plan.rule.scope == "tenant":
                assert found.tenant == tenant and answer["owner"] == tenant
            else:
                assert found.tenant is None
            assert _same_meaning(answer["prompt"], prompt) if plan.mode == "semantic" else answer["prompt"] == prompt


def _on_memory(check: Callable[[ResponseCache], Awaitable[None]]) -> None:
    asyncio.run(check(MemoryResponseCache()))


def _on_redis(check: Callable[[ResponseCache], Awaitable[None]]) -> None:
    async def run() -> None:
        prefix = unique_prefix()
        cache = RedisResponseCache(REDIS_URL, prefix)
        try:
            await check(cache)
        finally:
            await cache.aclose()
            await delete_prefix(prefix)
    asyncio.run(run())


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_memory_serves_tenant_entries_only_to_their_tenant(ops: list[Op]) -> None:
    _on_memory(lambda cache: _check(cache, ops))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_redis_serves_tenant_entries_only_to_their_tenant(ops: list[Op]) -> None:
    _on_redis(lambda cache: _check(cache, ops))


@settings(max_examples=100, deadline=None)
@given(TENANTS, TENANTS, st.integers(0, len(PROMPTS) - 1), st.integers(0, len(COMBOS) - 1))
def test_keys_and_contexts_are_shared_exactly_when_the_scope_is_global(a: str, b: str, p: int, combo: int) -> None:
    mine, theirs = _plan(a, PROMPTS[p], combo), _plan(b, PROMPTS[p], combo)
    shared = a == b or mine.rule.scope == "global"
    assert (mine.key == theirs.key) is shared
    if mine.mode == "semantic":
        assert (mine.context == theirs.context) is shared
