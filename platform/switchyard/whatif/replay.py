"""One arm of a pre-publish replay: a workload through one policy's decisions and simulated engines.

For each request, in arrival order, at its arrival time on the simulated clock:

1. every engine runs up to that moment, and the requests that finished settle their limit
   reservations with what they used;
2. the gateway's decisions run on it as they would in ``gateway.proxy``: the model is resolved
   (a refusal is the gateway's 403/404); admission reserves its estimate against the tier's limits
   in an in-process limit store on the simulated clock (a refusal is the gateway's 429; each tier
   is one tenant, since a trace names no tenants); the fallback plan is cut to the stages whose
   context window can hold it (``usable_stages``) and to the tier's regions, and an endpoint is
   picked with the model's endpoint profile, a prefix index and the engines' current load (sessions
   and home regions other than the policy's own are not known to a trace);
3. the request enters that endpoint's engine core with the priority its tier's class gets there.
   A prompt plus output budget larger than the engine's context window is the engine's 400.

When the last request has arrived, the engines run until they are empty. Every request then
has what a client would have seen: status, model, pool, region, TTFT, end-to-end time, prompt
tokens served from the prefix cache, and its cost at the served model's prices.

Stages of the request path that have not landed (queue deadlines and shedding, the response
cache) are not modelled yet; :data:`NOT_MODELLED` names them and the report says so rather than
predicting zero.
"""

from __future__ import annotations

import random
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from switchyard.bench.spec import RequestSpec, Workload
from switchyard.decide.admit import LimitCharge, actual_amounts, estimate, limit_charges, refusal_code, spend_of
from switchyard.decide.features import RequestFeatures, chat_features, completion_features
from switchyard.decide.flow import BadPriority, classify
from switchyard.decide.pick import (
    EndpointChoice,
    Stage,
    Strategy,
    fallback_plan,
    pick_endpoint,
    profile_for,
    usable_stages,
)
from switchyard.decide.plugins import PickRequest
from switchyard.decide.prefix import PrefixIndex, block_hashes, prompt_text
from switchyard.decide.regions import Placement, place
from switchyard.decide.resolve import ModelDecision, Refused, resolve_offline
from switchyard.policy.schema import Model
from switchyard.policy.snapshot import PolicySnapshot
from switchyard.sim.chat import render_chat
from switchyard.sim.request import SimRequest
from switchyard.sim.tokens import SPECIAL_TOKENS, tokenize
from switchyard.store.limits import MemoryLimitStore, charges_of
from switchyard.whatif.fleet import Fleet

#: Request-path stages the replay cannot evaluate yet, with the issue that brings each.
NOT_MODELLED: tuple[str, ...] = (
    "flow control (the gateway's queues, deadlines, shedding and downgrades; issue 5): the replay sends every "
    "admitted request straight to its engine, so it predicts no 503 from shedding and no downgrade",
    "response cache (issue 8): only the engines' prefix cache is counted",
)
#: How often (in arrivals) finished requests are collected, so their prompts do not pile up.
_SWEEP_EVERY = 256
_BOS = SPECIAL_TOKENS["<|begin_of_text|>"]
#: Reservations outlive any simulated request (the replay settles every one).
_TTL_S = 1e9
T = TypeVar("T")


@dataclass(slots=True)
class ReplayOutcome:
    """What one request would have met under one policy.

    Attributes:
        index: The request's position in the workload.
        arrival_s: Its arrival, in simulated seconds from the start.
        tier: The tier it was sent as.
        request_class: The priority class the tier has in this policy (``-`` for an unknown tier).
        requested: The ``model`` it asked for.
        status: 200 when served, else the status the gateway would answer with.
        code: The error code of a refusal.
        model: The model that served it (a fallback's when the plan moved on), if any.
        pool, region, endpoint: Where it ran, if it did.
        prompt_tokens: Prompt tokens the engine saw (chat template included).
        cached_tokens: Of those, tokens found in the engine's prefix cache.
        output_tokens: Tokens generated.
        ttft_s: Time to first token, from arrival.
        e2e_s: Time to the last token, from arrival.
        cost: Its price at the serving model's rates.
    """

    index: int
    arrival_s: float
    tier: str
    request_class: str
    requested: str
    status: int = 200
    code: str | None = None
    model: str | None = None
    pool: str | None = None
    region: str | None = None
    endpoint: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    cost: float = 0.0

    @property
    def placement(self) -> str:
        """Where it went, as one comparable string: ``model @ pool (region)`` or the refusal."""
        if self.status != 200:
            return f"refused {self.status} ({self.code})"
        return f"{self.model} @ {self.pool} ({self.region})"


@dataclass(slots=True)
class ArmResult:
    """One policy's replay.

    Attributes:
        name: ``active`` or ``candidate`` (or any label the caller gives).
        policy: The policy's label (``v7``, or a short hash for an unversioned document).
        sha256: The policy text's hash.
        outcomes: One per request, in workload order.
        simulated_s: Simulated seconds from the first arrival to the last token.
        wall_s: Wall-clock seconds the replay took.
    """

    name: str
    policy: str
    sha256: str
    outcomes: list[ReplayOutcome]
    simulated_s: float
    wall_s: float
    not_modelled: tuple[str, ...] = NOT_MODELLED

    @property
    def speedup(self) -> float | None:
        """Simulated seconds per wall-clock second."""
        return self.simulated_s / self.wall_s if self.wall_s > 0 else None


def prompt_ids(body: dict[str, Any]) -> list[int]:
    """The token ids a simulated engine makes of a request body's prompt."""
    if "messages" in body:
        return render_chat(body["messages"], body.get("tools"), body.get("response_format"))
    return [_BOS, *tokenize(str(body["prompt"]))]


def cost_of(model: Model, prompt: int, cached: int, output: int) -> float:
    """A request's price: uncached and cached prompt tokens and output tokens at the model's rates."""
    price = model.price
    cached_rate = price.cached_input_per_mtok if price.cached_input_per_mtok is not None else price.input_per_mtok
    return ((prompt - cached) * price.input_per_mtok + cached * cached_rate + output * price.output_per_mtok) / 1e6


@dataclass(slots=True)
class _Running:
    """A request of the replay and, when it reached an engine, its engine-side state."""

    outcome: ReplayOutcome
    request: SimRequest | None = None
    model: Model | None = None
    reservation: str | None = None
    charges: list[LimitCharge] = field(default_factory=list)


def _now(work: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never suspends (the in-process limit store's methods)."""
    try:
        work.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    work.close()
    raise RuntimeError("the in-process limit store suspended; the replay cannot drive it")


@dataclass(slots=True)
class _Arm:
    """The mutable state of one replay."""

    snapshot: PolicySnapshot
    fleet: Fleet
    strategy: Strategy
    seed: int
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)
    limits: MemoryLimitStore = field(default_factory=MemoryLimitStore)
    rotation: int = 0
    running: list[_Running] = field(default_factory=list)
    unsettled: dict[SimRequest, _Running] = field(default_factory=dict)
    #: Breaks ties between equally scored endpoints, reproducibly.
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def settle(self, finished: list[SimRequest], now: float) -> None:
        """Settle the reservations of requests that finished (what they used flows back)."""
        for request in finished:
            entry = self.unsettled.pop(request, None)
            if entry is None or entry.reservation is None or entry.model is None:
                continue
            used = len(request.prompt) + len(request.output)
            spend = spend_of(entry.model, len(request.prompt), len(request.output), request.num_cached_tokens)
            _now(self.limits.reconcile(entry.reservation, actual_amounts(entry.charges, used, spend), now))

    def route(self, spec: RequestSpec) -> None:
        """Decide where ``spec`` goes and submit it there (or record its refusal)."""
        t = spec.arrival_s
        body = spec.body()
        features = _features(body)
        snapshot = self.snapshot
        tier = snapshot.tiers.get(spec.tenant)
        outcome = ReplayOutcome(spec.index, t, spec.tenant, tier.priority if tier else "-", spec.model)
        try:
            decision = resolve_offline(snapshot, spec.tenant, features)
            placement = place(snapshot, spec.tenant, decision.model, None)
        except Refused as refusal:
            outcome.status, outcome.code = refusal.status, refusal.code
            self.running.append(_Running(outcome))
            return
        assert tier is not None  # resolve_model refuses an unknown tier
        charges = limit_charges(snapshot, tier.name, decision.model,
                                estimate(decision.model, features.prompt_tokens, features.max_tokens),
                                tenant=tier.name, key=tier.name)
        reservation = None
        if charges:
            answer = _now(self.limits.reserve(charges_of(charges), _TTL_S, t))
            if not answer.admitted:
                assert answer.refused_by is not None
                outcome.status, outcome.code = 429, refusal_code(answer.refused_by.unit, answer.never)
                self.running.append(_Running(outcome))
                return
            reservation = answer.reservation
        try:
            cls = classify(snapshot, tier.name, None, body.get("priority"))
        except BadPriority:
            outcome.status, outcome.code = 400, "invalid_priority"
            self._release(reservation, charges, t)
            self.running.append(_Running(outcome))
            return
        picked = self._pick(body, features, decision, placement, cls.cls.dispatch_ceiling, t)
        if picked is None:
            outcome.status, outcome.code = 503, "no_endpoint"
            self._release(reservation, charges, t)
            self.running.append(_Running(outcome))
            return
        stage, choice = picked
        endpoint = self.fleet.endpoints[choice.url]
        outcome.model, outcome.pool, outcome.region, outcome.endpoint = (
            stage.model.name, choice.pool.name, choice.pool.region, choice.url)
        ids = prompt_ids(body)
        outcome.prompt_tokens = len(ids)
        if len(ids) + spec.max_tokens > endpoint.config.max_model_len:
            outcome.status, outcome.code = 400, "context_length_exceeded"
            self._release(reservation, charges, t)
            self.running.append(_Running(outcome))
            return
        priority = cls.engine_priority
        request = SimRequest(request_id=str(spec.index), prompt=ids, max_output=spec.max_tokens,
                             priority=priority if choice.pool.priority_scheduling else 0, arrival=t,
                             seed=self.seed + spec.index, budget=spec.max_tokens)
        endpoint.submit(request)
        entry = _Running(outcome, request, stage.model, reservation, charges)
        self.running.append(entry)
        self.unsettled[request] = entry

    def _release(self, reservation: str | None, charges: list[LimitCharge], now: float) -> None:
        """A request that never ran gives its whole reservation back."""
        if reservation is not None:
            _now(self.limits.reconcile(reservation, actual_amounts(charges, 0, 0.0), now))

    def _pick(self, body: dict[str, Any], features: RequestFeatures, decision: ModelDecision, placement: Placement,
              ceiling: float, now: float) -> tuple[Stage, EndpointChoice] | None:
        """The gateway's first pick along the plan (no engine fails in a replay, so it is also the last)."""
        needed = features.prompt_tokens + (features.max_tokens or 0)
        stages, _skipped = usable_stages(fallback_plan(self.snapshot, decision.model, placement.allowed), needed)
        hashes: list[bytes] | None = None
        for stage in stages:
            options = stage.candidates()
            profile = profile_for(self.snapshot, stage.model, self.strategy)
            if hashes is None and profile.prefix and len(options) > 1:
                hashes = block_hashes(prompt_text(body))
            affinity = (self.prefixes.affinity(hashes, [o.url for o in options], now) if hashes and profile.prefix
                        else {})
            self.rotation += 1
            choice = pick_endpoint(profile, options, self.fleet.view,
                                   PickRequest(affinity, None, placement.home, ceiling, self.rotation, self.rng))
            if choice is not None:
                if hashes and profile.prefix:
                    self.prefixes.record(hashes, choice.url, now)
                return stage, choice
        return None

    def sweep(self, final: bool = False) -> list[ReplayOutcome]:
        """Outcomes of finished requests (all of them when ``final``), filled in and let go."""
        done, still = [], []
        for entry in self.running:
            request = entry.request
            if request is not None and request.finished_at is None and not final:
                still.append(entry)
                continue
            done.append(_fill(entry))
        self.running = still
        return done


def _features(body: dict[str, Any]) -> RequestFeatures:
    if "messages" in body:
        return chat_features(body, {})
    return completion_features(body, {})


def _fill(entry: _Running) -> ReplayOutcome:
    outcome, request, model = entry.outcome, entry.request, entry.model
    if request is None or model is None:
        return outcome
    outcome.cached_tokens = request.num_cached_tokens
    outcome.output_tokens = len(request.output)
    if request.first_token_at is not None:
        outcome.ttft_s = request.first_token_at - outcome.arrival_s
    if request.finished_at is not None:
        outcome.e2e_s = request.finished_at - outcome.arrival_s
    outcome.cost = cost_of(model, outcome.prompt_tokens, outcome.cached_tokens, outcome.output_tokens)
    request.prompt, request.output = [], []  # the outcome is all that is kept
    return outcome


def replay_policy(snapshot: PolicySnapshot, workload: Workload | Sequence[RequestSpec], *, name: str = "candidate",
                  base_dir: Path | None = None, strategy: Strategy = "prefix-aware", seed: int = 0) -> ArmResult:
    """Replay ``workload`` through ``snapshot``'s decisions on fresh simulated engines.

    Raises:
        FleetError: A pool of the policy cannot be simulated.
    """
    specs = workload.specs if isinstance(workload, Workload) else tuple(workload)
    started = time.perf_counter()
    arm = _Arm(snapshot, Fleet(snapshot, base_dir, seed), strategy, seed)
    outcomes: list[ReplayOutcome] = []
    for i, spec in enumerate(specs):
        arm.settle(arm.fleet.advance(spec.arrival_s), spec.arrival_s)
        arm.route(spec)
        if i % _SWEEP_EVERY == _SWEEP_EVERY - 1:
            outcomes += arm.sweep()
    end = arm.fleet.drain()
    outcomes += arm.sweep(final=True)
    outcomes.sort(key=lambda o: o.index)
    first = specs[0].arrival_s if specs else 0.0
    last_refusal = max((o.arrival_s for o in outcomes), default=first)
    return ArmResult(name, snapshot.label, snapshot.sha256, outcomes, max(end, last_refusal) - first,
                     time.perf_counter() - started)
