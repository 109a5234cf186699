"""The endpoint picker's plugins: one implementation per spec of :mod:`switchyard.policy.routing`.

Their interfaces are :mod:`switchyard.decide.picking`. Every plugin is a pure function of the
candidates and what the executor knows of them (an :class:`Option` per endpoint) and of the request
(:class:`PickRequest`):

- a :class:`Filter` keeps some candidates. A filter that would leave none is ignored (the trace
  says so): better to try a busy or cooling-down replica, or one whose scrape named another model
  (its own answer then says what is wrong), than to refuse.
- a :class:`Scorer` gives one score in [0, 1] per candidate; the profile's score is the weighted mean.
- a :class:`Picker` chooses the index of one candidate.

A scorer that keeps state (prefix affinity, session affinity) is also an :class:`Observer`: after a
pick and after the endpoint's answer, the procedure calls its hooks, and it records what it needs in
the executor's :class:`~switchyard.decide.views.ScorerMemory` (the executor owns the memory; the
scorer decides what goes in it and reads it back), as the Kubernetes endpoint picker's
PostResponse plugins do.

Each plugin class is registered for its spec class (:func:`register`); :func:`compile_profile` turns a
policy profile into plugin objects once per policy snapshot, and an import-time check makes sure
every spec class the schema accepts has a plugin.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, get_args

from pydantic import BaseModel

from switchyard.decide.picking import Answer, Explains, Filter, Observer, Option, Picker, PickRequest, Scorer
from switchyard.policy import routing as spec

Plugin = Filter | Scorer | Picker
P = TypeVar("P", bound=type)
_PLUGINS: dict[type[BaseModel], Callable[[Any], Plugin]] = {}


def register(kind: type[BaseModel]) -> Callable[[P], P]:
    """Register the plugin class built (from its spec) for spec class ``kind``."""

    def decorate(plugin: P) -> P:
        _PLUGINS[kind] = plugin
        return plugin

    return decorate


def build(item: BaseModel) -> Plugin:
    """The plugin a spec describes."""
    return _PLUGINS[type(item)](item)


# --- filters ------------------------------------------------------------------------------------

@register(spec.HealthyFilter)
@dataclass(frozen=True, slots=True)
class HealthyFilter:
    """Endpoints in service (picking drops the others anyway: see :func:`switchyard.decide.pick.pick_endpoint`)."""

    _spec: spec.HealthyFilter
    name: str = "healthy"

    def keep(self, options: Sequence[Option], request: PickRequest) -> list[Option]:
        return [o for o in options if o.view.healthy]


@register(spec.ServesModelFilter)
@dataclass(frozen=True, slots=True)
class ServesModelFilter:
    """Endpoints whose engine does not report serving another model than the pool declares."""

    _spec: spec.ServesModelFilter
    name: str = "serves-model"

    def keep(self, options: Sequence[Option], request: PickRequest) -> list[Option]:
        return [o for o in options if o.view.models is None or o.pool.served_model in o.view.models]


@register(spec.UnderSaturationFilter)
@dataclass(frozen=True, slots=True)
class UnderSaturationFilter:
    """Endpoints under the spec's utilisation, or the request's class's ceiling."""

    _spec: spec.UnderSaturationFilter
    name: str = "under-saturation"

    def keep(self, options: Sequence[Option], request: PickRequest) -> list[Option]:
        limit = self._spec.max_utilisation
        ceiling = limit if limit is not None else request.ceiling
        return [o for o in options if o.view.utilisation < ceiling]


# --- scorers ------------------------------------------------------------------------------------

class _Weighted:
    """A scorer whose weight is the one its spec gives."""

    __slots__ = ()
    _spec: Any

    @property
    def weight(self) -> float:
        """How much its score counts in the profile's weighted mean."""
        return float(self._spec.weight)


def _least_over(values: list[float]) -> list[float]:
    """``(least + 1) / (value + 1)``: 1 for the smallest value, falling towards 0."""
    least = min(values)
    return [(least + 1.0) / (v + 1.0) for v in values]


@register(spec.LoadScorer)
@dataclass(frozen=True, slots=True)
class LoadScorer(_Weighted):
    """Fewer requests at the engine score higher."""

    _spec: spec.LoadScorer
    name: str = "load"

    def score(self, options: Sequence[Option], request: PickRequest) -> list[float]:
        return _least_over([o.view.load for o in options])


@register(spec.QueueDepthScorer)
@dataclass(frozen=True, slots=True)
class QueueDepthScorer(_Weighted):
    """Fewer requests waiting inside the engine score higher."""

    _spec: spec.QueueDepthScorer
    name: str = "queue-depth"

    def score(self, options: Sequence[Option], request: PickRequest) -> list[float]:
        return [1.0 / (1.0 + o.view.queued) for o in options]


@register(spec.KvCacheScorer)
@dataclass(frozen=True, slots=True)
class KvCacheScorer(_Weighted):
    """More room left in the KV cache (and sequence slots) scores higher."""

    _spec: spec.KvCacheScorer
    name: str = "kv-cache"

    def score(self, options: Sequence[Option], request: PickRequest) -> list[float]:
        return [min(1.0, max(0.0, 1.0 - o.view.utilisation)) for o in options]


@register(spec.InflightTokensScorer)
@dataclass(frozen=True, slots=True)
class InflightTokensScorer(_Weighted):
    """Fewer of this gateway's tokens in flight there score higher."""

    _spec: spec.InflightTokensScorer
    name: str = "inflight-tokens"

    def score(self, options: Sequence[Option], request: PickRequest) -> list[float]:
        return _least_over([float(o.view.inflight_tokens) for o in options])


def _yielding(options: Sequence[Option], values: Sequence[float], ceiling: float, margin: float,
              when_queued: bool = True) -> list[float]:
    """``values``, but 0 at a busy endpoint (at or over ``ceiling``, more than ``margin`` requests above the
    least loaded candidate, or, with ``when_queued``, requests waiting in its engine): one hot prefix must not
    pile a burst onto one replica."""
    least = min(o.view.load for o in options)
    return [0.0 if ((when_queued and v.queued > 0) or v.utilisation >= ceiling or v.load > least + margin)
            else value for o, value in zip(options, values, strict=True) for v in (o.view,)]


@register(spec.PrefixAffinityScorer)
@dataclass(frozen=True, slots=True)
class PrefixAffinityScorer(_Weighted):
    """The share of the prompt's leading blocks an endpoint was sent recently, unless it is busy (herding guard).

    Its memory is the executor's :class:`~switchyard.decide.views.PrefixMemory`: after a request was
    answered (or preempted after running) at an endpoint, that endpoint holds the prompt's blocks.
    """

    _spec: spec.PrefixAffinityScorer
    name: str = "prefix-affinity"

    def score(self, options: Sequence[Option], request: PickRequest) -> list[float]:
        if request.alternatives < 2:  # nothing to choose between: the prompt need not even be hashed
            return [0.0] * len(options)
        hashes = request.subject.hashes()
        if not hashes:
            return [0.0] * len(options)
        affinity = request.memory.prefixes.affinity(hashes, [o.url for o in options], request.now)
        return _yielding(options, [affinity.get(o.url, 0.0) for o in options],
                         self._spec.yield_above_utilisation, self._spec.herd_margin)

    def picked(self, url: str, request: PickRequest) -> None:
        return None

    def answered(self, url: str, request: PickRequest, answer: Answer) -> None:
        _remember_prompt(url, request, answer)


def _remember_prompt(url: str, request: PickRequest, answer: Answer) -> None:
    if answer != "failed" and request.alternatives > 1 and request.subject.hashes():
        # Its prompt is in that engine's prefix cache now (as far as a guess goes).
        request.memory.prefixes.record(request.subject.hashes(), url, request.now)


@register(spec.KvCachePreciseScorer)
@dataclass(frozen=True, slots=True)
class KvCachePreciseScorer(_Weighted):
    """The share of the prompt's tokens an endpoint's prefix cache holds now, as its engine reports it (its
    KV-cache events: the executor's :class:`~switchyard.decide.views.EngineCacheView`), unless it is busy.

    An endpoint not reported on now (no events, a stream syncing, stale or cut), or a request the executor
    cannot render into the engine's tokens, is scored by the approximate index as ``prefix-affinity`` scores
    it; which one decided is kept on the request (:attr:`~switchyard.decide.picking.Subject.cache_sources`)
    for the decision trace. It also keeps the approximate index up to date, so that the fallback has history.
    """

    _spec: spec.KvCachePreciseScorer
    name: str = "kv-cache-precise"

    def score(self, options: Sequence[Option], request: PickRequest) -> list[float]:
        if request.alternatives < 2:
            return [0.0] * len(options)
        subject, now = request.subject, request.now
        caches = request.memory.engine_caches
        # The prompt is rendered into the engine's tokens only when an engine is reported on.
        tokens = subject.tokens(request.model) if any(caches.knows(o.url, now) for o in options) else None
        sources = subject.cache_sources
        values: list[float] = []
        guessing: list[int] = []
        for i, option in enumerate(options):
            held = caches.held(option.url, tokens, now) if tokens else None
            if held is None:
                guessing.append(i)
                values.append(0.0)
            else:
                sources[option.url] = (True, held)
                values.append(held / len(tokens) if tokens else 0.0)
        if guessing:
            hashes = subject.hashes()
            urls = [options[i].url for i in guessing]
            affinity = request.memory.prefixes.affinity(hashes, urls, now) if hashes else {}
            for i in guessing:
                values[i] = affinity.get(options[i].url, 0.0)
                sources[options[i].url] = (False, values[i])
        # What the engine reports it holds saves that prefill for sure: only the margin and the ceiling yield
        # (requests briefly waiting at the holder cost less than recomputing the prefix elsewhere).
        return _yielding(options, values, self._spec.yield_above_utilisation, self._spec.herd_margin,
                         when_queued=False)

    def picked(self, url: str, request: PickRequest) -> None:
        tokens = request.subject.tokens(request.model)
        known, held = request.subject.cache_sources.get(url, (False, 0.0))
        if tokens and known:
            request.memory.engine_caches.expect(url, tokens, int(held), request.now)

    def answered(self, url: str, request: PickRequest, answer: Answer) -> None:
        _remember_prompt(url, request, answer)

    def explain(self, url: str, request: PickRequest) -> str | None:
        """Which knowledge scored the chosen endpoint ``url``, for the decision trace."""
        if request.alternatives < 2:
            return None
        known, value = request.subject.cache_sources.get(url, (False, 0.0))
        if known:
            tokens = request.subject.tokens(request.model) or []  # (rendered already: it was scored by them)
            return f"{self.name}: engine events: {int(value):,} of {len(tokens):,} prompt tokens cached there"
        why = (f"no exact prompt tokens for {request.model}" if request.subject.cannot_render(request.model)
               else "no engine report for it")
        return f"{self.name}: approximate index ({why}): {value:.0%} of the prompt's blocks"


@register(spec.SessionAffinityScorer)
@dataclass(frozen=True, slots=True)
class SessionAffinityScorer(_Weighted):
    """1 for the endpoint that served the request's session last, while it is healthy and has room.

    Its memory is the executor's :class:`~switchyard.decide.views.SessionMemory`, keyed per tenant,
    model and session id (:func:`switchyard.decide.sessions.session_key`).
    """

    _spec: spec.SessionAffinityScorer
    name: str = "session-affinity"

    def key(self, request: PickRequest) -> str | None:
        """The request's session under this scorer (None: no session id)."""
        return request.subject.session(self._spec.header.lower(), self._spec.use_user, request.model)

    def score(self, options: Sequence[Option], request: PickRequest) -> list[float]:
        key = self.key(request)
        url = request.memory.sessions.get(key, request.now) if key is not None else None
        ceiling = self._spec.yield_above_utilisation
        return [1.0 if o.url == url and o.view.healthy and o.view.utilisation < ceiling else 0.0 for o in options]

    def picked(self, url: str, request: PickRequest) -> None:
        return None

    def answered(self, url: str, request: PickRequest, answer: Answer) -> None:
        key = self.key(request) if answer == "ok" else None
        if key is not None:
            request.memory.sessions.record(key, url, request.now)


@register(spec.LoraAffinityScorer)
@dataclass(frozen=True, slots=True)
class LoraAffinityScorer(_Weighted):
    """Keeps a LoRA adapter's requests on the replicas that have it loaded (see the spec)."""

    _spec: spec.LoraAffinityScorer
    name: str = "lora-affinity"

    def score(self, options: Sequence[Option], request: PickRequest) -> list[float]:
        adapter = request.adapter
        if adapter is None:
            return [1.0] * len(options)
        least = min(o.view.load for o in options)
        ceiling, margin = self._spec.yield_above_utilisation, self._spec.herd_margin
        scores = []
        for option in options:
            view = option.view
            busy = view.utilisation >= ceiling or view.load > least + margin
            if adapter in view.adapters and not busy:
                scores.append(1.0)
            elif adapter in view.recent_adapters and not busy:
                scores.append(0.8)
            elif len((view.adapters | view.recent_adapters) - {adapter}) < view.max_loras:
                scores.append(0.5)  # a slot free of active and lately used adapters
            elif len(view.adapters - {adapter}) < view.max_loras:
                scores.append(0.3)  # a slot free now, which a lately used adapter is likely loaded in
            else:
                scores.append(0.0)
        return scores


# --- pickers ------------------------------------------------------------------------------------

def _best(indexes: Sequence[int], scores: Sequence[float], rng: random.Random | None) -> int:
    top = max(scores[i] for i in indexes)
    tied = [i for i in indexes if scores[i] >= top - 1e-9]
    return tied[0] if rng is None or len(tied) == 1 else rng.choice(tied)


@register(spec.MaxScorePicker)
@dataclass(frozen=True, slots=True)
class MaxScorePicker:
    """The highest score (ties at random, or the first without a random source)."""

    _spec: spec.MaxScorePicker
    name: str = "max-score"

    def pick(self, options: Sequence[Option], scores: Sequence[float], request: PickRequest) -> int:
        return _best(range(len(options)), scores, request.rng)


@register(spec.PowerOfTwoPicker)
@dataclass(frozen=True, slots=True)
class PowerOfTwoPicker:
    """The better of two candidates drawn at random."""

    _spec: spec.PowerOfTwoPicker
    name: str = "power-of-two"

    def pick(self, options: Sequence[Option], scores: Sequence[float], request: PickRequest) -> int:
        n = len(options)
        if n <= 2 or request.rng is None:
            return _best(range(n), scores, request.rng)
        return _best(request.rng.sample(range(n), 2), scores, request.rng)


@register(spec.RoundRobinPicker)
@dataclass(frozen=True, slots=True)
class RoundRobinPicker:
    """The next candidate in turn."""

    _spec: spec.RoundRobinPicker
    name: str = "round-robin"

    def pick(self, options: Sequence[Option], scores: Sequence[float], request: PickRequest) -> int:
        return request.rotation % len(options)


def _spec_classes(union: Any) -> set[type[BaseModel]]:
    inner = get_args(union)[0]  # Annotated[Union[...], discriminator]
    return set(get_args(inner))


_DECLARED = _spec_classes(spec.FilterSpec) | _spec_classes(spec.ScorerSpec) | _spec_classes(spec.PickerSpec)
assert set(_PLUGINS) == _DECLARED, f"plugins without an implementation: {_DECLARED - set(_PLUGINS)}"


@dataclass(frozen=True, slots=True)
class Profile:
    """A compiled endpoint profile."""

    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[Scorer, ...]
    picker: Picker
    home_region: bool
    #: The plugins with observation hooks (the stateful scorers).
    observers: tuple[Observer, ...] = ()
    #: The scorers that say what they scored the chosen endpoint by.
    explainers: tuple[Explains, ...] = ()

    def picked(self, url: str, request: PickRequest) -> None:
        """Tell the stateful plugins what was picked."""
        for observer in self.observers:
            observer.picked(url, request)

    def answered(self, url: str, request: PickRequest, answer: Answer) -> None:
        """Tell the stateful plugins what became of the try at ``url``."""
        for observer in self.observers:
            observer.answered(url, request, answer)


def compile_profile(name: str, profile: spec.EndpointProfile) -> Profile:
    """The plugins of a policy profile."""
    filters = [build(f) for f in profile.filters]
    scorers = [build(s) for s in profile.scorers]
    picker = build(profile.picker)
    assert isinstance(picker, Picker), picker
    plugins = (*filters, *scorers, picker)
    observers = tuple(p for p in plugins if isinstance(p, Observer))
    explainers = tuple(s for s in scorers if isinstance(s, Explains))
    return Profile(name, tuple(f for f in filters if isinstance(f, Filter)),
                   tuple(s for s in scorers if isinstance(s, Scorer)), picker, profile.home_region, observers,
                   explainers)
