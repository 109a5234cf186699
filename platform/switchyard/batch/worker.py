"""The batch worker: runs the lines of batch jobs through the gateway's own request path, in the
batch lane, so that they fill only the capacity interactive traffic leaves.

Every gateway process runs one (``SWITCHYARD_BATCH_WORKER``), and ``switchyard worker`` runs
dedicated ones. Lines are claimed from the database under a lease (``store.batch_queue.claim``: row
locks with ``SKIP LOCKED`` on PostgreSQL), kept while they run (leases renewed), and their result
is recorded only while the lease is still this worker's — so a worker killed at any moment loses
nothing (its lines are claimed again once their lease runs out) and duplicates nothing (a late
result of a lease that moved on is dropped). Transient failures (an engine's 429, 5xx, sheds) go back
to the queue with exponential backoff; client errors are the line's result. A line the tenant's own
limits have no room for is not a failure: it goes back without spending a try, due when the limit
says (``Retry-After``); the worker claims none of that tenant's lines until then, and afterwards only a
few at a time (halved at each refusal, one more for each line served) — so a batch is paced to its
tenant's budget instead of retried into it. It fails on a limit only when it can never
fit: alone larger than the limit, or room only after the job's completion window. Nor is a line
whose model's batch lane already has as many lines waiting as its pools have sequence slots
(``batch_lane_full``): it goes back without spending a try, due when the lane is likely to have room;
otherwise the worker's room would fill with lines waiting for the slowest model while the other models'
pools stood idle. The worker claims no more lines than the lanes have room for
(``FlowController.batch_room``), none while every lane is full, and claims again as soon as a line leaves
a lane's queue: lines are handed back only when they go to a full lane while another has room. (It used
to claim all its free room at once, hand back what the lanes refused and pause a quarter of a second: in
the headline bench the small model's fast lines drained its lane during each pause, and its pools had no
batch line waiting a third to half of the time before the peak.)

A line runs as the key that made its job, as that key is *now*: the worker caches identities by key
id only while the process's key cache hears of no key change (``KeyAuthenticator.changes``: PostgreSQL
NOTIFY, the SQLite marker; ``store/key_changes.py``). Once a revocation, a tenant's deletion or a new
tier or limit has returned, no line of the key is dispatched with what it had before: a revoked key's
lines each get 401 ``invalid_api_key`` in the error file. Lines already handed to the request path
when the change lands finish as they started.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec
from litestar import Response
from sqlalchemy import Engine
from sqlmodel import Session

from switchyard.api.errors import ApiError, RateLimited
from switchyard.api.headers import PRIORITY_HEADER
from switchyard.decide.flow import batch_lines_in_flight
from switchyard.gateway.request import Incoming, Kind, never
from switchyard.gateway.runtime import GatewayRuntime
from switchyard.gateway.shutdown import ShutdownSteps
from switchyard.policy import PolicySnapshot
from switchyard.store import batch_finalize, batch_queue
from switchyard.store.db import in_transaction
from switchyard.store.keys import KeyIdentity, identity_of

log = logging.getLogger("switchyard.batch")

T = TypeVar("T")
Serve = Callable[[Incoming, Kind], Awaitable[Response[Any]]]

#: Answers worth another try later: timeouts, limits, sheds, engine and gateway failures.
TRANSIENT = frozenset({408, 429, 500, 502, 503, 504})
KINDS: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion",
                          "/v1/embeddings": "embedding", "/v1/responses": "responses"}
#: Longest wait before a line's next try.
MAX_BACKOFF_S = 300.0
#: Longest a key's identity is reused (bounds only changes made behind Switchyard's back, by SQL).
IDENTITY_TTL_S = 5.0
#: Lookups of one identity while key changes keep landing during them (then the last answer is used).
_LOOKUP_TRIES = 3
#: The refusal of a line whose model's batch lane already has as many lines waiting as its pools have slots.
LANE_FULL = "batch_lane_full"


class BatchLanes(Protocol):
    """The batch lanes of the request path the worker sends its lines through (the process's
    :class:`~switchyard.gateway.flow.FlowController`)."""

    def batch_room(self, snapshot: PolicySnapshot) -> int:
        """How many batch lines the lanes take now, whichever models they go to."""
        ...

    def on_batch_room(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever a lane has room again."""
        ...


def backoff_s(attempts: int, base_s: float = 2.0) -> float:
    """Seconds before try ``attempts + 1``: doubling from ``base_s``, at most :data:`MAX_BACKOFF_S`."""
    return float(min(MAX_BACKOFF_S, base_s * 2 ** max(0, attempts - 1)))


def _retry_after_s(headers: dict[str, str]) -> float:
    """The seconds a limit's 429 says to wait (its ``Retry-After``; a second when it says nothing usable)."""
    try:
        return max(1.0, float(headers.get("Retry-After", "1")))
    except ValueError:
        return 1.0


def batch_class(snapshot: PolicySnapshot) -> str | None:
    """The policy's first priority class in the batch lane (None: the policy declares none)."""
    return next((name for name, cls in snapshot.document.priorities.items() if cls.lane == "batch"), None)


def worker_id() -> str:
    """This worker's name in leases: host, process and a random part (restarts are new owners)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _claim(session: Session, *, owner: str, limit: int, lease_s: float, now: float,
           paced: dict[int, int]) -> list[batch_queue.ClaimedRequest]:
    """Lines for ``limit`` free slots: of the tenants not paced, then of each paced tenant its room."""
    claimed = batch_queue.claim(session, owner, limit, lease_s, now, except_tenants=paced)
    for tenant, room in paced.items():
        if len(claimed) < limit and room > 0:
            claimed += batch_queue.claim(session, owner, min(room, limit - len(claimed)), lease_s, now, tenant=tenant)
    return claimed


@dataclass(slots=True)
class _Pace:
    """How a tenant whose limit had no room is paced: nothing before ``until``, then at most ``cap`` lines at a
    time (halved at each refusal, one more at each line served; back to unpaced at the worker's concurrency)."""

    until: float
    cap: int


def _renew(session: Session, *, owner: str, rows: list[int], lease_s: float, now: float) -> list[int]:
    return batch_queue.renew_leases(session, owner, rows, lease_s, now)


def _finalize(session: Session, *, now: float) -> list[str]:
    return batch_finalize.finalize_ready(session, now)


class BatchWorker:
    """Claims lines while it has room, runs each through ``serve``, records results, finalizes jobs."""

    def __init__(self, engine: Engine, serve: Serve, policy: Callable[[], PolicySnapshot], *,
                 concurrency: int | None, lease_s: float, max_attempts: int, poll_s: float = 1.0,
                 owner: str | None = None, key_changes: Callable[[], int | None] | None = None,
                 lanes: BatchLanes | None = None) -> None:
        self.engine = engine
        self.serve = serve
        self.policy = policy
        #: Lines kept in flight (None: :func:`~switchyard.decide.flow.batch_lines_in_flight` of the policy in force).
        self.fixed_concurrency = concurrency
        #: The lanes that say how many lines to claim (None: as many as the worker has room for).
        self.lanes = lanes
        self.lease_s = lease_s
        self.max_attempts = max_attempts
        self.poll_s = poll_s
        self.owner = owner or worker_id()
        self._running: dict[int, asyncio.Task[None]] = {}
        # ``KeyAuthenticator.changes`` (None: none is followed, identities last IDENTITY_TTL_S).
        self._changes: Callable[[], int | None] = key_changes or (lambda: 0)
        self._identities: dict[int, tuple[int, float, KeyIdentity | None]] = {}
        self._identities_of: int | None = None  # the key changes the cached identities follow
        self._warned_no_lane = False
        #: Tenants whose limits had no room (their lines are paced), and the tenant of each running line.
        self._paced: dict[int, _Pace] = {}
        self._tenant_of: dict[int, int] = {}
        #: Set when a line ends or a batch lane has room again: the loop claims again at once.
        self._wake = asyncio.Event()
        if lanes is not None:
            lanes.on_batch_room(self._wake.set)
        #: Lines a full batch lane refused, still leased here, to be handed back in the loop's next round (row, delay
        #: before its next try, the refusal, when: monotonic): one write for all of them, not one each.
        self._lane_returns: list[tuple[int, float, dict[str, Any], float]] = []

    @property
    def concurrency(self) -> int:
        """Lines kept in flight now: the setting, or enough for the policy's pools (it follows reloads)."""
        return self.fixed_concurrency or batch_lines_in_flight(self.policy())

    def _claimable(self) -> int:
        """How many lines to claim now: the worker's free room, at most what the batch lanes take."""
        free = self.concurrency - len(self._running)
        if self.lanes is not None and free > 0:
            free = min(free, self.lanes.batch_room(self.policy()))
        return free

    async def _db(self, work: Callable[[Session], T]) -> T:
        return await in_transaction(self.engine, work)

    async def run(self) -> None:
        """Work until cancelled. Database trouble is logged and retried; it never ends the loop."""
        renewed = finalized = 0.0
        while True:
            now = time.time()
            try:
                await self._put_back(now)
                free = self._claimable()
                claimed = (await self._db(functools.partial(_claim, owner=self.owner, limit=free, lease_s=self.lease_s,
                                                            now=now, paced=self._room(now))) if free > 0 else [])
                for line in claimed:
                    self._tenant_of[line.id] = line.tenant_id
                    task = asyncio.get_running_loop().create_task(self._line(line), name=f"batch-line-{line.id}")
                    self._running[line.id] = task
                    task.add_done_callback(functools.partial(self._done, line.id))
                if self._running and now - renewed >= self.lease_s / 3:
                    held = await self._db(functools.partial(_renew, owner=self.owner, rows=list(self._running),
                                                            lease_s=self.lease_s, now=now))
                    for row in set(self._running) - set(held):  # another worker has it now: stop this try
                        self._running[row].cancel()
                    renewed = now
                if now - finalized >= self.poll_s:
                    done = await self._db(functools.partial(_finalize, now=now))
                    for batch_id in done:
                        log.info("batch %s finished", batch_id)
                    finalized = now
            except Exception:  # the database may be down for a while: try again
                log.exception("batch worker: a round failed; trying again")
                claimed = []
            await self._until_room(0.05 if claimed else self.poll_s)

    async def _put_back(self, now: float) -> None:
        """Hand the lines full batch lanes refused back to their jobs' queues (see :meth:`_lane_full`)."""
        if self._lane_returns:
            # Those refused more than half a lease ago (the database was down since) may be this worker's again by
            # a new claim: they are left to their leases.
            recent = time.monotonic() - self.lease_s / 2
            returns = [r for r in self._lane_returns if r[3] >= recent]
            self._lane_returns = []
            try:
                await self._db(lambda s: batch_queue.put_back(s, self.owner, [r[:3] for r in returns], now))
            except BaseException:
                self._lane_returns = returns + self._lane_returns  # the next round tries again (the leases hold)
                raise

    async def _until_room(self, delay_s: float) -> None:
        """Wait ``delay_s`` seconds, or less when a line ends or a batch lane has room again: a full worker claims
        again as soon as one of its lines is done, not at its next poll (a worker of 4 whose lines took 100 ms
        ran 4 a second), and a worker held back by full lanes as soon as one of them has room."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), delay_s)
        self._wake.clear()

    def _running_of(self, tenant: int) -> int:
        return sum(1 for row in self._running if self._tenant_of.get(row) == tenant)

    def _room(self, now: float) -> dict[int, int]:
        """How many more lines each paced tenant may have running now (0 while it waits)."""
        return {tenant: 0 if now < pace.until else max(0, pace.cap - self._running_of(tenant))
                for tenant, pace in self._paced.items()}

    def _served(self, tenant: int) -> None:
        pace = self._paced.get(tenant)
        if pace is not None:
            pace.cap += 1
            if pace.cap >= self.concurrency:
                del self._paced[tenant]

    def _refused(self, tenant: int, until: float) -> None:
        pace = self._paced.setdefault(tenant, _Pace(until, self.concurrency))
        pace.until = max(pace.until, until)
        pace.cap = max(1, min(pace.cap, self._running_of(tenant)) // 2)

    def _done(self, row: int, task: asyncio.Task[None]) -> None:
        self._running.pop(row, None)
        self._tenant_of.pop(row, None)
        self._wake.set()
        if not task.cancelled() and (error := task.exception()) is not None:
            # Its lease runs out and another round tries it again (the database may have been down).
            log.error("batch line %s: %s: %s", row, error.__class__.__name__, error)

    @property
    def running(self) -> int:
        """Lines in flight now."""
        return len(self._running)

    async def aclose(self) -> None:
        """Stop: lines still running are handed back at once (not after their lease)."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        rows = [int(task.get_name().rpartition("-")[2]) for task in tasks]
        with contextlib.suppress(Exception):
            await self._put_back(time.time())
        if rows:
            with contextlib.suppress(Exception):
                await self._db(lambda s: batch_queue.release(s, self.owner, rows))

    async def _identity(self, key_id: int) -> KeyIdentity | None:
        """The identity the job's key has now (None: revoked, or its tenant deleted).

        A cached one is used while no key change was heard since it was looked up (see the module doc);
        a lookup during which one was heard is made again, so its answer cannot predate the change.
        """
        seen = self._changes()
        if seen != self._identities_of:  # a change was heard (or none can be now): forget them all
            self._identities.clear()
            self._identities_of = seen
        started = time.monotonic()
        cached = self._identities.get(key_id)
        if cached is not None and seen is not None and cached[0] == seen and started - cached[1] <= IDENTITY_TTL_S:
            return cached[2]
        for _ in range(_LOOKUP_TRIES):
            identity = await self._db(lambda s: identity_of(s, key_id))
            after = self._changes()
            if after == seen:
                break
            seen = after
            started = time.monotonic()
        if seen is not None and seen == after and seen == self._identities_of:
            self._identities[key_id] = (seen, started, identity)
        return identity

    def _headers(self, line: batch_queue.ClaimedRequest) -> dict[str, str]:
        headers = {"x-request-id": f"batch_req_{line.id}"}
        lane = batch_class(self.policy())
        if lane is not None:
            headers[PRIORITY_HEADER] = lane
        elif not self._warned_no_lane:
            log.warning("the policy has no batch-lane priority class: batch lines run in their tier's class")
            self._warned_no_lane = True
        return headers

    async def _line(self, line: batch_queue.ClaimedRequest) -> None:
        identity = await self._identity(line.key_id)
        if identity is None:
            await self._finish(line, 401, None, {"code": "invalid_api_key",
                                                 "message": "the key that created this batch was revoked"})
            return
        body = dict(line.body)
        body.pop("stream", None)  # a batch line's answer is one JSON object
        body.pop("stream_options", None)
        incoming = Incoming(self._headers(line), msgspec.json.encode(body), never, identity, batch=True)
        try:
            response = await self.serve(incoming, KINDS[line.endpoint])
        except ApiError as error:
            detail = {"code": error.code or error.type, "message": error.message}
            if isinstance(error, RateLimited):
                await self._over_limit(line, error, detail)
            elif error.code == LANE_FULL:
                await self._lane_full(line, error, detail)
            elif error.status_code in TRANSIENT and line.attempts < self.max_attempts:
                delay = backoff_s(line.attempts)
                await self._db(lambda s: batch_queue.retry_later(s, line.id, self.owner, delay, detail, time.time()))
            else:
                await self._finish(line, error.status_code, None, detail)
            return
        if response.background is not None:  # (the request's end: its record and accounting, as after a client's)
            await response.background()
        self._served(line.tenant_id)
        content = response.content if isinstance(response.content, bytes) else msgspec.json.encode(response.content)
        await self._finish(line, response.status_code or 200, msgspec.json.decode(content),
                           None, response.headers.get("x-request-id"))

    async def _over_limit(self, line: batch_queue.ClaimedRequest, error: RateLimited, detail: dict[str, Any]) -> None:
        """A line its tenant's (or key's) limit had no room for: it waits for the budget, without spending a try,
        and the tenant's other lines wait with it (paced to the limit, not retried blindly). It fails only when
        it can never fit: it alone is larger than the limit, or the limit has room only after the job's
        completion window ends."""
        if error.code == "request_too_large":  # larger than the limit itself: no wait makes it fit
            await self._finish(line, error.status_code, None, detail)
            return
        now = time.time()
        wait = _retry_after_s(error.headers)
        if line.expires_at is not None and now + wait >= line.expires_at.timestamp():
            detail = {**detail, "message": f"{error.message} The batch's completion window ends before the limit "
                                           "has room again."}
            await self._finish(line, error.status_code, None, detail)
            return
        self._refused(line.tenant_id, now + wait)
        await self._db(lambda s: batch_queue.retry_later(s, line.id, self.owner, wait, detail, now,
                                                         count_attempt=False))

    async def _lane_full(self, line: batch_queue.ClaimedRequest, error: ApiError, detail: dict[str, Any]) -> None:
        """A line its model's batch lane had no waiting room for (another model's lane had room when it was
        claimed, or a lane filled meanwhile): it goes back to the job's queue without spending a try, due when
        the lane is likely to have room (the refusal's ``Retry-After``), and its place goes to the next lines
        claimed. The lines refused meanwhile go back together at the loop's next round (one write a round
        instead of one a refusal: each write waits for SQLite's one writer)."""
        self._lane_returns.append((line.id, _retry_after_s(error.headers), detail, time.monotonic()))

    async def _finish(self, line: batch_queue.ClaimedRequest, status: int, body: dict[str, Any] | None,
                      error: dict[str, Any] | None, request_id: str | None = None) -> None:
        kept = await self._db(lambda s: batch_queue.record_result(s, line.id, self.owner, status, body, error,
                                                                  time.time(), request_id=request_id))
        if not kept:
            log.warning("batch line %s: lease lost before its result was recorded; dropped", line.id)


def worker_lifespan(runtime: GatewayRuntime, serve: Serve) -> Callable[[Any], AbstractAsyncContextManager[None]]:
    """A lifespan hook (after the runtime's) that runs this process's batch worker when enabled."""

    @asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        settings = runtime.settings
        if not settings.batch_worker:
            yield
            return
        worker = BatchWorker(runtime.engine, serve, lambda: runtime.policy.snapshot,
                             concurrency=settings.batch_concurrency, lease_s=settings.batch_lease_s,
                             max_attempts=settings.batch_max_attempts, key_changes=runtime.auth.changes,
                             lanes=runtime.flow)
        task = asyncio.create_task(worker.run(), name="switchyard-batch")
        log.info("batch worker %s running (%d lines at a time%s)", worker.owner, worker.concurrency,
                 "" if settings.batch_concurrency else ", from the policy's pools")
        try:
            yield
        finally:
            with ShutdownSteps("shutdown") as steps:
                steps.at("stopping the batch worker")
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                steps.at(f"handing {worker.running} batch lines back")
                await worker.aclose()

    return lifespan
