"""The request path of ``/v1/chat/completions`` and ``/v1/completions``.

authenticate → parse → resolve the model (``decide``) → pick an endpoint (``decide``) → call
the engine → stream or return its answer. Every step that can refuse raises an ``ApiError``.
"""

from __future__ import annotations

import itertools
import re
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

import msgspec
from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from switchyard.decide.features import RequestFeatures, chat_features, completion_features
from switchyard.decide.pick import EndpointChoice, candidates, pick_least_outstanding
from switchyard.decide.resolve import ModelDecision, Refused, resolve_model
from switchyard.engines.upstream import (
    EngineError,
    StreamRelay,
    UpstreamFailure,
    post,
    read_body,
    read_engine_error,
)
from switchyard.gateway.body import check_chat, check_completion, decode_json_object
from switchyard.gateway.errors import (
    ApiError,
    BadGateway,
    BadRequest,
    Forbidden,
    GatewayTimeout,
    NotFound,
    Overloaded,
    PayloadTooLarge,
)
from switchyard.gateway.runtime import GatewayRuntime
from switchyard.policy import PolicySnapshot

Kind = Literal["chat", "completion"]
_PATHS: dict[Kind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class RequestIds:
    """Unique ids without a system call per request: a random per-process prefix and a counter.

    (``uuid4()`` reads the OS's random source on every call; on the hot path it cost about as
    much as the whole routing decision.)
    """

    __slots__ = ("_counter", "_prefix")

    def __init__(self) -> None:
        self._prefix = uuid.uuid4().hex[:12]
        self._counter = itertools.count(1)

    def new(self) -> str:
        """A fresh id, unique across processes and restarts."""
        return f"{self._prefix}{next(self._counter):x}"

    def for_request(self, request: Request[Any, Any, Any]) -> str:
        """The client's ``x-request-id`` when it is sane, else a fresh one."""
        given = request.headers.get("x-request-id")
        return given if given and _REQUEST_ID.match(given) else self.new()


def route_header(decision: ModelDecision, choice: EndpointChoice, snapshot: PolicySnapshot) -> str:
    """The ``x-switchyard-route`` value: what served the request, under which policy."""
    parts = [f"model={decision.model.name}"]
    if decision.route:
        parts.append(f"route={decision.route}")
        parts.append(f"rule={decision.rule}")
    parts += [f"pool={choice.pool.name}", f"region={choice.pool.region}",
              f"endpoint={choice.url}", f"policy={snapshot.label}"]
    return "; ".join(parts)


def refusal_error(refusal: Refused) -> ApiError:
    """The API error for a policy refusal."""
    cls = NotFound if refusal.status == 404 else Forbidden
    return cls(refusal.message, code=refusal.code, param=refusal.param)


def engine_error(err: EngineError, choice: EndpointChoice, headers: dict[str, str]) -> ApiError:
    """What an engine's non-2xx answer means for the client.

    The engine's 400s are the client's mistakes (context too long, bad parameter) and pass
    through; a 404 means the policy names a model the engine does not serve (a configuration
    error, so 502); 429/503 mean the engine is overloaded.
    """
    where = f"pool {choice.pool.name} ({choice.url})"
    code = str(err.code) if isinstance(err.code, str) else None
    if err.status in (400, 422):
        return BadRequest(err.message, code=code or "invalid_request", param=err.param, headers=headers)
    if err.status == 413:
        return PayloadTooLarge(err.message, headers=headers)
    if err.status == 404:
        return BadGateway(f"The engine of {where} does not serve '{choice.pool.served_model}': {err.message}",
                          code="upstream_model_missing", headers=headers)
    if err.status in (429, 503):
        return Overloaded(f"The engine of {where} is overloaded ({err.status}): {err.message}",
                          headers={**headers, "Retry-After": err.retry_after or "1"})
    return BadGateway(f"The engine of {where} answered {err.status}: {err.message}", headers=headers)


def failure_error(failure: UpstreamFailure, pool: str, headers: dict[str, str]) -> ApiError:
    """504 when the engine did not answer in time, 502 when it could not be reached or broke off."""
    cls = GatewayTimeout if failure.timeout else BadGateway
    return cls(f"Upstream failure in pool {pool}: {failure}", headers=headers)


class Proxy:
    """Carries requests to the engines."""

    def __init__(self, runtime: GatewayRuntime) -> None:
        self.runtime = runtime
        self.ids = RequestIds()

    async def handle(self, request: Request[Any, Any, Any], kind: Kind) -> Response[Any]:
        """Serve one chat or completion request."""
        started = time.perf_counter()
        runtime = self.runtime
        rid = self.ids.for_request(request)
        identity = await runtime.auth.authenticate(request.headers.get("authorization"))
        raw = await request.body()
        body = decode_json_object(raw)
        features: RequestFeatures
        if kind == "chat":
            check_chat(body)
            features = chat_features(body, request.headers)
        else:
            check_completion(body)
            features = completion_features(body, request.headers)
        snapshot = runtime.policy.snapshot  # read once; this request keeps it to the end
        try:
            decision = resolve_model(snapshot, identity.tier, features)
        except Refused as refusal:
            runtime.metrics.requests.labels("-", "-", str(refusal.status)).inc()
            raise refusal_error(refusal) from None
        choice = pick_least_outstanding(candidates(snapshot, decision.model), runtime.load.outstanding,
                                        runtime.next_rotation())
        served = choice.pool.served_model
        if body["model"] != served:
            body["model"] = served
            raw = msgspec.json.encode(body)
        headers = {"x-switchyard-route": route_header(decision, choice, snapshot), "x-request-id": rid}
        return await self._dispatch(kind, raw, bool(body.get("stream")), decision, choice, headers, started)

    async def _dispatch(self, kind: Kind, payload: bytes, stream: bool, decision: ModelDecision,
                        choice: EndpointChoice, headers: dict[str, str], started: float) -> Response[Any]:
        runtime = self.runtime
        model, pool = decision.model.name, choice.pool.name
        metrics = runtime.metrics
        runtime.load.acquire(choice.url)
        metrics.in_flight.labels(pool).inc()

        def done(status: int) -> None:
            runtime.load.release(choice.url)
            metrics.in_flight.labels(pool).dec()
            metrics.requests.labels(model, pool, str(status)).inc()
            metrics.duration.labels(model, pool).observe(time.perf_counter() - started)

        # The engine gets an id of our own: clients may reuse theirs, and two in-flight requests
        # with one id would collide inside the engine.
        upstream_headers = {"Content-Type": "application/json", "X-Request-Id": self.ids.new()}
        try:
            response = await post(runtime.http, choice.url + _PATHS[kind], payload, upstream_headers)
        except UpstreamFailure as failure:
            error = failure_error(failure, pool, headers)
            done(error.status_code)
            raise error from None
        if response.status >= 300:
            error = engine_error(await read_engine_error(response), choice, headers)
            done(error.status_code)
            raise error
        first_byte = self._first_byte_observer(model, pool, started)
        if stream:
            relay = StreamRelay(response, first_byte, lambda _completed: done(200))
            return Stream(relay.chunks(), media_type="text/event-stream",
                          headers={**headers, "Cache-Control": "no-cache"},
                          background=BackgroundTask(relay.afinish))
        try:
            data = await read_body(response)
        except UpstreamFailure as failure:
            error = failure_error(failure, pool, headers)
            done(error.status_code)
            raise error from None
        first_byte()
        done(200)
        return Response(content=data, status_code=200, media_type="application/json", headers=headers)

    def _first_byte_observer(self, model: str, pool: str, started: float) -> Callable[[], None]:
        histogram = self.runtime.metrics.first_byte.labels(model, pool)
        return lambda: histogram.observe(time.perf_counter() - started)
