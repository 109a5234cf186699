"""The request path of ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/responses``,
``/tokenize`` and ``/detokenize``: the live executor of the decisions.

authenticate → parse → run the decision procedure (:func:`switchyard.decide.procedure.decide`), answering
its effects live: classifier scores from the embeddings pools, the response cache, the limit store,
flow control's queues, the retry budget, and tries at the engines (:class:`~switchyard.gateway.attempt.Try`).
The order of the decisions is the procedure's alone; this module carries them out, keeps the
request's record, metrics and trace spans, and turns a refusal into the API's error.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Generator
from typing import Any

from litestar import Request, Response

from switchyard.api.errors import ApiError
from switchyard.api.headers import (
    CACHE_HEADER,
    CLASS_HEADER,
    DEGRADED_HEADER,
    PREEMPTED_HEADER,
    QUEUE_MS_HEADER,
    ROUTE_HEADER,
)
from switchyard.decide.admit import LimitAnswer, Reserve
from switchyard.decide.cache import GENERATING_KINDS, CanonicalRequest, is_deterministic
from switchyard.decide.decision import (
    Ask,
    Attempt,
    CacheHit,
    Caller,
    Decision,
    Effect,
    Hedge,
    LookupCache,
    Mark,
    Raced,
    Retry,
    Score,
    Tried,
)
from switchyard.decide.features import request_features
from switchyard.decide.flow import Queue, Waited
from switchyard.decide.procedure import decide
from switchyard.gateway.activity import CACHE_POOL, RequestRecord
from switchyard.gateway.attempt import Try
from switchyard.gateway.attempts import final_error, record_tries, refusal_error
from switchyard.gateway.body import check_body, decode_json_object
from switchyard.gateway.cache_hits import serve_hit
from switchyard.gateway.hedge import race
from switchyard.gateway.request import Incoming, Kind, PendingRequest, RequestIds
from switchyard.gateway.resume import Resumer
from switchyard.gateway.runtime import GatewayRuntime
from switchyard.gateway.tracing import RequestTrace, end
from switchyard.logs import REQUEST_ID


class Proxy:
    """Carries requests to the engines."""

    def __init__(self, runtime: GatewayRuntime) -> None:
        self.runtime = runtime
        self.ids = RequestIds()

    async def handle(self, request: Request[Any, Any, Any], kind: Kind) -> Response[Any]:
        """Serve one request of ``kind`` from a client."""
        return await self.serve(await Incoming.from_http(request), kind)

    async def serve(self, incoming: Incoming, kind: Kind) -> Response[Any]:
        """Serve one request of ``kind``, and keep its record (:mod:`switchyard.gateway.activity`).

        Clients come through :meth:`handle`; the batch worker calls this with the line's identity.
        """
        activity = self.runtime.activity
        record = activity.begin(self.ids.for_request(incoming.headers), kind, time.perf_counter())
        record.batch = incoming.batch
        REQUEST_ID.set(record.request_id)  # on this task's log lines (switchyard.logs)
        spans = self.runtime.tracing.request(kind, incoming.headers, {"switchyard.request_id": record.request_id})
        if spans.enabled:
            record.on_finish = functools.partial(_finish_trace, spans)
        try:
            return await self._serve(incoming, kind, record, spans)
        except ApiError as error:  # counted where it was raised, or refused before any count (401, 400)
            record.error_code = error.code
            if not record.trace:  # refused before the decision began (a bad body, a bad key): say what was wrong
                # (the code and the field, never the message: it may quote what the client sent)
                where = f", field {error.param}" if error.param else ""
                record.trace.append(f"refused {error.status_code} ({error.code or error.type}{where}) before the "
                                    "decision")
            activity.finish(record, error.status_code)
            error.headers.setdefault("x-request-id", record.request_id)  # errors too name the request
            raise
        except asyncio.CancelledError:  # the client left
            activity.finish(record, 499)
            raise
        except Exception:
            activity.finish(record, 500)
            raise

    async def _serve(self, incoming: Incoming, kind: Kind, record: RequestRecord, spans: RequestTrace) -> Response[Any]:
        runtime = self.runtime
        headers = incoming.headers
        identity = incoming.identity or await runtime.auth.authenticate(
            headers.get("authorization"), runtime.policy.snapshot.document.resilience.dependencies.database)
        record.identified(identity)
        settings = runtime.settings
        body = decode_json_object(incoming.raw, settings.max_json_depth)
        asked = body.get("model")
        record.model, record.stream = (asked if isinstance(asked, str) else None,
                                       kind in GENERATING_KINDS and bool(body.get("stream")))
        check_body(kind, body, settings.max_messages)
        features = request_features(kind, body, headers)
        record.prompt_tokens, record.max_tokens = features.prompt_tokens, features.max_tokens
        canonical = CanonicalRequest(kind, body)  # (normalised once, for the digest and a cache key)
        if runtime.activity.sink is not None:  # the request log keeps what a replay of it needs
            record.digest, record.deterministic = canonical.digest(), is_deterministic(body, kind)
        holder = runtime.policy
        # Read once, in one step of the event loop: this request keeps a matching set to the end.
        snapshot, counters, renderers = holder.snapshot, holder.counters, holder.renderers
        canary = runtime.canary
        role: str | None = None
        if (live := canary.live) is not None:  # (in the same step: a canary's candidate or the active version decides)
            record.canary_id = live.id
            chosen = canary.choose(snapshot, counters, renderers, tier=identity.tier, tenant=str(identity.tenant_id),
                                   key=str(identity.key_id), region=settings.region, headers=headers, body=body,
                                   request_id=record.request_id)
            snapshot, counters, renderers, role = chosen.snapshot, chosen.counters, chosen.renderers, chosen.role
        record.policy_version, record.canary = snapshot.version, role
        caller = Caller(identity.tier, str(identity.tenant_id), str(identity.key_id), identity.tenant_limits,
                        identity.key_limits, identity.region)
        ask = Ask(kind, body, features, caller, settings.region, settings.picker, runtime.flow.enabled, counters,
                  renderers, canonical)
        d = Decision(snapshot, ask)
        record.trace = d.trace  # one trace: the procedure's lines, and this gateway's own
        req = PendingRequest(kind, body, incoming.raw, record.stream, record.request_id, record.started, identity, d,
                             batch=incoming.batch, trace=spans)
        run = _Run(self, req, incoming, record)
        if role == "shadow":  # the candidate decides alongside, on the fleet as this request finds it
            run.shadow = canary.shadow_decide(ask)
        return await run.execute()


class _Run:
    """One request's run of the decision procedure in this gateway (see the module doc)."""

    def __init__(self, proxy: Proxy, req: PendingRequest, incoming: Incoming, record: RequestRecord) -> None:
        self.runtime = proxy.runtime
        self.ids = proxy.ids
        self.req = req
        self.d = req.decision
        self.incoming = incoming
        self.record = record
        #: What the queue waits so far added up to (a preempted request queues again).
        self.waited_s = 0.0
        #: A shadow canary's decision for this request, compared with the live one when that is made.
        self.shadow: Decision | None = None

    async def execute(self) -> Response[Any]:
        """Drive the procedure to its end and answer: the engine's response, the cache's, or the refusal."""
        if self.req.stream and self.req.kind in ("chat", "completion"):  # (a Responses API stream is not resumed)
            self.req.resume = Resumer(self.runtime, self, self.req, self.record)
        try:
            await self.drive(decide(self.d, self.runtime.view))
            self._sync()
            self._compare_shadow()
            return await self._conclude()
        except BaseException:
            self._sync()
            self._compare_shadow()
            self._abandon()
            raise
        finally:
            # The resume hook refers back to the request (and the request to it). A stream that is passed on lets
            # go of it at its end (``Try._stream_ended``); any other answer (the cache's, a refusal, a failure) has
            # no stream of an engine's to continue, and lets go of it here, or the request would be a reference
            # cycle for the garbage collector.
            tried = self.d.tried
            if self.d.outcome != "served" or tried is None or tried.outcome != "ok":
                self.req.resume = None

    def _compare_shadow(self) -> None:
        """Compare a shadow canary's decision with this one, once, before the request can finish."""
        if self.shadow is not None:
            self.runtime.canary.compare(self.record, self.d, self.shadow)
            self.shadow = None

    async def drive(self, steps: Generator[Effect, Any, Any]) -> Any:
        """Answer ``steps``' effects live until it returns (the whole procedure, or a resume of its stream); its
        value."""
        answer: Any = None
        try:
            while True:
                try:
                    effect = steps.send(answer)
                except StopIteration as stop:
                    return stop.value
                answer = await self._answer(effect)
        except BaseException:
            steps.close()
            raise

    def _sync(self) -> None:
        """Copy what has been decided so far into the request's record (the Requests page, the request log)."""
        d, record = self.d, self.record
        if d.model is not None:
            record.resolved_model = d.model.model.name
        if d.cls is not None:
            record.priority = d.cls.name

    async def _answer(self, effect: Effect) -> Any:
        kind = type(effect)
        if kind is Attempt:
            self._sync()  # (a try ends the request's record, with what was decided)
            self._compare_shadow()
            return await self._attempt(effect)  # type: ignore[arg-type]
        if kind is Mark:
            self._mark(effect)  # type: ignore[arg-type]
            return None
        if kind is Retry:
            return self._retry(effect)  # type: ignore[arg-type]
        if kind is Hedge:
            return await self._hedge(effect)  # type: ignore[arg-type]
        if kind is Reserve:
            return await self._reserve(effect)  # type: ignore[arg-type]
        if kind is Queue:
            return await self._queue(effect)  # type: ignore[arg-type]
        if kind is LookupCache:
            return await self._lookup(effect)  # type: ignore[arg-type]
        assert isinstance(effect, Score), effect
        return await self.runtime.classifiers.score(self.d.snapshot, effect.name, effect.features)

    # --- effects ------------------------------------------------------------------------------------

    async def _lookup(self, effect: LookupCache) -> CacheHit | None:
        d, req = self.d, self.req
        assert d.model is not None
        found = await self.runtime.cache.lookup(d.snapshot, effect.plan, d.ask.caller.tenant, d.model.model.name)
        req.cache = found
        self.record.cache, self.record.cache_rule = found.header.partition(";")[0], found.plan.label
        d.trace.append(f"cache: {found.header}")
        if found.entry is None:
            req.force_usage = req.stream and found.plan.write and not _asked_usage(req.body)
            return None
        return CacheHit(found.entry.prompt_tokens, found.entry.completion_tokens)

    async def _reserve(self, effect: Reserve) -> LimitAnswer:
        runtime, d = self.runtime, self.d
        span = self.req.trace.child("admit")
        try:
            self.req.lease, answer = await runtime.admitter.reserve(
                effect.charges, d.snapshot.document.resilience.dependencies.redis)
        except ApiError as refused:  # 503: the limit store is unreachable and fails closed
            end(span, {"http.response.status_code": refused.status_code}, refused.code or refused.type)
            self._sync()
            runtime.finished(self.record, self._asked(), "-", refused.status_code)
            raise
        end(span, None if answer.admitted else {"http.response.status_code": 429},
            None if answer.admitted else "rate_limited")
        return answer

    async def _queue(self, effect: Queue) -> Waited:
        waited, self.req.ticket = await self.runtime.flow.wait(effect, self.incoming.disconnected)
        if waited.waited_s:
            self.record.queue_ms = round((self.waited_s + waited.waited_s) * 1000, 1)
        self.waited_s += waited.waited_s
        return waited

    def _mark(self, mark: Mark) -> None:
        """A stage of the procedure ended: its trace span (from when it started, on the monotonic clock), and flow
        control's downgrades counted."""
        d, spans = self.d, self.req.trace
        if mark.stage == "queue" and mark.refusal is None and d.scheduled is not None:
            assert d.cls is not None
            self.runtime.flow.counted(d.cls.name, d.scheduled)
        if not spans.enabled:
            return
        error = None
        attributes: dict[str, str | float]
        if mark.stage == "pick":
            choice = mark.choice
            attributes = ({"switchyard.stage": mark.label, "switchyard.endpoint": choice.url,
                           "switchyard.pool": choice.pool.name} if choice is not None
                          else {"switchyard.stage": mark.label, "switchyard.endpoint": "none"})
        elif mark.refusal is not None:
            attributes, error = {"http.response.status_code": mark.refusal.status}, mark.refusal.code
        else:
            assert d.cls is not None and d.scheduled is not None  # noqa: PT018
            attributes = {"switchyard.class": d.cls.name, "switchyard.queue_ms": round(d.scheduled.waited_s * 1000, 1)}
        spans.record(mark.stage, mark.started, attributes, error)

    def _retry(self, effect: Retry) -> bool:
        runtime = self.runtime
        if runtime.retry_budget.allow_retry(time.monotonic(), self.d.snapshot.document.resilience.retries):
            return True
        runtime.metrics.retries_refused.inc()
        return False

    async def _attempt(self, effect: Attempt) -> Tried:
        d, runtime = self.d, self.runtime
        resilience = d.snapshot.document.resilience
        runtime.endpoints.configure(resilience)
        assert d.attempts is not None
        if d.attempts.count == 1:  # a dispatch's first try: counted for the retry budget
            runtime.retry_budget.request(time.monotonic(), resilience.retries)
        spans = self.req.trace
        if spans.enabled:
            spans.record("pick", effect.picked, {"switchyard.stage": effect.stage.label,
                                                 "switchyard.endpoint": effect.choice.url,
                                                 "switchyard.pool": effect.choice.pool.name})
        headers = self._headers()
        headers[ROUTE_HEADER] = route_header(d, effect)
        tried = await Try(runtime, self.ids, self.req, effect, headers, self.record).send(effect.hedge_after)
        if tried.outcome == "failed":
            runtime.metrics.fallbacks.labels(self._asked(), tried.kind).inc()
        return tried

    async def _hedge(self, effect: Hedge) -> Raced:
        """Race the late try against a hedge at ``effect.choice`` (or keep waiting for it alone)."""
        d, runtime = self.d, self.runtime
        pending = effect.pending.answer
        assert isinstance(pending, Try)
        second = None
        if effect.choice is not None:
            attempt = Attempt(d, effect.stage, effect.choice, effect.picked, pending.deadline_s)
            headers = self._headers()
            headers[ROUTE_HEADER] = route_header(d, attempt) + f"; hedged={pending.url}"
            second = Try(runtime, self.ids, self.req, attempt, headers, self.record)
        raced, winner = await race(pending, second)
        if second is None:
            outcome = "not_sent"
        elif raced.tried.outcome == "failed":
            outcome = "failed"
        else:
            outcome = "won" if winner is second else "lost"
        runtime.metrics.hedges.labels(pending.pool, outcome).inc()
        if raced.tried.outcome == "failed":
            runtime.metrics.fallbacks.labels(self._asked(), raced.tried.kind).inc()
        return raced

    # --- the end -----------------------------------------------------------------------------------

    async def _conclude(self) -> Response[Any]:
        d, req, record, runtime = self.d, self.req, self.record, self.runtime
        attempts = d.attempts
        if attempts is not None:
            for moved in attempts.moved_on:
                if moved.endswith(" unavailable"):
                    runtime.metrics.fallbacks.labels(self._asked(), "unavailable").inc()
        if d.outcome == "served":
            tried = d.tried
            assert tried is not None
            # The answer is handed on, not kept: it refers back to the try that made it (a whole answer's background
            # is the try's method, and the try holds the request and its decision), so a decision that kept it would
            # make every request a reference cycle, freed only by the garbage collector after it outlived a few
            # collections (``switchyard bench --scenario overhead``: 53 objects a request).
            answer, tried.answer = tried.answer, None
            if tried.outcome == "ok":
                response: Response[Any] = answer
                return response
            raise answer  # the engine's own refusal of the client's request (a 4xx passed through)
        if d.outcome == "cache_hit":
            assert req.cache is not None
            return await serve_hit(runtime, req.kind, req.body, req.cache, req.identity, d, req.lease, req.rid,
                                   record)
        headers = self._headers() if d.cls is not None else {}
        headers[ROUTE_HEADER] = unserved_route(d)  # a refusal too names the version that decided it
        if d.outcome == "failed":
            assert attempts is not None
            error = final_error(attempts, headers)
            record_tries(record, attempts, headers)
            runtime.finished(record, self._asked(), "-", error.status_code)
            raise error
        refusal = d.refusal
        assert d.outcome == "refused"
        assert refusal is not None
        if refusal.status == 429:
            runtime.metrics.limited.labels(refusal.limit, req.identity.tier).inc()
        if refusal.shed is not None:
            assert d.cls is not None
            runtime.flow.counted(d.cls.name, refusal)
            record.shed = True
        if attempts is not None:
            record_tries(record, attempts, headers)
        # A limit that refuses before the request's estimate was made refused a cache hit's charge.
        pool = CACHE_POOL if refusal.status == 429 and d.estimate is None else "-"
        runtime.finished(record, self._asked(), pool, refusal.status)
        raise refusal_error(refusal, headers)

    def _abandon(self) -> None:
        """The request ends without an engine's answer to account: its queue grant and reservation go back."""
        req = self.req
        self.runtime.flow.dispatched(req.ticket)  # granted but never sent: the pool may grant again
        req.ticket = None
        # It never ran (no usage to charge); a no-op once settled. In a task of its own: this one may be
        # cancelled (the client left) and must not be interrupted mid-settle.
        lease = req.lease
        if lease.reservation is not None and not lease.settled:
            self.runtime.spawn(lease.settle(0, 0.0))

    def _asked(self) -> str:
        """The model the request is served as (after a downgrade), for metrics; ``-`` before one is resolved."""
        d = self.d
        if d.scheduled is not None:
            return d.scheduled.model.name
        return d.model.model.name if d.model is not None else "-"

    def _headers(self) -> dict[str, str]:
        """The headers every answer of a classed request carries (the request's id, limits, class and fate)."""
        d, req = self.d, self.req
        assert d.cls is not None
        headers = {"x-request-id": req.rid, **req.lease.headers, CLASS_HEADER: d.cls.trace}
        if self.waited_s:
            headers[QUEUE_MS_HEADER] = str(round(self.waited_s * 1000))
        if d.scheduled is not None and d.scheduled.note is not None:
            headers[DEGRADED_HEADER] = d.scheduled.note
        if d.preemptions:
            headers[PREEMPTED_HEADER] = str(d.preemptions)
        if req.cache is not None:
            headers[CACHE_HEADER] = req.cache.header
        return headers


def route_header(d: Decision, attempt: Attempt) -> str:
    """The ``x-switchyard-route`` value: what served the request, under which policy, and every endpoint
    or stage it moved on from and why (``moved_on=<url or stage> <why>, ...``)."""
    stage, choice, decision, scheduled, cls, attempts = (attempt.stage, attempt.choice, d.model, d.scheduled, d.cls,
                                                          d.attempts)
    assert decision is not None
    assert scheduled is not None
    assert cls is not None
    assert attempts is not None
    parts = [f"model={stage.model.name}"]
    if decision.route:
        parts.append(f"route={decision.route}")
        parts.append(f"rule={decision.rule}")
    if scheduled.downgraded_from is not None:
        parts.append(f"downgraded_from={scheduled.downgraded_from.name}")
    if stage.model is not scheduled.model:
        parts.append(f"fallback_from={scheduled.model.name}")
    parts += [f"class={cls.name}", f"pool={choice.pool.name}", f"region={choice.pool.region}",
              f"endpoint={choice.url}", f"policy={d.snapshot.label}"]
    if attempts.count > 1:
        parts.append(f"attempt={attempts.count}")
    if attempts.moved_on:
        parts.append("moved_on=" + ", ".join(attempts.moved_on))
    return "; ".join(parts)


def unserved_route(d: Decision) -> str:
    """The ``x-switchyard-route`` value of an answer no engine gave (a refusal, every try failed): what was decided,
    under which policy."""
    parts = []
    if d.model is not None:
        parts.append(f"model={d.model.model.name}")
        if d.model.route:
            parts += [f"route={d.model.route}", f"rule={d.model.rule}"]
    if d.cls is not None:
        parts.append(f"class={d.cls.name}")
    parts.append(f"policy={d.snapshot.label}")
    return "; ".join(parts)


def _finish_trace(spans: RequestTrace, record: RequestRecord) -> None:
    """End the request's span with what became of it."""
    spans.finish({"http.response.status_code": record.status, "switchyard.outcome": record.outcome,
                  "switchyard.tier": record.tier, "switchyard.model": record.model,
                  "switchyard.served_model": record.served_model, "switchyard.pool": record.pool,
                  "switchyard.region": record.region, "switchyard.class": record.priority,
                  "switchyard.attempts": record.attempts, "switchyard.cache": record.cache},
                 error=(record.status or 0) >= 500)


def _asked_usage(body: dict[str, Any]) -> bool:
    """Whether a streaming client asked for the usage chunk itself."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True
