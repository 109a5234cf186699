"""Which endpoint serves a resolved model, and where a request goes when that one fails.

Picking (a pure function of what the gateway knows about each endpoint):

1. **Filter**: endpoints in a failure cool-down are out, unless every endpoint of the stage is
   (then they are tried anyway: better a probe than a refusal); endpoints this request already
   tried are out.
2. **Score** in [0, 1]: ``W_PREFIX * affinity + W_LOAD * (min_load + 1) / (load + 1)``, where
   ``load`` is the estimated requests at the engine (scraped running + waiting, plus what this
   gateway sent since the scrape) and ``affinity`` the fraction of the prompt's leading blocks
   the endpoint served before (:mod:`switchyard.decide.prefix`).
3. **Herding guard**: affinity counts only at an endpoint with nothing waiting inside the engine
   and a load within ``HERD_MARGIN`` of the least loaded one, so a burst of one prefix spreads
   instead of piling onto the endpoint that holds it.
4. **Pick** the highest score; ties go round-robin by a rotation counter.

Fallback stages: the model's own pools first (every replica), then each entry of the model's
``fallback`` chain in order (``model@region`` = that model's pools in that region).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from switchyard.policy.schema import Model, Pool
from switchyard.policy.snapshot import PolicySnapshot

#: ``prefix-aware`` is Switchyard's picker; the other two are the usual baselines, kept so that
#: ``switchyard bench`` can measure against them on the same engines.
Strategy = Literal["prefix-aware", "least-loaded", "round-robin"]
STRATEGIES: tuple[Strategy, ...] = ("prefix-aware", "least-loaded", "round-robin")

W_PREFIX = 0.6
W_LOAD = 0.4
HERD_MARGIN = 4.0


@dataclass(frozen=True, slots=True)
class Candidate:
    """An endpoint that could serve the request."""

    pool: Pool
    url: str


@dataclass(frozen=True, slots=True)
class EndpointView:
    """What the picker knows of one endpoint."""

    healthy: bool = True
    load: float = 0.0
    queued: float = 0.0


@dataclass(frozen=True, slots=True)
class EndpointChoice:
    """The chosen endpoint and why."""

    pool: Pool
    url: str
    load: float
    affinity: float
    trace: str


@dataclass(frozen=True, slots=True)
class Stage:
    """One step of a request's fallback plan: a model and the pools that may serve it."""

    model: Model
    pools: tuple[Pool, ...]
    label: str

    def candidates(self) -> list[Candidate]:
        """Every endpoint of the stage's pools, in policy order."""
        return [Candidate(pool, url) for pool in self.pools for url in pool.endpoints]


def candidates(snapshot: PolicySnapshot, model: Model) -> list[Candidate]:
    """Every endpoint of every pool of ``model``, in policy order."""
    return [Candidate(pool, url) for pool in snapshot.model_pools[model.name] for url in pool.endpoints]


def fallback_plan(snapshot: PolicySnapshot, model: Model) -> list[Stage]:
    """The model's own pools, then its fallback chain; stages without pools are left out."""
    stages = [Stage(model, snapshot.model_pools[model.name], model.name)]
    for target in model.fallback:
        name, _, region = target.partition("@")
        other = snapshot.models[name]
        pools = tuple(p for p in snapshot.model_pools[name] if not region or p.region == region)
        if pools:
            stages.append(Stage(other, pools, target))
    return stages


def usable_stages(plan: Sequence[Stage], needed_tokens: int) -> tuple[list[Stage], list[str]]:
    """The stages of ``plan`` worth trying for a request of ``needed_tokens`` (prompt + output budget).

    A fallback stage whose model's context window cannot hold the request is left out (with a
    note saying why); the first stage always stays, so that its engine answers a too-long
    request with its own 400.
    """
    stages = list(plan[:1])
    skipped = []
    for stage in plan[1:]:
        if stage.model.context_window < needed_tokens:
            skipped.append(f"fallback {stage.label}: context window {stage.model.context_window} "
                           f"< {needed_tokens} tokens")
        else:
            stages.append(stage)
    return stages, skipped


def pick_endpoint(options: Sequence[Candidate], view: Callable[[str], EndpointView],
                  affinity: Mapping[str, float], rotation: int,
                  exclude: frozenset[str] | set[str] = frozenset(),
                  strategy: Strategy = "prefix-aware") -> EndpointChoice | None:
    """The best of ``options`` not in ``exclude`` (see the module doc); None when none is left.

    ``least-loaded`` ignores affinity; ``round-robin`` ignores load and affinity (it still
    leaves out endpoints in cool-down and those already tried).
    """
    views = {o.url: view(o.url) for o in options}
    healthy = [o for o in options if views[o.url].healthy]
    pool = [o for o in (healthy or options) if o.url not in exclude]
    if not pool:
        return None
    n = len(pool)
    if strategy == "round-robin":
        option = pool[rotation % n]
        return EndpointChoice(option.pool, option.url, views[option.url].load, 0.0,
                              f"endpoint {option.url} of pool {option.pool.name}: round-robin of {n}")
    if strategy == "least-loaded":
        affinity = {}
    min_load = min(views[o.url].load for o in pool)
    best: Candidate | None = None
    best_score = best_affinity = -1.0
    for i in range(n):
        option = pool[(rotation + i) % n]
        v = views[option.url]
        a = affinity.get(option.url, 0.0)
        if v.queued > 0 or v.load > min_load + HERD_MARGIN:
            a = 0.0
        score = W_PREFIX * a + W_LOAD * (min_load + 1.0) / (v.load + 1.0)
        if score > best_score:
            best, best_score, best_affinity = option, score, a
    assert best is not None
    load = views[best.url].load
    note = "" if healthy else ", every endpoint in cool-down"
    if healthy and len(healthy) < len(options):
        note = f", {len(options) - len(healthy)} in cool-down"
    return EndpointChoice(best.pool, best.url, load, best_affinity,
                          f"endpoint {best.url} of pool {best.pool.name}: load {load:g}, "
                          f"affinity {best_affinity:.2f}, score {best_score:.2f}, best of {n}{note}")
