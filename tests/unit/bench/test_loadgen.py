"""The open-loop driver against a small aiohttp server on a loopback port.

The server's behaviour is chosen by the request's ``model``; it answers after fixed delays, so
the tests can check ordering (requests leave on schedule while earlier ones are unanswered) and
SSE timing (first token after the role-only chunk, one gap per later chunk), with rough bounds
only, never tight wall-clock limits.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from switchyard.bench.loadgen import connection_limit, run_open_loop
from switchyard.bench.prompts import LiteralText
from switchyard.bench.results import Outcome
from switchyard.bench.sender import Target
from switchyard.bench.spec import Labels, RequestSpec
from tests.helpers import free_port

SLOW_S = 1.2
FIRST_S = 0.2
GAP_S = 0.1


@dataclass
class Server:
    url: str
    seen: list[dict[str, str]] = field(default_factory=list)
    in_flight: int = 0
    peak: int = 0


def _chunk(payload: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def _stream(request: web.Request, kind: str, model: str) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "x-switchyard-route": "model=m; pool=p1; attempt=2",
                                           "x-switchyard-attempts": "2"})
    await response.prepare(request)
    if kind == "chat":
        await response.write(_chunk({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
    await asyncio.sleep(FIRST_S)
    for i in range(5):
        if i:
            await asyncio.sleep(GAP_S)
        piece = {"delta": {"content": f" w{i}"}} if kind == "chat" else {"text": f" w{i}"}
        await response.write(_chunk({"choices": [{"index": 0, **piece, "finish_reason": "stop" if i == 4 else None}]}))
        if model == "stream_error" and i == 1:
            await response.write(_chunk({"error": {"message": "engine died", "type": "internal_error",
                                                   "code": 500}}))
            return response
        if model == "truncated" and i == 1:
            return response
    await response.write(_chunk({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 5,
                                                           "prompt_tokens_details": {"cached_tokens": 4}}}))
    await response.write(b"data: [DONE]\n\n")
    return response


async def _handle(request: web.Request) -> web.StreamResponse:
    server = request.app[SERVER]
    body = await request.json()
    prompt = body["messages"][0]["content"] if "messages" in body else body["prompt"]
    server.seen.append({"auth": request.headers.get("Authorization", ""),
                        "rid": request.headers.get("x-request-id", ""), "model": body["model"], "prompt": prompt})
    server.in_flight += 1
    server.peak = max(server.peak, server.in_flight)
    try:
        model = body["model"]
        kind = "chat" if request.path.endswith("/chat/completions") else "completion"
        if model == "shed":
            return web.json_response({"error": {"message": "overloaded", "type": "overloaded_error",
                                                 "param": None, "code": "shed"}},
                                     status=503, headers={"Retry-After": "2"})
        if model == "hang":
            await asyncio.sleep(5)
        if body.get("stream"):
            return await _stream(request, kind, model)
        if model == "slow":
            await asyncio.sleep(SLOW_S)
        return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                               "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
    finally:
        server.in_flight -= 1


SERVER = web.AppKey("server", Server)


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _handle)
    app.router.add_post("/v1/completions", _handle)
    port = free_port()
    state = Server(f"http://127.0.0.1:{port}")
    app[SERVER] = state
    runner = web.AppRunner(app, handler_cancellation=True)  # a client that gives up ends its handler
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield state
    await runner.cleanup()


def spec(index: int, arrival: float, model: str, *, stream: bool = False, kind: str = "chat",
         tenant: str = "t1") -> RequestSpec:
    labels = Labels(tenant=tenant, request_class="c", model=model, kind=kind, stream=stream)  # type: ignore[arg-type]
    return RequestSpec(index, arrival, LiteralText(f"hello number {index}"), 5, labels)


async def test_arrivals_stay_on_schedule_while_responses_are_slow(server: Server) -> None:
    specs = [spec(i, 0.04 * i, "slow") for i in range(20)]
    results = await run_open_loop(specs, Target(server.url, name="arm"), progress=False)
    assert [r.index for r in results] == list(range(20))
    assert all(r.ok and r.status == 200 for r in results)
    # every request left before the first answer came back: sends did not wait for responses
    assert max(r.sent_s for r in results) < min(r.done_s for r in results)
    assert server.peak >= 15
    for r in results:
        assert r.lateness_s > -1e-3  # never early
        assert r.lateness_s < SLOW_S / 2  # and far from waiting for an answer
        assert r.ttft_s is not None and r.ttft_s >= SLOW_S * 0.9  # non-stream: the whole answer
        assert r.chunks == 1 and r.completion_tokens == 1 and r.finish_reason == "length"


async def test_sse_timing_usage_and_headers(server: Server) -> None:
    specs = [spec(0, 0.0, "m", stream=True), spec(1, 0.0, "m", stream=True, kind="completion")]
    results = await run_open_loop(specs, Target(server.url), progress=True)  # no TTY here: no bar
    for r in results:
        assert r.ok, r
        assert r.chunks == 5  # the role-only chunk carries no content and is not a token
        assert r.ttft_s is not None and r.ttft_s >= FIRST_S * 0.75
        assert len(r.itl_s) == 4 and all(g >= 0 for g in r.itl_s)
        assert sum(r.itl_s) >= 4 * GAP_S * 0.5
        assert r.first_token_s is not None and r.sent_s <= r.first_token_s < r.done_s
        assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (12, 5, 4)
        assert r.finish_reason == "stop"
        assert r.pool == "p1" and r.attempts == 2 and r.fell_back


async def test_errors_are_recorded_not_raised(server: Server) -> None:
    specs = [spec(0, 0.0, "shed"), spec(1, 0.0, "stream_error", stream=True), spec(2, 0.0, "truncated", stream=True),
             spec(3, 0.0, "hang")]
    results = await run_open_loop(specs, Target(server.url), progress=False, timeout_s=0.8)
    shed, broken, cut, hung = results
    assert shed.outcome is Outcome.SHED and shed.retry_after == "2"
    assert (shed.error_type, shed.error_code, shed.error_message) == ("overloaded_error", "shed", "overloaded")
    assert broken.outcome is Outcome.ERROR and broken.status == 200
    assert (broken.error_type, broken.error_code, broken.chunks) == ("internal_error", "500", 2)
    assert cut.outcome is Outcome.ERROR and cut.error_type == "stream_truncated"
    assert hung.outcome is Outcome.TIMEOUT and hung.timed_out and hung.status == 0


async def test_connection_failure() -> None:
    results = await run_open_loop([spec(0, 0.0, "m")], Target(f"http://127.0.0.1:{free_port()}"), progress=False)
    assert results[0].outcome is Outcome.ERROR and results[0].error_type == "connection_error"


async def test_keys_per_tenant_and_request_ids(server: Server) -> None:
    specs = [spec(0, 0.0, "m", tenant="t1"), spec(1, 0.01, "m", tenant="t2")]
    target = Target(server.url, name="cand", api_keys={"t1": "k1", "t2": "k2"}, headers={"x-extra": "1"})
    await run_open_loop(specs, target, progress=False)
    assert sorted((s["rid"], s["auth"]) for s in server.seen) == [("bench-cand-0", "Bearer k1"),
                                                                   ("bench-cand-1", "Bearer k2")]
    with pytest.raises(ValueError, match="no API key for tenant"):
        await run_open_loop(specs, Target(server.url, api_keys={"t1": "k1"}), progress=False)


async def test_each_request_carries_its_own_body(server: Server) -> None:
    # bursts of simultaneous arrivals (bodies encoded ahead) and spaced ones (encoded while waiting)
    times = [0.0] * 15 + [0.05 * i for i in range(1, 11)] + [0.6] * 15
    specs = [spec(i, t, "m", kind="completion" if i % 2 else "chat") for i, t in enumerate(times)]
    results = await run_open_loop(specs, Target(server.url, name="x"), progress=False)
    assert all(r.ok for r in results)
    assert sorted((s["rid"], s["prompt"]) for s in server.seen) == sorted(
        (f"bench-x-{i}", f"hello number {i}") for i in range(len(specs)))


def test_connection_limit_covers_the_busiest_window() -> None:
    specs = [spec(i, t, "m") for i, t in enumerate([0.0, 0.1, 0.2, 5.0, 5.05, 5.1, 5.15, 20.0])]
    assert connection_limit(specs, timeout_s=1.0) == 16  # at least 16
    many = [spec(i, i * 0.001, "m") for i in range(100)]
    assert connection_limit(many, timeout_s=1.0) == 100
