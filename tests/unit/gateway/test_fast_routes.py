"""The hot path's routes answered ahead of Litestar (``gateway/fast_routes.py``) answer exactly as Litestar's
handlers, exception handlers and body limit do: the same ASGI messages for the same answer of the proxy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from litestar import Request, Response, post
from litestar.background_tasks import BackgroundTask
from litestar.enums import MediaType
from litestar.exceptions import HTTPException
from litestar.response import Stream

from switchyard.api.errors import (
    ApiError,
    RateLimited,
    Unauthorized,
    api_error_handler,
    http_exception_handler,
    internal_error_handler,
)
from switchyard.gateway.fast_routes import FastRoutes, GatewayApp
from switchyard.gateway.request import Incoming
from switchyard.gateway.server import OnePieceCycle
from tests.unit.gateway.test_server import connect, turns

LIMIT = 64


class FakeProxy:
    """Answers with what ``answer`` makes of the request (its headers and body)."""

    def __init__(self, answer: Callable[[Incoming], Response[Any]]) -> None:
        self.answer = answer
        self.seen: list[tuple[Incoming, str]] = []

    async def serve(self, incoming: Incoming, kind: str) -> Response[Any]:
        self.seen.append((incoming, kind))
        return self.answer(incoming)


def _apps(proxy: FakeProxy) -> tuple[GatewayApp, GatewayApp]:
    """(Litestar's way, the fast way) around one proxy."""

    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request[Any, Any, Any]) -> Response[Any]:
        return await proxy.serve(await Incoming.from_http(request), "chat")

    def app() -> GatewayApp:
        return GatewayApp(route_handlers=[chat], request_max_body_size=LIMIT, logging_config=None,
                          exception_handlers={ApiError: api_error_handler, HTTPException: http_exception_handler,
                                              Exception: internal_error_handler})

    slow, fast = app(), app()
    fast.serve_fast(FastRoutes(proxy, LIMIT))  # type: ignore[arg-type]
    return slow, fast


async def _call(app: GatewayApp, body: bytes, *, headers: list[tuple[bytes, bytes]] | None = None,
                chunks: int = 1, path: str = "/v1/chat/completions", method: str = "POST",
                leave_after: int | None = None) -> list[dict[str, Any]]:
    """The ASGI messages ``app`` sends for a request, as uvicorn would carry them; ``leave_after``: the client leaves
    after that many."""
    size = max(1, -(-len(body) // chunks))
    parts = [body[i:i + size] for i in range(0, len(body), size)] or [b""]
    incoming: list[dict[str, Any]] = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
                                      for i, p in enumerate(parts)]
    sent: list[dict[str, Any]] = []
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        complete = message["type"] == "http.response.body" and not message.get("more_body", False)
        if complete or (leave_after is not None and len(sent) >= leave_after):
            gone.set()  # (uvicorn: once the answer is complete, the next message is the disconnect)

    scope = _scope(method, path, headers if headers is not None else [(b"content-length", str(len(body)).encode())])
    await asyncio.wait_for(app(scope, receive, send), 5)
    gone.set()
    return sent


def _scope(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
            "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000), "state": {}}


def _whole(incoming: Incoming) -> Response[Any]:
    return Response(b'{"id":"x","seen":' + str(len(incoming.raw)).encode() + b"}", status_code=200,
                    media_type="application/json",
                    headers={"X-Switchyard-Route": "model=small", "x-request-id": incoming.headers["x-request-id"]})


@pytest.mark.parametrize("answer", ["whole", "enum", "refused", "limited", "bug"])
async def test_answers_and_errors_are_the_messages_litestar_sends(answer: str) -> None:
    def make(incoming: Incoming) -> Response[Any]:
        if answer == "enum":  # a media type given as Litestar's enum
            return Response(b"{}", media_type=MediaType.JSON, headers={"x-request-id": "r"})
        if answer == "refused":
            raise Unauthorized("Incorrect API key provided.", headers={"x-request-id": "r1"})
        if answer == "limited":
            raise RateLimited("slow down", limit="tokens_per_minute", headers={"Retry-After": "3"})
        if answer == "bug":
            raise KeyError("oops")
        return _whole(incoming)

    slow, fast = _apps(FakeProxy(make))
    headers = [(b"content-length", b"2"), (b"X-Request-Id", b"first"), (b"x-request-id", b"second")]
    expected = await _call(slow, b"{}", headers=headers)
    assert await _call(fast, b"{}", headers=headers) == expected
    assert expected[0]["status"] == {"whole": 200, "enum": 200, "refused": 401, "limited": 429, "bug": 500}[answer]
    if answer == "whole":  # the first of repeated headers, as Litestar's ``get``; names in lower case
        assert (b"x-request-id", b"first") in expected[0]["headers"]


@pytest.mark.parametrize("write", ["written", "cancelled"])
async def test_a_whole_answers_background_runs_once_it_is_written_or_its_write_cancelled(write: str) -> None:
    """The gateway settles a whole answer (its record, its accounting) in the answer's background: after the write,
    and also when the write never ends (a shutdown cancelling it)."""
    events: list[str] = []

    async def after() -> None:
        events.append("background")

    _, fast = _apps(FakeProxy(lambda _: Response(b"{}", media_type=MediaType.JSON, background=BackgroundTask(after))))

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        events.append(message["type"])
        if write == "cancelled":
            raise asyncio.CancelledError

    call = fast(_scope("POST", "/v1/chat/completions", [(b"content-length", b"2")]), receive, send)
    if write == "cancelled":
        with pytest.raises(asyncio.CancelledError):
            await call
        assert events == ["http.response.start", "background"]
    else:
        await call
        assert events == ["http.response.start", "http.response.body", "background"]


@pytest.mark.parametrize(("body", "headers", "chunks"), [
    (b"x" * (LIMIT + 1), None, 1),  # announced too large
    (b"x" * (LIMIT + 1), [], 4),  # no content-length, more came than the limit
    (b"{}", [(b"content-length", b"two")], 1),  # not a number
])
async def test_bodies_refused_as_litestar_refuses_them(body: bytes, headers: list[tuple[bytes, bytes]] | None,
                                                     chunks: int) -> None:
    proxy = FakeProxy(_whole)
    slow, fast = _apps(proxy)
    expected = await _call(slow, body, headers=headers, chunks=chunks)
    assert await _call(fast, body, headers=headers, chunks=chunks) == expected
    assert expected[0]["status"] in (400, 413) and proxy.seen == []


async def test_a_body_in_parts_is_read_whole_and_the_headers_are_a_lower_case_dict() -> None:
    proxy = FakeProxy(_whole)
    _, fast = _apps(proxy)
    body = b'{"model": "small", "messages": []}'
    sent = await _call(fast, body, headers=[(b"Authorization", b"Bearer k"), (b"x-request-id", b"r")], chunks=3)
    assert sent[-1]["body"] == b'{"id":"x","seen":' + str(len(body)).encode() + b"}"
    (incoming, kind), = proxy.seen
    assert kind == "chat" and incoming.raw == body
    assert incoming.headers == {"authorization": "Bearer k", "x-request-id": "r"}


class Relay:
    """A stream whose chunks come when released; it records how it ended."""

    def __init__(self) -> None:
        self.release = asyncio.Queue[bytes | None]()
        self.ended: str | None = None
        self.finished = False

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            while (chunk := await self.release.get()) is not None:
                yield chunk
            self.ended = "completed"
        except asyncio.CancelledError:
            self.ended = "cancelled"
            raise

    async def finish(self) -> None:
        self.finished = True

    def answer(self, _incoming: Incoming) -> Response[Any]:
        return Stream(self.chunks(), media_type="text/event-stream", background=BackgroundTask(self.finish),
                      headers={"x-switchyard-route": "model=small", "Cache-Control": "no-cache"})


async def test_a_stream_is_relayed_as_litestar_relays_it() -> None:
    sent = {}
    for way in ("slow", "fast"):
        relay = Relay()
        for chunk in (b"data: 1\n\n", b"data: [DONE]\n\n", None):
            relay.release.put_nowait(chunk)
        slow, fast = _apps(FakeProxy(relay.answer))
        sent[way] = await _call(slow if way == "slow" else fast, b"{}")
        assert relay.ended == "completed" and relay.finished
    assert sent["fast"] == sent["slow"]
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent["fast"][0]["headers"]
    assert [m["body"] for m in sent["fast"][1:]] == [b"data: 1\n\n", b"data: [DONE]\n\n", b""]


async def test_a_client_that_leaves_mid_stream_cancels_the_relay_and_its_background_still_runs() -> None:
    relay = Relay()
    relay.release.put_nowait(b"data: 1\n\n")  # then nothing more: the client leaves after the first chunk
    _, fast = _apps(FakeProxy(relay.answer))
    sent = await _call(fast, b"{}", leave_after=2)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert relay.ended == "cancelled" and relay.finished
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0  # nothing left cancelled for the caller


async def test_behind_the_gateways_server_a_client_leaving_mid_stream_stops_the_relay_without_a_task_of_its_own(
) -> None:
    """The gateway's server tells the relay that its client left (``OnePieceCycle.on_client_gone``): no task waits
    for the disconnect beside the request's own, and the relay ends as when one did."""
    relay = Relay()
    relay.release.put_nowait(b"data: 1\n\n")  # then nothing more: the client leaves after the first chunk
    _, fast = _apps(FakeProxy(relay.answer))
    before = asyncio.all_tasks()
    protocol, transport = connect(app=fast)
    protocol.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    await turns()
    assert bytes(transport.written).startswith(b"HTTP/1.1 200") and b"data: 1" in bytes(transport.written)
    cycle = protocol.cycle
    assert isinstance(cycle, OnePieceCycle) and cycle.on_client_gone is not None
    assert len(asyncio.all_tasks() - before) == 1  # the request's task alone
    protocol.connection_lost(None)
    await turns()
    assert relay.ended == "cancelled" and relay.finished
    assert cycle.on_client_gone is None
    assert not asyncio.all_tasks() - before


async def test_a_stream_that_ends_lets_go_of_its_hook_and_a_later_loss_tells_nobody() -> None:
    relay = Relay()
    for chunk in (b"data: 1\n\n", None):
        relay.release.put_nowait(chunk)
    _, fast = _apps(FakeProxy(relay.answer))
    protocol, transport = connect(app=fast)
    protocol.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    await turns()
    assert relay.ended == "completed" and relay.finished
    assert bytes(transport.written).endswith(b"0\r\n\r\n")
    cycle = protocol.cycle
    assert isinstance(cycle, OnePieceCycle) and cycle.on_client_gone is None
    protocol.connection_lost(None)
    assert not cycle.disconnected  # (the answer was complete: nothing was cut off)


async def test_other_methods_and_paths_go_to_litestar() -> None:
    proxy = FakeProxy(_whole)
    _, fast = _apps(proxy)
    assert (await _call(fast, b"", method="GET"))[0]["status"] == 405
    assert (await _call(fast, b"{}", path="/v1/unknown"))[0]["status"] == 404
    assert proxy.seen == []
