"""Which endpoint serves a resolved model, and where a request goes when that one fails.

Picking runs the model's endpoint profile (:mod:`switchyard.policy.routing`, plugins in
:mod:`switchyard.decide.plugins`), as the Kubernetes inference gateway's endpoint picker does:

1. Endpoints out of service (health probes, refused connections, an open circuit breaker of the
   endpoint or its pool; see :mod:`switchyard.engines`) are left out, whatever the profile says:
   when none is left the stage is passed over. **Filters** then narrow the stage's endpoints
   (serves the model, under its saturation limit; a filter that would leave none is ignored);
   endpoints this request already tried are out, and so, before picking starts, are pools
   outside the regions the tier may use (``tiers[].regions``; see :func:`fallback_plan`).
2. **Home region**: when the request has one and some home endpoint is healthy and under its
   class's ceiling, only home endpoints stay; otherwise the request spills to the region with the
   most capacity left (the sum over its healthy endpoints of ``(ceiling - utilisation) x
   kv_cache_tokens``), not to a fixed next region.
3. **Scorers** give each endpoint a score in [0, 1]; the endpoint's score is their weighted mean.
4. **The picker** chooses (max score with random tie-break, power of two choices, or round-robin).

Fallback stages: the model's own pools first (every replica), then each entry of the model's
``fallback`` chain in order (``model@region`` = that model's pools in that region); pools in
regions the tier may not use are left out of every stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from switchyard.decide.classes import ClassDecision
from switchyard.decide.deadlines import first_token_deadline
from switchyard.decide.picking import Option, PickRequest
from switchyard.decide.plugins import Profile, compile_profile
from switchyard.decide.views import Candidate, EndpointView
from switchyard.policy.fleet import Model, Pool
from switchyard.policy.routing import BASELINE_PROFILES, DEFAULT_PROFILE
from switchyard.policy.snapshot import PolicySnapshot

#: ``prefix-aware`` runs each model's endpoint profile (Switchyard's picking); the other two are the
#: usual baselines, kept so that ``switchyard bench`` can measure against them on the same engines.
Strategy = Literal["prefix-aware", "least-loaded", "round-robin"]
STRATEGIES: tuple[Strategy, ...] = ("prefix-aware", "least-loaded", "round-robin")

_BUILTIN = compile_profile("default", DEFAULT_PROFILE)
_BASELINES = {name: compile_profile(name, p) for name, p in BASELINE_PROFILES.items()}


def compiled_profiles(snapshot: PolicySnapshot) -> dict[str, Profile]:
    """The snapshot's endpoint profiles, compiled once per snapshot (kept in ``snapshot.compiled``)."""
    profiles: dict[str, Profile] | None = snapshot.compiled.get("endpoint_profiles")
    if profiles is None:
        profiles = {name: compile_profile(name, p) for name, p in snapshot.document.endpoint_profiles.items()}
        snapshot.compiled["endpoint_profiles"] = profiles
    return profiles


def profile_for(snapshot: PolicySnapshot, model: Model, strategy: Strategy = "prefix-aware") -> Profile:
    """The compiled profile that picks ``model``'s endpoints under ``strategy``."""
    if strategy != "prefix-aware":
        return _BASELINES[strategy]
    name = model.endpoint_profile
    return _BUILTIN if name is None else compiled_profiles(snapshot)[name]


@dataclass(slots=True)
class EndpointChoice:
    """The chosen endpoint and why."""

    pool: Pool
    url: str
    score: float
    #: Each scorer's score of the chosen endpoint.
    parts: tuple[tuple[str, float], ...]
    picker: str
    of: int
    notes: tuple[str, ...]
    #: The other candidates the picker weighed, best first (at most :data:`RUNNERS_UP`): (url, score, each
    #: scorer's score).
    others: tuple[tuple[str, float, tuple[tuple[str, float], ...]], ...] = ()

    @property
    def trace(self) -> str:
        """One line for the decision trace."""
        return self.describe()

    def describe(self) -> str:
        """One line for the decision trace: the endpoint, its score and each scorer's, how it was picked, and
        the runners-up with theirs (why the chosen one won)."""
        parts = ", ".join(f"{name} {value:.2f}" for name, value in self.parts)
        notes = "".join(f"; {n}" for n in self.notes)
        others = "; ".join(f"{url} {score:.2f}" + (" (" + ", ".join(f"{name} {value:.2f}" for name, value in by)
                                                   + ")" if by else "")
                           for url, score, by in self.others)
        return (f"endpoint {self.url} of pool {self.pool.name} ({self.pool.region}): score {self.score:.2f}"
                + (f" ({parts})" if parts else "") + f", {self.picker} of {self.of}{notes}"
                + (f"; runners-up: {others}" if others else ""))


@dataclass(slots=True)
class Stage:
    """One step of a request's fallback plan: a model and the pools that may serve it."""

    model: Model
    pools: tuple[Pool, ...]
    label: str

    def candidates(self) -> list[Candidate]:
        """Every endpoint of the stage's pools, in policy order."""
        return [Candidate(pool, url) for pool in self.pools for url in pool.endpoints]


def pools_within(pools: tuple[Pool, ...], regions: frozenset[str] | None) -> tuple[Pool, ...]:
    """The pools in ``regions`` (all of them when None)."""
    return pools if regions is None else tuple(p for p in pools if p.region in regions)


def fallback_plan(snapshot: PolicySnapshot, model: Model, regions: frozenset[str] | None = None) -> list[Stage]:
    """The model's own pools, then its fallback chain, each within ``regions`` (None: all).

    Fallback stages left without pools are left out; the first stage stays even when empty (the
    caller refuses the request: no allowed region serves the model).
    """
    stages = [Stage(model, pools_within(snapshot.model_pools[model.name], regions), model.name)]
    for target in model.fallback:
        name, _, region = target.partition("@")
        other = snapshot.models[name]
        pools = tuple(p for p in pools_within(snapshot.model_pools[name], regions) if not region or p.region == region)
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


def plan_trace(snapshot: PolicySnapshot, stages: Sequence[Stage], model: Model, cls: ClassDecision) -> str:
    """One line for the decision trace: where a request goes when its engine fails, and when it moves on."""
    resilience = snapshot.document.resilience
    steps = " → ".join(f"{s.label} ({', '.join(p.name for p in s.pools)})" for s in stages)
    deadline = first_token_deadline(snapshot, cls, model)
    resumes = (f"; a stream its engine breaks off is resumed along it (at most {model.max_resumes} times)"
               if model.resume_streams and model.max_resumes else "")
    return (f"fallback plan: {steps}; at most {resilience.retries.max_attempts} attempts, moving on (before the "
            f"first byte) on a refused connection, a timeout, 5xx, 429, nothing produced within {deadline:g} s "
            f"(class {cls.name}'s first-token deadline){resumes}; endpoints out of service (health, open breakers, "
            "hung) are passed over")


def _home(options: list[Option], request: PickRequest, unfiltered: list[Option]) -> tuple[list[Option], str | None]:
    """The home region's endpoints while one of them has room; else the region with the most room left.

    ``unfiltered``: the candidates before the filters, to say why home was left.
    """
    home = request.home_region
    if home is None:
        return options, None
    ceiling = request.ceiling
    at_home = [o for o in options if o.pool.region == home]
    if any(o.view.healthy and o.view.utilisation < ceiling for o in at_home):
        return at_home, None
    room: dict[str, float] = {}
    for o in options:
        if o.pool.region != home and o.view.healthy:
            left = max(0.0, ceiling - o.view.utilisation) * o.pool.kv_cache_tokens
            room[o.pool.region] = room.get(o.pool.region, 0.0) + left
    home_all = [o for o in unfiltered if o.pool.region == home]
    why = ("has no endpoint" if not home_all else
           "is unhealthy" if not any(o.view.healthy for o in home_all) else "is saturated")
    best = max(room, key=lambda r: room[r], default=None)
    if best is None or room[best] <= 0.0:
        return options, f"home region {home} {why}, and no other region has room"
    return ([o for o in options if o.pool.region == best],
            f"home region {home} {why}: spilled to {best} ({room[best]:,.0f} tokens of room)")


#: Runners-up a decision trace names beside the chosen endpoint.
RUNNERS_UP = 3


def pick_endpoint(profile: Profile, options: Sequence[Candidate], view: Callable[[Candidate], EndpointView],
                  request: PickRequest, exclude: frozenset[str] | set[str] = frozenset()) -> EndpointChoice | None:
    """The endpoint ``profile`` picks among ``options`` not in ``exclude`` (see the module doc); None when
    none is left."""
    # Filters see every endpoint of the stage, tried ones included, so that "all in cool-down" means
    # the stage's endpoints, not those this request has left: a stage whose healthy endpoints all
    # failed moves on to the next stage instead of probing the ones in cool-down.
    unfiltered = [Option(c.pool, c.url, view(c)) for c in options]
    notes: list[str] = []
    # Endpoints out of service (health, an open breaker) are never picked, whatever the profile says.
    current = [o for o in unfiltered if o.view.healthy]
    if not current:
        return None
    if len(current) < len(unfiltered):
        notes.append(f"{len(unfiltered) - len(current)} out of service left out")
    for plugin in profile.filters:
        kept = plugin.keep(current, request)
        if not kept:
            notes.append(f"{plugin.name}: none passes, all {len(current)} kept")
        elif len(kept) < len(current):
            notes.append(f"{plugin.name}: {len(current) - len(kept)} left out")
            current = kept
    if exclude:
        current = [o for o in current if o.url not in exclude]
        unfiltered = [o for o in unfiltered if o.url not in exclude]
    if not current:
        return None
    if profile.home_region:
        current, note = _home(current, request, unfiltered)
        if note:
            notes.append(note)
    n = len(current)
    columns = [(plugin.name, plugin.weight, plugin.score(current, request)) for plugin in profile.scorers]
    total = sum(weight for _, weight, _ in columns) or 1.0
    scores = [sum(weight * values[i] for _, weight, values in columns) / total for i in range(n)]
    index = profile.picker.pick(current, scores, request)
    chosen = current[index]
    for explainer in profile.explainers:
        note = explainer.explain(chosen.url, request)
        if note:
            notes.append(note)
    ranked = sorted((i for i in range(n) if i != index), key=lambda i: -scores[i])[:RUNNERS_UP]
    others = tuple((current[i].url, scores[i], tuple((name, values[i]) for name, _, values in columns))
                   for i in ranked)
    return EndpointChoice(chosen.pool, chosen.url, scores[index],
                          tuple((name, values[index]) for name, _, values in columns), profile.picker.name, n,
                          tuple(notes), others)
