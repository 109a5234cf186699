"""The endpoint picker's plugins: a registry of typed factories, one per spec of :mod:`switchyard.policy.routing`.

Every plugin is a pure function of the candidates and what the gateway knows of them (an
:class:`Option` per endpoint) and of the request (:class:`PickRequest`):

- a **filter** returns the candidates that stay. A filter that would leave none is ignored (the
  trace says so): better to try a busy or cooling-down replica, or one whose scrape named another
  model (its own answer then says what is wrong), than to refuse.
- a **scorer** returns one score in [0, 1] per candidate; the profile's score is the weighted mean.
- a **picker** returns the index of the chosen candidate.

A factory is registered per spec class (``@register(SpecClass)``); :func:`compile_profile` turns a
policy profile into functions once per policy snapshot, and an import-time check makes sure every
spec class the schema accepts has a factory.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, get_args

from pydantic import BaseModel

from switchyard.policy import routing as spec
from switchyard.policy.schema import Pool


@dataclass(frozen=True, slots=True)
class EndpointView:
    """What the picker knows of one endpoint.

    Attributes:
        healthy: Not in a failure cool-down.
        load: Requests at the engine (scraped running + waiting, plus what this gateway sent since); as an
            interactive request weighs them: without the batch work that gives way to it, with the interactive
            streams in their prefill counted twice (:meth:`switchyard.engines.endpoints.EndpointState.load`).
        queued: Requests waiting inside the engine at the last fresh scrape.
        utilisation: How full it is (:meth:`switchyard.engines.endpoints.EndpointState.utilisation`).
        inflight_tokens: Tokens this gateway has in flight there (prompt + expected output).
        models: The models its engine reports serving (None: not known from a fresh scrape).
    """

    healthy: bool = True
    load: float = 0.0
    queued: float = 0.0
    utilisation: float = 0.0
    inflight_tokens: int = 0
    models: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class Option:
    """A candidate endpoint and its view."""

    pool: Pool
    url: str
    view: EndpointView


@dataclass(frozen=True, slots=True)
class PickRequest:
    """What the plugins know of the request.

    Attributes:
        affinity: Prefix affinity by URL (fraction of the prompt's leading blocks served there).
        session_url: The endpoint that served the request's session before, if any.
        home_region: The region it prefers (None: no preference).
        ceiling: The utilisation under which its class is dispatched (1.0, batch lane less).
        rotation: A counter for round-robin.
        rng: Breaks ties (None: the first of the tied candidates, for reproducible dry runs).
    """

    affinity: Mapping[str, float]
    session_url: str | None = None
    home_region: str | None = None
    ceiling: float = 1.0
    rotation: int = 0
    rng: random.Random | None = None


FilterFn = Callable[[Sequence[Option], PickRequest], list[Option]]
ScorerFn = Callable[[Sequence[Option], PickRequest], list[float]]
PickerFn = Callable[[Sequence[Option], Sequence[float], PickRequest], int]


@dataclass(frozen=True, slots=True)
class FilterPlugin:
    name: str
    fn: FilterFn


@dataclass(frozen=True, slots=True)
class ScorerPlugin:
    name: str
    fn: ScorerFn
    weight: float


@dataclass(frozen=True, slots=True)
class PickerPlugin:
    name: str
    fn: PickerFn


Plugin = FilterPlugin | ScorerPlugin | PickerPlugin
S = TypeVar("S", bound=BaseModel)
_FACTORIES: dict[type[BaseModel], Callable[[Any], Plugin]] = {}


def register(kind: type[S]) -> Callable[[Callable[[S], Plugin]], Callable[[S], Plugin]]:
    """Register the factory of the plugin whose spec class is ``kind``."""

    def decorate(factory: Callable[[S], Plugin]) -> Callable[[S], Plugin]:
        _FACTORIES[kind] = factory
        return factory

    return decorate


def build(item: BaseModel) -> Plugin:
    """The plugin a spec describes."""
    return _FACTORIES[type(item)](item)


# --- filters ------------------------------------------------------------------------------------

@register(spec.HealthyFilter)
def _healthy(_s: spec.HealthyFilter) -> Plugin:
    return FilterPlugin("healthy", lambda options, _r: [o for o in options if o.view.healthy])


@register(spec.ServesModelFilter)
def _serves_model(_s: spec.ServesModelFilter) -> Plugin:
    def keep(options: Sequence[Option], _r: PickRequest) -> list[Option]:
        return [o for o in options if o.view.models is None or o.pool.served_model in o.view.models]

    return FilterPlugin("serves-model", keep)


@register(spec.UnderSaturationFilter)
def _under_saturation(s: spec.UnderSaturationFilter) -> Plugin:
    limit = s.max_utilisation

    def keep(options: Sequence[Option], request: PickRequest) -> list[Option]:
        ceiling = limit if limit is not None else request.ceiling
        return [o for o in options if o.view.utilisation < ceiling]

    return FilterPlugin("under-saturation", keep)


# --- scorers ------------------------------------------------------------------------------------

def _least_over(values: list[float]) -> list[float]:
    """``(least + 1) / (value + 1)``: 1 for the smallest value, falling towards 0."""
    least = min(values)
    return [(least + 1.0) / (v + 1.0) for v in values]


@register(spec.LoadScorer)
def _load(s: spec.LoadScorer) -> Plugin:
    return ScorerPlugin("load", lambda options, _r: _least_over([o.view.load for o in options]), s.weight)


@register(spec.QueueDepthScorer)
def _queue_depth(s: spec.QueueDepthScorer) -> Plugin:
    return ScorerPlugin("queue-depth", lambda options, _r: [1.0 / (1.0 + o.view.queued) for o in options],
                        s.weight)


@register(spec.KvCacheScorer)
def _kv_cache(s: spec.KvCacheScorer) -> Plugin:
    return ScorerPlugin("kv-cache", lambda options, _r: [min(1.0, max(0.0, 1.0 - o.view.utilisation))
                                                          for o in options], s.weight)


@register(spec.InflightTokensScorer)
def _inflight_tokens(s: spec.InflightTokensScorer) -> Plugin:
    return ScorerPlugin("inflight-tokens",
                        lambda options, _r: _least_over([float(o.view.inflight_tokens) for o in options]), s.weight)


@register(spec.PrefixAffinityScorer)
def _prefix_affinity(s: spec.PrefixAffinityScorer) -> Plugin:
    ceiling, margin = s.yield_above_utilisation, s.herd_margin

    def score(options: Sequence[Option], request: PickRequest) -> list[float]:
        affinity = request.affinity
        if not affinity:
            return [0.0] * len(options)
        least = min(o.view.load for o in options)
        return [0.0 if (v.queued > 0 or v.utilisation >= ceiling or v.load > least + margin)
                else affinity.get(o.url, 0.0)
                for o in options for v in (o.view,)]

    return ScorerPlugin("prefix-affinity", score, s.weight)


@register(spec.SessionAffinityScorer)
def _session_affinity(s: spec.SessionAffinityScorer) -> Plugin:
    ceiling = s.yield_above_utilisation

    def score(options: Sequence[Option], request: PickRequest) -> list[float]:
        url = request.session_url
        return [1.0 if o.url == url and o.view.healthy and o.view.utilisation < ceiling else 0.0 for o in options]

    return ScorerPlugin("session-affinity", score, s.weight)


# --- pickers ------------------------------------------------------------------------------------

def _best(indexes: Sequence[int], scores: Sequence[float], rng: random.Random | None) -> int:
    top = max(scores[i] for i in indexes)
    tied = [i for i in indexes if scores[i] >= top - 1e-9]
    return tied[0] if rng is None or len(tied) == 1 else rng.choice(tied)


@register(spec.MaxScorePicker)
def _max_score(_s: spec.MaxScorePicker) -> Plugin:
    return PickerPlugin("max-score", lambda options, scores, request: _best(range(len(options)), scores, request.rng))


@register(spec.PowerOfTwoPicker)
def _power_of_two(_s: spec.PowerOfTwoPicker) -> Plugin:
    def pick(options: Sequence[Option], scores: Sequence[float], request: PickRequest) -> int:
        n = len(options)
        if n <= 2 or request.rng is None:
            return _best(range(n), scores, request.rng)
        return _best(request.rng.sample(range(n), 2), scores, request.rng)

    return PickerPlugin("power-of-two", pick)


@register(spec.RoundRobinPicker)
def _round_robin(_s: spec.RoundRobinPicker) -> Plugin:
    return PickerPlugin("round-robin", lambda options, _scores, request: request.rotation % len(options))


def _spec_classes(union: Any) -> set[type[BaseModel]]:
    inner = get_args(union)[0]  # Annotated[Union[...], discriminator]
    return set(get_args(inner))


_DECLARED = _spec_classes(spec.FilterSpec) | _spec_classes(spec.ScorerSpec) | _spec_classes(spec.PickerSpec)
assert set(_FACTORIES) == _DECLARED, f"plugins without a factory: {_DECLARED - set(_FACTORIES)}"


@dataclass(frozen=True, slots=True)
class Profile:
    """A compiled endpoint profile."""

    name: str
    filters: tuple[FilterPlugin, ...]
    scorers: tuple[ScorerPlugin, ...]
    picker: PickerPlugin
    home_region: bool
    #: The session-affinity scorer's (header, use the body's ``user``), when the profile has one.
    session: tuple[str, bool] | None = None
    #: The profile scores prefix affinity (the prompt's block hashes are needed).
    prefix: bool = False


def compile_profile(name: str, profile: spec.EndpointProfile) -> Profile:
    """The functions of a policy profile."""
    filters = tuple(p for p in map(build, profile.filters) if isinstance(p, FilterPlugin))
    scorers = tuple(p for p in map(build, profile.scorers) if isinstance(p, ScorerPlugin))
    picker = build(profile.picker)
    assert isinstance(picker, PickerPlugin)
    assert len(filters) == len(profile.filters)
    assert len(scorers) == len(profile.scorers)
    session = next(((s.header.lower(), s.use_user) for s in profile.scorers
                    if isinstance(s, spec.SessionAffinityScorer)), None)
    prefix = any(isinstance(s, spec.PrefixAffinityScorer) for s in profile.scorers)
    return Profile(name, filters, scorers, picker, profile.home_region, session, prefix)
