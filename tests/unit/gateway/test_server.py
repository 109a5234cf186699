"""The gateway's HTTP protocol in-process, on a fake transport: head size, slow heads, stalled bodies, and answers
written in one piece.

(tests/integration/test_limits.py does the same over real sockets against a gateway process.)
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState

from switchyard.gateway.server import ClientLimits, LimitedHttpToolsProtocol, OnePieceCycle

LIMITS = ClientLimits(max_header_bytes=4096, header_timeout_s=0.2, body_timeout_s=0.2)


class FakeTransport(asyncio.Transport):
    """Collects what the protocol writes; records whether it shut down writing and closed."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        #: Each write, as it came.
        self.writes: list[bytes] = []
        self.closed = False
        self.eof = False
        self.paused = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8400)}.get(name, default)


async def echo_app(scope: Any, receive: Any, send: Any) -> None:
    """Reads the whole body, answers its length."""
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = str(size).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def connect(limits: ClientLimits = LIMITS, app: Any = echo_app) -> tuple[LimitedHttpToolsProtocol, FakeTransport]:
    config = Config(app, lifespan="off", log_level="warning", access_log=False)  # (as the gateway serves)
    config.load()
    protocol = LimitedHttpToolsProtocol(config=config, server_state=ServerState(), app_state={}, limits=limits)
    transport = FakeTransport()
    protocol.connection_made(transport)
    return protocol, transport


async def turns(n: int = 5) -> None:
    """Let the event loop run ``n`` turns (the app's task, its writes)."""
    for _ in range(n):
        await asyncio.sleep(0)


def answer(transport: FakeTransport) -> tuple[int, dict[str, Any]]:
    head, _, body = bytes(transport.written).partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


async def test_a_complete_head_over_the_limit_is_431_and_never_reaches_the_app() -> None:
    protocol, transport = connect()
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n")
    await asyncio.sleep(0)
    status, body = answer(transport)
    assert status == 431 and body["error"]["code"] == "headers_too_large"
    assert transport.eof and not transport.closed  # lingering: what still comes is read and dropped
    protocol.data_received(b"more")
    assert status == answer(transport)[0]
    protocol.connection_lost(None)


async def test_a_head_growing_over_the_limit_in_pieces_is_431() -> None:
    protocol, transport = connect()
    protocol.data_received(b"GET / HTTP/1.1\r\nX-Endless: ")
    for _ in range(10):
        protocol.data_received(b"a" * 1000)
        if transport.written:
            break
    assert answer(transport)[0] == 431
    protocol.connection_lost(None)


async def test_heads_within_the_limit_are_served_and_kept_alive() -> None:
    protocol, transport = connect()
    for _ in range(3):
        transport.written.clear()
        protocol.data_received(b"POST / HTTP/1.1\r\nHost: x\r\nX-Fine: " + b"a" * 3000
                               + b"\r\nContent-Length: 5\r\n\r\nhello")
        await turns()
        assert bytes(transport.written).startswith(b"HTTP/1.1 200") and bytes(transport.written).endswith(b"5")
    assert not transport.closed and protocol._head_timer is None and protocol._body_timer is None
    protocol.connection_lost(None)


async def test_a_slow_head_is_408_after_the_header_timeout() -> None:
    protocol, transport = connect()
    for _ in range(6):
        if transport.written:
            break
        protocol.data_received(b"X-Slow: 1\r\n" if protocol._head_raw else b"GET / HTTP/1.1\r\n")
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    status, body = answer(transport)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    protocol.connection_lost(None)


async def test_a_connection_that_sends_nothing_is_closed_silently() -> None:
    protocol, transport = connect()
    await asyncio.sleep(0.3)
    assert transport.closed and not transport.written
    protocol.connection_lost(None)


async def test_the_header_clock_starts_with_a_requests_first_byte_on_a_kept_alive_connection() -> None:
    protocol, transport = connect()
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await turns()
    await asyncio.sleep(0.3)  # idle longer than the header timeout: uvicorn's keep-alive timeout's business
    assert not transport.closed
    transport.written.clear()
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await turns()
    assert bytes(transport.written).startswith(b"HTTP/1.1 200")
    protocol.connection_lost(None)


async def test_a_stalled_body_is_408_and_the_app_sees_the_client_leave() -> None:
    protocol, transport = connect()
    protocol.data_received(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
    for _ in range(4):  # pauses shorter than the timeout are fine
        await asyncio.sleep(0.1)
        protocol.data_received(b"0123456789")
    assert not transport.written
    await asyncio.sleep(0.35)
    status, body = answer(transport)
    assert status == 408 and "stopped arriving" in body["error"]["message"]
    assert protocol.cycle.disconnected
    protocol.connection_lost(None)


async def test_the_cycle_says_once_that_its_client_went_before_the_answer_was_complete() -> None:
    told: list[str] = []
    answered = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        cycle = send.__self__
        cycle.on_client_gone = lambda: told.append(scope["path"])
        await receive()
        if scope["path"] == "/whole":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
        answered.set()
        await asyncio.sleep(10)

    for path, gone in (("/whole", []), ("/unanswered", ["/unanswered"])):
        told.clear()
        answered.clear()
        protocol, _ = connect(app=app)
        protocol.data_received(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        await asyncio.wait_for(answered.wait(), 1)
        protocol.connection_lost(None)
        protocol.connection_lost(None)  # (a second loss says nothing more)
        assert told == gone
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()
        await turns()

    told.clear()  # a body that stops arriving: the client is gone too
    protocol, _ = connect(app=app)
    protocol.data_received(b"POST /stalled HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123")
    await asyncio.sleep(0.35)
    assert told == ["/stalled"]
    protocol.connection_lost(None)
    assert told == ["/stalled"]
    for task in asyncio.all_tasks() - {asyncio.current_task()}:
        task.cancel()
    await turns()


async def slow_app(scope: Any, receive: Any, send: Any) -> None:
    """Busy for a while before it reads the body."""
    await asyncio.sleep(0.5)
    await echo_app(scope, receive, send)


async def test_a_body_held_back_by_the_server_is_not_the_clients_pause() -> None:
    """More than uvicorn buffers (64 KiB) came before the application read any: reading pauses, and the
    time the server holds the body back is not counted against the client."""
    protocol, transport = connect(app=slow_app)
    protocol.data_received(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 70010\r\n\r\n" + b"x" * 70_000)
    assert transport.paused
    await asyncio.sleep(0.45)
    assert not transport.written and not transport.closed
    await asyncio.sleep(0.1)  # the application reads at last
    assert not transport.paused
    protocol.data_received(b"0123456789")
    await turns()
    assert bytes(transport.written).startswith(b"HTTP/1.1 200") and bytes(transport.written).endswith(b"70010")
    protocol.connection_lost(None)


async def test_a_whole_answer_is_written_in_one_piece_on_a_kept_alive_connection() -> None:
    protocol, transport = connect()
    for body in (b"hello", b""):
        transport.writes.clear()
        protocol.data_received(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await turns()
        assert len(transport.writes) == 1, transport.writes  # head and body: one write
        head, _, sent = transport.writes[0].partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"content-length: " in head and sent == str(len(body)).encode()
    assert not transport.closed
    protocol.connection_lost(None)


def _streaming_app(go_on: asyncio.Event | None, *, at_once: bool = False) -> Any:
    """A stream whose first chunk waits for ``go_on`` (None: sent at once, as the gateway sends its streams); its
    head through :meth:`OnePieceCycle.start_stream` (``at_once``) or as uvicorn's start message."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        if not at_once:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
        elif not send.__self__.start_stream(200, {"X-Request-Id": "abc"}, b"text/event-stream"):
            raise AssertionError("start_stream declined")
        if go_on is not None:
            await go_on.wait()
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    return app


@pytest.mark.parametrize("at_once", [False, True], ids=["asgi-start", "start_stream"])
async def test_a_streams_head_goes_with_its_first_chunk_or_alone_when_that_chunk_waits(at_once: bool) -> None:
    protocol, transport = connect(app=_streaming_app(None, at_once=at_once))
    protocol.data_received(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    await turns()
    head, _, first = transport.writes[0].partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head and first == b"9\r\ndata: 1\n\n\r\n"
    assert transport.writes[1:] == [b"0\r\n\r\n"]
    if at_once:
        assert head == (b"HTTP/1.1 200 OK\r\nx-request-id: abc\r\ncontent-type: text/event-stream\r\n"
                        b"transfer-encoding: chunked")
    protocol.connection_lost(None)

    go_on = asyncio.Event()
    protocol, transport = connect(app=_streaming_app(go_on, at_once=at_once))
    protocol.data_received(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    await turns()
    assert len(transport.writes) == 1 and transport.writes[0].endswith(b"transfer-encoding: chunked\r\n\r\n")
    go_on.set()  # (the head did not wait for it)
    await turns()
    assert transport.writes[1:] == [b"9\r\ndata: 1\n\n\r\n", b"0\r\n\r\n"]
    protocol.connection_lost(None)


async def test_a_head_request_and_a_bodiless_status_get_their_head_at_once() -> None:
    async def no_content(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await asyncio.sleep(3600)  # (its body message never comes)

    protocol, transport = connect()
    protocol.data_received(b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n")
    await turns()
    assert len(transport.writes) == 1 and b"content-length: 1" in transport.writes[0]
    assert transport.writes[0].endswith(b"\r\n\r\n")  # the head only
    protocol.connection_lost(None)
    protocol, transport = connect(app=no_content)
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await turns()
    assert [w.split(b"\r\n")[0] for w in transport.writes] == [b"HTTP/1.1 204 No Content"]
    protocol.connection_lost(None)


async def test_an_app_failing_after_its_head_gets_the_head_written_and_the_connection_closed() -> None:
    async def failing(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"10")]})
        raise RuntimeError("a bug")

    protocol, transport = connect(app=failing)
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await turns()
    assert len(transport.writes) == 1 and transport.writes[0].startswith(b"HTTP/1.1 200")
    assert transport.closed and protocol.cycle.transport is transport
    protocol.connection_lost(None)


def _whole_app(headers: dict[str, Any], *, at_once: bool, status: int = 200, body: bytes = b'{"ok": true}') -> Any:
    """Answers ``body`` with ``headers``: through :meth:`OnePieceCycle.send_whole` (``at_once``; what it returned
    is kept in ``app.took``), else (or where it declined) as two ASGI messages, as uvicorn's ``send`` takes them."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        if at_once:
            cycle = send.__self__
            assert isinstance(cycle, OnePieceCycle)
            took = cycle.send_whole(status, headers, b"application/json", body)
            app.took.append((took, cycle.response_started))  # type: ignore[attr-defined]
            if took:
                return
        encoded = [(name.lower().encode("latin-1"), str(value).encode("latin-1")) for name, value in headers.items()]
        names = {name.lower() for name in headers}
        if "content-type" not in names:
            encoded.append((b"content-type", b"application/json"))
        if "content-length" not in names:
            encoded.append((b"content-length", b"%d" % len(body)))
        await send({"type": "http.response.start", "status": status, "headers": encoded})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    app.took = []  # type: ignore[attr-defined]
    return app


async def _exchange(app: Any, requests: list[bytes]) -> tuple[bool, list[bytes]]:
    """What ``app`` wrote for each of ``requests`` in turn on one connection (the server's default headers: a date),
    and whether the server closed the connection."""
    config = Config(app, lifespan="off", log_level="warning", access_log=False)
    config.load()
    state = ServerState()
    state.default_headers = [(b"date", b"Mon, 07 Dec 2026 10:00:00 GMT")]
    protocol = LimitedHttpToolsProtocol(config=config, server_state=state, app_state={}, limits=LIMITS)
    transport = FakeTransport()
    protocol.connection_made(transport)
    answers = []
    for request in requests:
        transport.writes.clear()
        protocol.data_received(request)
        await turns()
        answers.append(b"".join(transport.writes))
    closed = transport.closed
    protocol.connection_lost(None)
    return closed, answers


KEPT = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
CLOSING = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"


async def test_a_whole_answer_sent_at_once_is_what_uvicorns_send_writes_and_the_connection_goes_on() -> None:
    headers = {"X-Request-Id": "abc", "x-ratelimit-remaining-tokens": 99, "x-switchyard-route": "model=small; pool=p"}
    for requests in ([KEPT, KEPT], [CLOSING]):
        fast = _whole_app(headers, at_once=True)
        fast_closed, fast_answers = await _exchange(fast, requests)
        slow_closed, slow_answers = await _exchange(_whole_app(headers, at_once=False), requests)
        assert fast.took == [(True, True)] * len(requests)
        assert fast_answers == slow_answers  # byte for byte: the date, every header, the length, the body
        assert all(len(a) > 0 for a in fast_answers) and fast_answers[0].startswith(b"HTTP/1.1 200 OK\r\ndate: ")
        assert b"x-ratelimit-remaining-tokens: 99\r\n" in fast_answers[0]
        assert fast_closed == slow_closed == (requests == [CLOSING])
        if requests == [CLOSING]:
            assert b"connection: close\r\n" in fast_answers[0]
    # the answer's own content type is kept, and an error status too
    typed = _whole_app({"Content-Type": "text/plain"}, at_once=True, status=429, body=b"no")
    _, (answer,) = await _exchange(typed, [KEPT])
    assert answer == (b"HTTP/1.1 429 Too Many Requests\r\ndate: Mon, 07 Dec 2026 10:00:00 GMT\r\n"
                      b"content-type: text/plain\r\ncontent-length: 2\r\n\r\nno")


@pytest.mark.parametrize("headers", [
    {"x-ok": "plain", "x-tab": "a\tb", "x-latin": "caf\u00e9", "x-all": "".join(map(chr, range(0x20, 0x7f)))},
    {"x-ok": "plain", "x-del": "a\x7fb"}, {"x-nul": "\x00"}, {"x-lf": "a\nb"}, {"x-cr": "a\rb"},
    {"x-ok": "plain", "x(paren)": "v"}, {"x-ok": "plain", "x:colon": "v"}, {"x\ttab": "v"}, {"x-ok": "plain"},
])
async def test_send_whole_refuses_exactly_the_headers_uvicorn_refuses(headers: dict[str, str]) -> None:
    """Names found good are remembered and values checked in one pass: the verdict is still uvicorn's own, header
    by header (a bad name after good ones, a bad byte among good ones)."""
    from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE

    refused = any(HEADER_RE.search(name.lower().encode("latin-1")) or HEADER_VALUE_RE.search(value.encode("latin-1"))
                  for name, value in headers.items())
    for _ in range(2):  # (the second time, the names of the first are remembered)
        async def app(scope: Any, receive: Any, send: Any) -> None:
            await receive()
            try:
                app.took = send.__self__.send_whole(200, headers, b"application/json", b"{}")  # type: ignore[attr-defined]
            except RuntimeError:
                app.took = "refused"  # type: ignore[attr-defined]

        _, (written,) = await _exchange(app, [KEPT])
        assert app.took == ("refused" if refused else True)  # type: ignore[attr-defined]
        assert written.startswith(b"HTTP/1.1 200") != refused
        if not refused:
            assert "caf\u00e9".encode("latin-1") in written or "x-latin" not in headers


async def test_send_whole_leaves_framing_headers_to_uvicorn_and_refuses_what_uvicorn_refuses() -> None:
    framed = _whole_app({"Content-Length": "12"}, at_once=True)
    _, written = await _exchange(framed, [KEPT])
    assert framed.took == [(False, False)]  # nothing done: the caller sends it the ASGI way
    assert written == (await _exchange(_whole_app({"Content-Length": "12"}, at_once=False), [KEPT]))[1]
    assert written[0].count(b"content-length") == 1

    async def bodiless(scope: Any, receive: Any, send: Any) -> None:  # a stream of a status that has no body
        await receive()
        bodiless.took = send.__self__.start_stream(204, {}, b"text/event-stream")  # type: ignore[attr-defined]
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    _, (written,) = await _exchange(bodiless, [KEPT])
    assert bodiless.took is False and written.startswith(b"HTTP/1.1 204")  # type: ignore[attr-defined]
    assert b"transfer-encoding" not in written
    for bad in ({"x-bad": "a\r\nx-injected: 1"}, {"bad name": "x"}):
        async def app(scope: Any, receive: Any, send: Any, bad: dict[str, str] = bad) -> None:
            await receive()
            with pytest.raises(RuntimeError, match="Invalid HTTP header"):
                send.__self__.send_whole(200, bad, b"application/json", b"{}")
            app.checked = True  # type: ignore[attr-defined]

        _, (written,) = await _exchange(app, [KEPT])
        assert app.checked and not written.startswith(b"HTTP/1.1 200")  # type: ignore[attr-defined]
        assert b"x-injected" not in written and b"bad name" not in written
