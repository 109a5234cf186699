"""Flow control decisions: a request's priority class, its place in a pool's queue, downgrades.

Pure code with an injected clock: the gateway (:mod:`switchyard.gateway.flow`) holds one
:class:`PoolQueues` per pool and carries these decisions out with futures and timers; the unit
tests drive the same objects with a virtual clock.

**Class.** A request's class is its tenant's tier's class, optionally *lowered* (never raised) by
the ``x-switchyard-priority`` header (a class name) or the body's ``priority`` (a class name, or an
integer in vLLM's sense: the request takes the last class whose engine priority is at most that
number, and the engine gets the number itself).

**Queue discipline.** Each pool has two lanes. The interactive lane serves classes strictly best
first; within a class, tenants share by *start-time fair queuing* (SFQ, Goyal et al. 1996) with
tokens as the cost: a request's start tag is ``max(V, F[tenant])``, its tenant's finish tag becomes
``start + cost``, the queue serves the smallest start tag, and the class's virtual time ``V``
becomes the start tag of the request it served. A tenant that floods the queue pushes only its own
tags forward, so a neighbour of the same class that sends one request is served next. The batch
lane has the same discipline and is served only while the interactive lane is empty and the pool
is under the batch class's utilisation ceiling. Each request carries a deadline (its class's
``max_queue_ms``); :meth:`FairQueue.expire` takes out those whose deadline has passed.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from switchyard.decide.pick import pools_within
from switchyard.policy.schema import Model, Pool, PriorityClass
from switchyard.policy.snapshot import PolicySnapshot

#: The request header that lowers a request's class.
PRIORITY_HEADER = "x-switchyard-priority"

Lane = Literal["interactive", "batch"]


class BadPriority(ValueError):
    """The request asks for a priority that is not a class of the policy (or not a number)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class ClassDecision:
    """The class a request is served in, and why.

    Attributes:
        name: The class's name.
        cls: The class as the policy declares it.
        rank: Its position in ``priorities`` (0 is the best).
        engine_priority: The vLLM ``priority`` the request carries to pools that honour it.
        tier_class: The tier's class (``name`` differs when the request lowered itself).
        trace: One sentence for the decision trace.
    """

    name: str
    cls: PriorityClass
    rank: int
    engine_priority: int
    tier_class: str
    trace: str


def _named_class(snapshot: PolicySnapshot, value: str, where: str, param: str) -> str:
    if value not in snapshot.priorities:
        known = ", ".join(snapshot.priorities)
        raise BadPriority(f"Unknown priority class {value!r} in {where}; the policy's classes are: {known}.", param)
    return value


def classify(snapshot: PolicySnapshot, tier_name: str, header: str | None, asked: object) -> ClassDecision:
    """The class of a request from a tenant of ``tier_name`` (the tier must exist in ``snapshot``).

    Raises:
        BadPriority: the header or body names an unknown class, or the body's ``priority`` is
            neither a class name nor an integer.
    """
    base = snapshot.tiers[tier_name].priority
    ranks = snapshot.class_rank
    chosen, by, engine = base, None, snapshot.engine_priority[base]
    wanted: list[tuple[str, str, int | None]] = []
    if header is not None:
        where = f"the {PRIORITY_HEADER} header"
        wanted.append((_named_class(snapshot, header.strip(), where, PRIORITY_HEADER), where, None))
    if isinstance(asked, str):
        wanted.append((_named_class(snapshot, asked, "priority", "priority"), "the body's priority", None))
    elif isinstance(asked, int) and not isinstance(asked, bool):
        # vLLM's sense: a larger number is served later. The last class at or below it.
        by_number = base
        for name in snapshot.priorities:
            if snapshot.engine_priority[name] <= asked and ranks[name] > ranks[by_number]:
                by_number = name
        wanted.append((by_number, "the body's priority", asked))
    elif asked is not None:
        raise BadPriority("priority must be an integer (vLLM's request priority) or the name of a priority "
                          "class.", "priority")
    notes = []
    for name, source, number in wanted:
        if ranks[name] > ranks[chosen]:
            chosen, by = name, source
        elif ranks[name] < ranks[base]:
            notes.append(f"{source} asked for {name}, which is above the tier's class (a request may only "
                         f"lower its class)")
        if number is not None and number > engine:
            engine = number
    engine = max(engine, snapshot.engine_priority[chosen])
    if by is None:
        trace = f"class {chosen} (tier {tier_name})"
    else:
        trace = f"class {chosen} (tier {tier_name}'s class {base}, lowered by {by})"
    if notes:
        trace += "; " + "; ".join(notes)
    return ClassDecision(chosen, snapshot.priorities[chosen], ranks[chosen], engine, base, trace)


def downgrade_target(snapshot: PolicySnapshot, model: Model, class_name: str, needed_tokens: int) -> Model | None:
    """The model that serves ``model``'s requests of ``class_name`` when its pools are saturated, if any.

    None when the model declares no ``on_saturation``, the class is not one it downgrades, or the
    target's context window cannot hold the request (prompt + output budget).
    """
    rule = model.on_saturation
    if rule is None or (rule.classes is not None and class_name not in rule.classes):
        return None
    target = snapshot.models[rule.downgrade_to]
    if target.context_window < needed_tokens:
        return None
    return target


# --- queues -------------------------------------------------------------------------------

WAITING, GRANTED, EXPIRED, LEFT = "waiting", "granted", "expired", "left"

_SEQ = itertools.count()


class Ticket:
    """A request waiting for a pool's capacity; it may wait in several pools' queues at once.

    Attributes:
        tenant: Who sent it (fairness is between tenants of a class).
        class_name, rank, lane: Its class.
        cost: Its size in tokens (prompt + expected output).
        ceiling: The pool utilisation under which it may be dispatched.
        enqueued, deadline: When it joined, and when it must have left the queue.
        state: waiting, granted, expired or left (the client went away).
        granted_by: The pool whose capacity it was granted.
    """

    __slots__ = ("_queues", "ceiling", "class_name", "cost", "deadline", "enqueued", "granted_by", "lane", "rank",
                 "seq", "state", "tenant", "waiter")

    def __init__(self, tenant: str, class_name: str, rank: int, lane: Lane, cost: int, ceiling: float,
                 enqueued: float, deadline: float) -> None:
        self.tenant = tenant
        self.class_name = class_name
        self.rank = rank
        self.lane: Lane = lane
        self.cost = max(1, cost)
        self.ceiling = ceiling
        self.enqueued = enqueued
        self.deadline = deadline
        self.state = WAITING
        self.granted_by: str | None = None
        self.seq = next(_SEQ)
        self._queues: list[FairQueue] = []
        #: Whatever the holder of the ticket needs to wake its request (the gateway's future).
        self.waiter: Any = None

    @property
    def waiting(self) -> bool:
        return self.state == WAITING

    def leave(self, state: str) -> None:
        """Leave every queue the ticket waits in, as ``state`` (granted, expired, left)."""
        if self.state != WAITING:
            return
        self.state = state
        for queue in self._queues:
            queue.discard(self)
        self._queues.clear()


class _ClassQueue:
    """One class's requests in one queue: start-time fair queuing between tenants."""

    __slots__ = ("finish", "heap", "live", "tokens", "vtime")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Ticket]] = []
        self.finish: dict[str, float] = {}
        self.vtime = 0.0
        self.live = 0
        self.tokens = 0

    def push(self, ticket: Ticket) -> None:
        start = max(self.vtime, self.finish.get(ticket.tenant, 0.0))
        self.finish[ticket.tenant] = start + ticket.cost
        heapq.heappush(self.heap, (start, ticket.seq, ticket))
        self.live += 1
        self.tokens += ticket.cost

    def head(self) -> tuple[float, Ticket] | None:
        heap = self.heap
        while heap and not heap[0][2].waiting:
            heapq.heappop(heap)
        return (heap[0][0], heap[0][2]) if heap else None


class FairQueue:
    """One lane of one pool: classes strictly by rank, tenants fairly within a class."""

    __slots__ = ("_classes", "_deadlines")

    def __init__(self) -> None:
        self._classes: dict[int, _ClassQueue] = {}
        self._deadlines: list[tuple[float, int, Ticket]] = []

    def push(self, ticket: Ticket) -> None:
        """Add a waiting ticket."""
        queue = self._classes.get(ticket.rank)
        if queue is None:
            queue = self._classes[ticket.rank] = _ClassQueue()
        queue.push(ticket)
        heapq.heappush(self._deadlines, (ticket.deadline, ticket.seq, ticket))
        ticket._queues.append(self)

    def discard(self, ticket: Ticket) -> None:
        """Count ``ticket`` out (it left through this queue or another); its entries go lazily."""
        queue = self._classes[ticket.rank]
        queue.live -= 1
        queue.tokens -= ticket.cost
        if queue.live == 0:
            # The class's busy period ended: every tenant starts level again.
            queue.finish.clear()
            queue.heap.clear()

    def head(self) -> Ticket | None:
        """The ticket served next: the best class's smallest start tag (None when empty)."""
        for rank in sorted(self._classes):
            queue = self._classes[rank]
            if queue.live:
                found = queue.head()
                if found is not None:
                    return found[1]
        return None

    def grant(self, ticket: Ticket, pool: str) -> None:
        """Serve ``ticket`` (which must be :meth:`head`): it leaves every queue, granted by ``pool``."""
        queue = self._classes[ticket.rank]
        found = queue.head()
        assert found is not None, "grant a waiting ticket"
        assert found[1] is ticket, "grant the head of the queue"
        queue.vtime = found[0]
        ticket.granted_by = pool
        ticket.leave(GRANTED)

    def expire(self, now: float) -> list[Ticket]:
        """Take out the waiting tickets whose deadline is at or before ``now`` (they leave every queue)."""
        gone = []
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            ticket = heapq.heappop(deadlines)[2]
            if ticket.waiting:
                ticket.leave(EXPIRED)
                gone.append(ticket)
        return gone

    def next_deadline(self) -> float | None:
        """The earliest deadline of a waiting ticket."""
        deadlines = self._deadlines
        while deadlines and not deadlines[0][2].waiting:
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else None

    def depth(self, rank: int | None = None) -> int:
        """Waiting tickets (of class ``rank``, or of all classes)."""
        if rank is not None:
            queue = self._classes.get(rank)
            return queue.live if queue is not None else 0
        return sum(q.live for q in self._classes.values())

    def tokens_ahead(self, rank: int) -> int:
        """Tokens of the waiting tickets of class ``rank`` and better."""
        return sum(q.tokens for r, q in self._classes.items() if r <= rank)

    def tokens_before(self, tenant: str, rank: int) -> int:
        """Tokens served before a newcomer from ``tenant`` of class ``rank`` (if nothing better arrives).

        Every waiting ticket of a better class, and those of its own class whose start tag is
        is at most the newcomer's would be (ties go to the earlier arrival): a tenant under its fair
        share has little ahead of it however long the class's queue is.
        """
        ahead = sum(q.tokens for r, q in self._classes.items() if r < rank)
        queue = self._classes.get(rank)
        if queue is not None and queue.live:
            start = max(queue.vtime, queue.finish.get(tenant, 0.0))
            ahead += sum(t.cost for tag, _, t in queue.heap if tag <= start and t.waiting)
        return ahead

    def __len__(self) -> int:
        return self.depth()


class PoolQueues:
    """A pool's two lanes and the one grant it may have in transit.

    A granted request still has to pick its endpoint and count itself there; until it has
    (:meth:`dispatched`), the pool grants nobody else, so that one freed slot is not granted twice.
    """

    __slots__ = ("batch", "in_transit", "interactive")

    def __init__(self) -> None:
        self.interactive = FairQueue()
        self.batch = FairQueue()
        self.in_transit: Ticket | None = None

    def lane(self, lane: Lane) -> FairQueue:
        return self.batch if lane == "batch" else self.interactive

    def saturated(self, lane: Lane, utilisation: float, ceiling: float) -> bool:
        """Whether the pool is full for a newcomer of ``lane``: at ``ceiling``, or somebody waits before it."""
        if utilisation >= ceiling or len(self.interactive):
            return True
        return lane == "batch" and len(self.batch) > 0

    def has_room(self, lane: Lane, utilisation: float, ceiling: float) -> bool:
        """Whether a newcomer of ``lane`` may go now: not :meth:`saturated` and no grant in transit (but
        an interactive newcomer does not wait for a batch grant: that one gives way to it anyway)."""
        transit = self.in_transit
        if transit is not None and (lane == "batch" or transit.lane == "interactive"):
            return False
        return not self.saturated(lane, utilisation, ceiling)

    def next_grant(self, interactive_u: float, batch_u: float) -> Ticket | None:
        """The ticket to serve now, if any (see the module doc), with the pool's utilisation as each lane
        sees it (the interactive lane leaves out work that would give way to it)."""
        if self.in_transit is not None:
            return None
        head = self.interactive.head()
        if head is not None:
            return head if interactive_u < head.ceiling else None
        head = self.batch.head()
        if head is not None and batch_u < head.ceiling:
            return head
        return None

    def grant(self, ticket: Ticket, pool: str) -> None:
        """Serve ``ticket`` (from :meth:`next_grant`); it is in transit until :meth:`dispatched`."""
        self.lane(ticket.lane).grant(ticket, pool)
        self.in_transit = ticket

    def dispatched(self, ticket: Ticket) -> bool:
        """``ticket`` reached its endpoint (or gave up): the pool may grant again. True if it was in transit."""
        if self.in_transit is ticket:
            self.in_transit = None
            return True
        return False

    def expire(self, now: float) -> list[Ticket]:
        """Both lanes' expired tickets."""
        return self.interactive.expire(now) + self.batch.expire(now)

    def waiting(self) -> int:
        """Tickets waiting in either lane."""
        return len(self.interactive) + len(self.batch)


# --- a newcomer's fate ----------------------------------------------------------------------

#: Weight of the newest finished request in a pool's moving average of service time.
SERVICE_EWMA = 0.2
#: Finished requests before the service time is trusted for predicting waits.
SERVICE_MIN_SAMPLES = 5


class ServiceTime:
    """A pool's moving average of how long its requests are served (for predicting queue waits)."""

    __slots__ = ("mean_s", "samples")

    def __init__(self) -> None:
        self.mean_s = 0.0
        self.samples = 0

    def finished(self, service_s: float) -> None:
        """Count a request that was served for ``service_s``."""
        self.samples += 1
        weight = max(SERVICE_EWMA, 1.0 / self.samples)  # a plain mean until the average has enough samples
        self.mean_s += weight * (service_s - self.mean_s)

    def drain_rate(self, in_flight_tokens: int) -> float | None:
        """Tokens per second the pool finishes while it holds ``in_flight_tokens`` (None: not known yet).

        A saturated pool turns over the tokens it holds once per service time (Little's law).
        """
        if self.samples < SERVICE_MIN_SAMPLES or in_flight_tokens <= 0 or self.mean_s <= 0:
            return None
        return in_flight_tokens / self.mean_s


def predicted_wait_s(pools: Sequence[tuple[PoolQueues, ServiceTime, int]], lane: Lane, tenant: str,
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


@dataclass(frozen=True, slots=True)
class FlowDecision:
    """What flow control does with a newcomer (before any wait).

    Attributes:
        action: ``go`` (a pool has room), ``downgrade`` (to ``model``), ``shed`` (above the class's
            threshold) or ``queue`` (wait in the queues of ``pools``).
        model: The model to serve it: the asked one, or the downgrade target.
        pools: The model's pools within the request's regions.
        least: The least utilisation among them, as the class sees it.
        reason: A downgrade's reason (``shed_threshold`` or ``saturated``).
    """

    action: Literal["go", "downgrade", "shed", "queue"]
    model: Model
    pools: tuple[Pool, ...]
    least: float
    reason: str | None = None


def plan_flow(snapshot: PolicySnapshot, model: Model, cls: ClassDecision, needed_tokens: int,
              regions: frozenset[str] | None, utilisation: Callable[[Pool, bool], float],
              queues: Callable[[Pool], PoolQueues]) -> FlowDecision:
    """Flow control's decision for a newcomer of ``cls`` to ``model`` (steps 1-5 of ``gateway.flow``).

    ``utilisation(pool, preempting)``: the pool's utilisation (``preempting``: as an interactive
    request sees it); ``queues(pool)``: its queues. A newcomer that may not go now only because a
    grant is in transit is queued (it waits a moment).
    """
    def room(pools: Sequence[Pool]) -> tuple[bool, bool, float]:
        has, saturated, least = False, True, math.inf
        lane, ceiling = cls.cls.lane, cls.cls.dispatch_ceiling
        for pool in pools:
            u = utilisation(pool, lane == "interactive")
            least = min(least, u)
            q = queues(pool)
            has = has or q.has_room(lane, u, ceiling)
            saturated = saturated and q.saturated(lane, u, ceiling)
        return has, saturated, least

    pools = pools_within(snapshot.model_pools[model.name], regions)
    has, saturated, least = room(pools)
    shed_at = cls.cls.shed_above_utilisation
    above = shed_at is not None and least > shed_at
    if above or saturated:
        target = downgrade_target(snapshot, model, cls.name, needed_tokens)
        target_pools = pools_within(snapshot.model_pools[target.name], regions) if target is not None else ()
        if target is not None and target_pools:
            _, target_saturated, target_least = room(target_pools)
            if not target_saturated and not (shed_at is not None and target_least > shed_at):
                return FlowDecision("downgrade", target, target_pools, least,
                                    "shed_threshold" if above else "saturated")
    if above:
        return FlowDecision("shed", model, pools, least)
    return FlowDecision("go" if has else "queue", model, pools, least)
