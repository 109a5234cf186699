"""Flow control's decisions: go, downgrade, shed or queue; how the batch lane sees the fleet; who gives way.

A request that has been admitted is scheduled (:func:`schedule`) before it picks an endpoint:

1. **Saturated?** Each pool's utilisation is its least-loaded endpoint's, as the request's lane
   sees it (the executor's :meth:`~switchyard.decide.views.FleetView.pool_utilisation`; endpoints
   down or behind an open breaker are left out, and a pool with none in service is infinitely full).
   A pool *has room* for a class when it is under the class's ceiling (1.0 interactive,
   ``max_utilisation`` for the batch lane) and nobody waits before the newcomer
   (:class:`~switchyard.decide.views.QueueView`). When no pool of the model is in service the request
   goes on at once: its fallback plan (another model, or a 503) decides, not a queue.
2. **Degrade before refusing**: a model with ``on_saturation`` sends requests of the chosen
   classes to ``downgrade_to`` when its own pools have no room (or are above the class's
   shedding threshold, or at least ``at_utilisation`` full: headroom kept for the classes that are
   not downgraded) and the cheaper model's have.
3. **Shed** a class with ``shed_above_utilisation`` at once when its pools are above it.
4. **Go** when a pool has room.
5. **Queue** otherwise, in the queue of every pool of the model (whichever frees first serves
   it) and, where the model's downgrade rule for the class says ``wait_for_either``, of every pool
   of the cheaper model too (served there, it is downgraded), unless the predicted wait already
   exceeds the class's deadline. The batch lane keeps at most :func:`batch_waiting_room` requests
   waiting per pool: beyond that a batch line is refused (``batch_lane_full``) and goes back to its
   job's queue, so that lines for a slow model cannot take all of the batch worker's room while
   another model's pools stand idle (the worker claims no more lines than :func:`batch_lanes_room`).
   A saturated pool turns over the tokens it holds once per service time (Little's law), so the wait
   is predicted as
   ``tokens served before it * mean service time / tokens in flight there``. The request leaves
   with 503 when its deadline passes, or quietly when its client disconnects.

**Batch gives way.** Batch-lane requests in flight that are answered as one JSON object give way to
interactive ones: an interactive request sees every utilisation without them, is steered to the
endpoint where giving way loses the least batch work (:func:`steer`), and the executor preempts the
youngest of them there until it is under the class's ceiling (:func:`preemption_victims`): vLLM's
priority scheduling only orders its waiting queue and never preempts a running request for a waiting
one, so without this an interactive request would wait for a batch sequence to end.

**Prefills kept apart.** An engine step's prefills run together (a step carrying two takes about as
long as both), so batch work is not sent to an endpoint while an interactive stream there waits for
its first byte, nor while the last batch request sent there is likely still in its prefill
(:func:`batch_view`: batch prefills go one at a time); and with ``max_num_seqs`` declared the batch
lane leaves ``batch_reserve_slots`` of a pool free for interactive arrivals
(:func:`batch_pool_utilisation`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from switchyard.decide.classes import ClassDecision
from switchyard.decide.pick import EndpointChoice, pools_within
from switchyard.decide.refusals import Refusal
from switchyard.decide.views import Candidate, DrainView, FleetView, QueueView
from switchyard.policy.fleet import Model, Pool
from switchyard.policy.snapshot import PolicySnapshot
from switchyard.policy.tiers import Lane

#: Batch lines that may wait at a pool per endpoint when the pool does not declare ``max_num_seqs``.
BATCH_WAITING_PER_ENDPOINT = 16


def batch_waiting_room(pool: Pool) -> int:
    """How many batch-lane requests may wait at ``pool``: as many as it has sequence slots (``max_num_seqs``
    per endpoint, or :data:`BATCH_WAITING_PER_ENDPOINT` when it declares none). More would only wait longer,
    and hold the batch worker's room for lines that other pools could start now."""
    return (pool.max_num_seqs or BATCH_WAITING_PER_ENDPOINT) * len(pool.endpoints)


#: The most batch lines one worker keeps in flight when its concurrency is derived from the policy.
MAX_BATCH_LINES_IN_FLIGHT = 1024


def batch_lines_in_flight(snapshot: PolicySnapshot) -> int:
    """How many batch lines a worker keeps in flight when no concurrency is set: enough to fill every pool's
    sequence slots and its batch waiting room (:func:`batch_waiting_room`; a pool that declares no
    ``max_num_seqs`` counts :data:`BATCH_WAITING_PER_ENDPOINT` slots per endpoint), at most
    :data:`MAX_BATCH_LINES_IN_FLIGHT`. Fewer would leave pools idle while lines for a full lane hold the
    worker's room: a line waits in its model's lane, or runs, for as long as it holds a place."""
    # (A pool's waiting room is as many lines as it has slots: its slots and its room are twice that.)
    room = sum(2 * batch_waiting_room(pool) for pool in snapshot.pools.values())
    return max(1, min(MAX_BATCH_LINES_IN_FLIGHT, room))


def batch_lane_room(pools: Sequence[Pool], queues: Callable[[Pool], QueueView]) -> int:
    """How many more batch lines the lane of a model with ``pools`` takes before it refuses one
    (``batch_lane_full``): a waiting line is in every pool's queue, and a line is refused only when each pool
    already has its :func:`batch_waiting_room` waiting (0 when there are no pools)."""
    return max(0, max((batch_waiting_room(p) - len(queues(p).lane("batch")) for p in pools), default=0))


def batch_lane_full(pools: Sequence[Pool], queues: Callable[[Pool], QueueView]) -> bool:
    """Whether the batch lane has no waiting room at any of ``pools`` (a batch line for them is refused)."""
    return batch_lane_room(pools, queues) == 0


def batch_lanes_room(snapshot: PolicySnapshot, queues: Callable[[Pool], QueueView]) -> int:
    """How many batch lines the batch lanes of all the models take now, whichever models they go to: the sum of
    each model's :func:`batch_lane_room`. A batch worker claims no more lines than this (and none while it is
    0), so that it hands back only the lines of a model whose lane is full while another's has room, and claims
    again as soon as a lane has room, instead of claiming at its own pace and handing back the excess."""
    return sum(batch_lane_room(pools, queues) for pools in snapshot.model_pools.values() if pools)


#: A batch request sent to an endpoint less than this share of its usual interactive time to first byte ago
#: has most likely not had its first engine step yet (that time is the engine's frontend, the wait for the
#: step in progress, and the prefill step; about half of it comes before the prefill step starts).
WAITING_SHARE = 0.5


def downgrade_target(snapshot: PolicySnapshot, model: Model, class_name: str, needed_tokens: int) -> Model | None:
    """The model that serves ``model``'s requests of ``class_name`` when its pools are saturated, if any.

    None when no ``on_saturation`` rule of the model applies to the class, or the target's context
    window cannot hold the request (prompt + output budget).
    """
    rule = model.saturation_rule(class_name)
    if rule is None:
        return None
    target = snapshot.models[rule.downgrade_to]
    if target.context_window < needed_tokens:
        return None
    return target


def predicted_wait_s(pools: Sequence[tuple[QueueView, DrainView, int]], lane: Lane, tenant: str,
                     rank: int) -> float | None:
    """The shortest predicted wait of a newcomer over its pools, each given as (queues, service time,
    tokens in flight there); None when a pool's service time is not known yet.

    The wait at one pool is ``tokens served before it / drain rate``.
    """
    predictions = []
    for queues, service, in_flight in pools:
        rate = service.drain_rate(in_flight)
        if rate is None:
            return None
        predictions.append(queues.lane(lane).tokens_before(tenant, rank) / rate)
    return min(predictions) if predictions else None


@dataclass(slots=True)
class FlowDecision:
    """What flow control does with a newcomer (before any wait).

    Attributes:
        action: ``go`` (a pool has room), ``downgrade`` (to ``model``), ``shed`` (above the class's
            threshold) or ``queue`` (wait in the queues of ``pools``, and of ``also``'s).
        model: The model to serve it: the asked one, or the downgrade target.
        pools: The model's pools within the request's regions.
        least: The least utilisation among them, as the class sees it.
        reason: A downgrade's reason (``shed_threshold``, ``saturated`` or ``headroom``).
        also: When it queues, the model it may be downgraded to, and that model's pools it waits for too
            (whichever pool frees first serves it, with its own model).
    """

    action: Literal["go", "downgrade", "shed", "queue"]
    model: Model
    pools: tuple[Pool, ...]
    least: float
    reason: str | None = None
    also: tuple[Model, tuple[Pool, ...]] | None = None


def plan_flow(snapshot: PolicySnapshot, model: Model, cls: ClassDecision, needed_tokens: int,
              regions: frozenset[str] | None, utilisation: Callable[[Pool, Lane], float],
              queues: Callable[[Pool], QueueView]) -> FlowDecision:
    """Flow control's decision for a newcomer of ``cls`` to ``model`` (steps 1-5 of the module doc).

    ``utilisation(pool, lane)``: the pool's utilisation as a newcomer of ``lane`` sees it;
    ``queues(pool)``: its queues. A newcomer that may not go now only because a grant is in transit
    is queued (it waits a moment).
    """
    def room(pools: Sequence[Pool]) -> tuple[bool, bool, float]:
        has, saturated, least = False, True, math.inf
        lane, ceiling = cls.cls.lane, cls.cls.dispatch_ceiling
        for pool in pools:
            u = utilisation(pool, lane)
            least = min(least, u)
            q = queues(pool)
            has = has or q.has_room(lane, u, ceiling)
            saturated = saturated and q.saturated(lane, u, ceiling)
        return has, saturated, least

    pools = pools_within(snapshot.model_pools[model.name], regions)
    has, saturated, least = room(pools)
    if math.isinf(least):  # no pool of the model has an endpoint in service: its fallback plan decides at once
        return FlowDecision("go", model, pools, least)
    shed_at = cls.cls.shed_above_utilisation
    above = shed_at is not None and least > shed_at
    rule = model.saturation_rule(cls.name)
    early = rule is not None and least >= rule.at_utilisation
    target = downgrade_target(snapshot, model, cls.name, needed_tokens)
    target_pools = pools_within(snapshot.model_pools[target.name], regions) if target is not None else ()
    if (above or saturated or early) and target is not None and target_pools:
        _, target_saturated, target_least = room(target_pools)
        if not target_saturated and not (shed_at is not None and target_least > shed_at):
            return FlowDecision("downgrade", target, target_pools, least,
                                "shed_threshold" if above else "saturated" if saturated else "headroom")
    if above:
        return FlowDecision("shed", model, pools, least)
    if has:
        return FlowDecision("go", model, pools, least)
    # Saturated, and so is the cheaper model: wait for both. (Not saturated: only a grant in transit holds the
    # model's room, and it will have it in a moment.)
    either = rule is not None and rule.wait_for_either
    also = (target, target_pools) if either and saturated and target is not None and target_pools else None
    return FlowDecision("queue", model, pools, least, also=also)


# --- scheduling: the flow stage of the procedure ---------------------------------------------------

@dataclass(slots=True)
class Queue:
    """An effect: wait in the queues of ``pools`` until one grants room, the deadline passes or the client
    leaves. The executor answers with :class:`Waited`.

    Attributes:
        pools: Where it waits (whichever frees first serves it).
        tenant: Who sent it (fairness is between tenants of a class).
        class_name, rank, lane: Its class.
        cost: Its size in tokens (prompt + expected output).
        ceiling: The pool utilisation under which it may be dispatched.
        deadline_s: How long it may wait.
    """

    pools: tuple[Pool, ...]
    tenant: str
    class_name: str
    rank: int
    lane: Lane
    cost: int
    ceiling: float
    deadline_s: float


@dataclass(slots=True)
class Waited:
    """What became of a :class:`Queue`: granted room, expired, or its client left; after how long."""

    outcome: Literal["granted", "expired", "left"]
    waited_s: float
    #: The pool that granted it.
    pool: str | None = None


@dataclass(slots=True)
class Scheduled:
    """Flow control's answer for a request that may go on.

    Attributes:
        model: The model to serve it (the resolved one, or its downgrade).
        downgraded_from: The resolved model when ``model`` is its downgrade.
        reason: A downgrade's reason (``shed_threshold``, ``saturated`` or ``headroom``).
        note: Why it was downgraded (for the ``x-switchyard-degraded`` header; ASCII).
        waited_s: Time spent in the queue.
    """

    model: Model
    downgraded_from: Model | None = None
    reason: str | None = None
    note: str | None = None
    waited_s: float = 0.0


def schedule(snapshot: PolicySnapshot, model: Model, cls: ClassDecision, cost: int, tenant: str, needed_tokens: int,
             regions: frozenset[str] | None, fleet: FleetView) -> Generator[Queue, Waited, Scheduled | Refusal]:
    """Capacity for a request of ``cost`` tokens to ``model``: go now, downgraded, after a wait, or a refusal.

    ``regions``: where the request may be served (its tier's regions; None: anywhere); pools elsewhere
    are not considered (the caller has checked that the model has a pool there). Yields a :class:`Queue`
    when the request must wait.
    """
    now = fleet.now()
    decision = plan_flow(snapshot, model, cls, needed_tokens, regions,
                         lambda pool, lane: fleet.pool_utilisation(pool, lane, now), fleet.queues)
    least, shed_at, klass = decision.least, cls.cls.shed_above_utilisation, cls.cls
    if decision.action == "downgrade":
        target = decision.model
        rule = model.saturation_rule(cls.name)
        if decision.reason == "shed_threshold":
            why = f"above the {shed_at:g} threshold of class {cls.name}"
        elif decision.reason == "headroom" and rule is not None:
            why = f"at least {rule.at_utilisation:g} full (the rest is kept for the classes not downgraded)"
        else:
            why = "saturated"
        note = f"{model.name} -> {target.name}: the pools of {model.name} are {why} (utilisation {least:.2f})"
        return Scheduled(target, model, decision.reason, note)
    if decision.action == "shed":
        assert shed_at is not None
        return Refusal(503, "shed_utilisation",
                       f"Shed: the pools of model {model.name} are at utilisation {least:.2f}, above the {shed_at:g} "
                       f"threshold of priority class {cls.name}. Retry later or with a higher tier.",
                       retry_after_s=1.0, shed="utilisation")
    if decision.action == "go":
        return Scheduled(model)
    deadline_s = klass.queue_deadline_s
    also_model, also_pools = decision.also if decision.also is not None else (None, ())
    pools = (*decision.pools, *also_pools)
    predicted = predicted_wait_s([(fleet.queues(p), fleet.service(p), fleet.reserved_tokens(p))
                                  for p in pools], klass.lane, tenant, cls.rank)
    if klass.lane == "batch" and batch_lane_full(pools, fleet.queues):
        return Refusal(503, "batch_lane_full",
                       f"The batch lane of model {model.name} is full: each of its pools has as many batch requests "
                       "waiting as it has sequence slots. A batch line goes back to its job's queue without "
                       "spending a try.", retry_after_s=min(60.0, max(1.0, math.ceil(predicted or 1.0))),
                       shed="lane_full")
    if predicted is not None and predicted > deadline_s:
        return Refusal(503, "queue_wait_too_long",
                       f"Shed: the predicted wait for model {model.name} ({predicted:.1f} s) exceeds the "
                       f"{deadline_s * 1000:g} ms queue deadline of priority class {cls.name}.",
                       retry_after_s=max(1.0, math.ceil(predicted)), shed="predicted_wait")
    waited = yield Queue(pools, tenant, cls.name, cls.rank, klass.lane, cost, klass.dispatch_ceiling, deadline_s)
    if waited.outcome == "granted":
        if also_model is not None and any(p.name == waited.pool for p in also_pools):
            note = (f"{model.name} -> {also_model.name}: the pools of {model.name} were saturated and one of "
                    f"{also_model.name}'s freed first (waited {waited.waited_s * 1000:.0f} ms)")
            return Scheduled(also_model, model, "saturated", note, waited.waited_s)
        return Scheduled(model, waited_s=waited.waited_s)
    if waited.outcome == "expired":
        return Refusal(503, "queue_deadline_exceeded",
                       f"Shed: the request waited {waited.waited_s * 1000:.0f} ms for model {model.name}, the queue "
                       f"deadline of priority class {cls.name} ({deadline_s * 1000:g} ms); its pools stayed "
                       "saturated.", retry_after_s=max(1.0, math.ceil(deadline_s)), shed="deadline")
    return Refusal(499, "client_closed_request", "The client closed the connection while the request waited in "
                   "the queue.")


# --- how the batch lane sees the fleet -------------------------------------------------------------

def batch_view(utilisation: float, prefilling: int, batch_prefilling: bool) -> float:
    """An endpoint's ``utilisation`` as batch work sees it: full while an interactive stream there is in its
    prefill (a batch prefill sent now would share its first engine step), and while the last batch request
    sent there is likely still in its own (batch prefills go one at a time: an engine step carrying several
    takes as long as all of them, and an interactive request arriving meanwhile waits for it)."""
    return max(utilisation, 1.0) if prefilling or batch_prefilling else utilisation


def batch_pool_utilisation(pool: Pool, utilisations: Sequence[float], slots_used: float) -> float:
    """A pool's utilisation as the batch lane sees it, from its endpoints in service (``utilisations``: each
    through :func:`batch_view`; ``slots_used``: their sequence slots taken).

    Its least-loaded endpoint's; with ``max_num_seqs`` declared, at least the share of the endpoints'
    slots taken with ``batch_reserve_slots`` more counted as taken (so batch work leaves that many free for
    interactive arrivals), but never all of them: the batch lane may always have one slot of the pool.
    """
    u = min(utilisations)
    if not pool.max_num_seqs or not pool.batch_reserve_slots:
        return u
    slots = pool.max_num_seqs * len(utilisations)
    return max(u, (slots_used + min(pool.batch_reserve_slots, slots - 1)) / slots)


# --- who gives way ---------------------------------------------------------------------------------

def steer(choice: EndpointChoice, options: Sequence[Candidate], tried: set[str], ceiling: float, fleet: FleetView,
          now: float) -> EndpointChoice:
    """Where an interactive request picked for ``choice`` should go to lose the least batch work.

    ``choice`` itself when it has room without preempting; otherwise the option (in service, not
    ``tried``, with room once its yielders are gone, and no more interactive streams in their prefill than
    ``choice``: the newcomer's first engine step would carry theirs) whose youngest yielder was sent last.
    """
    if not any(fleet.yielders(o.url) for o in options):  # no batch work anywhere here: nothing would give way
        return choice
    if not fleet.full(Candidate(choice.pool, choice.url), ceiling, now, False):
        return choice
    best: Candidate | None = None
    youngest = -math.inf
    prefilling = fleet.prefilling(choice.url)
    for option in options:
        started = fleet.yielders(option.url)
        if (not started or option.url in tried or started[-1] <= youngest
                or fleet.prefilling(option.url) > prefilling
                or not fleet.available(option, now)
                or fleet.full(option, ceiling, now, True)):
            continue
        best, youngest = option, started[-1]
    if best is None or best.url == choice.url:
        return choice
    return replace(choice, pool=best.pool, url=best.url,
                   notes=(*choice.notes, "moved to the endpoint whose youngest batch request gives way"))


def preemption_victims(yielders: Sequence[tuple[float, int]], full_without: Callable[[int, int], bool],
                       prefill_s: float | None, now: float) -> list[int]:
    """Which of an endpoint's yielders an interactive request preempts there (their indexes).

    ``yielders``: when each was sent and its tokens, oldest first; ``full_without(n, tokens)``: whether the
    endpoint is still at the request's ceiling with ``n`` requests of ``tokens`` tokens gone. The
    youngest go first (least work lost) until there is room; besides, those sent less than
    :data:`WAITING_SHARE` of the endpoint's usual interactive time to first byte (``prefill_s``) ago most
    likely wait for their first engine step: they would share the newcomer's and slow it down, and they
    lose nothing. (One already in its prefill step is left alone: that step runs to its end all the same.)
    """
    victims: list[int] = []
    gone_tokens = 0
    index = len(yielders) - 1
    while index >= 0 and full_without(len(victims), gone_tokens):
        victims.append(index)
        gone_tokens += yielders[index][1]
        index -= 1
    if prefill_s is not None:
        victims += [i for i in range(index + 1) if now - yielders[i][0] < WAITING_SHARE * prefill_s]
    return victims
