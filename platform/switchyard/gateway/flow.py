"""Flow control in the gateway: carries out ``decide.flow``'s decisions with its queues, futures and timers.

The decisions (go, downgrade, shed or queue; how the batch lane sees a pool; where an interactive
request is steered and which batch requests give way to it) are :mod:`switchyard.decide.flow`'s,
taken in the request's run of the decision procedure. This module owns what they read and what
carries them out in one gateway process: each pool's queues and service time
(:mod:`switchyard.state.queues`), the wait of a queued request (:meth:`FlowController.wait`), the
pump that grants a pool's room to the head of its queues, and the *yielders*: this process's
batch-lane requests in flight that give way to interactive ones (:meth:`FlowController.make_room`
cancels those :func:`~switchyard.decide.flow.preemption_victims` names; the engine aborts a request
whose connection closes, and a preempted request queues again at no charge). Yielders of other
processes (other replicas, a ``switchyard worker``) are out of this process's reach: they count as
plain load.

A pool is pumped when a request it served finishes, when a granted request reaches its endpoint,
when an interactive stream there gets its first byte or a batch request's likely prefill ends, and
every ``TICK_S`` while anything waits (engine load read by the scraper, cool-downs ending). Queues
are per gateway process; replicas each queue their own arrivals and share engine load through the
scraped metrics.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from switchyard.decide.flow import (
    Queue,
    Scheduled,
    Waited,
    batch_lanes_room,
    batch_pool_utilisation,
    batch_view,
    preemption_victims,
)
from switchyard.decide.refusals import Refusal
from switchyard.engines.endpoints import EndpointRegistry, EndpointState
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.policy.fleet import Pool
from switchyard.policy.snapshot import PolicySnapshot
from switchyard.state.queues import EXPIRED, GRANTED, LEFT, PoolQueues, ServiceTime, Ticket

#: How often pools with waiting requests are re-examined without another trigger.
TICK_S = 0.05


@dataclass(slots=True, eq=False)
class Yielder:
    """A batch-lane request in flight at ``url`` that gives way to interactive requests.

    Attributes:
        release: Gives its place at the endpoint back (idempotent; the request calls it too).
        task: The task serving it, cancelled to preempt it.
        preempted: Set when flow control preempted it (its cancellation is flow control's).
    """

    url: str
    #: Its tokens at the endpoint (prompt + expected output).
    tokens: int
    release: Callable[[], None]
    task: asyncio.Task[Any]
    #: When it was sent (monotonic): the youngest has done the least work.
    started: float
    preempted: bool = False


class Preempted(Exception):
    """The request was preempted by flow control for an interactive request; it should queue again."""

    def __init__(self, url: str) -> None:
        super().__init__(f"preempted at {url} for an interactive request")
        self.url = url


@dataclass(slots=True)
class _Waiter:
    future: asyncio.Future[None]
    timer: asyncio.TimerHandle
    pools: tuple[str, ...]


class _PoolState:
    __slots__ = ("pool", "queues", "service")

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.queues = PoolQueues()
        self.service = ServiceTime()


class FlowController:
    """Per-pool queues of one gateway process (see the module doc)."""

    def __init__(self, endpoints: EndpointRegistry, metrics: GatewayMetrics, enabled: bool = True) -> None:
        self.endpoints = endpoints
        self.metrics = metrics
        self.enabled = enabled
        self._pools: dict[str, _PoolState] = {}
        self._kicked: set[str] = set()
        #: Yielders by endpoint URL, oldest first.
        self._yielders: dict[str, list[Yielder]] = {}
        #: Called when a batch-lane request leaves a queue (its lane has room again): the batch worker's wake-up.
        self._batch_room_listeners: list[Callable[[], None]] = []

    # --- load ---------------------------------------------------------------------------------

    def utilisation(self, pool: Pool, now: float, preempting: bool = False) -> float:
        """The pool's utilisation: that of its least-loaded endpoint in service; infinite when none is.

        A pool whose endpoints are all down or behind open breakers has no room: its model's requests go
        to the model's other pools, and wait for those when they are full, instead of being let through
        as if it were empty (the picker would then crowd them into the live pools' engines).
        ``preempting``: as an interactive request sees it, without this process's yielders.
        """
        age = self.endpoints.signal_max_age
        return min((s.utilisation(now, age, pool.kv_cache_tokens, pool.max_num_seqs, preempting)
                    for s in self._in_service(pool, now)), default=math.inf)

    def _in_service(self, pool: Pool, now: float) -> list[EndpointState]:
        """The states of the pool's endpoints that may take a request now (health and breakers)."""
        registry = self.endpoints
        return [registry.state(url) for url in pool.endpoints if registry.available(url, pool.name, now)]

    def batch_utilisation(self, pool: Pool, now: float) -> float:
        """The pool's utilisation as the batch lane sees it (:func:`~switchyard.decide.flow.batch_pool_utilisation`
        of its endpoints in service, each seen through :func:`~switchyard.decide.flow.batch_view`); infinite
        when none is in service."""
        healthy = self._in_service(pool, now)
        if not healthy:
            return math.inf
        age = self.endpoints.signal_max_age
        return batch_pool_utilisation(
            pool, [batch_view(s.utilisation(now, age, pool.kv_cache_tokens, pool.max_num_seqs), s.prefilling,
                              s.batch_prefilling(now)) for s in healthy],
            sum(s.slots_used(now, age) for s in healthy) if pool.max_num_seqs else 0.0)

    def full(self, pool: Pool, url: str, ceiling: float, now: float, preempting: bool = False) -> bool:
        """Whether ``url`` of ``pool`` is at ``ceiling`` (``preempting``: without this process's yielders)."""
        age = self.endpoints.signal_max_age
        u = self.endpoints.state(url).utilisation(now, age, pool.kv_cache_tokens, pool.max_num_seqs, preempting)
        return u >= ceiling

    def queues(self, pool: Pool) -> PoolQueues:
        """The pool's queues."""
        return self._state(pool).queues

    def batch_room(self, snapshot: PolicySnapshot) -> int:
        """How many batch lines this process's batch lanes take now (:func:`~switchyard.decide.flow.batch_lanes_room`):
        what the batch worker claims at most."""
        return batch_lanes_room(snapshot, self.queues)

    def on_batch_room(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever a batch-lane request leaves a queue (granted, expired or gone): its lane has
        room for another line."""
        self._batch_room_listeners.append(listener)

    def _batch_left(self, ticket: Ticket) -> None:
        if ticket.lane == "batch":
            for listener in self._batch_room_listeners:
                listener()

    def service(self, pool: Pool) -> ServiceTime:
        """The pool's service time."""
        return self._state(pool).service

    def _state(self, pool: Pool) -> _PoolState:
        state = self._pools.get(pool.name)
        if state is None:
            state = self._pools[pool.name] = _PoolState(pool)
        else:
            state.pool = pool  # the latest policy's view of it
        return state

    # --- the request's side ---------------------------------------------------------------------

    async def wait(self, queue: Queue, disconnected: Callable[[], Awaitable[Any]]) -> tuple[Waited, Ticket | None]:
        """Carry out ``queue``: wait in its pools' queues until one grants room (the granted ticket is returned:
        :meth:`dispatched` once the request counted itself at its endpoint), the deadline passes, or
        ``disconnected`` returns (the client is gone)."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        ticket = Ticket(queue.tenant, queue.class_name, queue.rank, queue.lane, queue.cost, queue.ceiling, now,
                        now + queue.deadline_s)
        names = tuple(p.name for p in queue.pools)
        waiter = _Waiter(loop.create_future(), loop.call_at(ticket.deadline, self._expire, names), names)
        ticket.waiter = waiter
        for pool in queue.pools:
            self._state(pool).queues.lane(queue.lane).push(ticket)
        self._gauge(ticket)
        for name in names:
            self._kick(name)
        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait((waiter.future, watcher), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            if ticket.state == GRANTED:  # cancelled just after its grant: the pool must not wait for it
                self.dispatched(ticket)
            raise
        finally:
            watcher.cancel()
            waiter.timer.cancel()
            if ticket.waiting:  # the client left, or this task was cancelled
                ticket.leave(LEFT)
                self.metrics.queue_left.labels(queue.class_name).inc()
                self._gauge(ticket)
                self._batch_left(ticket)
        waited = time.monotonic() - now
        if ticket.state == GRANTED:
            return Waited("granted", waited, ticket.granted_by), ticket
        return Waited("expired" if ticket.state == EXPIRED else "left", waited), None

    def counted(self, class_name: str, outcome: Scheduled | Refusal) -> None:
        """Count what flow control decided for a request of ``class_name``: a downgrade or a shed."""
        if isinstance(outcome, Refusal):
            if outcome.shed is not None:
                self.metrics.shed.labels(class_name, outcome.shed).inc()
        elif outcome.downgraded_from is not None:
            self.metrics.downgrades.labels(class_name, outcome.reason, outcome.downgraded_from.name).inc()

    def dispatched(self, ticket: Ticket | None) -> None:
        """A granted request counted itself at its endpoint (or gave up): its pool may grant again."""
        if ticket is None or ticket.granted_by is None:
            return
        state = self._pools.get(ticket.granted_by)
        if state is not None and state.queues.dispatched(ticket):
            self._kick(ticket.granted_by)

    def released(self, pool: str, service_s: float | None) -> None:
        """A request that was at ``pool`` for ``service_s`` finished: it counts towards the service time
        (unless None: it was cut short) and frees room."""
        if not self.enabled:
            return
        state = self._pools.get(pool)
        if state is None:
            return
        if service_s is not None:
            state.service.finished(service_s)
        if state.queues.waiting():
            self._kick(pool)

    # --- batch gives way ------------------------------------------------------------------------

    def yielding(self, url: str, tokens: int, release: Callable[[], None]) -> Yielder | None:
        """Register the current task's request of ``tokens`` at ``url`` as a yielder (None: flow control is off)."""
        task = asyncio.current_task()
        if not self.enabled or task is None:
            return None
        yielder = Yielder(url, tokens, release, task, time.monotonic())
        self._yielders.setdefault(url, []).append(yielder)
        return yielder

    def yielder_starts(self, url: str) -> Sequence[float]:
        """When each yielder at ``url`` was sent, oldest first."""
        at = self._yielders.get(url)
        return [y.started for y in at] if at else ()

    def finished_yielding(self, yielder: Yielder | None) -> None:
        """``yielder``'s request left its endpoint (answered, failed or preempted)."""
        if yielder is None:
            return
        at = self._yielders.get(yielder.url)
        if at is not None and yielder in at:
            at.remove(yielder)
            if not at:
                del self._yielders[yielder.url]

    def make_room(self, pool: Pool, url: str, ceiling: float, now: float) -> int:
        """Preempt the yielders at ``url`` that :func:`~switchyard.decide.flow.preemption_victims` names for an
        interactive request of a class with ``ceiling``; how many were preempted.

        Their places are given back at once, so the caller's request is counted where they were.
        """
        at = self._yielders.get(url)
        if not self.enabled or not at:
            return 0
        state = self.endpoints.state(url)
        age = self.endpoints.signal_max_age

        def full_without(gone: int, gone_tokens: int) -> bool:
            return state.utilisation(now, age, pool.kv_cache_tokens, pool.max_num_seqs, gone=gone,
                                     gone_tokens=gone_tokens) >= ceiling

        victims = [at[i] for i in preemption_victims([(y.started, y.tokens) for y in at], full_without,
                                                     state.prefill_s, now)]
        for yielder in victims:
            at.remove(yielder)
            _preempt(yielder)
        if not at:
            self._yielders.pop(url, None)
        if victims:
            self.metrics.preemptions.labels(pool.name).inc(len(victims))
        return len(victims)

    def batch_sent(self, pool: str, url: str) -> None:
        """A batch request was sent to ``url`` (of ``pool``): batch work may go there again once it is likely out
        of its prefill (:func:`batch_view`); the pool is pumped then."""
        prefill_s = self.endpoints.state(url).prefill_s
        if self.enabled and prefill_s is not None:
            asyncio.get_running_loop().call_later(prefill_s, self._pump_if_waiting, pool)

    def prefill_ended(self, pool: str) -> None:
        """An interactive stream at an endpoint of ``pool`` got its first byte: batch work may go there again."""
        self._pump_if_waiting(pool)

    def _pump_if_waiting(self, pool: str) -> None:
        state = self._pools.get(pool)
        if self.enabled and state is not None and state.queues.waiting():
            self._kick(pool)

    # --- the pools' side ---------------------------------------------------------------------

    def _kick(self, name: str) -> None:
        if name not in self._kicked:
            self._kicked.add(name)
            asyncio.get_running_loop().call_soon(self._pump, name)

    def _pump(self, name: str) -> None:
        """Grant the pool's next request if it has room."""
        self._kicked.discard(name)
        state = self._pools.get(name)
        if state is None:
            return
        now = time.monotonic()
        self._fail_expired(state, now)
        u = self.utilisation(state.pool, now)
        self.metrics.utilisation.labels(name).set(u)
        ticket = state.queues.next_grant(self.utilisation(state.pool, now, preempting=True),
                                         self.batch_utilisation(state.pool, now) if state.queues.batch.head() else u)
        if ticket is None:
            return
        state.queues.grant(ticket, name)
        self.metrics.queue_wait.labels(name, ticket.lane, ticket.class_name).observe(now - ticket.enqueued)
        self._gauge(ticket)
        self._batch_left(ticket)
        waiter: _Waiter = ticket.waiter
        if not waiter.future.done():
            waiter.future.set_result(None)

    def _expire(self, names: tuple[str, ...]) -> None:
        now = time.monotonic()
        for name in names:
            state = self._pools.get(name)
            if state is not None:
                self._fail_expired(state, now)

    def _fail_expired(self, state: _PoolState, now: float) -> None:
        for ticket in state.queues.expire(now):
            self._gauge(ticket)
            self._batch_left(ticket)
            waiter: _Waiter = ticket.waiter
            if not waiter.future.done():
                waiter.future.set_result(None)

    def _gauge(self, ticket: Ticket) -> None:
        """Show the depth of ``ticket``'s class in every queue it was in."""
        waiter: _Waiter = ticket.waiter
        for name in waiter.pools:
            state = self._pools.get(name)
            if state is not None:
                depth = state.queues.lane(ticket.lane).depth(ticket.rank)
                self.metrics.queue_depth.labels(name, ticket.lane, ticket.class_name).set(depth)

    async def run(self) -> None:
        """Re-examine pools with waiting requests every ``TICK_S``, and show every pool's utilisation
        (cancel the task to stop)."""
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            for name, state in list(self._pools.items()):
                if state.queues.waiting():
                    self._pump(name)
                else:
                    self.metrics.utilisation.labels(name).set(self.utilisation(state.pool, now))

    def waiting(self) -> int:
        """Requests waiting in any queue (each counted once per pool it waits for)."""
        return sum(state.queues.waiting() for state in self._pools.values())


def _preempt(yielder: Yielder) -> None:
    yielder.preempted = True
    yielder.release()
    yielder.task.cancel("preempted for an interactive request")


async def never() -> None:
    """A disconnect signal that never fires (for callers that cannot see their client)."""
    await asyncio.Event().wait()

