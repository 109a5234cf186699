"""An engine that answers instantly: a measuring device for the overhead scenario, not a simulator.

To measure what a proxy *adds*, the engine behind it must add as little as possible. The
simulator cannot do that: it models an engine's scheduler, KV cache and step times, and even at a
high time scale each request costs it a framework round trip, tokenisation and a scheduler step.
This server answers every completion at once with a fixed one-token reply, in the shapes vLLM
uses (a JSON body, or an SSE stream of a role chunk, one content chunk, a finish chunk, an
optional usage chunk and ``[DONE]``), from pre-encoded bytes.

It is a raw ``asyncio.Protocol`` over ``httptools`` (HTTP/1.1, keep-alive, chunked streams), with
``uvloop`` when installed: about ten times the requests per second of a framework app on the same
core, so the engine is never what limits a proxy measured in front of it.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (vLLM's load gauges, all zero, so a gateway's scraper is
satisfied). Anything else is 404. Run it with ``python -m switchyard.bench.instant --port N``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from typing import Any

import httptools
import msgspec

_ENCODE = msgspec.json.Encoder().encode
_STATUS = {200: b"200 OK", 404: b"404 Not Found", 405: b"405 Method Not Allowed", 400: b"400 Bad Request"}
_METRICS = b"".join(
    b"# TYPE %s gauge\n%s{engine=\"0\",model_name=\"instant\"} 0.0\n" % (name, name)
    for name in (b"vllm:num_requests_running", b"vllm:num_requests_waiting", b"vllm:kv_cache_usage_perc")
) + b"".join(
    b"# TYPE %s counter\n%s_total{engine=\"0\",model_name=\"instant\"} 0.0\n" % (name, name)
    for name in (b"vllm:prefix_cache_queries", b"vllm:prefix_cache_hits")
)


class _Request(msgspec.Struct):
    model: str = "instant"
    stream: bool = False
    stream_options: dict[str, Any] | None = None


_DECODE = msgspec.json.Decoder(_Request).decode


def _response(status: int, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (_STATUS[status], content_type,
                                                                                    len(body))) + body


def _chunked(parts: list[bytes]) -> bytes:
    out = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
           b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"]
    for part in parts:
        out.append(b"%x\r\n%s\r\n" % (len(part), part))
    out.append(b"0\r\n\r\n")
    return b"".join(out)


def _event(payload: dict[str, Any] | bytes) -> bytes:
    data = payload if isinstance(payload, bytes) else _ENCODE(payload)
    return b"data: " + data + b"\n\n"


class Replies:
    """Pre-encoded answers, per (kind, model, streaming, usage chunk)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[bool, str, bool, bool], bytes] = {}

    def get(self, chat: bool, model: str, stream: bool, usage: bool) -> bytes:
        """The whole HTTP response for one request."""
        key = (chat, model, stream, usage)
        reply = self._cache.get(key)
        if reply is None:
            reply = self._build(chat, model, stream, usage)
            if len(self._cache) < 1024:
                self._cache[key] = reply
        return reply

    @staticmethod
    def _build(chat: bool, model: str, stream: bool, usage: bool) -> bytes:
        counts = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        head = {"id": "cmpl-instant", "created": 0, "model": model}
        if not stream:
            if chat:
                choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "ok"},
                                          "logprobs": None, "finish_reason": "stop"}
            else:
                choice = {"index": 0, "text": "ok", "logprobs": None, "finish_reason": "stop"}
            body = {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                    "usage": counts}
            return _response(200, _ENCODE(body))
        obj = "chat.completion.chunk" if chat else "text_completion"
        events: list[bytes] = []
        if chat:
            events.append(_event({**head, "object": obj, "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}))
            events.append(_event({**head, "object": obj, "choices": [
                {"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]}))
            events.append(_event({**head, "object": obj, "choices": [
                {"index": 0, "delta": {}, "finish_reason": "stop"}]}))
        else:
            events.append(_event({**head, "object": obj, "choices": [
                {"index": 0, "text": "ok", "finish_reason": None}]}))
            events.append(_event({**head, "object": obj, "choices": [
                {"index": 0, "text": "", "finish_reason": "stop"}]}))
        if usage:
            events.append(_event({**head, "object": obj, "choices": [], "usage": counts}))
        events.append(_event(b"[DONE]"))
        return _chunked([b"".join(events)])


class InstantProtocol(asyncio.Protocol):
    """One client connection: parse requests, answer each at once (keep-alive)."""

    def __init__(self, replies: Replies) -> None:
        self._replies = replies
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's transport is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            if self._transport is not None:
                self._transport.write(_response(400, b'{"detail":"Bad Request"}'))
                self._transport.close()

    # httptools callbacks
    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        url, body = self._url, b"".join(self._body)
        self._url, self._body = b"", []
        method = self._parser.get_method()
        if self._transport is None or self._transport.is_closing():
            return
        self._transport.write(self.answer(method, url.split(b"?", 1)[0], body))
        if not self._parser.should_keep_alive():
            self._transport.close()

    def answer(self, method: bytes, path: bytes, body: bytes) -> bytes:
        """The HTTP response to one request."""
        if path in (b"/v1/chat/completions", b"/v1/completions"):
            if method != b"POST":
                return _response(405, b'{"detail":"Method Not Allowed"}')
            try:
                req = _DECODE(body)
            except msgspec.DecodeError as exc:
                return _response(400, _ENCODE({"object": "error", "message": str(exc), "type": "BadRequestError",
                                               "code": 400}))
            usage = bool(req.stream_options and req.stream_options.get("include_usage"))
            return self._replies.get(path == b"/v1/chat/completions", req.model, req.stream, usage)
        if path == b"/health":
            return b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
        if path == b"/metrics":
            return _response(200, _METRICS, b"text/plain; version=0.0.4")
        if path == b"/v1/models":
            return _response(200, _ENCODE({"object": "list", "data": [
                {"id": "instant", "object": "model", "created": 0, "owned_by": "switchyard-bench"}]}))
        return _response(404, b'{"detail":"Not Found"}')


async def serve(host: str, port: int, ready: asyncio.Event | None = None) -> None:
    """Serve until cancelled (or SIGINT/SIGTERM when run as a program)."""
    loop = asyncio.get_running_loop()
    replies = Replies()
    server = await loop.create_server(lambda: InstantProtocol(replies), host, port, backlog=4096,
                                      reuse_address=True)
    if ready is not None:
        ready.set()
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    """``python -m switchyard.bench.instant --port N [--host H]``."""
    parser = argparse.ArgumentParser(description="An OpenAI-compatible engine that answers instantly.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        runner = asyncio.Runner()
    else:
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)

    async def run() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await serve(args.host, args.port)

    with runner:
        runner.run(run())


if __name__ == "__main__":
    main()
