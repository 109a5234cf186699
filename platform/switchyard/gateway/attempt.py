"""One try of a request at one endpoint: send it, pass the answer on, or say why to move on.

The decision procedure chose the endpoint (:class:`~switchyard.decide.decision.Attempt`); a
:class:`Try` carries it out and answers with :class:`~switchyard.decide.decision.Tried`. Whatever
happens, the try is counted once and given back once: at the endpoint (this process's in-flight
accounting), in flow control (a yielder, an interactive prefill, the pool's service time), in the
breakers (one trial outcome), in the watchdog (:mod:`switchyard.gateway.watchdog`) and in the metrics.

A try waits for its first byte (a stream's first chunk, a complete answer) under an ``asyncio.timeout``:
a stream's is its class's first-token deadline; a complete answer's is moved to now by the watchdog when
its engine shows no progress by then, or is found hung. Until a first byte has reached the client a
failure can still move on to another endpoint; a stream that breaks after that is resumed by the request's
:class:`~switchyard.gateway.resume.Resumer` where the policy allows. A hedged try waits for its first byte
in a task of its own (:mod:`switchyard.gateway.hedge`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from litestar import Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from switchyard.api.errors import ApiError, BadGateway, GatewayTimeout
from switchyard.decide.cache import TOKENIZER_KINDS
from switchyard.decide.decision import Attempt, Tried
from switchyard.engines.breakers import Trial
from switchyard.engines.splice import Transcript, stream_kind
from switchyard.engines.streams import Leg, LegEnd, ResponsesUsage, StreamRelay, StreamUsage, first_chunk
from switchyard.engines.upstream import (
    UpstreamFailure,
    engine_url,
    post,
    read_answer,
    read_engine_error,
    usage_counts,
)
from switchyard.gateway.accounting import account
from switchyard.gateway.activity import RequestRecord
from switchyard.gateway.adapters import AdapterLoadFailed
from switchyard.gateway.attempts import (
    BUSY_STATUS,
    RETRYABLE_STATUS,
    engine_error,
    failure_error,
    record_tries,
    stored_response_missing,
)
from switchyard.gateway.flow import Yielder
from switchyard.gateway.request import LegUsage, PendingRequest, RequestIds
from switchyard.gateway.tracing import end
from switchyard.gateway.watchdog import Watched

if TYPE_CHECKING:
    from switchyard.gateway.runtime import GatewayRuntime

log = logging.getLogger("switchyard.gateway")


class _AfterAnswer(BackgroundTask):
    """An answer's background (a whole answer's :meth:`Try._after_whole`, a stream's relay's end): Litestar's
    task, without its check, on every request, of whether the function given is a coroutine function (these are)."""

    __slots__ = ()

    def __init__(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        self.fn = fn
        self.args = args  # type: ignore[assignment]  # (Litestar types them by the function's parameters)
        self.kwargs = {}  # type: ignore[assignment]

_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "embedding": "/v1/embeddings",
          "responses": "/v1/responses", "tokenize": "/tokenize", "detokenize": "/detokenize"}


class Try:
    """One try of ``req`` at the endpoint ``attempt`` names; :meth:`send` (or :meth:`start`, for a hedge) runs
    it once."""

    def __init__(self, runtime: GatewayRuntime, ids: RequestIds, req: PendingRequest, attempt: Attempt,
                 headers: dict[str, str], record: RequestRecord) -> None:
        self.runtime = runtime
        self.ids = ids
        self.req = req
        self.stage = attempt.stage
        self.choice = attempt.choice
        self.deadline_s = attempt.deadline_s
        self.resuming = attempt.resuming
        self.headers = headers
        self.record = record
        self.url = attempt.choice.url
        self.pool = attempt.choice.pool.name
        self.model = attempt.stage.model.name
        #: The LoRA adapter it sends to (the model's served adapter name; None: a base model).
        self.adapter = attempt.stage.model.served_name
        #: What became of it, for its span: ok, a status, a failure's kind, cancelled or preempted.
        self.outcome = "ok"
        self.released = False
        self.prefilling = False
        self.yielder: Yielder | None = None
        self.trial: Trial | None = None
        self.span: Any = None
        self.sent_at = 0.0
        self.watched: Watched | None = None
        #: A hedged try's wait for its first byte (None: it waits in the request's own task).
        self.task: asyncio.Task[Tried] | None = None
        #: A streamed answer whose first chunk came, not passed on yet: (response, first chunk).
        self.ready: tuple[Any, bytes] | None = None
        #: The prompt this try's engine computes, as estimated (a continuation's includes the text so far).
        self.prompt_estimate = req.decision.prompt_tokens + (req.continued_tokens if attempt.resuming else 0)

    async def send(self, hedge_after: float | None = None) -> Tried:
        """Send the request and wait for its answer's start (see the module doc). With ``hedge_after``: answer
        ``slow`` if no first byte has come by then (the try goes on in its :attr:`task`)."""
        self._begin()
        if hedge_after is None:
            return self._delivered(await self._guarded())
        task = self.task = asyncio.ensure_future(self._guarded())
        try:
            done, _ = await asyncio.wait({task}, timeout=hedge_after)
        except BaseException:  # the client left while we waited: the try goes with it
            task.cancel()
            raise
        if task in done:
            return self._delivered(task.result())
        return Tried("slow", answer=self)

    def start(self) -> asyncio.Task[Tried]:
        """Send the request, waiting for its first byte in a task of its own (a hedge)."""
        self._begin()
        task = self.task = asyncio.ensure_future(self._guarded())
        return task

    def deliver(self, tried: Tried) -> Tried:
        """The try that won a hedge's race: its answer, passed on (the request's record names where it went)."""
        record = self.record
        record.served_model, record.pool, record.region, record.endpoint = (self.model, self.pool,
                                                                             self.choice.pool.region, self.url)
        return self._delivered(tried)

    def abandon(self) -> None:
        """A try that lost a hedge's race, or whose waiting was given up: abort it (the engine sees the
        connection close and aborts the request), saying nothing of the engine's health."""
        task = self.task
        if task is not None and not task.done():
            task.cancel()
            # Once it is done, let go of it: the cancelled task keeps its CancelledError, whose traceback holds this
            # try's frame, and so this try (a reference cycle, with the request it refers to, until the collector).
            task.add_done_callback(self._let_go)
            return  # its own handler gives it back
        if self.ready is not None:
            response, _ = self.ready
            self.ready = None
            response.close()
        if not self.released:
            self.outcome = "cancelled"
            self.release()
            if self.trial is not None:
                self.trial.neutral()

    def _let_go(self, task: asyncio.Task[Tried]) -> None:
        if self.task is task:
            self.task = None

    # --- sending ------------------------------------------------------------------------------------

    def _begin(self) -> None:
        """Count the try at its endpoint, in flow control, in its breakers and in the record."""
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
        runtime.metrics.in_flight_by(self.pool).inc()
        if self.adapter is not None:
            endpoints.state(url).adapter_sent(self.adapter, time.monotonic())
        self.watched = Watched(url, req.stream, time.monotonic(), self.deadline_s)
        runtime.watchdog.add(self.watched)
        record = self.record
        record.served_model, record.pool, record.region, record.endpoint = (self.model, self.pool,
                                                                             self.choice.pool.region, url)

    async def _guarded(self) -> Tried:
        try:
            return await self._exchange()
        except BaseException:  # the client left (cancelled), or flow control preempted it: nothing leaks
            preempted = self._preempted()
            self.outcome = "cancelled"  # (release() says "preempted" itself when it was)
            self.release()
            assert self.trial is not None
            self.trial.neutral()
            if preempted:
                return Tried("preempted")
            raise

    async def _exchange(self) -> Tried:
        runtime, req, url, watched = self.runtime, self.req, self.url, self.watched
        assert watched is not None
        trial = self.trial
        assert trial is not None
        # The engine gets an id of our own: clients may reuse theirs, and two in-flight requests with one id
        # would collide inside the engine.
        upstream_headers = {"Content-Type": "application/json", "X-Request-Id": self.ids.new()}
        req.trace.inject(self.span, upstream_headers)
        payload = req.payload_for(self.choice.pool, self.stage.model)
        deadline = self.deadline_s
        data: bytes = b""
        usage: dict[str, Any] | None = None
        try:
            try:
                # A stream's wait for its first chunk runs under its deadline; a complete answer's under none of its
                # own: the watchdog ends it when its engine shows no progress by the deadline, or is hung.
                async with asyncio.timeout(deadline if req.stream else None) as watched.timer:
                    model, pool = self.stage.model, self.choice.pool
                    if runtime.adapters.needed(pool, model) and not runtime.adapters.loaded(url, model):
                        refused = await self._load_adapter()
                        if refused is not None:
                            return refused
                    response = await post(runtime.engines, engine_url(url, _PATHS[req.kind]), payload,
                                          upstream_headers)
                    if response.status >= 300:
                        watched.timer = None  # (its error is read with no watchdog to end the wait)
                        return self._engine_refused(await read_engine_error(response))
                    if req.stream:
                        try:
                            first = await first_chunk(response)
                        except BaseException:
                            response.close()
                            raise
                    else:
                        try:
                            data, usage = await read_answer(response, runtime.settings.upstream_max_response_bytes)
                        except UpstreamFailure as failure:
                            failed = ("body_timeout" if failure.timeout else failure.kind if failure.invalid
                                      else "body_error")
                            return self.failed(failed, str(failure), failure_error(failure, self.pool,
                                                                                   dict(self.headers)))
            finally:
                # However the wait ends, its timeout goes with it: the watchdog has nothing left to end, and a
                # cancelled try (the client left, or a hedge's loser), whose task keeps the CancelledError with its
                # traceback and so this frame, is no reference cycle through the timeout, which holds the task.
                watched.timer = None
        except TimeoutError:
            kind = watched.abort_kind or "first_token_timeout"
            reason = watched.abort_reason or f"no first token within {deadline:g} s"
            if watched.abort_kind is None:
                runtime.watchdog.expired(watched, time.monotonic())
            return self.failed(kind, reason, GatewayTimeout(f"Upstream failure in pool {self.pool}: {reason}",
                                                            headers=dict(self.headers)))
        except UpstreamFailure as failure:
            if failure.refused:
                runtime.mark_down(url, str(failure))
            return self.failed(failure.kind, str(failure), failure_error(failure, self.pool, dict(self.headers)))
        runtime.endpoints.state(url).heard(time.monotonic())
        runtime.metrics.attempts_by(self.pool, "ok").inc()
        if req.stream:
            self.ready = (response, first)
            return Tried("ok")
        return await self._whole(data, usage)

    async def _load_adapter(self) -> Tried | None:
        """Load the model's adapter at the endpoint first (runtime loading); a failed try when it would not."""
        runtime, model, req = self.runtime, self.stage.model, self.req
        try:
            loaded = await runtime.adapters.ensure(runtime.engines, self.url, self.choice.pool, model)
        except AdapterLoadFailed as failed:
            return self.failed("adapter_load", str(failed), BadGateway(
                f"Upstream failure in pool {self.pool}: {failed}", headers=dict(self.headers)))
        if loaded.outcome == "already":
            req.decision.trace.append(f"adapter: {self.adapter} was loaded at {self.url} already")
        else:
            waited = " (another request's load)" if loaded.outcome == "shared" else ""
            req.decision.trace.append(f"adapter: loaded {self.adapter} at {self.url} in "
                                      f"{loaded.seconds * 1000:.0f} ms{waited}")
        return None

    def _engine_refused(self, err: Any) -> Tried:
        """The engine answered non-2xx: worth trying elsewhere, or the client's own error (final)."""
        missing = stored_response_missing(err)
        if err.status == 404 and self.adapter is not None and not missing:  # no adapter (restarted?): load again
            self.runtime.adapters.forget(self.url, self.stage.model)
        error = engine_error(err, self.choice, dict(self.headers))
        if err.status in RETRYABLE_STATUS:
            return self.failed(str(err.status), f"{err.status} {err.message[:200]}", error,
                               engine_fault=err.status not in BUSY_STATUS and not missing)
        assert self.trial is not None
        self.trial.neutral()
        self.runtime.metrics.attempts_by(self.pool, str(err.status)).inc()
        if self.resuming:  # the continuation was refused: the stream it was for ends, and the request with it
            self.outcome = str(err.status)
            self.release()
        else:
            self.done(error.status_code)
        return Tried("refused", str(err.status), err.message, error)

    def _delivered(self, tried: Tried) -> Tried:
        """A streamed try's first chunk came: pass the stream on (or hand the continuation to the resume)."""
        if tried.outcome != "ok" or self.ready is None:
            return tried
        response, first = self.ready
        self.ready = None
        self._first_byte()
        if self.resuming:
            return Tried("ok", answer=(Leg(response, first, self._leg_ended), self))
        return Tried("ok", answer=self._stream(response, first))

    def _first_byte(self) -> None:
        runtime, req, record = self.runtime, self.req, self.record
        ttfb = time.perf_counter() - self.sent_at
        self.prefilled(ttfb)
        runtime.latencies.window(self.pool).add(ttfb)
        max_ttfb = runtime.endpoints.resilience.health.max_ttfb
        assert self.trial is not None
        if max_ttfb is not None and ttfb > max_ttfb:
            self.trial.failed(time.monotonic(), f"first byte after {ttfb:.2f} s (max_ttfb {max_ttfb:g} s)")
        else:
            self.trial.succeeded(time.monotonic())
        if self.resuming:
            return
        record.ttft_s = time.perf_counter() - req.started
        runtime.metrics.first_byte_by(self.model, self.pool).observe(record.ttft_s)

    def _stream(self, response: Any, first: bytes) -> Stream:
        """Pass a stream on from its first chunk (its end settles it: :meth:`_stream_ended`)."""
        runtime, req = self.runtime, self.req
        storing = runtime.cache.wants(req.cache, self.model) and req.cache is not None
        capture = 8 * req.cache.plan.rule.max_entry_bytes if storing and req.cache is not None else 0
        usage = ResponsesUsage() if req.kind == "responses" else StreamUsage()
        leg = Leg(response, first, self._leg_ended, usage=usage)
        # What the client receives is kept (to continue from, should the engine break off) only where the model
        # resumes its streams; the others' breaks are still handed to the resume, which says why not.
        model = self.stage.model
        keep = (req.resume is not None and model.resume_streams and model.max_resumes > 0
                and req.kind in ("chat", "completion"))
        relay = StreamRelay(leg, lambda completed: self._stream_ended(relay, completed),
                            strip_usage=req.force_usage, capture_limit=capture,
                            max_event_bytes=runtime.settings.upstream_max_event_bytes, resume=req.resume,
                            transcript=Transcript(stream_kind(req.kind)) if keep else None)
        self.watch(relay, leg)
        return Stream(relay.chunks(), media_type="text/event-stream",
                      headers={**self.headers, "Cache-Control": "no-cache"}, background=_AfterAnswer(relay.afinish))

    def watch(self, relay: StreamRelay, leg: Leg) -> None:
        """Its stream is being passed on (as ``leg`` of ``relay``): the watchdog cuts it when it stalls."""
        if self.watched is not None:
            self.watched.relay, self.watched.leg = relay, leg

    def _leg_ended(self, ended: LegEnd) -> None:
        """This try's part of a stream ended: count a break against its engine, give the try back, and keep what
        it used for the request's accounting."""
        runtime, req, record = self.runtime, self.req, self.record
        if ended.broken is not None:
            # Counted against the engine even though its first byte was fine: it broke off.
            now = time.monotonic()
            runtime.endpoints.state(self.url).breaker.failure(now, f"broke off mid-stream: {ended.broken}")
            runtime.endpoints.pool_breaker(self.pool).failure(now, f"broke off mid-stream: {ended.broken}")
            runtime.metrics.streams_broken.labels(self.pool).inc()
            if req.resume is None:  # (a resume's trace says it itself)
                record.trace.append(f"stream: the engine at {self.url} {ended.broken}")
            self.outcome = ended.kind or "broken"
        elif not ended.completed:
            record.trace.append("stream: the client left before its end")
        self.release()
        reported = ended.usage.usage()
        prompt, completion, cached = self.prompt_estimate, ended.usage.text_events, 0
        if reported is not None:
            prompt, completion, cached = usage_counts(reported, prompt, completion)
        req.legs.append(LegUsage(self.stage.model, prompt, completion, cached))

    def _stream_ended(self, relay: StreamRelay, completed: bool) -> None:
        """A passed-on stream ended (every leg of it): store it, settle its usage, finish the request."""
        runtime, req, record = self.runtime, self.req, self.record
        if completed and relay.resumed == 0 and req.cache is not None and runtime.cache.wants(req.cache, self.model):
            captured = relay.captured
            runtime.cache.store_stream(req.cache, stream_kind(req.kind), str(req.identity.tenant_id),
                                       bytes(captured) if captured is not None else None)
        if relay.broken and not completed:
            record.broken = True
        # The resume hook refers back to the request (and the request to it): let go, or every stream is a
        # reference cycle for the garbage collector (the relay drops its own hooks: StreamRelay.finish).
        req.resume = None
        self.finish_request(200)
        runtime.spawn(account(runtime, req, req.legs, record))

    def finish_request(self, status: int) -> None:
        """The request this try served is finished with ``status`` (where its last try served it)."""
        runtime, req, record = self.runtime, self.req, self.record
        model, pool = record.served_model or self.model, record.pool or self.pool
        runtime.metrics.duration_by(model, pool).observe(time.perf_counter() - req.started)
        attempts = req.decision.attempts
        assert attempts is not None
        record.resumes, record.hedges = req.decision.resumes, req.decision.hedges
        record_tries(record, attempts, self.headers)
        runtime.finished(record, model, pool, status)

    async def _whole(self, data: bytes, usage: dict[str, Any] | None) -> Tried:
        """Pass a whole answer on. Its endpoint is given back at once; the rest of the request's end (its record,
        the response cache, the accounting: about a tenth of a request's CPU) is the answer's background, run once
        the answer is written (:meth:`_after_whole`)."""
        runtime, req, record = self.runtime, self.req, self.record
        assert self.trial is not None
        self.trial.succeeded(time.monotonic())
        record.ttft_s = time.perf_counter() - req.started
        runtime.metrics.first_byte_by(self.model, self.pool).observe(record.ttft_s)
        self.release()
        return Tried("ok", answer=Response(content=data, status_code=200, media_type="application/json",
                                           headers=dict(self.headers),
                                           background=_AfterAnswer(self._after_whole, data, usage)))

    async def _after_whole(self, data: bytes, usage: dict[str, Any] | None) -> None:
        """A whole answer was written (or its client left): finish the request, store the answer, account for it.

        Nothing of this changes the answer, and a client's next request sees it done: it runs before the event loop
        takes that request (the answer's write does not wait), and the one store call that waits (a shared limit
        store's reconcile) is sent before any later request's reserve on the same connection. Errors are logged,
        never raised: the answer is out, and its connection is kept."""
        runtime, req, record = self.runtime, self.req, self.record
        try:
            self.finish_request(200)
            if req.cache is not None and runtime.cache.wants(req.cache, self.model):
                runtime.cache.store_answer(req.cache, str(req.identity.tenant_id), data)
            if req.kind not in TOKENIZER_KINDS:  # (the tokenizer endpoints use no GPU: nothing to charge or count)
                prompt, completion, cached = req.decision.prompt_tokens, 0, 0
                if usage is not None:
                    prompt, completion, cached = usage_counts(usage, prompt, completion)
                await account(runtime, req, [LegUsage(self.stage.model, prompt, completion, cached)], record)
        except Exception:
            log.exception("request %s: finishing its answered request failed", record.request_id)

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
        if self.watched is not None:
            runtime.watchdog.discard(self.watched)
        preempted = self.yielder is not None and self.yielder.preempted
        ended = "preempted" if preempted else self.outcome
        end(self.span, {"switchyard.outcome": ended}, None if ended == "ok" else ended)
        runtime.endpoints.release(self.url, self.req.cost, self.yielder is not None)
        runtime.flow.finished_yielding(self.yielder)
        runtime.flow.released(self.pool, None if preempted else time.perf_counter() - self.sent_at)
        runtime.metrics.in_flight_by(self.pool).dec()
        if self.adapter is not None:
            runtime.endpoints.state(self.url).adapter_done(self.adapter, time.monotonic())

    def done(self, status: int) -> None:
        """The engine's answer ended with ``status``: the request is finished."""
        if status >= 400:
            self.outcome = str(status)
        self.release()
        self.finish_request(status)

    def failed(self, kind: str, reason: str, error: ApiError, engine_fault: bool = True) -> Tried:
        """The try failed in a way worth trying elsewhere (``engine_fault``: counted against its breakers)."""
        self.outcome = kind
        self.release()
        assert self.trial is not None
        if engine_fault:
            self.trial.failed(time.monotonic(), reason)
        else:
            self.trial.neutral()
        self.runtime.metrics.attempts_by(self.pool, kind).inc()
        return Tried("failed", kind, reason, error)

    def _preempted(self) -> bool:
        """Whether the cancellation being handled is flow control's preemption of this try and nothing else's
        (then it is taken back: the request goes on, to queue again)."""
        if self.yielder is None or not self.yielder.preempted:
            return False
        task = asyncio.current_task()
        return task is not None and task.uncancel() == 0
