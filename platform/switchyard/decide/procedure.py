"""The one ordered decision procedure: from an authenticated request to the endpoint that serves it.

authenticate (done by the caller) → resolve the model → place (regions) → class → response cache →
fits the model → admit (limits) → flow control (go, downgrade, shed or queue) → fallback plan →
pick an endpoint (and steer interactive work away from batch work that would have to give way) →
try it, and the next one along the plan while tries fail.

The order lives here and only here. The procedure is a generator: what it cannot compute it asks
for as an *effect* (a classifier score, the response cache's answer, the limit store's answer, a
place in a queue, the retry budget, a try at an endpoint) and it receives the answer; what it
reads of the fleet it reads through the executor's read-only :class:`~switchyard.decide.views.FleetView`.
Each executor answers the effects its own way:

- the gateway live (:mod:`switchyard.gateway.proxy`): embeddings, Redis, its queues, real engines;
- the dry-run and the policy tests (:mod:`switchyard.decide.dryrun`) on an idle fleet: no history,
  fresh limit buckets, no embedding classifier, every try answered;
- the what-if replay (:mod:`switchyard.whatif.replay`) on simulated engines and a simulated clock.

So what the dry-run, the policy tests and the replay say is what the gateway does: a decision
written twice cannot drift (``tests/integration/test_differential.py`` checks it).
"""

from __future__ import annotations

import functools
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from switchyard.decide.admit import (
    DoesNotFit,
    Estimate,
    LimitAnswer,
    LimitCharge,
    Reserve,
    check_fits,
    estimate,
    limit_charges,
    limit_refusal,
)
from switchyard.decide.cache import (
    CACHE_CONTROL_HEADER,
    BadCacheControl,
    CachePlan,
    RequestKind,
    parse_cache_control,
    plan_cache,
)
from switchyard.decide.classes import PRIORITY_HEADER, BadPriority, ClassDecision, classify
from switchyard.decide.features import RequestFeatures, count_prompts
from switchyard.decide.flow import Queue, Scheduled, schedule, steer
from switchyard.decide.pick import (
    EndpointChoice,
    Stage,
    Strategy,
    fallback_plan,
    pick_endpoint,
    plan_trace,
    profile_for,
    usable_stages,
)
from switchyard.decide.plugins import PickRequest, Subject
from switchyard.decide.refusals import Refusal, Refused
from switchyard.decide.regions import REGION_HEADER, Placement, place
from switchyard.decide.resolve import ModelDecision, NeedsScore, resolve_model
from switchyard.decide.tokens import TokenCounter
from switchyard.decide.views import FleetView
from switchyard.policy.snapshot import PolicySnapshot
from switchyard.policy.tiers import Limits

#: A batch-lane request preempted this many times runs to its end: every request makes progress.
MAX_PREEMPTIONS = 8


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sends the request, as authentication found it.

    Attributes:
        tier: The tenant's tier.
        tenant: A stable id of the tenant (limit buckets and queue fairness are keyed by it).
        key: A stable id of the API key.
        tenant_limits: The tenant's limit override (each limit it sets replaces the tier's).
        key_limits: The key's own limits (charged in addition).
        region: The key's or tenant's home region.
    """

    tier: str
    tenant: str
    key: str
    tenant_limits: Limits | None = None
    key_limits: Limits | None = None
    region: str | None = None


@dataclass(frozen=True, slots=True)
class Ask:
    """A request to decide.

    Attributes:
        kind: ``chat`` or ``completion``.
        body: The parsed, validated OpenAI request body.
        features: What the policy looks at in it (its headers included).
        caller: Who sends it.
        gateway_region: The executing gateway's region (a home region when the caller has none).
        strategy: The picking strategy (the policy's profiles, or a baseline the bench measures against).
        flow_control: Whether flow control runs (off: every admitted request goes at once).
        counters: Prompt counters by model (a model's own tokenizer counts exactly; others estimate).
    """

    kind: RequestKind
    body: Mapping[str, Any]
    features: RequestFeatures
    caller: Caller
    gateway_region: str | None = None
    strategy: Strategy = "prefix-aware"
    flow_control: bool = True
    counters: Mapping[str, TokenCounter] = field(default_factory=dict)


# --- effects: what the procedure asks its executor -------------------------------------------------

@dataclass(frozen=True, slots=True)
class Score:
    """The score of classifier ``name`` for the request (an embedding); answered with a float, or None when
    it cannot be had (its rules then do not match)."""

    name: str
    features: RequestFeatures


@dataclass(frozen=True, slots=True)
class CacheHit:
    """A response-cache entry for the request: the answer's usage."""

    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class LookupCache:
    """Look the request up in the response cache under ``plan``; answered with a :class:`CacheHit` or None."""

    plan: CachePlan


@dataclass(frozen=True, slots=True)
class Retry:
    """Whether the retry budget lets the ``number``-th try go (the first is always let go, and counted)."""

    number: int


@dataclass(frozen=True, slots=True)
class Attempt:
    """Send the request to ``choice`` (of ``stage`` of the plan); answered with :class:`Tried`."""

    decision: Decision
    stage: Stage
    choice: EndpointChoice


@dataclass(frozen=True, slots=True)
class Mark:
    """A stage ended (``queue``: flow control; ``pick``: an endpoint choice), for executors that time or trace
    stages; answered with None.

    Attributes:
        stage: Its name.
        started: The fleet's clock when it began.
        attributes: What it decided (``switchyard.*`` names, as the trace spans carry them).
        error: Why it refused, if it did.
    """

    stage: Literal["queue", "pick"]
    started: float
    attributes: Mapping[str, str | float]
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Tried:
    """What one try at an endpoint came to.

    Attributes:
        outcome: ``ok`` (it answered), ``refused`` (it answered with the client's error, which is final),
            ``failed`` (worth trying elsewhere) or ``preempted`` (flow control took it back for an
            interactive request: it queues again).
        kind: Why it failed, short (``connect_error``, ``timeout``, ``first_token_timeout``, a status...).
        reason: Why it failed, for the trace.
        answer: The executor's own answer (its response, or its error for the client).
    """

    outcome: Literal["ok", "refused", "failed", "preempted"]
    kind: str = ""
    reason: str = ""
    answer: Any = None


Effect = Score | LookupCache | Reserve | Queue | Retry | Attempt | Mark


# --- what was decided ------------------------------------------------------------------------------

@dataclass(slots=True)
class Attempts:
    """One dispatch's way through its fallback plan: what was tried, what was passed over, and why.

    Attributes:
        limit: The most tries (the policy's ``resilience.retries.max_attempts``).
        tried: The endpoints tried.
        failures: Every step that moved the request on, in order: ``"<url or stage>: <reason>"``.
        moved_on: The same, short (``"<url or stage> <kind>"``), for the route header.
        last: The last failed try.
        budget_spent: A retry was not sent because the retry budget was spent.
        retry_in: Seconds until an endpoint that is out may take requests again, when known.
    """

    limit: int
    tried: set[str] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)
    moved_on: list[str] = field(default_factory=list)
    last: Tried | None = None
    budget_spent: bool = False
    retry_in: float | None = None

    @property
    def count(self) -> int:
        """Tries made."""
        return len(self.tried)

    def failed(self, url: str, tried: Tried) -> None:
        """The try at ``url`` failed."""
        self.failures.append(f"{url}: {tried.reason}")
        self.moved_on.append(f"{url} {tried.kind}")
        self.last = tried

    def passed_over(self, stage: str, reason: str) -> None:
        """A stage of the plan had no endpoint that could take the request."""
        self.failures.append(f"{stage}: {reason}")
        self.moved_on.append(f"{stage} unavailable")


Outcome = Literal["deciding", "refused", "cache_hit", "served", "failed"]


@dataclass(slots=True, eq=False)
class Decision:
    """Everything decided for one request, filled in as the procedure goes (an executor may read it at any
    point, for instance to record how far a request came before its client left).

    ``outcome``: ``refused`` (``refusal`` says why), ``cache_hit`` (``hit``), ``served`` (``tried`` is the
    try that answered: ``ok``, or the engine's own refusal of the client's request), ``failed`` (every
    try failed: ``attempts.last``).
    """

    snapshot: PolicySnapshot
    ask: Ask
    outcome: Outcome = "deciding"
    model: ModelDecision | None = None
    placement: Placement | None = None
    cls: ClassDecision | None = None
    cache: CachePlan | None = None
    hit: CacheHit | None = None
    prompt_tokens: int = 0
    estimate: Estimate | None = None
    charges: tuple[LimitCharge, ...] = ()
    scheduled: Scheduled | None = None
    stages: list[Stage] = field(default_factory=list)
    attempts: Attempts | None = None
    stage: Stage | None = None
    choice: EndpointChoice | None = None
    tried: Tried | None = None
    preemptions: int = 0
    refusal: Refusal | None = None
    trace: list[str] = field(default_factory=list)

    @property
    def gives_way(self) -> bool:
        """Whether the request gives way to interactive requests while in flight: a batch-lane request
        answered as one JSON object (nothing has reached its client until it ends), preempted fewer than
        :data:`MAX_PREEMPTIONS` times."""
        cls = self.cls
        return (cls is not None and cls.cls.lane == "batch" and not self.ask.body.get("stream")
                and self.preemptions < MAX_PREEMPTIONS)

    def refuse(self, refusal: Refusal) -> Decision:
        """End the procedure with ``refusal``."""
        self.outcome, self.refusal = "refused", refusal
        self.trace.append(f"refused {refusal.status} ({refusal.code}): {refusal.message}")
        return self


#: The procedure as its executors drive it: effects out, answers in, the decision at the end.
Steps = Generator[Effect, Any, Decision]


def decide(d: Decision, fleet: FleetView) -> Steps:
    """Decide ``d.ask`` under ``d.snapshot`` (see the module doc), filling ``d`` in; returns ``d``."""
    snapshot, ask = d.snapshot, d.ask
    caller, features = ask.caller, ask.features
    scores: dict[str, float | None] = {}
    try:
        while d.model is None:
            try:
                d.model = resolve_model(snapshot, caller.tier, features, scores)
            except NeedsScore as needs:
                scores[needs.name] = yield Score(needs.name, features)
        d.trace += d.model.trace
        d.placement = place(snapshot, caller.tier, d.model.model, features.headers.get(REGION_HEADER), caller.region,
                            ask.gateway_region)
    except Refused as refused:
        return d.refuse(refused.refusal)
    d.trace.append(d.placement.trace)
    try:
        d.cls = classify(snapshot, caller.tier, features.headers.get(PRIORITY_HEADER), ask.body.get("priority"))
    except BadPriority as bad:
        return d.refuse(Refusal(400, "invalid_priority", bad.message, bad.param))
    d.trace.append(d.cls.trace)
    if (yield from _cached(d)):
        return d
    model = d.model.model
    counter = ask.counters.get(model.name)
    if counter is not None and counter.exact:
        d.prompt_tokens, longest = count_prompts(counter, ask.kind, ask.body)
        exact = True
    else:
        d.prompt_tokens, exact = features.prompt_tokens, features.prompt_exact
        longest = d.prompt_tokens if features.longest_prompt is None else features.longest_prompt
    try:  # a request the model cannot serve is refused here, before it is charged or sent
        check_fits(model, ask.kind, longest, exact, features.max_tokens,
                   "max_completion_tokens" if ask.body.get("max_completion_tokens") else "max_tokens")
    except DoesNotFit as unfit:
        return d.refuse(Refusal(400, unfit.code, unfit.message, unfit.param))
    d.estimate = estimate(model, d.prompt_tokens, features.max_tokens, features.choices)
    d.charges = tuple(limit_charges(snapshot, caller.tier, model, d.estimate, tenant=caller.tenant, key=caller.key,
                                    tenant_limits=caller.tenant_limits, key_limits=caller.key_limits))
    answer: LimitAnswer = yield Reserve(d.charges)  # (none to charge: the executor still admits it)
    if not answer.admitted:
        return d.refuse(limit_refusal(d.charges, answer))
    waited_s = 0.0
    while True:  # once, unless flow control takes the request back for interactive work: then it queues again
        started = fleet.now()
        if ask.flow_control:
            scheduled = yield from schedule(snapshot, model, d.cls, d.estimate.tokens, caller.tenant,
                                            _needed(features), d.placement.allowed, fleet)
        else:
            scheduled = Scheduled(model)
        if isinstance(scheduled, Refusal):
            yield Mark("queue", started, {"http.response.status_code": scheduled.status}, scheduled.code)
            return d.refuse(scheduled)
        waited_s += scheduled.waited_s
        d.scheduled = Scheduled(scheduled.model, scheduled.downgraded_from, scheduled.reason, scheduled.note, waited_s)
        yield Mark("queue", started, {"switchyard.class": d.cls.name,
                                      "switchyard.queue_ms": round(scheduled.waited_s * 1000, 1)})
        if scheduled.note is not None:
            d.trace.append(f"flow control: downgraded {scheduled.note}")
        tried = yield from _dispatch(d, fleet)
        if tried is None:
            attempts = d.attempts
            assert attempts is not None
            if attempts.last is not None:
                d.outcome = "failed"
                return d
            why = "; ".join(attempts.failures) or "no endpoint serves it"
            return d.refuse(Refusal(503, "no_healthy_endpoint",
                                    f"No healthy endpoint can serve this request right now: {why}",
                                    retry_after_s=max(1.0, attempts.retry_in or 1.0)))
        if tried.outcome != "preempted":
            d.outcome, d.tried = "served", tried
            return d
        d.preemptions += 1
        d.trace.append(f"preempted at {d.choice.url if d.choice else '?'} for an interactive request "
                       f"({d.preemptions}); queued again")


def _needed(features: RequestFeatures) -> int:
    """Tokens a request may hold in a context window: its prompt (as estimated) and its output budget."""
    return features.prompt_tokens + (features.max_tokens or 0)


def _cached(d: Decision) -> Generator[Effect, Any, bool]:
    """The response cache: its plan for the request, and the entry that answers it (charged the rule's
    ``hit_charge`` of the cached answer). True when that ends the procedure (a hit, or a refusal)."""
    snapshot, ask = d.snapshot, d.ask
    caller = ask.caller
    try:
        read, write = parse_cache_control(ask.features.headers.get(CACHE_CONTROL_HEADER))
    except BadCacheControl as bad:
        d.refuse(Refusal(400, "invalid_cache_control", str(bad), CACHE_CONTROL_HEADER))
        return True
    if not snapshot.document.cache:
        return False
    assert d.model is not None
    model = d.model.model
    d.cache = plan_cache(snapshot, kind=ask.kind, model=model.name, route=d.model.route, tier=caller.tier,
                         tenant=caller.tenant, body=ask.body, read=read, write=write)
    if d.cache is None:
        d.trace.append("response cache: no rule applies (a rule's match, or not deterministic: temperature 0 or "
                       "a seed)")
        return False
    d.trace.append(d.cache.trace)
    hit: CacheHit | None = yield LookupCache(d.cache)
    if hit is None:
        return False
    charge = d.cache.rule.hit_charge
    if charge > 0:
        est = estimate(model, round(charge * hit.prompt_tokens), round(charge * hit.completion_tokens))
        d.charges = tuple(limit_charges(snapshot, caller.tier, model, est, tenant=caller.tenant, key=caller.key,
                                        tenant_limits=caller.tenant_limits, key_limits=caller.key_limits))
        if d.charges:
            answer: LimitAnswer = yield Reserve(d.charges)
            if not answer.admitted:
                d.refuse(limit_refusal(d.charges, answer))
                return True
    d.outcome, d.hit = "cache_hit", hit
    return True


def _dispatch(d: Decision, fleet: FleetView) -> Generator[Effect, Any, Tried | None]:
    """Try the plan's stages in order until an endpoint answers (see ``decide.pick``); None when none did.

    A stage with no endpoint in service is passed over; a failed try moves on to the next endpoint
    (then stage) while the request has tries left and the retry budget allows.
    """
    snapshot, ask = d.snapshot, d.ask
    assert d.scheduled is not None
    assert d.placement is not None
    assert d.cls is not None
    assert d.model is not None
    attempts = d.attempts = Attempts(snapshot.document.resilience.retries.max_attempts)
    placement, klass = d.placement, d.cls.cls
    stages, skipped = usable_stages(fallback_plan(snapshot, d.scheduled.model, placement.allowed),
                                    _needed(ask.features))
    d.stages = stages
    d.trace += skipped
    d.trace.append(plan_trace(snapshot, stages, d.model.model))
    subject = Subject(ask.body, ask.features.headers, ask.caller.tenant)
    lane, ceiling = klass.lane, klass.dispatch_ceiling
    for stage in stages:
        options = stage.candidates()
        profile = profile_for(snapshot, stage.model, ask.strategy)
        while attempts.count < attempts.limit:
            now = fleet.now()
            request = PickRequest(fleet.memory, subject, stage.model.name, len(options), placement.home, ceiling,
                                  fleet.rotation(), fleet.rng, now)
            choice = pick_endpoint(profile, options, functools.partial(fleet.endpoint, lane=lane, now=now), request,
                                   attempts.tried)
            if lane == "interactive" and choice is not None:
                choice = steer(choice, options, attempts.tried, ceiling, fleet, now)
            yield Mark("pick", now, {"switchyard.stage": stage.label, "switchyard.endpoint": choice.url,
                                     "switchyard.pool": choice.pool.name} if choice is not None
                       else {"switchyard.stage": stage.label, "switchyard.endpoint": "none"})
            if choice is None:
                if not any(o.url in attempts.tried for o in options):
                    reason, retry_in = fleet.out_of_service(options, now)
                    attempts.passed_over(stage.label, reason)
                    attempts.retry_in = min(retry_in, attempts.retry_in or retry_in)
                break
            if not (yield Retry(attempts.count + 1)):
                attempts.budget_spent = True
                break
            attempts.tried.add(choice.url)
            d.stage, d.choice = stage, choice
            d.trace.append(choice.trace)
            profile.picked(choice.url, request)
            tried: Tried = yield Attempt(d, stage, choice)
            # (An engine that refused the client's request holds nothing of it: as a failure, for the memory.)
            profile.answered(choice.url, request, "ok" if tried.outcome == "ok" else
                             "preempted" if tried.outcome == "preempted" else "failed")
            if tried.outcome != "failed":
                return tried
            attempts.failed(choice.url, tried)
        if attempts.count >= attempts.limit or attempts.budget_spent:
            break
    return None
