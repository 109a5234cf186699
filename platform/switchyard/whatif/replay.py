"""One arm of a pre-publish replay: a workload through one policy's decisions and simulated engines.

For each request, in arrival order, at its arrival time on the simulated clock:

1. every engine runs up to that moment; the requests that finished settle their limit
   reservations with what they used, store their answers in the response cache where a rule
   says so, and free room that flow control grants to the requests waiting in its queues;
2. the gateway's decisions run on it as they would in ``gateway.proxy``: the model is resolved
   (a refusal is the gateway's 403/404) and placed; its priority class is chosen; the response
   cache is looked up (an exact rule's entry stored by an earlier identical request and not yet
   expired is a hit: answered at once, charged the rule's ``hit_charge``, no engine touched);
   admission reserves its estimate against the tier's limits in an in-process limit store on the
   simulated clock (a refusal is the gateway's 429; each tier is one tenant, since a trace names
   no tenants); flow control (``decide.flow.plan_flow``, the gateway's own) sends it on, downgrades
   it, sheds it (503) or queues it in its pools' fair queues until a pool grants it room, its
   predicted wait exceeds the class's deadline (503) or the deadline passes (503); then the
   fallback plan is cut to the stages whose context window can hold it and an endpoint is picked
   with the model's endpoint profile, a prefix index and the engines' current load;
3. the request enters that endpoint's engine core with the priority its class gets there. A
   prompt plus output budget larger than the engine's context window is the engine's 400.

While requests wait, the clock moves in steps of :data:`FLOW_TICK_S` (the gateway grants on each
release and every 50 ms). When the last request has arrived, the engines run until they are
empty. Every request then has what a client would have seen: status, model, pool, region,
whether it was downgraded or answered from the cache, its queue wait, TTFT, end-to-end time,
prompt tokens served from the prefix cache, and its cost at the served model's prices.

What the replay cannot know is named in :data:`NOT_MODELLED`, and the report says so rather than
predicting zero.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from switchyard.bench.spec import RequestSpec, Workload
from switchyard.decide.admit import LimitCharge, actual_amounts, estimate, limit_charges, refusal_code, spend_of
from switchyard.decide.cache import CachePlan, plan_cache
from switchyard.decide.features import RequestFeatures, chat_features, completion_features
from switchyard.decide.flow import (
    BadPriority,
    ClassDecision,
    PoolQueues,
    ServiceTime,
    Ticket,
    classify,
    plan_flow,
    predicted_wait_s,
)
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
from switchyard.decide.resolve import Refused, resolve_offline
from switchyard.policy.schema import Model, Pool
from switchyard.policy.snapshot import PolicySnapshot
from switchyard.sim.chat import render_chat
from switchyard.sim.request import SimRequest
from switchyard.sim.tokens import SPECIAL_TOKENS, tokenize
from switchyard.store.limits import MemoryLimitStore, charges_of
from switchyard.whatif.fleet import Fleet

#: What the replay leaves out, each with what that means for its figures.
NOT_MODELLED: tuple[str, ...] = (
    "semantic cache rules (answers by meaning need the embedding model): only exact rules are replayed",
    "batch preemption (the gateway cancels its own batch requests for interactive ones): batch work "
    "holds its place in the engine",
    "engine failures, timeouts and retries: every engine stays healthy",
    "several gateway replicas: one gateway's queues and limits",
)
#: Simulated seconds between two looks at the queues while requests wait.
FLOW_TICK_S = 0.01
#: How long the gateway takes to answer a response-cache hit (its own time; not simulated).
HIT_S = 0.001
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
        queued_s: Time it waited in flow control's queue (None: it did not queue).
        downgraded_from: The model flow control downgraded it from, if it did.
        cache_hit: Answered from the response cache.
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
    queued_s: float | None = None
    downgraded_from: str | None = None
    cache_hit: bool = False

    @property
    def placement(self) -> str:
        """Where it went, as one comparable string: ``model @ pool (region)`` or the refusal."""
        if self.status != 200:
            return f"refused {self.status} ({self.code})"
        if self.cache_hit:
            return f"{self.model} @ response cache"
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
    #: Where it runs, the tokens it reserved there, and when it was sent (for the pool's service time).
    url: str | None = None
    reserved: int = 0
    sent_at: float = 0.0
    cache: CachePlan | None = None


@dataclass(slots=True, eq=False)
class _Waiting:
    """A request in flow control's queues: what it needs to be sent once a pool grants it room."""

    entry: _Running
    spec: RequestSpec
    body: dict[str, Any]
    features: RequestFeatures
    model: Model
    placement: Placement
    cls: ClassDecision
    ticket: Ticket


def _now(work: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never suspends (the in-process limit store's methods)."""
    try:
        work.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    work.close()
    raise RuntimeError("the in-process limit store suspended; the replay cannot drive it")


@dataclass(slots=True)
class _CachedAnswer:
    expires: float
    prompt_tokens: int
    completion_tokens: int


@dataclass(slots=True)
class _Arm:
    """The mutable state of one replay."""

    snapshot: PolicySnapshot
    fleet: Fleet
    strategy: Strategy
    seed: int
    flow_control: bool = True
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)
    limits: MemoryLimitStore = field(default_factory=MemoryLimitStore)
    rotation: int = 0
    running: list[_Running] = field(default_factory=list)
    unsettled: dict[SimRequest, _Running] = field(default_factory=dict)
    #: Flow control's queues and service times per pool, and the requests waiting in them.
    queues: dict[str, PoolQueues] = field(default_factory=dict)
    service: dict[str, ServiceTime] = field(default_factory=dict)
    waiting: int = 0
    #: The response cache: per rule, answers by key, least recently used first.
    cache: dict[str, OrderedDict[str, _CachedAnswer]] = field(default_factory=dict)
    clock: float = 0.0
    #: Breaks ties between equally scored endpoints, reproducibly.
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    # --- time -------------------------------------------------------------------------------------

    def run_until(self, t: float) -> None:
        """Move the clock to ``t``: engines run, finished requests settle, queues are served."""
        while self.waiting:
            step = min(t, self.clock + FLOW_TICK_S)
            for queues in self.queues.values():
                deadline = queues.interactive.next_deadline(), queues.batch.next_deadline()
                step = min([step, *(d for d in deadline if d is not None and d > self.clock)])
            self._advance(step)
            self._serve_queues(step)
            if step >= t:
                return
        self._advance(t)

    def _advance(self, t: float) -> None:
        self.settle(self.fleet.advance(t), t)
        self.clock = max(self.clock, t)

    def settle(self, finished: list[SimRequest], now: float) -> None:
        """Settle what finished: reservations (what they used flows back), the endpoint's reserved tokens,
        the pool's service time, and the response cache."""
        for request in finished:
            entry = self.unsettled.pop(request, None)
            if entry is None or entry.model is None:
                continue
            endpoint = self.fleet.endpoints[cast(str, entry.url)]
            endpoint.reserved -= entry.reserved
            done_at = request.finished_at if request.finished_at is not None else now
            self.service.setdefault(endpoint.pool.name, ServiceTime()).finished(done_at - entry.sent_at)
            if entry.cache is not None and entry.cache.write:
                self._store(entry.cache, done_at, len(request.prompt), len(request.output))
            if entry.reservation is not None:
                used = len(request.prompt) + len(request.output)
                spend = spend_of(entry.model, len(request.prompt), len(request.output), request.num_cached_tokens)
                _now(self.limits.reconcile(entry.reservation, actual_amounts(entry.charges, used, spend), now))

    # --- a request's path -------------------------------------------------------------------------

    def route(self, spec: RequestSpec) -> None:
        """Decide what happens to ``spec`` at its arrival and carry it out (see the module doc)."""
        t = spec.arrival_s
        body = spec.body()
        features = _features(body)
        snapshot = self.snapshot
        tier = snapshot.tiers.get(spec.tenant)
        outcome = ReplayOutcome(spec.index, t, spec.tenant, tier.priority if tier else "-", spec.model)
        entry = _Running(outcome)
        self.running.append(entry)
        try:
            decision = resolve_offline(snapshot, spec.tenant, features)
            placement = place(snapshot, spec.tenant, decision.model, None)
        except Refused as refusal:
            outcome.status, outcome.code = refusal.status, refusal.code
            return
        assert tier is not None  # resolve_model refuses an unknown tier
        try:
            cls = classify(snapshot, tier.name, None, body.get("priority"))
        except BadPriority:
            outcome.status, outcome.code = 400, "invalid_priority"
            return
        model = decision.model
        plan = (plan_cache(snapshot, kind=spec.kind, model=model.name, route=decision.route, tier=tier.name,
                           tenant=tier.name, body=body) if snapshot.document.cache else None)
        if plan is not None and plan.mode == "exact":
            entry.cache = plan
            if plan.read and self._hit(entry, plan, model, t):
                return
        est = estimate(model, features.prompt_tokens, features.max_tokens)
        charges = limit_charges(snapshot, tier.name, model, est, tenant=tier.name, key=tier.name)
        if not self._admit(entry, charges, t):
            return
        needed = features.prompt_tokens + (features.max_tokens or 0)
        if self.flow_control:
            flow = plan_flow(snapshot, model, cls, needed, placement.allowed,
                             lambda pool, _preempting: self._utilisation(pool), self._queues)
            if flow.action == "shed":
                self._refuse(entry, 503, "shed_utilisation", t)
                return
            if flow.action == "downgrade":
                outcome.downgraded_from, model = model.name, flow.model
            elif flow.action == "queue":
                ticket = Ticket(tier.name, cls.name, cls.rank, cls.cls.lane, est.tokens, cls.cls.dispatch_ceiling,
                                t, t + cls.cls.queue_deadline_s)
                self._queue(_Waiting(entry, spec, body, features, model, placement, cls, ticket), flow.pools)
                return
        self._send(entry, spec, body, features, model, placement, cls, t)

    def _hit(self, entry: _Running, plan: CachePlan, model: Model, t: float) -> bool:
        """Answer from the cache if an entry is there (charging the rule's ``hit_charge``); whether it was."""
        answers = self.cache.get(plan.label)
        found = answers.get(plan.key) if answers is not None else None
        if found is None or found.expires <= t:
            return False
        assert answers is not None
        answers.move_to_end(plan.key)
        outcome, charge = entry.outcome, plan.rule.hit_charge
        if charge > 0:
            est = estimate(model, round(charge * found.prompt_tokens), round(charge * found.completion_tokens))
            charges = limit_charges(self.snapshot, outcome.tier, model, est, tenant=outcome.tier, key=outcome.tier)
            if not self._admit(entry, charges, t):
                return True
            if entry.reservation is not None:
                spent = charge * cost_of(model, found.prompt_tokens, 0, found.completion_tokens)
                _now(self.limits.reconcile(entry.reservation, actual_amounts(
                    charges, round(charge * (found.prompt_tokens + found.completion_tokens)), spent), t))
        outcome.cache_hit, outcome.model, outcome.pool = True, model.name, "cache"
        outcome.prompt_tokens = outcome.cached_tokens = found.prompt_tokens
        outcome.output_tokens = found.completion_tokens
        outcome.ttft_s = outcome.e2e_s = HIT_S
        outcome.cost = charge * cost_of(model, found.prompt_tokens, 0, found.completion_tokens)
        return True

    def _store(self, plan: CachePlan, t: float, prompt: int, completion: int) -> None:
        answers = self.cache.setdefault(plan.label, OrderedDict())
        answers[plan.key] = _CachedAnswer(t + plan.rule.ttl, prompt, completion)
        answers.move_to_end(plan.key)
        while len(answers) > plan.rule.max_entries:
            answers.popitem(last=False)

    def _admit(self, entry: _Running, charges: list[LimitCharge], t: float) -> bool:
        """Reserve ``charges`` against the tier's limits; False (and a 429) when a limit refuses."""
        if not charges:
            return True
        answer = _now(self.limits.reserve(charges_of(charges), _TTL_S, t))
        if not answer.admitted:
            assert answer.refused_by is not None
            entry.outcome.status, entry.outcome.code = 429, refusal_code(answer.refused_by.unit, answer.never)
            return False
        entry.reservation, entry.charges = answer.reservation, charges
        return True

    def _refuse(self, entry: _Running, status: int, code: str, t: float) -> None:
        """A request that will not run: its status, and its whole reservation given back."""
        entry.outcome.status, entry.outcome.code = status, code
        if entry.reservation is not None:
            _now(self.limits.reconcile(entry.reservation, actual_amounts(entry.charges, 0, 0.0), t))
            entry.reservation = None

    def _send(self, entry: _Running, spec: RequestSpec, body: dict[str, Any], features: RequestFeatures,
              model: Model, placement: Placement, cls: ClassDecision, t: float) -> None:
        """Pick an endpoint along ``model``'s plan and hand the request to its engine."""
        outcome = entry.outcome
        picked = self._pick(body, features, model, placement, cls.cls.dispatch_ceiling, t)
        if picked is None:
            self._refuse(entry, 503, "no_endpoint", t)
            return
        stage, choice = picked
        endpoint = self.fleet.endpoints[choice.url]
        outcome.model, outcome.pool, outcome.region, outcome.endpoint = (
            stage.model.name, choice.pool.name, choice.pool.region, choice.url)
        ids = prompt_ids(body)
        outcome.prompt_tokens = len(ids)
        if len(ids) + spec.max_tokens > endpoint.config.max_model_len:
            self._refuse(entry, 400, "context_length_exceeded", t)
            return
        priority = cls.engine_priority
        request = SimRequest(request_id=str(spec.index), prompt=ids, max_output=spec.max_tokens,
                             priority=priority if choice.pool.priority_scheduling else 0, arrival=t,
                             seed=self.seed + spec.index, budget=spec.max_tokens)
        endpoint.submit(request)
        entry.request, entry.model, entry.url, entry.sent_at = request, stage.model, choice.url, t
        entry.reserved = len(ids) + spec.max_tokens
        endpoint.reserved += entry.reserved
        self.unsettled[request] = entry

    # --- flow control -----------------------------------------------------------------------------

    def _queues(self, pool: Pool) -> PoolQueues:
        queues = self.queues.get(pool.name)
        if queues is None:
            queues = self.queues[pool.name] = PoolQueues()
        return queues

    def _utilisation(self, pool: Pool) -> float:
        """A pool's utilisation as flow control sees it: its least-loaded endpoint's."""
        return min(self.fleet.endpoints[url].view().utilisation for url in pool.endpoints)

    def _queue(self, waiting: _Waiting, pools: tuple[Pool, ...]) -> None:
        """Queue ``waiting`` at ``pools`` unless its predicted wait already exceeds its deadline."""
        ticket, cls = waiting.ticket, waiting.cls
        predicted = predicted_wait_s(
            [(self._queues(pool), self.service.setdefault(pool.name, ServiceTime()),
              sum(self.fleet.endpoints[url].reserved for url in pool.endpoints)) for pool in pools],
            cls.cls.lane, ticket.tenant, cls.rank)
        if predicted is not None and predicted > cls.cls.queue_deadline_s:
            self._refuse(waiting.entry, 503, "queue_wait_too_long", ticket.enqueued)
            return
        ticket.waiter = waiting
        for pool in pools:
            self._queues(pool).lane(cls.cls.lane).push(ticket)
        self.waiting += 1

    def _serve_queues(self, now: float) -> None:
        """Fail the requests whose deadline passed, then grant room to the heads of the queues."""
        for queues in self.queues.values():
            for ticket in queues.expire(now):
                self.waiting -= 1
                waiting: _Waiting = ticket.waiter
                self._refuse(waiting.entry, 503, "queue_deadline_exceeded", now)
                waiting.entry.outcome.queued_s = now - ticket.enqueued
        for name, queues in self.queues.items():
            pool = self.snapshot.pools[name]
            while queues.waiting():
                u = self._utilisation(pool)
                granted = queues.next_grant(u, u)
                if granted is None:
                    break
                queues.grant(granted, name)
                queues.dispatched(granted)
                self.waiting -= 1
                waiting = granted.waiter
                waiting.entry.outcome.queued_s = now - granted.enqueued
                self._send(waiting.entry, waiting.spec, waiting.body, waiting.features, waiting.model,
                           waiting.placement, waiting.cls, now)
                if waiting.entry.request is None:
                    break  # it could not be sent (no endpoint or too long): the pool's load did not move

    def _pick(self, body: dict[str, Any], features: RequestFeatures, model: Model, placement: Placement,
              ceiling: float, now: float) -> tuple[Stage, EndpointChoice] | None:
        """The gateway's first pick along the plan (no engine fails in a replay, so it is also the last)."""
        needed = features.prompt_tokens + (features.max_tokens or 0)
        stages, _skipped = usable_stages(fallback_plan(self.snapshot, model, placement.allowed), needed)
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
            waits = entry.outcome.status == 200 and request is None and not entry.outcome.cache_hit
            if not final and (waits or (request is not None and request.finished_at is None)):
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
                  base_dir: Path | None = None, strategy: Strategy = "prefix-aware", seed: int = 0,
                  flow_control: bool = True) -> ArmResult:
    """Replay ``workload`` through ``snapshot``'s decisions on fresh simulated engines.

    ``flow_control``: False sends every admitted request straight to its engine (as a gateway with
    ``SWITCHYARD_FLOW_CONTROL`` off would).

    Raises:
        FleetError: A pool of the policy cannot be simulated.
    """
    specs = workload.specs if isinstance(workload, Workload) else tuple(workload)
    started = time.perf_counter()
    arm = _Arm(snapshot, Fleet(snapshot, base_dir, seed), strategy, seed, flow_control)
    outcomes: list[ReplayOutcome] = []
    for i, spec in enumerate(specs):
        arm.run_until(spec.arrival_s)
        arm.route(spec)
        if i % _SWEEP_EVERY == _SWEEP_EVERY - 1:
            outcomes += arm.sweep()
    while arm.waiting:  # the last arrivals' queues: served or expired as the engines drain
        arm.run_until(arm.clock + FLOW_TICK_S)
    end = max(arm.fleet.drain(), arm.clock)
    outcomes += arm.sweep(final=True)
    outcomes.sort(key=lambda o: o.index)
    first = specs[0].arrival_s if specs else 0.0
    last_refusal = max((o.arrival_s for o in outcomes), default=first)
    return ArmResult(name, snapshot.label, snapshot.sha256, outcomes, max(end, last_refusal) - first,
                     time.perf_counter() - started)
