"""Flow control's queues: the per-pool lanes requests wait in, and each pool's service time.

Mutable state, owned by whoever executes flow control (the gateway's
:class:`~switchyard.gateway.flow.FlowController`, a replay arm of :mod:`switchyard.whatif`); the
decisions (:mod:`switchyard.decide.flow`) read it through :class:`switchyard.decide.views.QueueView`
and never change it. Time is passed in (``now``): nothing here reads a clock.

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
from typing import Any

from switchyard.policy.tiers import Lane

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


# --- how fast a pool drains ---------------------------------------------------------------

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
