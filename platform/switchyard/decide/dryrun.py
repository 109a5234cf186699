"""What the gateway would decide for a request, without sending it or changing any state.

The policy tests, the console's dry-run and ``switchyard policy test`` ask this. It runs the decision
procedure (:func:`switchyard.decide.procedure.decide`) itself, the gateway's own, answering its effects
as a quiet fleet would: every endpoint idle and healthy, no prefix or session history (unless a live
fleet view is given: then as that fleet is now, read-only), ties going to the first endpoint, fresh
limit buckets (only a request larger than a
limit is refused), an empty response cache, no embedding classifier (its rules do not match, and the
trace says so), and every try answered. A request that would queue is taken to wait out its deadline:
a dry run's fleet does not change while it waits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from switchyard.decide.admit import LimitCharge, Reserve, fresh_buckets
from switchyard.decide.cache import RequestKind
from switchyard.decide.decision import Ask, Attempt, Caller, Decision, LookupCache, Mark, Retry, Score, Tried
from switchyard.decide.features import RequestFeatures
from switchyard.decide.flow import Queue, Waited
from switchyard.decide.pick import Strategy
from switchyard.decide.picking import PromptRenderer
from switchyard.decide.procedure import decide
from switchyard.decide.tokens import TokenCounter
from switchyard.decide.views import (
    NO_MEMORY,
    Candidate,
    DrainView,
    EndpointView,
    EngineCacheView,
    FleetView,
    PrefixMemory,
    QueueView,
    ScorerMemory,
    SessionMemory,
)
from switchyard.policy.fleet import Pool
from switchyard.policy.snapshot import PolicySnapshot
from switchyard.policy.tiers import Lane, Limits

_IDLE = EndpointView()


class _EmptyQueue:
    """A pool's queues with nobody in them."""

    def lane(self, lane: Lane) -> _EmptyQueue:
        return self

    def tokens_before(self, tenant: str, rank: int) -> int:
        return 0

    def __len__(self) -> int:
        return 0

    def saturated(self, lane: Lane, utilisation: float, ceiling: float) -> bool:
        return utilisation >= ceiling

    def has_room(self, lane: Lane, utilisation: float, ceiling: float) -> bool:
        return utilisation < ceiling


class _Unknown:
    """A pool that has finished nothing yet: its drain rate is not known."""

    def drain_rate(self, in_flight_tokens: int) -> float | None:
        return None


class IdleFleet:
    """A :class:`~switchyard.decide.views.FleetView` of a quiet fleet: every endpoint healthy and empty, no
    queue, no history, no clock."""

    memory: ScorerMemory = NO_MEMORY
    rng = None

    def now(self) -> float:
        return 0.0

    def rotation(self) -> int:
        return 0

    def endpoint(self, candidate: Candidate, lane: Lane, now: float) -> EndpointView:
        return _IDLE

    def pool_utilisation(self, pool: Pool, lane: Lane, now: float) -> float:
        return 0.0

    def queues(self, pool: Pool) -> _EmptyQueue:
        return _EmptyQueue()

    def service(self, pool: Pool) -> _Unknown:
        return _Unknown()

    def reserved_tokens(self, pool: Pool) -> int:
        return 0

    def out_of_service(self, options: Sequence[Candidate], now: float) -> tuple[str, float]:
        return "no endpoint", 1.0

    def yielders(self, url: str) -> Sequence[float]:
        return ()

    def prefilling(self, url: str) -> int:
        return 0

    def ttft_quantile(self, pool: Pool, quantile: float, now: float) -> float | None:
        return None  # no history: a hedge at an observed quantile is never sent

    def available(self, candidate: Candidate, now: float) -> bool:
        return True

    def full(self, candidate: Candidate, ceiling: float, now: float, preempting: bool) -> bool:
        return False


class _Unwritten:
    """A scorer memory read as it is, and never written (a dry run records nothing)."""

    def __init__(self, memory: ScorerMemory) -> None:
        self._memory = memory

    @property
    def prefixes(self) -> PrefixMemory:
        return _ReadPrefixes(self._memory.prefixes)

    @property
    def sessions(self) -> SessionMemory:
        return _ReadSessions(self._memory.sessions)

    @property
    def engine_caches(self) -> EngineCacheView:
        return _ReadEngineCaches(self._memory.engine_caches)


class _ReadPrefixes:
    def __init__(self, prefixes: PrefixMemory) -> None:
        self._prefixes = prefixes

    def affinity(self, hashes: Sequence[bytes], urls: Sequence[str], now: float) -> dict[str, float]:
        return self._prefixes.affinity(hashes, urls, now)

    def record(self, hashes: Sequence[bytes], url: str, now: float) -> None:
        return None


class _ReadEngineCaches:
    def __init__(self, caches: EngineCacheView) -> None:
        self._caches = caches

    def knows(self, url: str, now: float) -> bool:
        return self._caches.knows(url, now)

    def held(self, url: str, tokens: Sequence[int], now: float) -> int | None:
        return self._caches.held(url, tokens, now)

    def expect(self, url: str, tokens: Sequence[int], held: int, now: float) -> None:
        return None


class _ReadSessions:
    def __init__(self, sessions: SessionMemory) -> None:
        self._sessions = sessions

    def get(self, key: str, now: float) -> str | None:
        return self._sessions.get(key, now)

    def record(self, key: str, url: str, now: float) -> None:
        return None


class Looking:
    """A live :class:`~switchyard.decide.views.FleetView` as a dry run reads it: everything as it is, but the
    stateful scorers' memory is only read, round-robin does not advance, and ties go to the first endpoint."""

    rng = None

    def __init__(self, fleet: FleetView) -> None:
        self._fleet = fleet
        self.memory = _Unwritten(fleet.memory)

    def now(self) -> float:
        return self._fleet.now()

    def rotation(self) -> int:
        return 0

    def endpoint(self, candidate: Candidate, lane: Lane, now: float) -> EndpointView:
        return self._fleet.endpoint(candidate, lane, now)

    def pool_utilisation(self, pool: Pool, lane: Lane, now: float) -> float:
        return self._fleet.pool_utilisation(pool, lane, now)

    def queues(self, pool: Pool) -> QueueView:
        return self._fleet.queues(pool)

    def service(self, pool: Pool) -> DrainView:
        return self._fleet.service(pool)

    def reserved_tokens(self, pool: Pool) -> int:
        return self._fleet.reserved_tokens(pool)

    def out_of_service(self, options: Sequence[Candidate], now: float) -> tuple[str, float]:
        return self._fleet.out_of_service(options, now)

    def yielders(self, url: str) -> Sequence[float]:
        return self._fleet.yielders(url)

    def prefilling(self, url: str) -> int:
        return self._fleet.prefilling(url)

    def ttft_quantile(self, pool: Pool, quantile: float, now: float) -> float | None:
        return self._fleet.ttft_quantile(pool, quantile, now)

    def available(self, candidate: Candidate, now: float) -> bool:
        return self._fleet.available(candidate, now)

    def full(self, candidate: Candidate, ceiling: float, now: float, preempting: bool) -> bool:
        return self._fleet.full(candidate, ceiling, now, preempting)


@dataclass(frozen=True, slots=True)
class DryRun:
    """The decisions for one request.

    Attributes:
        status: 200 when it would be served, else the status of the refusal.
        code: The refusal's error code.
        model: The resolved model (None when refused before resolving).
        priority: The priority class it is served in (None when refused before classifying).
        pool, region, endpoint: Where it would be sent (None when refused).
        served_model: The model of the stage that would serve it (the resolved one, unless flow control
            downgraded it).
        limit: The limit that refuses it (429).
        plan: The fallback plan's stages, in order.
        prompt_tokens: Its prompt as counted for admission.
        estimated_tokens: What admission reserves for it (prompt + expected output).
        charges: The limits it is charged against.
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
    served_model: str | None = None
    plan: tuple[str, ...] = ()
    prompt_tokens: int | None = None
    estimated_tokens: int | None = None
    charges: tuple[LimitCharge, ...] = ()
    trace: tuple[str, ...] = ()


def body_of_features(features: RequestFeatures) -> dict[str, Any]:
    """A chat request body with what ``features`` say of one (for callers that describe a request by its
    features only)."""
    messages = [{"role": "system", "content": features.system_text}] if features.system_text else []
    messages.append({"role": "user", "content": features.last_user_text})
    body: dict[str, Any] = {"model": features.model, "messages": messages}
    if features.max_tokens is not None:
        body["max_tokens"] = features.max_tokens
    if features.choices > 1:
        body["n"] = features.choices
    return body


def run_idle(d: Decision, fleet: FleetView) -> Decision:
    """Drive the procedure for ``d`` to its end, answering its effects as a dry run does (see the module doc)."""
    steps = decide(d, fleet)
    answer: Any = None
    try:
        while True:
            effect = steps.send(answer)
            if isinstance(effect, Reserve):
                answer = fresh_buckets(effect.charges)
            elif isinstance(effect, Attempt):
                answer = Tried("ok")  # (at once: never "slow", so never hedged)
            elif isinstance(effect, Retry):
                answer = True
            elif isinstance(effect, Queue):
                answer = Waited("expired", effect.deadline_s)
            else:
                assert isinstance(effect, Score | LookupCache | Mark), effect
                answer = None  # no embedding classifier, an empty cache, no stage timed
    except StopIteration as done:
        result: Decision = done.value
        return result


def dry_run(snapshot: PolicySnapshot, tier: str, features: RequestFeatures,
            strategy: Strategy = "prefix-aware", priority: object = None, key_region: str | None = None,
            gateway_region: str | None = None, body: Mapping[str, Any] | None = None, *, kind: RequestKind = "chat",
            tenant: str = "dry-run", tenant_limits: Limits | None = None, key_limits: Limits | None = None,
            counters: Mapping[str, TokenCounter] | None = None, fleet: FleetView | None = None,
            renderers: Mapping[str, PromptRenderer] | None = None) -> DryRun:
    """Every decision the gateway would take for ``features`` from a tenant of ``tier``.

    ``priority`` is the body's ``priority`` (a class name or vLLM number); the headers that lower the
    class, name a home region or bypass the cache are read from ``features.headers``. ``body``: the
    request body (default: one made of ``features``); ``key_region``: the API key's (or tenant's) home
    region; ``gateway_region``: the gateway's; ``tenant_limits``, ``key_limits``: the tenant's and the
    key's limit overrides; ``counters``: the models' prompt counters (their tokenizers); ``fleet``: the
    fleet as it is (default: idle), read and never changed (:class:`Looking`); ``renderers``: the models'
    prompt renderers (the precise KV-cache scorer looks the prompt up in the engines' reported caches).
    """
    request = dict(body) if body is not None else body_of_features(features)
    if priority is not None:
        request["priority"] = priority
    caller = Caller(tier, tenant, "dry-run", tenant_limits, key_limits, key_region)
    ask = Ask(kind, request, features, caller, gateway_region, strategy, counters=counters or {},
              renderers=renderers or {})
    return summary(run_idle(Decision(snapshot, ask), Looking(fleet) if fleet is not None else IdleFleet()))


def summary(d: Decision) -> DryRun:
    """The dry run's answer from a finished decision."""
    model = d.model.model.name if d.model is not None else None
    priority = d.cls.name if d.cls is not None else None
    est = d.estimate.tokens if d.estimate is not None else None
    prompt = d.prompt_tokens if d.estimate is not None else None
    common: dict[str, Any] = {"model": model, "priority": priority, "plan": tuple(s.label for s in d.stages),
                              "prompt_tokens": prompt, "estimated_tokens": est, "charges": d.charges,
                              "trace": tuple(str(line) for line in d.trace)}
    if d.outcome == "refused":
        assert d.refusal is not None
        return DryRun(d.refusal.status, d.refusal.code, limit=d.refusal.limit, **common)
    if d.outcome == "cache_hit":
        return DryRun(200, None, pool="cache", served_model=model, **common)
    assert d.outcome == "served", d.outcome
    assert d.choice is not None
    assert d.stage is not None
    return DryRun(200, None, pool=d.choice.pool.name, region=d.choice.pool.region, endpoint=d.choice.url,
                  served_model=d.stage.model.name, **common)
