"""The one ordered decision procedure: from an authenticated request to the endpoint that serves it.

authenticate (done by the caller) → resolve the model → place (regions) → class → response cache →
fits the model → admit (limits) → flow control (go, downgrade, shed or queue) → fallback plan →
pick an endpoint (and steer interactive work away from batch work that would have to give way) →
try it (hedging a late first token where the class says so), and the next one along the plan while tries
fail. A stream its engine breaks off after its first byte goes on from there (:func:`resume`): the same
plan, from the stage that served it.

Every kind of request (:data:`~switchyard.decide.cache.RequestKind`: chat, completion, embedding, responses,
tokenize, detokenize) runs this one procedure; a model serves only its own kind (an embedding model
embeddings), and the tokenizer endpoints go from the class straight to the plan (nothing to cache, charge or
queue).

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
from dataclasses import replace
from typing import Any, Literal

from switchyard.api.headers import CACHE_CONTROL_HEADER, PRIORITY_HEADER, REGION_HEADER
from switchyard.decide.admit import (
    DoesNotFit,
    LimitAnswer,
    Reserve,
    check_fits,
    estimate,
    limit_charges,
    limit_refusal,
)
from switchyard.decide.cache import (
    GENERATING_KINDS,
    TOKENIZER_KINDS,
    BadCacheControl,
    RequestKind,
    parse_cache_control,
    plan_cache,
)
from switchyard.decide.classes import BadPriority, classify
from switchyard.decide.deadlines import first_token_deadline, hedge_blocked, hedge_delay
from switchyard.decide.decision import (
    Attempt,
    Attempts,
    CacheHit,
    Decision,
    Effect,
    Hedge,
    Later,
    LookupCache,
    Mark,
    Raced,
    Retry,
    Score,
    Tried,
)
from switchyard.decide.features import RequestFeatures, count_prompts
from switchyard.decide.flow import Scheduled, schedule, steer
from switchyard.decide.pick import (
    EndpointChoice,
    Stage,
    fallback_plan,
    pick_endpoint,
    plan_trace,
    profile_for,
    usable_stages,
)
from switchyard.decide.picking import PickRequest, Subject
from switchyard.decide.plugins import Profile
from switchyard.decide.refusals import Refusal, Refused
from switchyard.decide.regions import place
from switchyard.decide.resolve import NeedsScore, resolve_model
from switchyard.decide.resume import StreamSoFar, resume_refusal
from switchyard.decide.views import Candidate, FleetView
from switchyard.policy.fleet import Model

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
    wrong = _wrong_kind(ask.kind, d.model.model)
    if wrong is not None:
        return d.refuse(wrong)
    d.trace.append(d.placement.trace)
    try:
        d.cls = classify(snapshot, caller.tier, features.headers.get(PRIORITY_HEADER), ask.body.get("priority"))
    except BadPriority as bad:
        return d.refuse(Refusal(400, "invalid_priority", bad.message, bad.param))
    d.trace.append(d.cls.trace)
    if ask.kind in TOKENIZER_KINDS:  # only the model's tokenizer: nothing charged, never queued or cached
        d.prompt_tokens = features.prompt_tokens
        d.estimate = estimate(d.model.model, 0, 0)
        d.scheduled = Scheduled(d.model.model)
        d.trace.append(f"{ask.kind}: uses only the model's tokenizer: no limits charged, no queue")
        return (yield from _served(d, fleet))
    if (yield from _cached(d)):
        return d
    model = d.model.model
    counter = ask.counters.get(model.name)
    if counter is not None and counter.exact:
        # A chat the model's renderer renders is counted as its engine will see it (the template's own tokens
        # exact), and rendered once: its endpoint's pick scores the same ids.
        rendered = _subject(d).tokens(model.name) if ask.kind == "chat" and model.name in ask.renderers else None
        if rendered is not None:
            d.prompt_tokens = longest = len(rendered)
        else:
            d.prompt_tokens, longest = count_prompts(counter, ask.kind, ask.body)
        exact = True
    else:
        d.prompt_tokens, exact = features.prompt_tokens, features.prompt_exact
        longest = d.prompt_tokens if features.longest_prompt is None else features.longest_prompt
    try:  # a request the model cannot serve is refused here, before it is charged or sent
        check_fits(model, ask.kind, longest, exact, features.max_tokens, _max_tokens_param(ask.kind, ask.body))
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
            yield Mark("queue", started, refusal=scheduled)
            return d.refuse(scheduled)
        if waited_s:  # queued again after a preemption: the waits add up
            scheduled = replace(scheduled, waited_s=waited_s + scheduled.waited_s)
        waited_s = scheduled.waited_s
        d.scheduled = scheduled
        yield Mark("queue", started)
        if scheduled.note is not None:
            d.trace.append(f"flow control: downgraded {scheduled.note}")
        yield from _served(d, fleet)
        if d.outcome != "deciding":
            return d
        d.preemptions += 1
        d.trace.append(f"preempted at {d.choice.url if d.choice else '?'} for an interactive request "
                       f"({d.preemptions}); queued again")


def _served(d: Decision, fleet: FleetView) -> Generator[Effect, Any, Decision]:
    """Dispatch ``d`` along its plan: served, failed, refused (no endpoint in service), or (``d.outcome`` still
    ``deciding``) preempted for interactive work, to queue again."""
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


#: The API each kind of request belongs to, for errors.
_API_NAMES = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "responses": "/v1/responses",
              "embedding": "/v1/embeddings"}


def _wrong_kind(kind: RequestKind, model: Model) -> Refusal | None:
    """A 400 when ``model`` does not serve requests of ``kind`` (an embedding model asked to chat, and the
    reverse); the tokenizer endpoints serve both kinds of model."""
    if kind in TOKENIZER_KINDS or (kind == "embedding") == (model.kind == "embedding"):
        return None
    assert kind in GENERATING_KINDS or kind == "embedding"
    if model.kind == "embedding":
        why = f"an embedding model: it is served at /v1/embeddings, not at {_API_NAMES[kind]}"
    else:
        why = "a generating model: /v1/embeddings serves models of kind embedding"
    return Refusal(400, "model_not_supported", f"The model {model.name!r} is {why}.", "model")


def _max_tokens_param(kind: RequestKind, body: Mapping[str, Any]) -> str:
    """The body field a request's output budget came from (for errors)."""
    if kind == "responses":
        return "max_output_tokens"
    return "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"


def _subject(d: Decision) -> Subject:
    """The request as its picks see it, made on first use and kept (its renders with it)."""
    if d.subject is None:
        ask = d.ask
        d.subject = Subject(ask.body, ask.features.headers, ask.caller.tenant, ask.renderers)
    return d.subject


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
                         tenant=caller.tenant, body=ask.body, read=read, write=write, canonical=ask.canonical)
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


def _dispatch(d: Decision, fleet: FleetView, *, resuming: bool = False) -> Generator[Effect, Any, Tried | None]:
    """Try the plan's stages in order until an endpoint answers (see ``decide.pick``); None when none did.

    A stage with no endpoint in service is passed over; a failed try moves on to the next endpoint
    (then stage) while the request has tries left and the retry budget allows. A streamed try of a class that
    hedges and whose first token is late may be hedged (:func:`_hedge`). ``resuming``: the request's stream
    broke off and goes on from the stage that served it (:func:`resume`), with the tries it made so far.
    """
    snapshot, ask = d.snapshot, d.ask
    assert d.scheduled is not None
    assert d.placement is not None
    assert d.cls is not None
    assert d.model is not None
    placement, klass = d.placement, d.cls.cls
    if resuming:
        attempts, stages = d.attempts, d.stages
        assert attempts is not None
        assert d.stage is not None
        first = stages.index(d.stage)
    else:
        attempts = d.attempts = Attempts(snapshot.document.resilience.retries.max_attempts)
        stages, skipped = usable_stages(fallback_plan(snapshot, d.scheduled.model, placement.allowed),
                                        _needed(ask.features))
        d.stages = stages
        d.trace += skipped
        d.trace.append(Later(plan_trace, snapshot, stages, d.model.model, d.cls))
        first = 0
    subject = _subject(d)
    lane, ceiling = klass.lane, klass.dispatch_ceiling
    streamed = bool(ask.body.get("stream"))
    for stage in stages[first:]:
        options = stage.candidates()
        profile = profile_for(snapshot, stage.model, ask.strategy)
        deadline = first_token_deadline(snapshot, d.cls, stage.model)
        while attempts.count < attempts.limit:
            now = fleet.now()
            request = PickRequest(fleet.memory, subject, stage.model.name, len(options), placement.home, ceiling,
                                  fleet.rotation(), fleet.rng, now, stage.model.served_name)
            choice = pick_endpoint(profile, options, functools.partial(fleet.endpoint, lane=lane, now=now), request,
                                   attempts.tried)
            if lane == "interactive" and choice is not None:
                choice = steer(choice, options, attempts.tried, ceiling, fleet, now)
            if choice is None:
                yield Mark("pick", now, stage.label)
                if not any(o.url in attempts.tried for o in options):
                    reason, retry_in = fleet.out_of_service(options, now)
                    attempts.passed_over(stage.label, reason)
                    attempts.retry_in = min(retry_in, attempts.retry_in or retry_in)
                break
            if attempts.count and not (yield Retry(attempts.count + 1)):  # a retry: the budget has the last word
                yield Mark("pick", now, stage.label, choice)
                attempts.budget_spent = True
                break
            attempts.tried.add(choice.url)
            d.stage, d.choice = stage, choice
            d.trace.append(Later(EndpointChoice.describe, choice))
            profile.picked(choice.url, request)
            hedge_after = (hedge_delay(klass.hedge, choice.pool, deadline, fleet, now)
                           if streamed and not resuming else None)
            tried: Tried = yield Attempt(d, stage, choice, now, deadline, hedge_after, resuming)
            if tried.outcome == "slow":
                assert hedge_after is not None
                tried = yield from _hedge(d, fleet, stage, options, profile, request, tried, hedge_after)
            else:
                # (An engine that refused the client's request holds nothing of it: as a failure, for the memory.)
                profile.answered(choice.url, request, _observed(tried))
            if tried.outcome != "failed":
                return tried
            assert d.choice is not None
            attempts.failed(d.choice.url, tried)
        if attempts.count >= attempts.limit or attempts.budget_spent:
            break
    return None


def _observed(tried: Tried) -> Literal["ok", "failed", "preempted"]:
    """A try's outcome as the profile's observers take it."""
    return "ok" if tried.outcome == "ok" else "preempted" if tried.outcome == "preempted" else "failed"


def _hedge(d: Decision, fleet: FleetView, stage: Stage, options: list[Candidate], profile: Profile,
           request: PickRequest, pending: Tried, after_s: float) -> Generator[Effect, Any, Tried]:
    """The try at ``d.choice`` has no first token ``after_s`` after it was sent: hedge it on a second endpoint of
    the stage, unless the fleet is saturated, the retry budget says no or no other endpoint can take it; the
    try that answers first serves the request (``d.choice``), the other is aborted."""
    attempts, first = d.attempts, d.choice
    assert attempts is not None
    assert first is not None
    assert d.cls is not None
    spec = d.cls.cls.hedge
    assert spec is not None
    now = fleet.now()
    why = hedge_blocked(spec, stage.pools, fleet, now)
    second: EndpointChoice | None = None
    if why is None:
        second = pick_endpoint(profile, options, functools.partial(fleet.endpoint, lane="interactive", now=now),
                               request, attempts.tried)
        if second is None:
            why = "no other endpoint of the stage can take it"
        elif not (yield Retry(attempts.count + 1)):
            why, second = "the retry budget is spent", None
    if second is None:
        d.trace.append(f"hedge: no first token from {first.url} within {after_s:.3g} s; not hedged: {why}")
        raced: Raced = yield Hedge(d, stage, None, pending, first.url, now)
    else:
        attempts.tried.add(second.url)
        d.hedges += 1
        profile.picked(second.url, request)
        d.trace.append(f"hedge: no first token from {first.url} within {after_s:.3g} s; also sent to {second.url} "
                       f"of pool {second.pool.name} ({second.pool.region})")
        raced = yield Hedge(d, stage, second, pending, first.url, now)
    by_url = {first.url: first} if second is None else {first.url: first, second.url: second}
    d.choice = by_url[raced.url]
    if raced.other is not None and raced.other_url is not None:
        profile.answered(raced.other_url, request, "failed")  # aborted or failed: it holds nothing of the request
        if raced.other.outcome == "failed":
            attempts.failed(raced.other_url, raced.other)
        else:
            d.trace.append(f"hedge: {raced.url} answered first; {raced.other_url} aborted")
    profile.answered(raced.url, request, _observed(raced.tried))
    return raced.tried


def resume(d: Decision, fleet: FleetView, so_far: StreamSoFar) -> Generator[Effect, Any, Tried | None]:
    """The stream that ``d``'s try at ``d.choice`` was passing on broke off after ``so_far``: continue it on the
    next endpoint of the fallback plan, from the stage that served it (a fresh round of at most
    ``resilience.retries.max_attempts`` tries, each a retry for the budget), when that is safe
    (:func:`~switchyard.decide.resume.resume_refusal`). Returns the try that continues it (``ok``), or None when it
    is not continued (the trace says why)."""
    attempts, stage, choice = d.attempts, d.stage, d.choice
    assert attempts is not None
    assert stage is not None
    assert choice is not None
    attempts.failed(choice.url, Tried("failed", so_far.kind, f"broke off mid-stream after {so_far.tokens} tokens: "
                                                               f"{so_far.why}"))
    why = resume_refusal(stage.model, d.ask.kind, d.ask.body, so_far, d.resumes)
    if why is not None:
        d.trace.append(f"stream: not resumed: {why}")
        return None
    d.resumes += 1
    d.trace.append(f"stream: resuming after {so_far.tokens} tokens ({d.resumes} of at most "
                   f"{stage.model.max_resumes}), from stage {stage.label}")
    attempts.limit = attempts.count + d.snapshot.document.resilience.retries.max_attempts
    attempts.budget_spent = False
    tried = yield from _dispatch(d, fleet, resuming=True)
    if tried is None:
        d.trace.append("stream: not resumed: " + ("the retry budget is spent" if attempts.budget_spent else
                                                   "no endpoint of the plan could continue it"))
    return tried
