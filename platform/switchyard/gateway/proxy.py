"""The request path of ``/v1/chat/completions`` and ``/v1/completions``.

authenticate → parse → resolve the model and the priority class (``decide``) → admit (limits) →
schedule (flow control: go, downgrade, queue or shed) → pick an endpoint (``decide``) → call the
engine → stream or return its answer. Every step that can refuse raises an ``ApiError``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from switchyard.decide.admit import DoesNotFit, check_fits, estimate, limit_charges, spend_of
from switchyard.decide.cache import is_deterministic, request_digest
from switchyard.decide.features import RequestFeatures, chat_features, completion_features, count_prompts
from switchyard.decide.flow import PRIORITY_HEADER, BadPriority, classify
from switchyard.decide.pick import EndpointChoice, Stage, fallback_plan, pick_endpoint, profile_for, usable_stages
from switchyard.decide.plugins import PickRequest
from switchyard.decide.prefix import block_hashes, prompt_text
from switchyard.decide.regions import REGION_HEADER, place
from switchyard.decide.resolve import ModelDecision, NeedsScore, Refused, resolve_model
from switchyard.decide.sessions import session_key
from switchyard.engines.breakers import Trial
from switchyard.engines.upstream import (
    StreamRelay,
    UpstreamFailure,
    first_chunk,
    post,
    read_answer,
    read_engine_error,
    usage_counts,
)
from switchyard.gateway.activity import RequestRecord
from switchyard.gateway.attempts import (
    BUSY_STATUS,
    RETRYABLE_STATUS,
    Attempts,
    engine_error,
    failure_error,
    refusal_error,
)
from switchyard.gateway.body import check_chat, check_completion, decode_json_object
from switchyard.gateway.cache_hits import cache_lookup, serve_hit
from switchyard.gateway.errors import ApiError, BadRequest, GatewayTimeout, RateLimited
from switchyard.gateway.flow import Preempted, Scheduled, Yielder
from switchyard.gateway.request import Incoming, Kind, PendingRequest, RequestIds
from switchyard.gateway.response_cache import CACHE_HEADER
from switchyard.gateway.runtime import GatewayRuntime
from switchyard.gateway.tracing import RequestTrace, end
from switchyard.logs import REQUEST_ID
from switchyard.policy import PolicySnapshot
from switchyard.policy.schema import Model

_PATHS: dict[Kind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


def route_header(decision: ModelDecision, stage: Stage, choice: EndpointChoice, snapshot: PolicySnapshot,
                 attempt: int, cls: str, scheduled: Scheduled, moved_on: list[str]) -> str:
    """The ``x-switchyard-route`` value: what served the request, under which policy, and every endpoint
    or stage it moved on from and why (``moved_on=<url or stage> <why>, ...``)."""
    parts = [f"model={stage.model.name}"]
    if decision.route:
        parts.append(f"route={decision.route}")
        parts.append(f"rule={decision.rule}")
    if scheduled.downgraded_from is not None:
        parts.append(f"downgraded_from={scheduled.downgraded_from.name}")
    if stage.model is not scheduled.model:
        parts.append(f"fallback_from={scheduled.model.name}")
    parts += [f"class={cls}", f"pool={choice.pool.name}", f"region={choice.pool.region}",
              f"endpoint={choice.url}", f"policy={snapshot.label}"]
    if attempt > 1:
        parts.append(f"attempt={attempt}")
    if moved_on:
        parts.append("moved_on=" + ", ".join(moved_on))
    return "; ".join(parts)


class Proxy:
    """Carries requests to the engines."""

    def __init__(self, runtime: GatewayRuntime) -> None:
        self.runtime = runtime
        self.ids = RequestIds()

    async def handle(self, request: Request[Any, Any, Any], kind: Kind) -> Response[Any]:
        """Serve one chat or completion request from a client."""
        return await self.serve(await Incoming.from_http(request), kind)

    async def serve(self, incoming: Incoming, kind: Kind) -> Response[Any]:
        """Serve one chat or completion request, and keep its record (:mod:`switchyard.gateway.activity`).

        Clients come through :meth:`handle`; the batch worker calls this with the line's identity.
        """
        activity = self.runtime.activity
        record = activity.begin(self.ids.for_request(incoming.headers), kind, time.perf_counter())
        REQUEST_ID.set(record.request_id)  # on this task's log lines (switchyard.logs)
        spans = self.runtime.tracing.request(kind, incoming.headers, {"switchyard.request_id": record.request_id})
        if spans.enabled:
            record.on_finish = functools.partial(_finish_trace, spans)
        try:
            return await self._serve(incoming, kind, record, spans)
        except ApiError as error:  # counted where it was raised, or refused before any count (401, 400)
            record.error_code = error.code
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
        started, rid = record.started, record.request_id
        runtime = self.runtime
        request_headers = incoming.headers
        identity = incoming.identity or await runtime.auth.authenticate(
            request_headers.get("authorization"), runtime.policy.snapshot.document.resilience.dependencies.database)
        record.identified(identity)
        raw = incoming.raw
        settings = runtime.settings
        body = decode_json_object(raw, settings.max_json_depth)
        asked = body.get("model")
        record.model, record.stream = asked if isinstance(asked, str) else None, bool(body.get("stream"))
        features: RequestFeatures
        if kind == "chat":
            check_chat(body, settings.max_messages)
            features = chat_features(body, request_headers)
        else:
            check_completion(body)
            features = completion_features(body, request_headers)
        record.prompt_tokens, record.max_tokens = features.prompt_tokens, features.max_tokens
        if runtime.activity.sink is not None:  # the request log keeps what a replay of it needs
            record.digest, record.deterministic = request_digest(kind, body), is_deterministic(body)
        holder = runtime.policy
        snapshot, counters = holder.snapshot, holder.counters  # read once; this request keeps them to the end
        try:
            decision = await self._resolve(snapshot, identity.tier, features)
            record.decided(decision)
            placement = place(snapshot, identity.tier, decision.model, request_headers.get(REGION_HEADER),
                              identity.region, runtime.settings.region)
        except Refused as refusal:
            runtime.finished(record, "-", "-", refusal.status)
            raise refusal_error(refusal) from None
        record.trace.append(placement.trace)
        try:
            cls = classify(snapshot, identity.tier, request_headers.get(PRIORITY_HEADER), body.get("priority"))
        except BadPriority as bad:
            runtime.finished(record, decision.model.name, "-", 400)
            raise BadRequest(bad.message, code="invalid_priority", param=bad.param) from None
        record.classed(cls)
        found = await cache_lookup(runtime, request_headers, snapshot, kind, decision, identity, body)
        record.cached(found)
        if found is not None and found.entry is not None:
            return await serve_hit(runtime, kind, body, found, identity, decision, snapshot, rid, cls.trace, record)
        counter = counters.get(decision.model.name)
        if counter is not None and counter.exact:
            prompt_tokens, longest = count_prompts(counter, kind, body)
            exact = True
        else:
            prompt_tokens, exact = features.prompt_tokens, features.prompt_exact
            longest = prompt_tokens if features.longest_prompt is None else features.longest_prompt
        record.prompt_tokens = prompt_tokens
        try:  # a request the model cannot serve is refused here, before it is charged or sent
            check_fits(decision.model, kind, longest, exact, features.max_tokens,
                       "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens")
        except DoesNotFit as unfit:
            runtime.finished(record, decision.model.name, "-", 400)
            raise BadRequest(unfit.message, code=unfit.code, param=unfit.param) from None
        est = estimate(decision.model, prompt_tokens, features.max_tokens, features.choices)
        charges = limit_charges(snapshot, identity.tier, decision.model, est,
                                tenant=str(identity.tenant_id), key=str(identity.key_id),
                                tenant_limits=identity.tenant_limits, key_limits=identity.key_limits)
        span = spans.child("admit")
        try:
            lease = await runtime.admitter.admit(charges, snapshot.document.resilience.dependencies.redis)
        except ApiError as refused:  # 429 (a limit), 503 (the limit store is unreachable and fails closed)
            end(span, {"http.response.status_code": refused.status_code}, refused.code or refused.type)
            if isinstance(refused, RateLimited):
                runtime.metrics.limited.labels(refused.limit, identity.tier).inc()
            runtime.finished(record, decision.model.name, "-", refused.status_code)
            raise
        end(span)
        flow = runtime.flow
        stream = bool(body.get("stream"))
        request_state = PendingRequest(kind, body, raw, stream, cls.engine_priority, features, rid, started, identity,
                                       prompt_tokens, lease, cls, est.tokens, placement, cache=found,
                                       force_usage=stream and found is not None and found.plan.write
                                       and not _asked_usage(body), batch=incoming.batch, trace=spans)
        waited_s = 0.0
        try:
            while True:  # once, unless flow control preempts it for interactive requests: then it queues again
                span = spans.child("queue", {"switchyard.class": cls.name})
                try:
                    scheduled = await flow.schedule(snapshot, decision.model, cls, est.tokens,
                                                    str(identity.tenant_id),
                                                    features.prompt_tokens + (features.max_tokens or 0),
                                                    incoming.disconnected, placement.allowed)
                    end(span, {"switchyard.queue_ms": round(scheduled.waited_s * 1000, 1)})
                except ApiError as refused:
                    end(span, {"http.response.status_code": refused.status_code}, refused.code or refused.type)
                    record.shed = refused.status_code == 503  # flow control's 503s are sheds (499: the client left)
                    runtime.finished(record, decision.model.name, "-", refused.status_code)
                    refused.headers = {"x-request-id": rid, **lease.headers, "x-switchyard-class": cls.trace,
                                       **(refused.headers or {})}
                    raise
                request_state.ticket = scheduled.ticket
                waited_s += scheduled.waited_s
                scheduled.waited_s = waited_s
                if waited_s:
                    record.queue_ms = round(waited_s * 1000, 1)
                try:
                    return await self._dispatch(request_state, snapshot, decision, scheduled, record)
                except Preempted as preempted:
                    request_state.preemptions += 1
                    record.trace.append(f"preempted at {preempted.url} for an interactive request "
                                        f"({request_state.preemptions}); queued again")
        except BaseException:
            flow.dispatched(request_state.ticket)  # granted but never sent: the pool may grant again
            # It never ran (no usage to charge); a no-op once settled. In a task of its own: this
            # one may be cancelled (the client left) and must not be interrupted mid-settle.
            if lease.reservation is not None and not lease.settled:
                runtime.spawn(lease.settle(0, 0.0))
            raise

    async def _resolve(self, snapshot: PolicySnapshot, tier: str, features: RequestFeatures) -> ModelDecision:
        """The model decision, with the scores of classifiers that call out computed as rules need them."""
        scores: dict[str, float | None] = {}
        while True:
            try:
                return resolve_model(snapshot, tier, features, scores)
            except NeedsScore as needs:
                scores[needs.name] = await self.runtime.classifiers.score(snapshot, needs.name, features)

    async def _dispatch(self, req: PendingRequest, snapshot: PolicySnapshot, decision: ModelDecision,
                        scheduled: Scheduled, record: RequestRecord) -> Response[Any]:
        """Try the plan's stages in order until an engine answers (see ``decide.pick``).

        A stage with no endpoint in service is passed over; a failed try moves on to the next
        endpoint (then stage) while the request has attempts left and the retry budget allows.
        """
        runtime = self.runtime
        resilience = snapshot.document.resilience
        runtime.endpoints.configure(resilience)
        attempts = Attempts(resilience.retries.max_attempts)
        headers = {"x-request-id": req.rid, **req.lease.headers, "x-switchyard-class": req.cls.trace}
        if scheduled.waited_s:
            headers["x-switchyard-queue-ms"] = str(round(scheduled.waited_s * 1000))
        if scheduled.note is not None:
            headers["x-switchyard-degraded"] = scheduled.note
        if req.preemptions:
            headers["x-switchyard-preempted"] = str(req.preemptions)
        if req.cache is not None:
            headers[CACHE_HEADER] = req.cache.header
        needed = req.features.prompt_tokens + (req.features.max_tokens or 0)
        hashes: list[bytes] | None = None
        strategy = runtime.settings.picker
        placement = req.placement
        stages, skipped = usable_stages(fallback_plan(snapshot, scheduled.model, placement.allowed), needed)
        attempts.failures += skipped
        tenant = str(req.identity.tenant_id)
        asked = scheduled.model.name
        view = functools.partial(runtime.endpoint_view, preempting=req.cls.cls.lane == "interactive")
        for stage in stages:
            options = stage.candidates()
            profile = profile_for(snapshot, stage.model, strategy)
            session = session_key(profile, req.features.headers, req.body, tenant, stage.model.name)
            if hashes is None and profile.prefix and len(options) > 1:
                hashes = block_hashes(prompt_text(req.body))
            while attempts.count < attempts.limit:
                now = time.monotonic()
                pick = PickRequest(
                    runtime.prefixes.affinity(hashes, [o.url for o in options], now) if hashes and profile.prefix
                    else {},
                    runtime.sessions.get(session, now) if session is not None else None,
                    placement.home, req.cls.cls.dispatch_ceiling, runtime.next_rotation(), runtime.rng)
                span = req.trace.child("pick", {"switchyard.stage": stage.label})
                choice = pick_endpoint(profile, options, functools.partial(view, now=now), pick,
                                       attempts.tried)
                if choice is None:
                    end(span, {"switchyard.endpoint": "none"})
                    if not any(o.url in attempts.tried for o in options):
                        reason, retry_in = runtime.out_of_service(options, now)
                        attempts.passed_over(stage.label, reason)
                        attempts.retry_in = min(retry_in, attempts.retry_in or retry_in)
                        runtime.metrics.fallbacks.labels(asked, "unavailable").inc()
                    break
                if req.cls.cls.lane == "interactive":
                    choice = runtime.flow.steer(choice, options, attempts.tried, req.cls.cls.dispatch_ceiling, now)
                end(span, {"switchyard.endpoint": choice.url, "switchyard.pool": choice.pool.name})
                if attempts.count == 0:
                    runtime.retry_budget.request(now, resilience.retries)
                elif not runtime.retry_budget.allow_retry(now, resilience.retries):
                    runtime.metrics.retries_refused.inc()
                    attempts.budget_spent = True
                    break
                attempts.tried.add(choice.url)
                headers["x-switchyard-route"] = route_header(decision, stage, choice, snapshot, attempts.count,
                                                             req.cls.name, scheduled, attempts.moved_on)
                try:
                    response = await self._attempt(req, stage, choice, attempts, headers, record)
                except Preempted:
                    if hashes and profile.prefix:  # its prompt is in that engine's prefix cache now
                        runtime.prefixes.record(hashes, choice.url)
                    raise
                if response is not None:
                    if hashes and profile.prefix:
                        runtime.prefixes.record(hashes, choice.url)
                    if session is not None:
                        runtime.sessions.record(session, choice.url)
                    return response
                runtime.metrics.fallbacks.labels(asked, attempts.moved_on[-1].rpartition(" ")[2]).inc()
            if attempts.count >= attempts.limit or attempts.budget_spent:
                break
        error = attempts.final_error(headers)
        _tried(record, attempts, headers)
        runtime.finished(record, asked, "-", error.status_code)
        raise error

    async def _attempt(self, req: PendingRequest, stage: Stage, choice: EndpointChoice, attempts: Attempts,
                       headers: dict[str, str], record: RequestRecord) -> Response[Any] | None:
        """Send the request to one endpoint: its response, or None after a failure worth retrying.

        A streamed answer is passed on only once its first chunk has come (within the model's
        first-token timeout): until then a failure can still move on to another endpoint.
        """
        runtime = self.runtime
        model, pool, url = stage.model.name, choice.pool.name, choice.url
        metrics = runtime.metrics
        endpoints = runtime.endpoints
        resilience = endpoints.resilience
        flow = runtime.flow
        if req.cls.cls.lane == "interactive":
            flow.make_room(choice.pool, url, req.cls.cls.dispatch_ceiling, time.monotonic())
        yielder = flow.yielding(url, lambda: release()) if req.yields else None
        span = req.trace.child("upstream", {"switchyard.endpoint": url, "switchyard.pool": pool,
                                            "switchyard.model": model, "switchyard.attempt": len(attempts.tried)})
        outcome = "ok"
        endpoints.acquire(url, req.cost, yielder is not None)
        if yielder is not None:
            flow.batch_sent(pool, url)
        # An interactive stream's prefill: batch work is not sent here until its first byte (flow.batch_view).
        prefilling = req.stream and req.cls.cls.lane == "interactive"
        if prefilling:
            endpoints.prefill_started(url)
        sent_at = time.perf_counter()
        trial = Trial.start(endpoints.state(url).breaker, endpoints.pool_breaker(pool), time.monotonic())
        if req.ticket is not None:
            runtime.flow.dispatched(req.ticket)
            req.ticket = None
        metrics.in_flight.labels(pool).inc()
        record.served_model, record.pool, record.region, record.endpoint = model, pool, choice.pool.region, url
        released = False

        def prefilled(ttfb_s: float | None) -> None:
            nonlocal prefilling
            if prefilling:
                prefilling = False
                endpoints.prefill_ended(url, ttfb_s)
                flow.prefill_ended(pool)

        def release() -> None:
            nonlocal released
            prefilled(None)
            if not released:
                released = True
                preempted = yielder is not None and yielder.preempted  # (flow control may call this first)
                ended = "preempted" if preempted else outcome
                end(span, {"switchyard.outcome": ended}, None if ended == "ok" else ended)
                endpoints.release(url, req.cost, yielder is not None)
                flow.finished_yielding(yielder)
                flow.released(pool, None if preempted else time.perf_counter() - sent_at)
                metrics.in_flight.labels(pool).dec()

        def done(status: int) -> None:
            nonlocal outcome
            if status >= 400:
                outcome = str(status)
            release()
            metrics.duration.labels(model, pool).observe(time.perf_counter() - req.started)
            _tried(record, attempts, headers)
            runtime.finished(record, model, pool, status)

        def retry(kind: str, reason: str, error: ApiError, engine_fault: bool = True) -> None:
            nonlocal outcome
            outcome = kind
            release()
            if engine_fault:
                trial.failed(time.monotonic(), reason)
            else:
                trial.neutral()
            metrics.attempts.labels(pool, kind).inc()
            attempts.failed(url, kind, reason, error)

        # The engine gets an id of our own: clients may reuse theirs, and two in-flight requests
        # with one id would collide inside the engine.
        upstream_headers = {"Content-Type": "application/json", "X-Request-Id": self.ids.new()}
        req.trace.inject(span, upstream_headers)
        payload = req.payload_for(choice.pool)
        first_token_s = stage.model.first_token_timeout or resilience.first_token_timeout
        try:
            sending = post(runtime.http, url + _PATHS[req.kind], payload, upstream_headers, runtime.http_fresh)
            # (post() turns its own timeouts into UpstreamFailure: a TimeoutError here is the first-token wait's.)
            response = await (asyncio.wait_for(sending, first_token_s) if req.stream else sending)
            if response.status >= 300:
                err = await read_engine_error(response)
                error = engine_error(err, choice, dict(headers))
                if err.status in RETRYABLE_STATUS:
                    retry(str(err.status), f"{err.status} {err.message[:200]}", error,
                          engine_fault=err.status not in BUSY_STATUS)
                    return None
                trial.neutral()
                metrics.attempts.labels(pool, str(err.status)).inc()
                done(error.status_code)
                raise error
            if req.stream:
                left = first_token_s - (time.perf_counter() - sent_at)
                try:
                    first = await asyncio.wait_for(first_chunk(response), max(left, 0.001))
                except BaseException:
                    response.close()
                    raise
        except TimeoutError:
            retry("first_token_timeout", f"no first token within {first_token_s:g} s",
                  GatewayTimeout(f"Upstream failure in pool {pool}: no first token within {first_token_s:g} s",
                                 headers=dict(headers)))
            return None
        except UpstreamFailure as failure:
            if failure.refused:
                runtime.mark_down(url, str(failure))
            retry(failure.kind, str(failure), failure_error(failure, pool, dict(headers)))
            return None
        except BaseException:  # the client left (cancelled) or a client error was raised: nothing leaks
            preempted = _preempted(yielder)
            outcome = "cancelled"  # (release() says "preempted" itself when it was)
            release()
            trial.neutral()
            if preempted:
                raise Preempted(url) from None
            raise
        metrics.attempts.labels(pool, "ok").inc()
        if req.stream:
            ttfb = time.perf_counter() - sent_at
            prefilled(ttfb)
            record.ttft_s = time.perf_counter() - req.started
            metrics.first_byte.labels(model, pool).observe(record.ttft_s)
            max_ttfb = resilience.health.max_ttfb
            if max_ttfb is not None and ttfb > max_ttfb:
                trial.failed(time.monotonic(), f"first byte after {ttfb:.2f} s (max_ttfb {max_ttfb:g} s)")
            else:
                trial.succeeded(time.monotonic())
            relay: StreamRelay

            def finished(completed: bool) -> None:
                if completed and runtime.cache.wants(req.cache, model):
                    assert req.cache is not None
                    captured = relay.captured
                    runtime.cache.store_stream(req.cache, req.kind, str(req.identity.tenant_id),
                                               bytes(captured) if captured is not None else None)
                if relay.broken:
                    # Counted against the engine even though its first byte was fine: it broke off.
                    endpoints.state(url).breaker.failure(time.monotonic(), "broke off mid-stream")
                    endpoints.pool_breaker(pool).failure(time.monotonic(), "broke off mid-stream")
                    metrics.streams_broken.labels(pool).inc()
                    record.broken = True
                    record.trace.append("stream: the engine broke off mid-stream")
                elif not completed:
                    record.trace.append("stream: the client left before its end")
                done(200)
                runtime.spawn(self._account(req, stage.model, relay.usage.usage(), relay.usage.text_events, record))

            storing = runtime.cache.wants(req.cache, model)
            relay = StreamRelay(response, first, finished, strip_usage=req.force_usage,
                                capture_limit=8 * req.cache.plan.rule.max_entry_bytes if storing and req.cache else 0,
                                max_event_bytes=runtime.settings.upstream_max_event_bytes)
            return Stream(relay.chunks(), media_type="text/event-stream",
                          headers={**headers, "Cache-Control": "no-cache"},
                          background=BackgroundTask(relay.afinish))
        try:
            data, usage = await read_answer(response, runtime.settings.upstream_max_response_bytes)
        except UpstreamFailure as failure:
            failed = "body_timeout" if failure.timeout else failure.kind if failure.invalid else "body_error"
            retry(failed, str(failure), failure_error(failure, pool, dict(headers)))
            return None
        except BaseException:
            preempted = _preempted(yielder)
            outcome = "cancelled"
            release()
            trial.neutral()
            if preempted:
                response.close()  # the engine aborts a request whose connection closes
                raise Preempted(url) from None
            raise
        trial.succeeded(time.monotonic())
        record.ttft_s = time.perf_counter() - req.started
        metrics.first_byte.labels(model, pool).observe(record.ttft_s)
        done(200)
        if runtime.cache.wants(req.cache, model):
            assert req.cache is not None
            runtime.cache.store_answer(req.cache, str(req.identity.tenant_id), data)
        await self._account(req, stage.model, usage, 0, record)
        return Response(content=data, status_code=200, media_type="application/json", headers=dict(headers))

    async def _account(self, req: PendingRequest, model: Model, usage: dict[str, Any] | None, text_events: int,
                       record: RequestRecord) -> None:
        """Settle the request's reservation with what it used and add it to the usage ledger.

        The engine's ``usage`` when it sent one; else (a stream without ``include_usage``, or one
        its client left) the prompt as counted at admission and one token per text event.
        """
        prompt, completion, cached = req.prompt_tokens, text_events, 0
        if usage is not None:
            prompt, completion, cached = usage_counts(usage, prompt, completion)
        record.prompt_tokens, record.completion_tokens, record.cached_tokens = prompt, completion, cached
        spend = spend_of(model, prompt, completion, cached, batch=req.batch)
        identity = req.identity
        runtime = self.runtime
        runtime.usage.record(identity.tenant_id, identity.key_id, model.name, prompt, completion, cached, spend)
        prompt_total, completion_total, cached_total, spend_total = runtime.metrics.usage_counters(model.name)
        prompt_total.inc(prompt)
        completion_total.inc(completion)
        if cached:
            cached_total.inc(cached)
        spend_total.inc(spend)
        if req.lease.reservation is not None:
            await req.lease.settle(prompt + completion, spend)


def _finish_trace(spans: RequestTrace, record: RequestRecord) -> None:
    """End the request's span with what became of it."""
    spans.finish({"http.response.status_code": record.status, "switchyard.outcome": record.outcome,
                  "switchyard.tier": record.tier, "switchyard.model": record.model,
                  "switchyard.served_model": record.served_model, "switchyard.pool": record.pool,
                  "switchyard.region": record.region, "switchyard.class": record.priority,
                  "switchyard.attempts": record.attempts, "switchyard.cache": record.cache},
                 error=(record.status or 0) >= 500)


def _preempted(yielder: Yielder | None) -> bool:
    """Whether the cancellation being handled is flow control's preemption of ``yielder`` and nothing
    else's (then it is taken back: the request goes on, to queue again)."""
    if yielder is None or not yielder.preempted:
        return False
    task = asyncio.current_task()
    return task is not None and task.uncancel() == 0


def _tried(record: RequestRecord, attempts: Attempts, headers: dict[str, str]) -> None:
    """Copy what the request's tries did into its record: attempts, moves and why, the route it took."""
    record.attempts = attempts.count
    record.moved_on = attempts.moved_on
    record.trace.extend(attempts.failures)
    route = headers.get("x-switchyard-route")
    if route is not None:
        record.trace.append(f"route: {route}")


def _asked_usage(body: dict[str, Any]) -> bool:
    """Whether a streaming client asked for the usage chunk itself."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True
