"""Flow control in the gateway: carries out ``decide.flow``'s queue decisions with futures and timers.

A request that has been admitted asks :meth:`FlowController.schedule` for capacity before it
picks an endpoint:

1. **Saturated?** Each pool's utilisation is its least-loaded endpoint's
   (:meth:`~switchyard.engines.endpoints.EndpointState.utilisation`; endpoints in a failure
   cool-down are left out unless all are). A pool *has room* for a class when it is under the
   class's ceiling (1.0 interactive, ``max_utilisation`` for the batch lane) and nobody waits
   before the newcomer.
2. **Degrade before refusing**: a model with ``on_saturation`` sends requests of the chosen
   classes to ``downgrade_to`` when its own pools have no room (or are above the class's
   shedding threshold) and the cheaper model's have.
3. **Shed** a class with ``shed_above_utilisation`` at once when its pools are above it.
4. **Go** when a pool has room.
5. **Queue** otherwise, in the queue of every pool of the model (whichever frees first serves
   it), unless the predicted wait already exceeds the class's deadline. A saturated pool turns
   over the tokens it holds once per service time (Little's law), so the wait is predicted as
   ``tokens served before it * mean service time / tokens in flight there`` (this gateway's
   requests; the service time is a moving average of its finished requests'). The request
   leaves with 503 when its deadline passes, or quietly when its client disconnects; either way
   its reservation is released.

**Batch gives way.** This process's batch-lane requests in flight that are answered as one JSON
object (:attr:`~switchyard.gateway.request.PendingRequest.yields`) are *yielders*: interactive
requests see every utilisation without them (``preempting``), so batch work never makes an
interactive request wait. When an interactive request is sent to an endpoint that is at its
class's ceiling with them counted, :meth:`FlowController.make_room` cancels the youngest yielders
there (least work lost; the engine aborts a request whose connection closes) until it is under:
vLLM's priority scheduling only orders its waiting queue and never preempts a running request for a
waiting one, so without this an interactive request would wait for a batch sequence to end. A
preempted request is charged nothing for that try and queues again in the batch lane (see
:class:`~switchyard.gateway.proxy.Proxy`). Yielders of other processes (other replicas, a
``switchyard worker``) are out of this process's reach: they count as plain load.

**Prefills kept apart.** An engine step's prefills run together (a step carrying two takes about as long
as both), so an interactive request's time to first token suffers most from other prefills in its first
step. Batch work is not sent to an endpoint while an interactive stream there waits for its first byte,
nor while the last batch request sent there is likely still in its prefill (:func:`batch_view`: batch
prefills go one at a time); an interactive request preempts the batch requests sent to its endpoint too
recently to have had their first step (:meth:`FlowController.make_room`), weighs endpoints by their
interactive load with streams in their prefill counted twice (``EndpointState.load``), and is not
steered to where more of them are (:meth:`FlowController.steer`).

A pool is pumped when a request it served finishes, when a granted request reaches its endpoint,
and every ``TICK_S`` while anything waits (engine load read by the scraper, cool-downs ending).
Queues are per gateway process; replicas each queue their own arrivals and share engine load
through the scraped metrics.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from switchyard.decide.flow import (
    EXPIRED,
    GRANTED,
    LEFT,
    ClassDecision,
    PoolQueues,
    ServiceTime,
    Ticket,
    plan_flow,
    predicted_wait_s,
)
from switchyard.decide.pick import Candidate, EndpointChoice
from switchyard.engines.endpoints import EndpointRegistry, EndpointState
from switchyard.gateway.errors import ApiError, Overloaded
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.policy import PolicySnapshot
from switchyard.policy.schema import Model, Pool

#: How often pools with waiting requests are re-examined without another trigger.
TICK_S = 0.05
#: A batch request sent to an endpoint less than this share of its usual interactive time to first byte ago
#: has most likely not had its first engine step yet (that time is the engine's frontend, the wait for the
#: step in progress, and the prefill step; about half of it comes before the prefill step starts).
WAITING_SHARE = 0.5


class ClientLeft(ApiError):
    """The client disconnected while its request waited (nobody reads this answer)."""

    status_code = 499
    type = "client_closed_request"
    code = "client_closed_request"


@dataclass(slots=True)
class Scheduled:
    """What flow control decided for a request that may go on.

    Attributes:
        model: The model to serve it (the resolved one, or its downgrade).
        downgraded_from: The resolved model when ``model`` is its downgrade.
        note: Why it was downgraded (for the ``x-switchyard-degraded`` header).
        waited_s: Time spent in the queue.
        ticket: The granted ticket, until the request counts itself at its endpoint.
    """

    model: Model
    downgraded_from: Model | None = None
    note: str | None = None
    waited_s: float = 0.0
    ticket: Ticket | None = None


@dataclass(slots=True, eq=False)
class Yielder:
    """A batch-lane request in flight at ``url`` that gives way to interactive requests.

    Attributes:
        release: Gives its place at the endpoint back (idempotent; the request calls it too).
        task: The task serving it, cancelled to preempt it.
        preempted: Set when flow control preempted it (its cancellation is flow control's).
    """

    url: str
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

    # --- load ---------------------------------------------------------------------------------

    def utilisation(self, pool: Pool, now: float, preempting: bool = False) -> float:
        """The pool's utilisation: that of its least-loaded endpoint out of cool-down (all, if none is).

        ``preempting``: as an interactive request sees it, without this process's yielders.
        """
        age = self.endpoints.signal_max_age
        return min(s.utilisation(now, age, pool.kv_cache_tokens, pool.max_num_seqs, preempting)
                   for s in self._in_service(pool, now))

    def _in_service(self, pool: Pool, now: float) -> list[EndpointState]:
        """The states of the pool's endpoints out of cool-down (all of them, if none is)."""
        states = [self.endpoints.state(url) for url in pool.endpoints]
        return [s for s in states if s.healthy(now)] or states

    def batch_utilisation(self, pool: Pool, now: float) -> float:
        """The pool's utilisation as the batch lane sees it: :meth:`utilisation` with every endpoint where an
        interactive stream or the last batch request is in its prefill counted as full (:func:`batch_view`), and
        with ``max_num_seqs`` declared, the sequence slots of its endpoints in service taken with
        ``batch_reserve_slots`` more counted as taken (so batch work leaves that many free for interactive
        arrivals), but never all of them: the batch lane may always have one slot of the pool."""
        healthy = self._in_service(pool, now)
        age = self.endpoints.signal_max_age
        u = min(batch_view(s.utilisation(now, age, pool.kv_cache_tokens, pool.max_num_seqs), s, now) for s in healthy)
        if not pool.max_num_seqs or not pool.batch_reserve_slots:
            return u
        slots = pool.max_num_seqs * len(healthy)
        used = sum(s.slots_used(now, age) for s in healthy)
        return max(u, (used + min(pool.batch_reserve_slots, slots - 1)) / slots)

    def _state(self, pool: Pool) -> _PoolState:
        state = self._pools.get(pool.name)
        if state is None:
            state = self._pools[pool.name] = _PoolState(pool)
        else:
            state.pool = pool  # the latest policy's view of it
        return state

    # --- the request's side ---------------------------------------------------------------------

    async def schedule(self, snapshot: PolicySnapshot, model: Model, cls: ClassDecision, cost: int, tenant: str,
                       needed_tokens: int, disconnected: Callable[[], Awaitable[Any]],
                       regions: frozenset[str] | None = None) -> Scheduled:
        """Capacity for a request of ``cost`` tokens to ``model``: go now, downgraded, after a wait, or 503.

        ``disconnected`` is awaited while the request waits; when it returns, the client is gone.
        ``regions``: where the request may be served (its tier's regions; None: anywhere); pools
        elsewhere are not considered. The caller has checked that the model has a pool there.

        Raises:
            Overloaded: shed (above the class's threshold, deadline passed, or predicted to pass).
            ClientLeft: the client went away while the request waited.
        """
        if not self.enabled:
            return Scheduled(model)
        now = time.monotonic()
        decision = plan_flow(snapshot, model, cls, needed_tokens, regions,
                             lambda pool, preempting: (self.utilisation(pool, now, preempting) if preempting
                                                       else self.batch_utilisation(pool, now)),
                             lambda pool: self._state(pool).queues)
        least, shed_at = decision.least, cls.cls.shed_above_utilisation
        if decision.action == "downgrade":
            target = decision.model
            self.metrics.downgrades.labels(cls.name, decision.reason, model.name).inc()
            why = (f"above the {shed_at:g} threshold of class {cls.name}" if decision.reason == "shed_threshold"
                   else "saturated")
            # A response header: ASCII only.
            note = f"{model.name} -> {target.name}: the pools of {model.name} are {why} (utilisation {least:.2f})"
            return Scheduled(target, model, note)
        if decision.action == "shed":
            assert shed_at is not None
            self.metrics.shed.labels(cls.name, "utilisation").inc()
            raise Overloaded(
                f"Shed: the pools of model {model.name} are at utilisation {least:.2f}, above the {shed_at:g} "
                f"threshold of priority class {cls.name}. Retry later or with a higher tier.",
                code="shed_utilisation", headers={"Retry-After": "1"})
        if decision.action == "go":
            return Scheduled(model)
        pools = decision.pools
        return await self._wait(pools, cls, cost, tenant, now, model, disconnected)

    async def _wait(self, pools: Sequence[Pool], cls: ClassDecision, cost: int, tenant: str, now: float,
                    model: Model, disconnected: Callable[[], Awaitable[Any]]) -> Scheduled:
        klass = cls.cls
        deadline_s = klass.queue_deadline_s
        predicted = predicted_wait_s(
            [(state.queues, state.service, sum(self.endpoints.state(url).reserved for url in pool.endpoints))
             for pool in pools for state in (self._state(pool),)], klass.lane, tenant, cls.rank)
        if predicted is not None and predicted > deadline_s:
            self.metrics.shed.labels(cls.name, "predicted_wait").inc()
            raise Overloaded(
                f"Shed: the predicted wait for model {model.name} ({predicted:.1f} s) exceeds the "
                f"{deadline_s * 1000:g} ms queue deadline of priority class {cls.name}.",
                code="queue_wait_too_long", headers={"Retry-After": str(max(1, math.ceil(predicted)))})
        loop = asyncio.get_running_loop()
        ticket = Ticket(tenant, cls.name, cls.rank, klass.lane, cost, klass.dispatch_ceiling, now, now + deadline_s)
        names = tuple(p.name for p in pools)
        waiter = _Waiter(loop.create_future(), loop.call_at(ticket.deadline, self._expire, names), names)
        ticket.waiter = waiter
        for pool in pools:
            self._state(pool).queues.lane(klass.lane).push(ticket)
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
                self.metrics.queue_left.labels(cls.name).inc()
                self._gauge(ticket)
        waited = time.monotonic() - now
        if ticket.state == GRANTED:
            return Scheduled(model, waited_s=waited, ticket=ticket)
        if ticket.state == EXPIRED:
            self.metrics.shed.labels(cls.name, "deadline").inc()
            raise Overloaded(
                f"Shed: the request waited {waited * 1000:.0f} ms for model {model.name}, the queue deadline of "
                f"priority class {cls.name} ({deadline_s * 1000:g} ms); its pools stayed saturated.",
                code="queue_deadline_exceeded", headers={"Retry-After": str(max(1, math.ceil(deadline_s)))})
        raise ClientLeft("The client closed the connection while the request waited in the queue.")

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

    def yielding(self, url: str, release: Callable[[], None]) -> Yielder | None:
        """Register the current task's request at ``url`` as a yielder (None: flow control is off)."""
        task = asyncio.current_task()
        if not self.enabled or task is None:
            return None
        yielder = Yielder(url, release, task, time.monotonic())
        self._yielders.setdefault(url, []).append(yielder)
        return yielder

    def finished_yielding(self, yielder: Yielder | None) -> None:
        """``yielder``'s request left its endpoint (answered, failed or preempted)."""
        if yielder is None:
            return
        at = self._yielders.get(yielder.url)
        if at is not None and yielder in at:
            at.remove(yielder)
            if not at:
                del self._yielders[yielder.url]

    def _full(self, pool: Pool, url: str, ceiling: float, now: float, preempting: bool = False) -> bool:
        age = self.endpoints.signal_max_age
        u = self.endpoints.state(url).utilisation(now, age, pool.kv_cache_tokens, pool.max_num_seqs, preempting)
        return u >= ceiling

    def steer(self, choice: EndpointChoice, options: Sequence[Candidate], tried: set[str], ceiling: float,
              now: float) -> EndpointChoice:
        """Where an interactive request picked for ``choice`` should go to lose the least batch work.

        ``choice`` itself when it has room without preempting; otherwise the option (in service, not
        ``tried``, with room once its yielders are gone, and no more interactive streams in their prefill than
        ``choice``: the newcomer's first engine step would carry theirs) whose youngest yielder was sent last.
        """
        if not self._yielders or not self._full(choice.pool, choice.url, ceiling, now):
            return choice
        best: Candidate | None = None
        youngest = -math.inf
        prefilling = self.endpoints.state(choice.url).prefilling
        for option in options:
            at = self._yielders.get(option.url)
            if (not at or option.url in tried or at[-1].started <= youngest
                    or self.endpoints.state(option.url).prefilling > prefilling
                    or not self.endpoints.available(option.url, option.pool.name, now)
                    or self._full(option.pool, option.url, ceiling, now, preempting=True)):
                continue
            best, youngest = option, at[-1].started
        if best is None or best.url == choice.url:
            return choice
        return replace(choice, pool=best.pool, url=best.url,
                       notes=(*choice.notes, "moved to the endpoint whose youngest batch request gives way"))

    def make_room(self, pool: Pool, url: str, ceiling: float, now: float) -> int:
        """Preempt the youngest yielders at ``url`` until it is under ``ceiling``; how many were preempted.

        Their places are given back at once, so the caller's request is counted where they were.
        """
        at = self._yielders.get(url)
        if not self.enabled or not at:
            return 0
        preempted = 0
        while at and self._full(pool, url, ceiling, now):
            _preempt(at.pop())
            preempted += 1
        # A batch request sent here very recently most likely waits for its first engine step: it would
        # share the newcomer's and slow it down, and it loses nothing. (One already in its prefill step is
        # left alone: that step runs to its end all the same.)
        prefill_s = self.endpoints.state(url).prefill_s
        if prefill_s is not None:
            young = [y for y in at if now - y.started < WAITING_SHARE * prefill_s]
            for yielder in young:
                at.remove(yielder)
                _preempt(yielder)
            preempted += len(young)
        if not at:
            self._yielders.pop(url, None)
        if preempted:
            self.metrics.preemptions.labels(pool.name).inc(preempted)
        return preempted

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


def batch_view(u: float, state: EndpointState, now: float) -> float:
    """An endpoint's utilisation ``u`` as batch work sees it: full while an interactive stream there is in its
    prefill (a batch prefill sent now would share its first engine step), and while the last batch request
    sent there is likely still in its own (batch prefills go one at a time: an engine step carrying several
    takes as long as all of them, and an interactive request arriving meanwhile waits for it)."""
    return max(u, 1.0) if state.prefilling or state.batch_prefilling(now) else u


def _preempt(yielder: Yielder) -> None:
    yielder.preempted = True
    yielder.release()
    yielder.task.cancel("preempted for an interactive request")


async def never() -> None:
    """A disconnect signal that never fires (for callers that cannot see their client)."""
    await asyncio.Event().wait()

