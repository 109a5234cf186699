"""The open-loop load generator: every request leaves at its scheduled time, answered or not.

A closed loop (N clients, each waiting for its answer) slows down exactly when the system under
test does, so queueing hides from its measurements (coordinated omission). Here a dispatcher
walks the schedule on the event loop's monotonic clock and starts each request as its own task
when it is due, whatever earlier requests are doing. Each :class:`~switchyard.bench.results.Result`
keeps the scheduled and the actual send time, so a generator that cannot keep up shows as
lateness instead of as a lower offered load.

Low overhead, since the generator shares the machine with what it measures: one
``aiohttp.ClientSession`` with keep-alive, each body encoded once and ahead of its time (while
the dispatcher would wait anyway), headers built once per tenant, each answer read by
:func:`~switchyard.bench.sender.send_one` (SSE parsed on bytes, chunks decoded by ``msgspec`` into
small typed structs).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import deque
from collections.abc import Callable, Sequence

import aiohttp
from tqdm import tqdm  # type: ignore[import-untyped]

from switchyard.bench.results import Result
from switchyard.bench.sender import PATHS, Target, send_one
from switchyard.bench.spec import RequestSpec, Workload

log = logging.getLogger("switchyard.bench")


class _Bodies:
    """Request bodies encoded ahead of their time, while the dispatcher would otherwise wait.

    Requests due at the same instant (traces have many) then leave one after another without
    an encoding between them. Encoding yields to the event loop after each body, so streams
    being read are never held up by more than one encoding; the lookahead is bounded in count
    and bytes, and stops when the next body would not be ready before the next request is due.
    """

    LOOKAHEAD = 256
    LOOKAHEAD_BYTES = 64 << 20
    MARGIN_S = 0.001

    def __init__(self, specs: Sequence[RequestSpec], now: Callable[[], float]) -> None:
        self._specs = specs
        self._now = now
        self._ready: deque[bytes] = deque()
        self._bytes = 0
        self._next = 0  # the first spec not yet encoded
        self._s_per_token = 0.0  # running estimate of the encoding cost

    def _encode_next(self) -> None:
        spec = self._specs[self._next]
        began = self._now()
        body = spec.encode()
        cost = (self._now() - began) / max(spec.prompt_tokens, 1)
        self._s_per_token = cost if not self._s_per_token else 0.8 * self._s_per_token + 0.2 * cost
        self._ready.append(body)
        self._bytes += len(body)
        self._next += 1

    def _room(self) -> bool:
        return (self._next < len(self._specs) and len(self._ready) < self.LOOKAHEAD
                and self._bytes < self.LOOKAHEAD_BYTES)

    def prepare(self, count: int) -> None:
        """Encode up to ``count`` more bodies now."""
        for _ in range(count):
            if not self._room():
                return
            self._encode_next()

    async def prepare_until(self, due: float) -> None:
        """Encode ahead while the next body would be ready before ``due``."""
        while self._room():
            expected = self._s_per_token * self._specs[self._next].prompt_tokens
            if self._now() + expected > due - self.MARGIN_S:
                return
            self._encode_next()
            await asyncio.sleep(0)

    def take(self) -> bytes:
        """The next request's body (encoded now if it was not ready)."""
        if not self._ready:
            self._encode_next()
        body = self._ready.popleft()
        self._bytes -= len(body)
        return body


def connection_limit(specs: Sequence[RequestSpec], timeout_s: float) -> int:
    """A pool size that never throttles the schedule: the most arrivals in any ``timeout_s``
    window (no more requests than that can be in flight at once), capped by the process's
    file-descriptor limit (less a reserve) and at least 16."""
    most, left = 0, 0
    for right, spec in enumerate(specs):
        while spec.arrival_s - specs[left].arrival_s >= timeout_s:
            left += 1
        most = max(most, right - left + 1)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = soft - 128 if soft != resource.RLIM_INFINITY else 1 << 16
    if most > cap:
        log.warning("open loop: %d requests may be in flight but only %d connections fit the file-descriptor "
                    "limit; raise `ulimit -n`, or later requests wait for a connection (visible as latency)",
                    most, cap)
    return max(16, min(most, cap))



class LoadStarts:
    """When each of several open-loop runs began, as ``time.time()``, and an event set when the first did (made on
    the loop the runs run on)."""

    def __init__(self, at: dict[str, float] | None = None) -> None:
        self.at = at if at is not None else {}
        self.began = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def recorder(self, name: str) -> Callable[[float], None]:
        """The ``on_start`` of run ``name``."""
        def started(at: float) -> None:
            self.at[name] = time.time() - (self._loop.time() - at)
            self.began.set()
        return started

async def run_open_loop(workload: Workload | Sequence[RequestSpec], target: Target, *, progress: bool = True,
                        timeout_s: float = 300.0, connect_timeout_s: float = 10.0,
                        max_connections: int | None = None, request_id_prefix: str | None = "bench",
                        on_result: Callable[[Result], None] | None = None,
                        on_start: Callable[[float], None] | None = None) -> list[Result]:
    """Send every request of ``workload`` to ``target`` at its scheduled time (open loop).

    Args:
        workload: The requests, in arrival order (``arrival_s`` relative to the run's start).
        target: Where to send them and with which keys.
        progress: Show a tqdm bar (only on a terminal; never when False).
        timeout_s: A request still unanswered after this long is given up (``timed_out``).
        connect_timeout_s: Limit for opening a connection (a failure, not a timeout).
        max_connections: Connection pool size; default: :func:`connection_limit`.
        request_id_prefix: Send ``x-request-id: <prefix>-<arm>-<index>`` (None: send none).
        on_result: Called with each result as it completes (on the event loop: keep it short).
        on_start: Called once with the run's start on the event loop's clock (``loop.time()``),
            so that other tasks (fault injection, samplers) can act on the results' time base.

    Returns:
        One result per request, in the workload's order.

    Raises:
        ValueError: ``target.api_keys`` is given but lacks a tenant of the workload (and there
            is no default key).
    """
    specs = workload.specs if isinstance(workload, Workload) else tuple(workload)
    tenants = {s.tenant for s in specs}
    if target.api_keys and target.default_api_key is None and (missing := tenants - set(target.api_keys)):
        raise ValueError(f"target {target.name}: no API key for tenant(s) {', '.join(sorted(missing))}")
    tenant_headers = {t: target.headers_for(t) for t in tenants}
    urls = {kind: target.url(kind) for kind in PATHS}
    limit = max_connections or connection_limit(specs, timeout_s)
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
    loop = asyncio.get_running_loop()
    now = loop.time
    results: list[Result] = []
    tasks: set[asyncio.Task[Result]] = set()
    bar = tqdm(total=len(specs), unit="req", desc=target.name, disable=None if progress else True,
               mininterval=0.5, dynamic_ncols=True)
    counts = {"in_flight": 0, "failed": 0}

    def finished(task: asyncio.Task[Result]) -> None:
        tasks.discard(task)
        counts["in_flight"] -= 1
        if task.cancelled() or task.exception() is not None:
            return
        result = task.result()
        counts["failed"] += not result.ok
        bar.update(1)
        bar.set_postfix_str(f"in flight {counts['in_flight']}, failed {counts['failed']}", refresh=False)
        if on_result is not None:
            on_result(result)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        bodies = _Bodies(specs, now)
        bodies.prepare(1)  # the first body before the clock starts
        start = now()
        if on_start is not None:
            on_start(start)
        try:
            for spec in specs:
                due = start + spec.arrival_s
                await bodies.prepare_until(due)
                body = bodies.take()
                headers = tenant_headers[spec.tenant]
                if spec.labels.headers:
                    headers = {**headers, **spec.labels.headers}
                if request_id_prefix is not None:
                    headers = {**headers, "x-request-id": f"{request_id_prefix}-{target.name}-{spec.index}"}
                result = Result(spec.index, target.name, spec.tenant, spec.request_class, spec.model, spec.kind,
                                spec.stream, spec.prompt_tokens, spec.max_tokens, spec.prefix_group, spec.arrival_s)
                results.append(result)
                delay = due - now()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = loop.create_task(send_one(session, body, urls[spec.kind], headers, result, now, start))
                tasks.add(task)
                counts["in_flight"] += 1
                task.add_done_callback(finished)
                await asyncio.sleep(0)  # let it start sending before the next body is encoded
            while tasks:
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            bar.close()
    return results
