"""The engines' client against loopback servers: connections closed without an answer, redirects (never
followed), and answers that are no answer (wrong type, not JSON, too large, streams cut short). The client's own
rules (keep-alive, the connection limit, timeouts, framing) are in ``test_http1.py``."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator

import msgspec
import pytest
import yarl

from switchyard.engines.http1 import EngineClient, EngineResponse
from switchyard.engines.streams import Leg, ResponsesUsage, StreamRelay, first_chunk
from switchyard.engines.upstream import (
    UpstreamFailure,
    UpstreamTimeouts,
    create_engine_client,
    post,
    read_body,
    read_engine_error,
    usage_counts,
)

BODY = b'{"ok": true}'
ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY)


class ClosingServer:
    """Reads each request, then closes the first ``drops`` connections without a byte of answer."""

    def __init__(self, drops: int) -> None:
        self.drops = drops
        self.requests = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            self.requests += 1
            if self.requests <= self.drops:
                writer.close()
                return
            writer.write(ANSWER)
            await writer.drain()


async def _post_to(server: ClosingServer) -> tuple[int, int]:
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    client = create_engine_client(UpstreamTimeouts(connect_s=2, read_s=5), max_connections=4)
    url = yarl.URL(f"http://127.0.0.1:{port}/v1/completions")
    try:
        # A first request on a new connection, kept alive: the server's close of it comes on the second.
        first = await post(client, url, b'{"prompt": "x"}', {"content-type": "application/json"})
        assert await first.read() == BODY
        first.release()
        server.requests = 0
        response = await post(client, url, b'{"prompt": "x"}', {"content-type": "application/json"})
        body = await response.read()
        assert body == BODY
        return response.status, server.requests
    finally:
        await client.close()
        listener.close()
        await listener.wait_closed()


class ClosingAfterFirst(ClosingServer):
    """Answers the first request, then closes the next ``drops`` connections at their first request."""

    def __init__(self, drops: int) -> None:
        super().__init__(drops)
        self.answered_first = False

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.answered_first:
            self.answered_first = True
            await read_request(reader)
            writer.write(ANSWER)
            await writer.drain()
        await super().handle(reader, writer)


async def test_a_kept_alive_connection_closed_before_any_answer_is_tried_once_more_on_a_new_one() -> None:
    status, requests = await _post_to(ClosingAfterFirst(drops=1))
    assert (status, requests) == (200, 2)


async def test_a_second_close_is_a_broken_upstream_not_a_third_try() -> None:
    server = ClosingAfterFirst(drops=2)
    with pytest.raises(UpstreamFailure) as failure:
        await _post_to(server)
    assert failure.value.kind == "broken" and "closed before any answer" in str(failure.value)
    assert server.requests == 2



# --- answers that are no answer -------------------------------------------------------------------------------


async def read_request(reader: asyncio.StreamReader) -> None:
    """Read one request (its head and its body) off a connection."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    await reader.readexactly(length)


class ScriptedServer:
    """Answers every request with ``pieces``, written one by one (a short pause between them), then
    closes the connection; counts the connections it was given."""

    def __init__(self, *pieces: bytes) -> None:
        self.pieces = pieces
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await read_request(reader)
            for piece in self.pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.01)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def http_answer(content_type: str | None, body: bytes, status: str = "200 OK", length: bool = True,
                extra: str = "") -> bytes:
    """A raw HTTP/1.1 answer (``length`` False: close-delimited, no Content-Length)."""
    head = f"HTTP/1.1 {status}\r\n" + (f"content-type: {content_type}\r\n" if content_type else "") + extra
    head += f"content-length: {len(body)}\r\n" if length else "connection: close\r\n"
    return head.encode() + b"\r\n" + body


def chunked(content_type: str, *parts: bytes, end: bool = True) -> list[bytes]:
    """A chunked answer's pieces: the head, each part as a chunk, and (``end``) the last chunk."""
    head = f"HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\n\r\n".encode()
    return [head, *(b"%x\r\n%s\r\n" % (len(p), p) for p in parts), *([b"0\r\n\r\n"] if end else [])]


class Upstream:
    """Servers on loopback and the gateway's engine client."""

    def __init__(self) -> None:
        self.client: EngineClient = create_engine_client(UpstreamTimeouts(connect_s=2, read_s=5), max_connections=4)
        self.listeners: list[asyncio.Server] = []

    async def serve(self, server: ScriptedServer) -> str:
        listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        self.listeners.append(listener)
        return f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"

    async def post(self, *pieces: bytes) -> EngineResponse:
        url = await self.serve(ScriptedServer(*pieces))
        return await post(self.client, yarl.URL(url + "/v1/completions"), b"{}", {"content-type": "application/json"})

    async def close(self) -> None:
        await self.client.close()
        for listener in self.listeners:
            listener.close()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    yield up
    await up.close()


async def test_a_redirect_is_never_followed(upstream: Upstream) -> None:
    trap = ScriptedServer(http_answer("application/json", b'{"stolen": true}'))
    trap_url = await upstream.serve(trap)
    for status in ("301 Moved Permanently", "302 Found", "303 See Other", "307 Temporary Redirect",
                   "308 Permanent Redirect"):
        response = await upstream.post(http_answer(None, b"", status, extra=f"location: {trap_url}/v1/completions\r\n"))
        assert response.status == int(status[:3])
        error = await read_engine_error(response)
        assert error.status == int(status[:3])
    assert trap.connections == 0


@pytest.mark.parametrize(("answer", "why"), [
    (http_answer("text/html", b"<html>It works!</html>"), "content type 'text/html'"),
    (http_answer(None, b'{"ok": true}'), "not application/json"),
    (http_answer("application/json", b"{'id': 'x'}"), "not a JSON object"),
    (http_answer("application/json", b'{"id": "x", "choices": [{"text": "cut'), "not a JSON object"),
    (http_answer("application/json", b"[1, 2]"), "not a JSON object"),
    (http_answer("application/json", b'{"pad": "' + b"x" * 2000 + b'"}'), "more than the gateway's limit of 1000"),
    (http_answer("application/json", b'{"pad": "' + b"x" * 2000 + b'"}', length=False), "more than the gateway's"),
    (b"".join(chunked("application/json", b'{"pad": "', b"x" * 600, b"x" * 600, b'"}')), "more than the gateway's"),
])
async def test_a_body_that_is_no_answer_is_an_invalid_response(upstream: Upstream, answer: bytes, why: str) -> None:
    response = await upstream.post(answer)
    with pytest.raises(UpstreamFailure) as failure:
        await read_body(response, max_bytes=1000)
    assert failure.value.invalid and failure.value.kind == "invalid_response" and not failure.value.timeout
    assert why in str(failure.value)
    assert response.closed  # what was left unread never goes back to the pool


async def test_a_cookie_an_engine_sets_is_never_sent_on(upstream: Upstream) -> None:
    """The upstream client keeps no cookies: what one engine sets would otherwise go with every later request,
    whoever sent it, to that engine and any other on the same host."""
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                heads.append(head.lower())
                writer.write(http_answer("application/json", b"{}", extra="set-cookie: session=tenant-a; Path=/\r\n"))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    listener = await asyncio.start_server(handle, "127.0.0.1", 0)
    upstream.listeners.append(listener)
    # (A name, not an address: a cookie jar takes no cookie from an IP address.)
    url = yarl.URL(f"http://localhost:{listener.sockets[0].getsockname()[1]}/v1/completions")
    for _ in range(2):
        response = await post(upstream.client, url, b"{}", {"content-type": "application/json"})
        assert await read_body(response) == b"{}"
    assert len(heads) == 2 and not any(b"\r\ncookie:" in head for head in heads)


async def test_a_good_body_is_read_whole(upstream: Upstream) -> None:
    body = b'{"id": "cmpl-1", "choices": [{"text": "' + b"y" * 900 + b'"}]}'
    for answer in (http_answer("application/json; charset=utf-8", body),
                   b"".join(chunked("application/json", body[:500], body[500:]))):
        assert await read_body(await upstream.post(answer), max_bytes=1000) == body


EVENT = b'data: {"id":"c","choices":[{"index":0,"text":"hi"}]}\n\n'
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize(("pieces", "why"), [
    ([http_answer("text/html", b"<html>It works!</html>")], "content type 'text/html'"),
    ([http_answer("application/json", b'{"id": "x"}')], "not text/event-stream"),
    (chunked("text/event-stream", b"<html>It works!</html>"), "a stream that is not SSE"),
    (chunked("text/event-stream", b"data: {'id': 'x'}\n\n", DONE), "first event is not JSON"),
])
async def test_a_stream_that_is_no_stream_fails_before_its_first_byte(upstream: Upstream, pieces: list[bytes],
                                                                     why: str) -> None:
    response = await upstream.post(*pieces)
    with pytest.raises(UpstreamFailure) as failure:
        await first_chunk(response)
    assert failure.value.kind == "invalid_response" and why in str(failure.value)
    response.close()


async def _relay(upstream: Upstream, *pieces: bytes, max_event_bytes: int = 1000,
                 strip_usage: bool = False) -> tuple[bytes, list[bool], StreamRelay]:
    response = await upstream.post(*pieces)
    outcomes: list[bool] = []
    relay = StreamRelay(Leg(response, await first_chunk(response), lambda _end: None), outcomes.append,
                        max_event_bytes=max_event_bytes, strip_usage=strip_usage)
    out = [chunk async for chunk in relay.chunks()]
    assert all(chunk.endswith(b"\n\n") for chunk in out)  # whole events only, always
    return b"".join(out), outcomes, relay


async def test_a_stream_that_ends_with_done_is_relayed_whole(upstream: Upstream) -> None:
    # An event split across chunks is passed on once its end has come.
    out, outcomes, relay = await _relay(upstream, *chunked("text/event-stream", EVENT + EVENT[:10], EVENT[10:],
                                                           EVENT[:-1], b"\n" + DONE))
    assert out == EVENT * 3 + DONE and outcomes == [True] and not relay.broken


class Holder:
    """What the gateway's try is to a relay: told when its leg ends and when the relay finishes, and keeping the relay
    (its watchdog entry) and the answer that runs the relay's ``afinish`` afterwards."""

    def __init__(self) -> None:
        self.relay: StreamRelay | None = None
        self.ends: list[object] = []

    def leg_ended(self, end: object) -> None:
        self.ends.append(end)

    def finished(self, completed: bool) -> None:
        self.ends.append(completed)


async def test_a_finished_relay_lets_go_of_the_hooks_that_refer_back_to_it(upstream: Upstream) -> None:
    """A relay, its leg and the try they tell refer to each other while the stream runs; once it is finished the
    relay drops its hooks, so the whole stream is freed by reference counting, not left to the garbage collector."""
    response = await upstream.post(*chunked("text/event-stream", EVENT, DONE))
    holder = Holder()
    relay = StreamRelay(Leg(response, await first_chunk(response), holder.leg_ended), holder.finished,
                        resume=lambda _break: asyncio.sleep(0, None))
    holder.relay = relay
    holder.answer = relay.afinish  # type: ignore[attr-defined]
    assert [chunk async for chunk in relay.chunks()] == [EVENT, DONE]
    await relay.afinish()
    assert len(holder.ends) == 2 and holder.ends[-1] is True
    gone = weakref.ref(holder)
    gc.disable()
    try:
        del holder, relay
        assert gone() is None  # freed without a collection: no cycle left
    finally:
        gc.enable()


@pytest.mark.parametrize(("parts", "where"), [
    ((EVENT, EVENT), "without its last event ([DONE])"),
    ((EVENT, EVENT[:20]), "inside an event"),
])
async def test_a_stream_cut_short_ends_with_an_error_event_and_is_broken(upstream: Upstream, parts: tuple[bytes, ...],
                                                                        where: str) -> None:
    out, outcomes, relay = await _relay(upstream, *chunked("text/event-stream", *parts))
    events = out.split(b"\n\n")[:-1]
    assert events[:-1] == [EVENT[:-2]] * (len(events) - 1)  # the half event never reached the client
    error = msgspec.json.decode(events[-1].removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_stream_broken" and where in error["message"]
    assert relay.broken and outcomes == [False]


async def test_an_event_past_the_limit_ends_the_stream(upstream: Upstream) -> None:
    huge = b'data: {"id":"c","choices":[{"index":0,"text":"' + b"x" * 600
    out, outcomes, relay = await _relay(upstream, *chunked("text/event-stream", EVENT, huge, b"x" * 600, b'"}]}\n\n',
                                                           DONE, end=False))
    events = out.split(b"\n\n")[:-1]
    assert events[0] == EVENT[:-2] and len(events) == 2
    error = msgspec.json.decode(events[1].removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_invalid_response" and "upstream_max_event_bytes" in error["message"]
    assert relay.broken and outcomes == [False]


async def test_a_broken_connection_mid_stream_is_still_broken(upstream: Upstream) -> None:
    out, outcomes, relay = await _relay(upstream, *chunked("text/event-stream", EVENT, EVENT, end=False))
    assert out.startswith(EVENT * 2) and b"upstream_stream_broken" in out
    assert relay.broken and outcomes == [False]


async def test_the_events_before_one_past_the_limit_go_out_even_in_the_same_chunk(upstream: Upstream) -> None:
    huge = b'data: {"id":"c","choices":[{"index":0,"text":"' + b"x" * 2000
    out, outcomes, relay = await _relay(upstream, *chunked("text/event-stream", EVENT + EVENT + huge, end=False))
    events = out.split(b"\n\n")[:-1]
    assert events[:2] == [EVENT[:-2]] * 2 and b"upstream_invalid_response" in events[2] and len(events) == 3
    assert relay.broken and outcomes == [False]


def _responses_event(kind: str, sequence: int, **fields: object) -> bytes:
    return (f"event: {kind}\ndata: ".encode() + msgspec.json.encode({"type": kind, "sequence_number": sequence,
                                                                      **fields}) + b"\n\n")


RESPONSES_EVENTS = [
    _responses_event("response.created", 0, response={"id": "resp_1", "status": "in_progress", "usage": None}),
    _responses_event("response.output_text.delta", 1, delta="Hel"),
    _responses_event("response.output_text.delta", 2, delta="lo"),
    _responses_event("response.completed", 3, response={"id": "resp_1", "status": "completed", "usage": {
        "input_tokens": 12, "output_tokens": 2, "total_tokens": 14, "input_tokens_details": {"cached_tokens": 8}}}),
]


async def _relay_responses(upstream: Upstream, *pieces: bytes) -> tuple[bytes, list[bool], Leg]:
    response = await upstream.post(*pieces)
    outcomes: list[bool] = []
    leg = Leg(response, await first_chunk(response), lambda _end: None, usage=ResponsesUsage())
    relay = StreamRelay(leg, outcomes.append)
    out = b"".join([chunk async for chunk in relay.chunks()])
    return out, outcomes, leg


async def test_a_responses_stream_ends_at_its_last_named_event_with_its_usage(upstream: Upstream) -> None:
    out, outcomes, leg = await _relay_responses(upstream, *chunked("text/event-stream", *RESPONSES_EVENTS))
    assert out == b"".join(RESPONSES_EVENTS) and outcomes == [True]  # no [DONE] in this API
    assert leg.usage.usage() == {"input_tokens": 12, "output_tokens": 2, "total_tokens": 14,
                                 "input_tokens_details": {"cached_tokens": 8}}
    assert usage_counts(leg.usage.usage() or {}, 0, 0) == (12, 2, 8)
    assert leg.usage.text_events == 2


async def test_a_responses_stream_cut_short_ends_with_an_error_event_of_its_own_shape(upstream: Upstream) -> None:
    out, outcomes, _ = await _relay_responses(upstream, *chunked("text/event-stream", *RESPONSES_EVENTS[:3]))
    last = out.split(b"\n\n")[-2]
    assert last.startswith(b"event: error\ndata: ") and outcomes == [False]
    error = msgspec.json.decode(last.split(b"data: ", 1)[1])
    assert error["type"] == "error" and error["code"] == "upstream_stream_broken" and error["sequence_number"] == 3
    # An engine's own error event ends it too (and is passed on as it came).
    failed = _responses_event("error", 2, code="server_error", message="engine failed", param=None)
    out, outcomes, _ = await _relay_responses(upstream, *chunked("text/event-stream", *RESPONSES_EVENTS[:2], failed))
    assert out.endswith(failed) and outcomes == [False]
