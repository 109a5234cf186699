"""One arm of a pre-publish replay: a workload through one policy's decisions and simulated engines.

Each request, in arrival order, runs the decision procedure (:func:`switchyard.decide.procedure.decide`),
the gateway's own, at its arrival time on the simulated clock; this module is its executor there:

- every engine runs up to that moment (:class:`~switchyard.whatif.fleet.Fleet`); the requests that
  finished settle their limit reservations with what they used, store their answers in the response
  cache where a rule says so, and free room that flow control grants to the requests waiting in its
  queues;
- the procedure's effects are answered on the simulated clock: no embedding classifier (its rules do
  not match); the response cache holds the answers of earlier identical requests under exact rules
  until they expire; admission reserves against an in-process limit store (each tier is one tenant,
  since a trace names no tenants); a request that must queue waits in its pools' queues
  (:mod:`switchyard.state.queues`) until a pool grants it room, or its deadline passes; every try is
  answered by the engine it picked: the request enters that endpoint's engine core with the priority
  its class gets there (a prompt plus output budget larger than the engine's context window is the
  engine's 400).

**A canary.** An arm may replay a policy canary (``canary``): its candidate decides the requests of the
canary's slice and the active version the rest (:meth:`_Arm.decider`, the one place a request's policy is
chosen; :mod:`switchyard.whatif.canary` says which requests). Both decide on one fleet (the active
version's engines, and the candidate's that the active version does not name), one limit store and one set
of queues, as two versions share them in the gateway.

The ``kv-cache-precise`` scorer reads the simulated engines' own prefix caches, exactly and at once, for
pools that declare ``kv_events`` (:class:`~switchyard.whatif.view.FleetCaches`), and renders prompts with
the simulator's tokenizer for models that name a ``tokenizer``, as the gateway renders with theirs; so a
candidate profile that uses it is compared on what the engines would report.

While requests wait, the clock moves in steps of :data:`FLOW_TICK_S` (the gateway grants on each
release and every 50 ms). When the last request has arrived, the engines run until they are
empty. Every request then has what a client would have seen: status, model, pool, region,
whether it was downgraded or answered from the cache, its queue wait, TTFT, end-to-end time,
prompt tokens served from the prefix cache, and its cost at the served model's prices.

What the replay cannot know is named in :data:`switchyard.whatif.outcomes.NOT_MODELLED`, and the
report says so rather than predicting zero.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from switchyard.bench.spec import RequestSpec, Workload
from switchyard.decide.admit import LimitAnswer, LimitCharge, Reserve, actual_amounts, spend_of
from switchyard.decide.cache import CachePlan, hit_charge
from switchyard.decide.decision import Ask, Attempt, CacheHit, Caller, Decision, LookupCache, Retry, Tried
from switchyard.decide.features import chat_features, completion_features
from switchyard.decide.flow import Queue, Waited
from switchyard.decide.pick import Strategy
from switchyard.decide.picking import PromptRenderer
from switchyard.decide.procedure import Steps, decide
from switchyard.policy.fleet import Model, Pool
from switchyard.policy.snapshot import PolicySnapshot
from switchyard.sim.request import SimRequest
from switchyard.state.queues import Ticket
from switchyard.store.limits import MemoryLimitStore, answer_of, charges_of
from switchyard.whatif.canary import ReplayCanary, Who
from switchyard.whatif.fleet import Fleet
from switchyard.whatif.outcomes import ArmResult, ReplayOutcome, prompt_ids
from switchyard.whatif.view import ReplayView

#: Simulated seconds between two looks at the queues while requests wait.
FLOW_TICK_S = 0.01
#: How long the gateway takes to answer a response-cache hit (its own time; not simulated).
HIT_S = 0.001
#: How often (in arrivals) finished requests are collected, so their prompts do not pile up.
_SWEEP_EVERY = 256
#: Reservations outlive any simulated request (the replay settles every one).
_TTL_S = 1e9
T = TypeVar("T")


@dataclass(slots=True, eq=False)
class _Running:
    """A request of the replay: its decision, its run of the procedure while it waits, its engine-side state."""

    outcome: ReplayOutcome
    spec: RequestSpec
    decision: Decision
    steps: Steps
    request: SimRequest | None = None
    model: Model | None = None
    reservation: str | None = None
    charges: tuple[LimitCharge, ...] = ()
    #: Where it runs, the tokens it reserved there, and when it was sent (for the pool's service time).
    url: str | None = None
    reserved: int = 0
    sent_at: float = 0.0
    #: The exact cache rule its answer is stored under, if one applies.
    cache: CachePlan | None = None
    #: Waiting in flow control's queues.
    waiting: bool = False


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
    """The mutable state of one replay, and the executor of its requests' decisions."""

    snapshot: PolicySnapshot
    fleet: Fleet
    strategy: Strategy
    seed: int
    flow_control: bool = True
    #: Who each tenant label of the workload is (a label not in it is a tier, and a tenant of its own).
    callers: Mapping[str, Caller] = field(default_factory=dict)
    gateway_region: str | None = None
    #: Endpoints out of service for the whole replay.
    down: frozenset[str] = frozenset()
    #: A canary: its candidate decides the requests of its slice (None: ``snapshot`` decides every request).
    canary: ReplayCanary | None = None
    #: Who each request was (by index), as the gateway identified it: what a canary's slice is hashed by.
    who: Mapping[int, Who] = field(default_factory=dict)
    limits: MemoryLimitStore = field(default_factory=MemoryLimitStore)
    running: list[_Running] = field(default_factory=list)
    unsettled: dict[SimRequest, _Running] = field(default_factory=dict)
    waiting: int = 0
    #: The response cache: per rule, answers by key, least recently used first.
    cache: dict[str, OrderedDict[str, _CachedAnswer]] = field(default_factory=dict)
    clock: float = 0.0
    view: ReplayView = field(init=False)
    #: The prompt renderers of the models that name a tokenizer (the gateway has exact prompt tokens for those
    #: only): the simulated engines' own, since they are the engines replayed.
    renderers: dict[str, PromptRenderer] = field(init=False)
    #: The canary's candidate's renderers.
    candidate_renderers: dict[str, PromptRenderer] = field(init=False)
    #: Every pool by name, the active version's first (queues are the pools' of either version).
    pools: dict[str, Pool] = field(init=False)

    def __post_init__(self) -> None:
        self.view = ReplayView(self.fleet, lambda: self.clock, self.seed, self.down)
        self.renderers = _renderers(self.snapshot)
        candidate = self.canary.candidate if self.canary is not None else None
        self.candidate_renderers = _renderers(candidate) if candidate is not None else {}
        self.pools = {**(candidate.pools if candidate is not None else {}), **self.snapshot.pools}

    def decider(self, spec: RequestSpec, caller: Caller, headers: Mapping[str, str],
                body: Mapping[str, Any]) -> tuple[PolicySnapshot, Mapping[str, PromptRenderer], str | None]:
        """The policy that decides ``spec`` (with its models' renderers), and the request's part in the canary
        (``canary``, ``control``, or None outside it or without one)."""
        canary = self.canary
        if canary is None:
            return self.snapshot, self.renderers, None
        role = canary.slice.role(spec.index, caller, self.gateway_region, headers, body, self.who.get(spec.index))
        if role == "canary":
            return canary.candidate, self.candidate_renderers, role
        return self.snapshot, self.renderers, role

    # --- time -------------------------------------------------------------------------------------

    def run_until(self, t: float) -> None:
        """Move the clock to ``t``: engines run, finished requests settle, queues are served."""
        while self.waiting:
            step = min(t, self.clock + FLOW_TICK_S)
            for queues in self.view.all_queues().values():
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
            self.view.service(endpoint.pool).finished(done_at - entry.sent_at)
            if entry.cache is not None and entry.cache.write:
                self._store(entry.cache, done_at, len(request.prompt), len(request.output))
            if entry.reservation is not None:
                used = len(request.prompt) + len(request.output)
                spend = spend_of(entry.model, len(request.prompt), len(request.output), request.num_cached_tokens)
                self._settle(entry, used, spend)

    def _settle(self, entry: _Running, tokens: int, spend: float) -> None:
        """Settle ``entry``'s reservation with what it used (nothing: it did not run)."""
        if entry.reservation is not None:
            _now(self.limits.reconcile(entry.reservation, actual_amounts(list(entry.charges), tokens, spend),
                                       self.clock))
            entry.reservation = None

    # --- a request's path -------------------------------------------------------------------------

    def route(self, spec: RequestSpec) -> None:
        """Run the decision procedure for ``spec`` at its arrival (see the module doc)."""
        body = spec.body()
        headers = {k.lower(): v for k, v in spec.labels.headers.items()}
        features = chat_features(body, headers) if "messages" in body else completion_features(body, headers)
        caller = self.callers.get(spec.tenant) or Caller(spec.tenant, spec.tenant, spec.tenant)
        snapshot, renderers, role = self.decider(spec, caller, headers, body)
        tier = snapshot.tiers.get(caller.tier)
        outcome = ReplayOutcome(spec.index, spec.arrival_s, spec.tenant, tier.priority if tier else "-", spec.model,
                                canary=role)
        ask = Ask("chat" if "messages" in body else "completion", body, features, caller, self.gateway_region,
                  self.strategy, self.flow_control, renderers=renderers)
        d = Decision(snapshot, ask)
        entry = _Running(outcome, spec, d, decide(d, self.view))
        self.running.append(entry)
        self._drive(entry, None)

    def _drive(self, entry: _Running, answer: Any) -> None:
        """Run ``entry``'s procedure on from ``answer`` until it ends or waits in a queue."""
        steps = entry.steps
        while True:
            try:
                effect = steps.send(answer)
            except StopIteration:
                self._decided(entry)
                return
            if isinstance(effect, Attempt):
                answer = self._send(entry, effect)
            elif isinstance(effect, Reserve):
                answer = self._reserve(entry, effect)
            elif isinstance(effect, LookupCache):
                answer = self._lookup(entry, effect.plan)
            elif isinstance(effect, Queue):
                self._queue(entry, effect)
                return
            else:  # Retry: every engine stays healthy; Mark: nothing to time; Score: no embeddings
                answer = True if isinstance(effect, Retry) else None

    def _decided(self, entry: _Running) -> None:
        """The procedure ended: the outcome of a refusal or a cache hit (a served request's comes at its end)."""
        d, outcome = entry.decision, entry.outcome
        outcome.plan = tuple(s.label for s in d.stages)
        if d.model is not None:
            outcome.resolved_model = d.model.model.name
        if d.cls is not None:
            outcome.priority = d.cls.name
        if d.scheduled is not None and d.scheduled.downgraded_from is not None:
            outcome.downgraded_from = d.scheduled.downgraded_from.name
        if d.outcome == "cache_hit":
            assert d.hit is not None
            assert d.model is not None
            assert d.cache is not None
            model, hit = d.model.model, d.hit
            outcome.cache_hit, outcome.model, outcome.pool = True, model.name, "cache"
            outcome.prompt_tokens = outcome.cached_tokens = hit.prompt_tokens
            outcome.output_tokens = hit.completion_tokens
            outcome.ttft_s = outcome.e2e_s = HIT_S
            tokens, outcome.cost = hit_charge(d.cache.rule, model, hit.prompt_tokens, hit.completion_tokens)
            self._settle(entry, tokens, outcome.cost)
        elif d.outcome == "refused":
            assert d.refusal is not None
            outcome.status, outcome.code, outcome.limit = d.refusal.status, d.refusal.code, d.refusal.limit
            self._settle(entry, 0, 0.0)
        elif d.tried is not None and d.tried.outcome == "refused":  # the engine's 400
            outcome.status, outcome.code = 400, d.tried.kind
            self._settle(entry, 0, 0.0)

    def _lookup(self, entry: _Running, plan: CachePlan) -> CacheHit | None:
        """The exact cache's entry for the request (semantic rules are not replayed)."""
        if plan.mode != "exact":
            return None
        entry.cache = plan
        answers = self.cache.get(plan.label)
        found = answers.get(plan.key) if answers is not None and plan.read else None
        if found is None or found.expires <= self.clock:
            return None
        assert answers is not None
        answers.move_to_end(plan.key)
        return CacheHit(found.prompt_tokens, found.completion_tokens)

    def _store(self, plan: CachePlan, t: float, prompt: int, completion: int) -> None:
        answers = self.cache.setdefault(plan.label, OrderedDict())
        answers[plan.key] = _CachedAnswer(t + plan.rule.ttl, prompt, completion)
        answers.move_to_end(plan.key)
        while len(answers) > plan.rule.max_entries:
            answers.popitem(last=False)

    def _reserve(self, entry: _Running, effect: Reserve) -> LimitAnswer:
        """Reserve against the tiers' limits on the simulated clock."""
        if not effect.charges:
            return LimitAnswer(True)
        answer = _now(self.limits.reserve(charges_of(effect.charges), _TTL_S, self.clock))
        if answer.admitted:
            entry.reservation, entry.charges = answer.reservation, effect.charges
        return answer_of(answer)

    def _send(self, entry: _Running, attempt: Attempt) -> Tried:
        """Hand the request to the engine of the endpoint the procedure picked."""
        outcome, spec, choice, d = entry.outcome, entry.spec, attempt.choice, entry.decision
        endpoint = self.fleet.endpoints[choice.url]
        outcome.model, outcome.pool, outcome.region, outcome.endpoint = (
            attempt.stage.model.name, choice.pool.name, choice.pool.region, choice.url)
        ids = prompt_ids(d.ask.body)
        outcome.prompt_tokens = len(ids)
        if len(ids) + spec.max_tokens > endpoint.config.max_model_len:
            return Tried("refused", "context_length_exceeded", "the engine's context window cannot hold it")
        assert d.cls is not None
        priority = d.cls.engine_priority if choice.pool.priority_scheduling else 0
        request = SimRequest(request_id=str(spec.index), prompt=ids, max_output=spec.max_tokens, priority=priority,
                             arrival=self.clock, seed=self.seed + spec.index, budget=spec.max_tokens)
        endpoint.submit(request)
        entry.request, entry.model, entry.url, entry.sent_at = request, attempt.stage.model, choice.url, self.clock
        entry.reserved = len(ids) + spec.max_tokens
        endpoint.reserved += entry.reserved
        self.unsettled[request] = entry
        return Tried("ok")

    # --- flow control -----------------------------------------------------------------------------

    def _queue(self, entry: _Running, queue: Queue) -> None:
        """Wait in the queues of ``queue.pools`` (the procedure goes on once a pool grants room, or at the deadline)."""
        ticket = Ticket(queue.tenant, queue.class_name, queue.rank, queue.lane, queue.cost, queue.ceiling,
                        self.clock, self.clock + queue.deadline_s)
        ticket.waiter = entry
        for pool in queue.pools:
            self.view.queues(pool).lane(queue.lane).push(ticket)
        entry.waiting = True
        self.waiting += 1

    def _serve_queues(self, now: float) -> None:
        """Fail the requests whose deadline passed, then grant room to the heads of the queues."""
        for queues in list(self.view.all_queues().values()):
            for ticket in queues.expire(now):
                self._resume(ticket, Waited("expired", now - ticket.enqueued))
        for name, queues in list(self.view.all_queues().items()):
            pool = self.pools[name]
            while queues.waiting():
                u = self.view.pool_utilisation(pool, "interactive", now)
                granted = queues.next_grant(u, self.view.pool_utilisation(pool, "batch", now))
                if granted is None:
                    break
                queues.grant(granted, name)
                queues.dispatched(granted)
                entry: _Running = granted.waiter
                self._resume(granted, Waited("granted", now - granted.enqueued, name))
                if entry.request is None:
                    break  # it was not sent (refused, or too long for the engine): the pool's load did not move

    def _resume(self, ticket: Ticket, waited: Waited) -> None:
        entry: _Running = ticket.waiter
        entry.waiting = False
        self.waiting -= 1
        entry.outcome.queued_s = waited.waited_s
        self._drive(entry, waited)

    def sweep(self, final: bool = False) -> list[ReplayOutcome]:
        """Outcomes of finished requests (all of them when ``final``), filled in and let go."""
        done, still = [], []
        for entry in self.running:
            request = entry.request
            if not final and (entry.waiting or (request is not None and request.finished_at is None)):
                still.append(entry)
                continue
            done.append(_fill(entry))
        self.running = still
        return done


def _renderers(snapshot: PolicySnapshot) -> dict[str, PromptRenderer]:
    return {name: prompt_ids for name, model in snapshot.models.items() if model.tokenizer is not None}


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
    outcome.cost = spend_of(model, outcome.prompt_tokens, outcome.output_tokens, outcome.cached_tokens)
    request.prompt, request.output = [], []  # the outcome is all that is kept
    return outcome


def replay_policy(snapshot: PolicySnapshot, workload: Workload | Sequence[RequestSpec], *, name: str = "candidate",
                  base_dir: Path | None = None, strategy: Strategy = "prefix-aware", seed: int = 0,
                  flow_control: bool = True, callers: Mapping[str, Caller] | None = None,
                  gateway_region: str | None = None, down: Collection[str] = (),
                  background: Mapping[str, int] | None = None, canary: ReplayCanary | None = None,
                  who: Mapping[int, Who] | None = None) -> ArmResult:
    """Replay ``workload`` through ``snapshot``'s decisions on fresh simulated engines (with ``canary``: through
    a canary's, its candidate deciding the slice and ``snapshot`` the rest).

    Args:
        snapshot: The policy.
        workload: The requests, in arrival order.
        name: The arm's name in the report.
        base_dir: Where relative ``sim_profile`` paths are.
        strategy: The picking strategy (the policy's profiles, or a baseline).
        seed: Seeds the engines and the picker's ties.
        flow_control: False sends every admitted request straight to its engine (as a gateway with
            ``SWITCHYARD_FLOW_CONTROL`` off would).
        callers: Who each tenant label is: its tier and limit overrides (default: each label is a tier, and a
            tenant of its own).
        gateway_region: The region of the gateway replayed (a home region for requests with none).
        down: Endpoints out of service for the whole replay (a region down, say).
        background: Requests already running in an endpoint's engine when the replay starts (other
            gateways' traffic), by URL.
        canary: A canary: its candidate decides the requests of its slice (the arm's policy is named after it).
        who: Who each request was, by index, as the gateway identified it (the request log knows): what the
            canary's slice hashes (default: the request's caller and its index).

    Raises:
        FleetError: A pool of the policy cannot be simulated.
    """
    specs = workload.specs if isinstance(workload, Workload) else tuple(workload)
    started = time.perf_counter()
    fleet = Fleet(snapshot, base_dir, seed)
    if canary is not None:
        fleet.add(canary.candidate, canary.base_dir, seed)
    for url, count in (background or {}).items():
        fleet.occupy(url, count)
    arm = _Arm(snapshot, fleet, strategy, seed, flow_control, callers or {}, gateway_region, frozenset(down), canary,
               who or {})
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
    if canary is not None:
        return ArmResult(name, canary.label(), canary.candidate.sha256, outcomes, max(end, last_refusal) - first,
                         time.perf_counter() - started, canary=canary.describe())
    return ArmResult(name, snapshot.label, snapshot.sha256, outcomes, max(end, last_refusal) - first,
                     time.perf_counter() - started)
