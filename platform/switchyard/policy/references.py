"""Checks that span sections: every name a section uses must be declared, and chains must end.

Each check yields ``(loc, message)`` where ``loc`` is the path into the document as pydantic
would give it (list indexes, mapping keys), so the caller can name the YAML line.
"""

from __future__ import annotations

from collections.abc import Iterator
from difflib import get_close_matches

from switchyard.policy.errors import Loc
from switchyard.policy.fleet import split_fallback
from switchyard.policy.schema import PolicyDocument

Finding = tuple[Loc, str]


def _unknown(kind: str, name: str, known: set[str] | list[str]) -> str:
    hint = get_close_matches(name, sorted(known), n=1)
    suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
    return f"unknown {kind} {name!r}{suggestion}"


def _duplicates(names: list[str], section: str, kind: str) -> Iterator[Finding]:
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            loc: Loc = (section, i) if section == "regions" else (section, i, "name")
            yield loc, f"duplicate {kind} {name!r}"
        seen.add(name)


def check_references(doc: PolicyDocument) -> list[Finding]:
    """Every cross-section mistake in ``doc`` (empty when the document is consistent)."""
    return [
        *_regions_and_pools(doc),
        *_models(doc),
        *_fallback_cycles(doc),
        *_routes(doc),
        *_tiers(doc),
        *_cache(doc),
        *_routing(doc),
        *_tests(doc),
    ]


def _regions_and_pools(doc: PolicyDocument) -> Iterator[Finding]:
    yield from _duplicates(list(doc.regions), "regions", "region")
    yield from _duplicates([p.name for p in doc.pools], "pools", "pool")
    regions = set(doc.regions)
    owner: dict[str, str] = {}
    for i, pool in enumerate(doc.pools):
        if pool.region not in regions:
            yield ("pools", i, "region"), _unknown("region", pool.region, regions)
        for j, url in enumerate(pool.endpoints):
            if url in owner and owner[url] != pool.name:
                yield ("pools", i, "endpoints", j), f"endpoint {url} is already in pool {owner[url]!r}"
            owner.setdefault(url, pool.name)


def _models(doc: PolicyDocument) -> Iterator[Finding]:
    yield from _duplicates([m.name for m in doc.models], "models", "model")
    pools = {p.name: p for p in doc.pools}
    models = {m.name: m for m in doc.models}
    regions = set(doc.regions)
    for i, model in enumerate(doc.models):
        for j, pool in enumerate(model.pools):
            if pool not in pools:
                yield ("models", i, "pools", j), _unknown("pool", pool, set(pools))
            elif model.kind == "generate" and pools[pool].task == "embed":
                yield ("models", i, "pools", j), (f"pool {pool!r} serves embeddings (task: embed), not the generating "
                                                  f"model {model.name!r} (give the model kind: embedding)")
            elif model.kind == "embedding" and pools[pool].task != "embed":
                yield ("models", i, "pools", j), (f"pool {pool!r} serves a generating model: the embedding model "
                                                  f"{model.name!r} needs pools of task: embed")
        if model.adapter_of is not None and model.adapter_of not in pools:
            yield ("models", i, "adapter_of"), _unknown("pool", model.adapter_of, set(pools))
        for j, target in enumerate(model.fallback):
            name, region = split_fallback(target)
            loc: Loc = ("models", i, "fallback", j)
            if name not in models:
                yield loc, _unknown("model", name, set(models))
                continue
            if models[name].kind != model.kind:
                yield loc, f"model {name!r} is of kind {models[name].kind}, {model.name!r} of kind {model.kind}"
                continue
            if region is None and name == model.name:
                yield loc, "a model cannot fall back to itself (name another region: model@region)"
                continue
            if region is None:
                continue
            if region not in regions:
                yield loc, _unknown("region", region, regions)
            elif not any(pools[p].region == region for p in models[name].pools if p in pools):
                yield loc, f"model {name!r} has no pool in region {region!r}"
        listed = isinstance(model.on_saturation, list)
        for k, rule in enumerate(model.saturation_rules):
            at: tuple[str | int, ...] = ("models", i, "on_saturation", *((k,) if listed else ()))
            target = rule.downgrade_to
            if target not in models:
                yield (*at, "downgrade_to"), _unknown("model", target, set(models))
            elif target == model.name:
                yield (*at, "downgrade_to"), "a model cannot downgrade to itself"
            elif models[target].kind != model.kind:
                yield (*at, "downgrade_to"), f"model {target!r} is of kind {models[target].kind}, not {model.kind}"
            for j, cls in enumerate(rule.classes or []):
                if cls not in doc.priorities:
                    yield (*at, "classes", j), _unknown("priority class", cls, set(doc.priorities))


def _fallback_cycles(doc: PolicyDocument) -> Iterator[Finding]:
    """A chain that leads back to where it started would bounce a failing request forever."""
    edges: dict[str, list[str]] = {}
    for model in doc.models:
        edges[model.name] = [
            name for name, _ in map(split_fallback, model.fallback) if name != model.name
        ]
    reported: set[frozenset[str]] = set()
    for i, model in enumerate(doc.models):
        cycle = _cycle_from(model.name, edges)
        if cycle and frozenset(cycle) not in reported:
            reported.add(frozenset(cycle))
            yield ("models", i, "fallback"), "fallback cycle: " + " → ".join([*cycle, cycle[0]])


def _cycle_from(start: str, edges: dict[str, list[str]]) -> list[str] | None:
    stack: list[tuple[str, list[str]]] = [(start, [start])]
    while stack:
        node, path = stack.pop()
        for nxt in edges.get(node, []):
            if nxt == start:
                return path
            if nxt not in path:
                stack.append((nxt, [*path, nxt]))
    return None


def _routes(doc: PolicyDocument) -> Iterator[Finding]:
    yield from _duplicates([r.name for r in doc.routes], "routes", "route")
    models = {m.name for m in doc.models}
    kinds = {m.name: m.kind for m in doc.models}
    routes = {r.name for r in doc.routes}
    tiers = {t.name for t in doc.tiers}

    def target(name: str) -> str:
        if name in routes:
            return f"{name!r} is a route; a route must resolve to a model"
        return _unknown("model", name, models)

    for i, route in enumerate(doc.routes):
        if route.name in models:
            yield ("routes", i, "name"), f"route {route.name!r} has the name of a model"
        if route.default not in models:
            yield ("routes", i, "default"), target(route.default)
        for j, rule in enumerate(route.rules):
            if rule.model not in models:
                yield ("routes", i, "rules", j, "model"), target(rule.model)
            elif route.default in models and kinds[rule.model] != kinds[route.default]:
                yield ("routes", i, "rules", j, "model"), (f"model {rule.model!r} is of kind {kinds[rule.model]}, "
                                                           f"the route's default of kind {kinds[route.default]}")
            for k, tier in enumerate(rule.when.tier or []):
                if tier not in tiers:
                    yield ("routes", i, "rules", j, "when", "tier", k), _unknown("tier", tier, tiers)
            name = rule.when.classifier
            if name is not None and name not in doc.classifiers:
                yield (("routes", i, "rules", j, "when", "classifier"),
                       _unknown("classifier", name, set(doc.classifiers)))
        if route.compare_to is not None and route.compare_to not in models:
            yield ("routes", i, "compare_to"), target(route.compare_to)


def _tiers(doc: PolicyDocument) -> Iterator[Finding]:
    yield from _duplicates([t.name for t in doc.tiers], "tiers", "tier")
    callable_names = {m.name for m in doc.models} | {r.name for r in doc.routes}
    for i, tier in enumerate(doc.tiers):
        if tier.priority not in doc.priorities:
            yield ("tiers", i, "priority"), _unknown("priority class", tier.priority, set(doc.priorities))
        for j, name in enumerate(tier.models):
            if name != "*" and name not in callable_names:
                yield ("tiers", i, "models", j), _unknown("model or route", name, callable_names)
        if len(set(tier.models)) != len(tier.models):
            yield ("tiers", i, "models"), "a model is listed twice"
        for j, region in enumerate(tier.regions or []):
            if region not in doc.regions:
                yield ("tiers", i, "regions", j), _unknown("region", region, set(doc.regions))
        allowed = set(tier.models)
        for name in tier.model_limits:
            if name not in callable_names:
                yield ("tiers", i, "model_limits", name), _unknown("model", name, callable_names)
            elif "*" not in allowed and name not in allowed:
                yield ("tiers", i, "model_limits", name), f"limits for {name!r}, which this tier cannot use"


def _cache(doc: PolicyDocument) -> Iterator[Finding]:
    models = {m.name for m in doc.models}
    pools = {p.name: p for p in doc.pools}
    routes = {r.name for r in doc.routes}
    tiers = {t.name for t in doc.tiers}
    for i, rule in enumerate(doc.cache):
        for field, known, kind in (("models", models, "model"), ("routes", routes, "route"),
                                   ("tiers", tiers, "tier")):
            for j, name in enumerate(getattr(rule.match, field) or []):
                if name not in known:
                    yield ("cache", i, "match", field, j), _unknown(kind, name, known)
        if rule.embedding_pool is not None:
            if rule.embedding_pool not in pools:
                yield ("cache", i, "embedding_pool"), _unknown("pool", rule.embedding_pool, set(pools))
            elif pools[rule.embedding_pool].task != "embed":
                yield ("cache", i, "embedding_pool"), (f"pool {rule.embedding_pool!r} serves generation; an "
                                                        "embedding pool needs `task: embed`")


def _routing(doc: PolicyDocument) -> Iterator[Finding]:
    pools = {p.name: p for p in doc.pools}
    for name, spec in doc.classifiers.items():
        if spec.type != "embedding":
            continue
        loc: Loc = ("classifiers", name, "pool")
        if spec.pool not in pools:
            yield loc, _unknown("pool", spec.pool, set(pools))
        elif pools[spec.pool].task != "embed":
            yield loc, f"pool {spec.pool!r} does not serve embeddings (give it task: embed)"
    for i, model in enumerate(doc.models):
        profile = model.endpoint_profile
        if profile is not None and profile not in doc.endpoint_profiles:
            yield ("models", i, "endpoint_profile"), _unknown("endpoint profile", profile, set(doc.endpoint_profiles))


def _tests(doc: PolicyDocument) -> Iterator[Finding]:
    models = {m.name for m in doc.models}
    tiers = {t.name for t in doc.tiers}
    pools = {p.name for p in doc.pools}
    regions = set(doc.regions)
    for i, test in enumerate(doc.tests):
        if test.request.tier not in tiers:
            yield ("tests", i, "request", "tier"), _unknown("tier", test.request.tier, tiers)
        if test.expect.model is not None and test.expect.model not in models:
            yield ("tests", i, "expect", "model"), _unknown("model", test.expect.model, models)
        if test.expect.pool is not None and test.expect.pool not in pools:
            yield ("tests", i, "expect", "pool"), _unknown("pool", test.expect.pool, pools)
        if test.expect.region is not None and test.expect.region not in regions:
            yield ("tests", i, "expect", "region"), _unknown("region", test.expect.region, regions)
        for where, cls in (("request", test.request.priority), ("expect", test.expect.priority)):
            if cls is not None and cls not in doc.priorities:
                yield ("tests", i, where, "priority"), _unknown("priority class", cls, set(doc.priorities))
