"""One try of a request at one endpoint: send it, pass the answer on, or say why to move on.

The decision procedure chose the endpoint (:class:`~switchyard.decide.decision.Attempt`); a
:class:`Try` carries it out and answers with :class:`~switchyard.decide.decision.Tried`. Whatever
happens, the try is counted once and given back once: at the endpoint (this process's in-flight
accounting), in flow control (a yielder, an interactive prefill, the pool's service time), in the
breakers (one trial outcome) and in the metrics. A streamed answer is passed on only once its first
chunk has come (within the model's first-token timeout): until then a failure can still move on to
another endpoint.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from litestar import Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from switchyard.api.errors import ApiError, GatewayTimeout
from switchyard.decide.decision import Tried
from switchyard.decide.pick import EndpointChoice, Stage
from switchyard.engines.breakers import Trial
from switchyard.engines.streams import StreamRelay, first_chunk
from switchyard.engines.upstream import UpstreamFailure, post, read_answer, read_engine_error
from switchyard.gateway.accounting import account
from switchyard.gateway.activity import RequestRecord
from switchyard.gateway.attempts import BUSY_STATUS, RETRYABLE_STATUS, engine_error, failure_error, record_tries
from switchyard.gateway.flow import Yielder
from switchyard.gateway.request import PendingRequest, RequestIds
from switchyard.gateway.tracing import end

if TYPE_CHECKING:
    from switchyard.gateway.runtime import GatewayRuntime

_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


class Try:
    """One try of ``req`` at ``choice`` (of ``stage`` of its plan); :meth:`send` runs it once."""

    def __init__(self, runtime: GatewayRuntime, ids: RequestIds, req: PendingRequest, stage: Stage,
                 choice: EndpointChoice, headers: dict[str, str], record: RequestRecord) -> None:
        self.runtime = runtime
        self.ids = ids
        self.req = req
        self.stage = stage
        self.choice = choice
        self.headers = headers
        self.record = record
        self.url = choice.url
        self.pool = choice.pool.name
        self.model = stage.model.name
        #: What became of it, for its span: ok, a status, a failure's kind, cancelled or preempted.
        self.outcome = "ok"
        self.released = False
        self.prefilling = False
        self.yielder: Yielder | None = None
        self.trial: Trial | None = None
        self.span: Any = None
        self.sent_at = 0.0

    async def send(self) -> Tried:
        """Send the request and wait for its answer's start (see the module doc)."""
        runtime, req, url = self.runtime, self.req, self.url
        decision = req.decision
        assert decision.cls is not None
        assert decision.attempts is not None
        klass = decision.cls.cls
        endpoints, flow = runtime.endpoints, runtime.flow
        if klass.lane == "interactive":
            flow.make_room(self.choice.pool, url, klass.dispatch_ceiling, time.monotonic())
        self.yielder = flow.yielding(url, req.cost, self.release) if decision.gives_way else None
        self.span = req.trace.child("upstream", {"switchyard.endpoint": url, "switchyard.pool": self.pool,
                                                 "switchyard.model": self.model,
                                                 "switchyard.attempt": decision.attempts.count})
        endpoints.acquire(url, req.cost, self.yielder is not None)
        if self.yielder is not None:
            flow.batch_sent(self.pool, url)
        # An interactive stream's prefill: batch work is not sent here until its first byte (decide.flow.batch_view).
        self.prefilling = req.stream and klass.lane == "interactive"
        if self.prefilling:
            endpoints.prefill_started(url)
        self.sent_at = time.perf_counter()
        self.trial = Trial.start(endpoints.state(url).breaker, endpoints.pool_breaker(self.pool), time.monotonic())
        if req.ticket is not None:  # it counts itself at its endpoint now: the pool that granted it may grant again
            runtime.flow.dispatched(req.ticket)
            req.ticket = None
        runtime.metrics.in_flight.labels(self.pool).inc()
        record = self.record
        record.served_model, record.pool, record.region, record.endpoint = (self.model, self.pool,
                                                                             self.choice.pool.region, url)
        try:
            return await self._exchange()
        except BaseException:  # the client left (cancelled), or flow control preempted it: nothing leaks
            preempted = self._preempted()
            self.outcome = "cancelled"  # (release() says "preempted" itself when it was)
            self.release()
            self.trial.neutral()
            if preempted:
                return Tried("preempted")
            raise

    async def _exchange(self) -> Tried:
        runtime, req, url = self.runtime, self.req, self.url
        resilience = runtime.endpoints.resilience
        trial = self.trial
        assert trial is not None
        # The engine gets an id of our own: clients may reuse theirs, and two in-flight requests with one id
        # would collide inside the engine.
        upstream_headers = {"Content-Type": "application/json", "X-Request-Id": self.ids.new()}
        req.trace.inject(self.span, upstream_headers)
        payload = req.payload_for(self.choice.pool)
        first_token_s = self.stage.model.first_token_timeout or resilience.first_token_timeout
        try:
            sending = post(runtime.http, url + _PATHS[req.kind], payload, upstream_headers, runtime.http_fresh)
            # (post() turns its own timeouts into UpstreamFailure: a TimeoutError here is the first-token wait's.)
            response = await (asyncio.wait_for(sending, first_token_s) if req.stream else sending)
            if response.status >= 300:
                err = await read_engine_error(response)
                error = engine_error(err, self.choice, dict(self.headers))
                if err.status in RETRYABLE_STATUS:
                    return self.failed(str(err.status), f"{err.status} {err.message[:200]}", error,
                                       engine_fault=err.status not in BUSY_STATUS)
                trial.neutral()
                runtime.metrics.attempts.labels(self.pool, str(err.status)).inc()
                self.done(error.status_code)
                return Tried("refused", str(err.status), err.message, error)
            if req.stream:
                left = first_token_s - (time.perf_counter() - self.sent_at)
                try:
                    first = await asyncio.wait_for(first_chunk(response), max(left, 0.001))
                except BaseException:
                    response.close()
                    raise
        except TimeoutError:
            return self.failed("first_token_timeout", f"no first token within {first_token_s:g} s",
                               GatewayTimeout(f"Upstream failure in pool {self.pool}: no first token within "
                                              f"{first_token_s:g} s", headers=dict(self.headers)))
        except UpstreamFailure as failure:
            if failure.refused:
                runtime.mark_down(url, str(failure))
            return self.failed(failure.kind, str(failure), failure_error(failure, self.pool, dict(self.headers)))
        runtime.metrics.attempts.labels(self.pool, "ok").inc()
        if req.stream:
            return Tried("ok", answer=self._stream(response, first))
        return await self._whole(response)

    def _stream(self, response: Any, first: bytes) -> Stream:
        """Pass a stream on from its first chunk (its end settles it: :meth:`_stream_ended`)."""
        runtime, req, record = self.runtime, self.req, self.record
        ttfb = time.perf_counter() - self.sent_at
        self.prefilled(ttfb)
        record.ttft_s = time.perf_counter() - req.started
        runtime.metrics.first_byte.labels(self.model, self.pool).observe(record.ttft_s)
        max_ttfb = runtime.endpoints.resilience.health.max_ttfb
        assert self.trial is not None
        if max_ttfb is not None and ttfb > max_ttfb:
            self.trial.failed(time.monotonic(), f"first byte after {ttfb:.2f} s (max_ttfb {max_ttfb:g} s)")
        else:
            self.trial.succeeded(time.monotonic())
        storing = runtime.cache.wants(req.cache, self.model) and req.cache is not None
        capture = 8 * req.cache.plan.rule.max_entry_bytes if storing and req.cache is not None else 0
        relay = StreamRelay(response, first, lambda completed: self._stream_ended(relay, completed),
                            strip_usage=req.force_usage, capture_limit=capture,
                            max_event_bytes=runtime.settings.upstream_max_event_bytes)
        return Stream(relay.chunks(), media_type="text/event-stream",
                      headers={**self.headers, "Cache-Control": "no-cache"}, background=BackgroundTask(relay.afinish))

    def _stream_ended(self, relay: StreamRelay, completed: bool) -> None:
        """A passed-on stream ended: store it, count a break against the engine, settle its usage."""
        runtime, req, record = self.runtime, self.req, self.record
        if completed and req.cache is not None and runtime.cache.wants(req.cache, self.model):
            captured = relay.captured
            runtime.cache.store_stream(req.cache, req.kind, str(req.identity.tenant_id),
                                       bytes(captured) if captured is not None else None)
        if relay.broken:
            # Counted against the engine even though its first byte was fine: it broke off.
            now = time.monotonic()
            runtime.endpoints.state(self.url).breaker.failure(now, "broke off mid-stream")
            runtime.endpoints.pool_breaker(self.pool).failure(now, "broke off mid-stream")
            runtime.metrics.streams_broken.labels(self.pool).inc()
            record.broken = True
            record.trace.append("stream: the engine broke off mid-stream")
        elif not completed:
            record.trace.append("stream: the client left before its end")
        self.done(200)
        runtime.spawn(account(runtime, req, self.stage.model, relay.usage.usage(), relay.usage.text_events, record))

    async def _whole(self, response: Any) -> Tried:
        """Read a whole answer and pass it on."""
        runtime, req, record = self.runtime, self.req, self.record
        assert self.trial is not None
        try:
            data, usage = await read_answer(response, runtime.settings.upstream_max_response_bytes)
        except UpstreamFailure as failure:
            failed = "body_timeout" if failure.timeout else failure.kind if failure.invalid else "body_error"
            return self.failed(failed, str(failure), failure_error(failure, self.pool, dict(self.headers)))
        except BaseException:
            if self._preempted():
                response.close()  # the engine aborts a request whose connection closes
                self.outcome = "cancelled"
                self.release()
                self.trial.neutral()
                return Tried("preempted")
            raise
        self.trial.succeeded(time.monotonic())
        record.ttft_s = time.perf_counter() - req.started
        runtime.metrics.first_byte.labels(self.model, self.pool).observe(record.ttft_s)
        self.done(200)
        if req.cache is not None and runtime.cache.wants(req.cache, self.model):
            runtime.cache.store_answer(req.cache, str(req.identity.tenant_id), data)
        await account(runtime, req, self.stage.model, usage, 0, record)
        return Tried("ok", answer=Response(content=data, status_code=200, media_type="application/json",
                                           headers=dict(self.headers)))

    # --- giving it back -------------------------------------------------------------------------------

    def prefilled(self, ttfb_s: float | None) -> None:
        """Its first byte came after ``ttfb_s`` (None: it ended without one): batch work may go there again."""
        if self.prefilling:
            self.prefilling = False
            self.runtime.endpoints.prefill_ended(self.url, ttfb_s)
            self.runtime.flow.prefill_ended(self.pool)

    def release(self) -> None:
        """Give its place at the endpoint back (once; flow control may call this first, to preempt it)."""
        self.prefilled(None)
        if self.released:
            return
        self.released = True
        runtime = self.runtime
        preempted = self.yielder is not None and self.yielder.preempted
        ended = "preempted" if preempted else self.outcome
        end(self.span, {"switchyard.outcome": ended}, None if ended == "ok" else ended)
        runtime.endpoints.release(self.url, self.req.cost, self.yielder is not None)
        runtime.flow.finished_yielding(self.yielder)
        runtime.flow.released(self.pool, None if preempted else time.perf_counter() - self.sent_at)
        runtime.metrics.in_flight.labels(self.pool).dec()

    def done(self, status: int) -> None:
        """The engine's answer ended with ``status``: the request is finished."""
        if status >= 400:
            self.outcome = str(status)
        self.release()
        runtime, req, record = self.runtime, self.req, self.record
        runtime.metrics.duration.labels(self.model, self.pool).observe(time.perf_counter() - req.started)
        attempts = req.decision.attempts
        assert attempts is not None
        record_tries(record, attempts, self.headers)
        runtime.finished(record, self.model, self.pool, status)

    def failed(self, kind: str, reason: str, error: ApiError, engine_fault: bool = True) -> Tried:
        """The try failed in a way worth trying elsewhere (``engine_fault``: counted against its breakers)."""
        self.outcome = kind
        self.release()
        assert self.trial is not None
        if engine_fault:
            self.trial.failed(time.monotonic(), reason)
        else:
            self.trial.neutral()
        self.runtime.metrics.attempts.labels(self.pool, kind).inc()
        return Tried("failed", kind, reason, error)

    def _preempted(self) -> bool:
        """Whether the cancellation being handled is flow control's preemption of this try and nothing else's
        (then it is taken back: the request goes on, to queue again)."""
        if self.yielder is None or not self.yielder.preempted:
            return False
        task = asyncio.current_task()
        return task is not None and task.uncancel() == 0
