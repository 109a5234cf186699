"""One benchmark request sent and its answer read: what the client saw, recorded in a
:class:`~switchyard.bench.results.Result` (status, route, times of the first and each later
content chunk, usage, finish reason, error).

Cheap, since the load generator shares the machine with what it measures: SSE parsed on bytes,
chunks decoded by ``msgspec`` into small typed structs holding only the fields read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from switchyard.api.headers import ATTEMPTS_HEADER, ROUTE_HEADER
from switchyard.bench.results import Result
from switchyard.bench.sse import SseParser

#: The API path of each request kind.
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
_MESSAGE_LIMIT = 300


@dataclass(frozen=True, slots=True)
class Target:
    """Where requests go and how they authenticate.

    Attributes:
        base_url: Scheme, host and port (``http://127.0.0.1:8080``); ``/v1/...`` is appended.
        name: The arm's name in results and reports.
        api_keys: Tenant label -> API key (sent as ``Authorization: Bearer``).
        default_api_key: The key for tenants not in ``api_keys`` (None: send no key).
        headers: Extra headers for every request.
    """

    base_url: str
    name: str = "target"
    api_keys: Mapping[str, str] = field(default_factory=dict)
    default_api_key: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)

    def url(self, kind: str) -> str:
        """The endpoint URL for a request kind."""
        return self.base_url.rstrip("/") + PATHS[kind]

    def headers_for(self, tenant: str) -> dict[str, str]:
        """The headers of a tenant's requests."""
        headers = {"Content-Type": "application/json", **self.headers}
        key = self.api_keys.get(tenant, self.default_api_key)
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        return headers


# --- response shapes (only the fields we read; msgspec skips the rest) ----------------------


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[Any] | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    message: _Delta | None = None
    text: str | None = None
    finish_reason: str | None = None


class _Body(msgspec.Struct):
    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None
    error: Any = None
    detail: Any = None  # a framework's own error shape ({"status_code", "detail"})


_DECODE = msgspec.json.Decoder(_Body).decode


def _has_content(choice: _Choice) -> bool:
    if choice.text:
        return True
    part = choice.delta or choice.message
    return part is not None and bool(part.content or part.reasoning_content or part.reasoning or part.tool_calls)


def _take_usage(result: Result, usage: _Usage) -> None:
    result.prompt_tokens = usage.prompt_tokens
    result.completion_tokens = usage.completion_tokens
    if usage.prompt_tokens_details is not None:
        result.cached_tokens = usage.prompt_tokens_details.cached_tokens


def _take_error(result: Result, error: Any, fallback_type: str) -> None:
    """Record an OpenAI error object (or whatever the server sent instead)."""
    if isinstance(error, dict):
        kind, code, message = error.get("type"), error.get("code"), error.get("message")
        result.error_type = str(kind) if kind is not None else fallback_type
        result.error_code = str(code) if code is not None else None
        result.error_message = str(message)[:_MESSAGE_LIMIT] if message is not None else None
    else:
        result.error_type = fallback_type
        result.error_message = str(error)[:_MESSAGE_LIMIT] if error is not None else None


def _take_headers(result: Result, headers: Mapping[str, str]) -> None:
    result.route = headers.get(ROUTE_HEADER)
    result.retry_after = headers.get("retry-after")
    attempts = headers.get(ATTEMPTS_HEADER)
    if attempts is not None and attempts.isdigit():
        result.attempts = int(attempts)


def _take_body(result: Result, raw: bytes) -> None:
    """A whole (non-streamed or error) body: usage, finish reason, error."""
    try:
        body = _DECODE(raw)
    except msgspec.DecodeError:
        if result.status >= 300:
            result.error_type = "http_error"
            result.error_message = raw[:_MESSAGE_LIMIT].decode("utf-8", "replace")
        else:
            result.error_type = "bad_response"
        return
    if body.usage is not None:
        _take_usage(result, body.usage)
    if body.choices:
        result.finish_reason = body.choices[0].finish_reason
    if body.error is not None:
        _take_error(result, body.error, "http_error")
    elif result.status >= 300:
        _take_error(result, body.detail, "http_error")


async def _read_stream(response: aiohttp.ClientResponse, result: Result, now: Callable[[], float],
                       start: float) -> None:
    """Read an SSE body, timing each content-bearing chunk (its read's arrival time)."""
    parser = SseParser()
    last: float | None = None
    done = False
    itl = result.itl_s
    async for data in response.content.iter_any():
        at = now() - start
        for event in parser.feed(data):
            payload = event.data
            if payload == b"[DONE]":
                done = True
                continue
            try:
                chunk = _DECODE(payload)
            except msgspec.DecodeError:
                result.error_type = result.error_type or "bad_response"
                continue
            if chunk.error is not None:
                _take_error(result, chunk.error, "stream_error")
            if chunk.usage is not None:
                _take_usage(result, chunk.usage)
            for choice in chunk.choices:
                if choice.finish_reason is not None and result.finish_reason is None:
                    result.finish_reason = choice.finish_reason
            if any(_has_content(c) for c in chunk.choices):
                if last is None:
                    result.first_token_s = at
                else:
                    itl.append(at - last)
                last = at
                result.chunks += 1
    if (parser.close() or not done) and result.error_type is None:
        result.error_type = "stream_truncated"


async def send_one(session: aiohttp.ClientSession, body: bytes, url: str, headers: dict[str, str], result: Result,
                   now: Callable[[], float], start: float) -> Result:
    """Send one request and fill in ``result`` (times relative to ``start`` on clock ``now``).

    The sender of the open loop (:func:`switchyard.bench.loadgen.run_open_loop`) and of other drivers
    (the closed loop of ``bench.closedloop``). Never raises for a failed request: the failure is
    recorded in ``result``.
    """
    result.sent_s = now() - start
    try:
        async with session.post(url, data=body, headers=headers) as response:
            result.status = response.status
            _take_headers(result, response.headers)
            streamed = response.content_type == "text/event-stream"
            if 200 <= response.status < 300 and streamed:
                await _read_stream(response, result, now, start)
            else:
                raw = await response.read()
                if 200 <= response.status < 300:
                    result.first_token_s = now() - start
                    result.chunks = 1
                _take_body(result, raw)
    except aiohttp.ConnectionTimeoutError as exc:  # before TimeoutError: it is one, but a failure
        result.error_type = "connection_error"
        result.error_message = f"connect timeout: {exc}"[:_MESSAGE_LIMIT]
    except TimeoutError:
        result.timed_out = True
        result.error_type = "timeout"
    except aiohttp.ClientError as exc:
        result.error_type = "connection_error"
        result.error_message = f"{type(exc).__name__}: {exc}"[:_MESSAGE_LIMIT]
    result.done_s = now() - start
    return result
