"""The gateway's HTTP protocol in-process, on a fake transport: head size, slow heads, stalled bodies, and answers
written in one piece.

(tests/integration/test_limits.py does the same over real sockets against a gateway process.)
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.config import Config
from uvicorn.server import ServerState

from switchyard.gateway.server import ClientLimits, LimitedHttpToolsProtocol

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
    config = Config(app, lifespan="off", log_level="warning")
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


def _streaming_app(go_on: asyncio.Event | None) -> Any:
    """A stream whose first chunk waits for ``go_on`` (None: sent at once, as the gateway sends its streams)."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        if go_on is not None:
            await go_on.wait()
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    return app


async def test_a_streams_head_goes_with_its_first_chunk_or_alone_when_that_chunk_waits() -> None:
    protocol, transport = connect(app=_streaming_app(None))
    protocol.data_received(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    await turns()
    head, _, first = transport.writes[0].partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head and first == b"9\r\ndata: 1\n\n\r\n"
    assert transport.writes[1:] == [b"0\r\n\r\n"]
    protocol.connection_lost(None)

    go_on = asyncio.Event()
    protocol, transport = connect(app=_streaming_app(go_on))
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
