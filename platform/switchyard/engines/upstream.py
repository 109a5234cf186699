"""The one connection pool to the engines, and what their failures mean.

aiohttp, not httpx, on the hot path: on this kind of machine a Litestar proxy with aiohttp
carries 6-8x the requests per second of the same proxy with httpx (DESIGN.md's measurements).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

# Error texts from an engine are shown to clients; never forward more than this of them.
MAX_ERROR_BODY = 16_384
#: The defaults of ``Settings.upstream_max_response_bytes`` and ``upstream_max_event_bytes``: the largest
#: complete answer, and the largest single SSE event of a stream, the gateway reads from an engine.
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
MAX_EVENT_BYTES = 16 * 1024 * 1024
#: What an answer's first bytes may be, as a stream: an SSE field or comment.
_SSE_STARTS = (b"data:", b":", b"event:", b"id:", b"retry:")
#: The last event of every engine stream that ran to its end.
_DONE = b"data: [DONE]"


@dataclass(frozen=True, slots=True)
class UpstreamTimeouts:
    """How long to wait to connect, and for each read from an engine."""

    connect_s: float
    read_s: float


#: Idle keep-alive connections are closed before vLLM's API server closes them: it runs uvicorn with a
#: keep-alive timeout of 5 s (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``), and a request sent on a connection the
#: server has just closed fails with "Server disconnected" (taking the endpoint out for a cool-down).
KEEPALIVE_S = 4.0


def create_client_session(timeouts: UpstreamTimeouts, max_connections: int,
                          fresh: bool = False) -> aiohttp.ClientSession:
    """The process-wide upstream client (create it inside the app's lifespan).

    ``fresh``: a client that opens a new connection for every request and keeps none, for the one
    retry of a request whose pooled connection the engine had closed (see :func:`post`).
    """
    connector = (aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, force_close=True) if fresh else
                 aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, ttl_dns_cache=300,
                                      keepalive_timeout=KEEPALIVE_S))
    timeout = aiohttp.ClientTimeout(total=None, connect=timeouts.connect_s, sock_read=timeouts.read_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, raise_for_status=False,
                                 auto_decompress=False, skip_auto_headers=("User-Agent",))


class UpstreamFailure(Exception):
    """The engine could not be reached, did not answer in time, or answered something that is no answer.

    ``refused``: no connection could be made at all (the engine is gone, not just slow or broken).
    ``invalid``: the engine answered 200 with garbage: not JSON, the wrong content type, too large, or a
    stream that is not SSE.
    """

    def __init__(self, message: str, *, timeout: bool, refused: bool = False, invalid: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout
        self.refused = refused
        self.invalid = invalid

    @property
    def kind(self) -> str:
        """``connect_error``, ``timeout``, ``invalid_response`` or ``broken`` (a connection that broke off)."""
        return ("timeout" if self.timeout else "connect_error" if self.refused else
                "invalid_response" if self.invalid else "broken")


def invalid(url: object, what: str) -> UpstreamFailure:
    """The failure of an engine at ``url`` that answered garbage (``what`` says which)."""
    return UpstreamFailure(f"{url} answered {what}", timeout=False, invalid=True)


@dataclass(frozen=True, slots=True)
class EngineError:
    """A non-2xx answer from an engine: its status, message, and the engine's own code."""

    status: int
    message: str
    type: str | None
    code: str | int | None
    param: str | None
    retry_after: str | None


async def post(session: aiohttp.ClientSession, url: str, payload: bytes, headers: Mapping[str, str],
               fresh: aiohttp.ClientSession | None = None) -> aiohttp.ClientResponse:
    """POST to an engine; connection failures and timeouts become :class:`UpstreamFailure`.

    A connection closed by the engine before any answer came is tried once more, at once, on a new
    connection (``fresh``, else the pool): that is what a pooled keep-alive connection the engine
    had just closed looks like. On a starved machine the gateway can take the connection from the
    pool more than :data:`KEEPALIVE_S`'s margin after the engine's idle timer started, and the
    connections released with it are as stale, so the retry must not take another pooled one. An
    engine that is really gone refuses the second try.

    Redirects are never followed: the gateway connects only to the endpoints of its policy, so an
    engine's 3xx is answered like any other error status (the caller's to judge).
    """
    try:
        try:
            return await session.post(url, data=payload, headers=headers, allow_redirects=False)
        except aiohttp.ServerDisconnectedError:
            return await (fresh or session).post(url, data=payload, headers=headers, allow_redirects=False)
    except TimeoutError:
        raise UpstreamFailure(f"{url} did not answer in time", timeout=True) from None
    except aiohttp.ClientConnectorError as exc:
        reason = exc.os_error.strerror or str(exc.os_error)
        raise UpstreamFailure(f"cannot connect to {url}: {reason}", timeout=False, refused=True) from None
    except aiohttp.ClientError as exc:
        raise UpstreamFailure(f"{url}: {exc.__class__.__name__}: {exc}", timeout=False) from None


async def read_body(response: aiohttp.ClientResponse, max_bytes: int = MAX_RESPONSE_BYTES) -> bytes:
    """The whole body of a non-streaming 2xx answer: a JSON object of at most ``max_bytes`` (see
    :func:`read_answer`, which also gives its ``usage``)."""
    data, _ = await read_answer(response, max_bytes)
    return data


async def read_answer(response: aiohttp.ClientResponse,
                      max_bytes: int = MAX_RESPONSE_BYTES) -> tuple[bytes, dict[str, Any] | None]:
    """The whole body of a non-streaming 2xx answer, a JSON object of at most ``max_bytes``, and its
    ``usage`` object (None when it has none): the body is decoded once, for both.

    Raises:
        UpstreamFailure: The answer broke off or stopped (timeout); or (``invalid``) it is not
            ``application/json``, is larger than ``max_bytes`` (the rest is never read: the connection is
            closed), or is not a JSON object.
    """
    ok = False
    try:
        if response.content_type != "application/json":
            raise invalid(response.url, f"{response.status} with content type {response.content_type!r}, "
                                        "not application/json")
        if response.content_length is not None and response.content_length > max_bytes:
            raise invalid(response.url, f"{response.content_length} bytes, more than the gateway's limit "
                                        f"of {max_bytes} (upstream_max_response_bytes)")
        parts: list[bytes] = []
        size = 0
        while chunk := await response.content.readany():
            size += len(chunk)
            if size > max_bytes:
                raise invalid(response.url, f"more than the gateway's limit of {max_bytes} bytes "
                                            "(upstream_max_response_bytes)")
            parts.append(chunk)
        data = b"".join(parts)
        usage = check_json_object(response.url, data)
        ok = True
        return data, usage
    except TimeoutError:
        raise UpstreamFailure(f"{response.url} stopped answering mid-response", timeout=True) from None
    except aiohttp.ClientError as exc:
        raise UpstreamFailure(f"{response.url} broke off its answer: {exc}", timeout=False) from None
    finally:
        if ok:
            response.release()
        else:
            response.close()  # what is left unread must not stay on a pooled connection


def check_json_object(url: object, data: bytes) -> dict[str, Any] | None:
    """Check that ``data`` is one JSON object (its members are not looked at beyond their syntax); its
    ``usage`` object, if it has one.

    Raises:
        UpstreamFailure: (``invalid``) It is not.
    """
    try:
        usage = msgspec.json.decode(data, type=_UsageOnly).usage
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise invalid(url, f"200 with a body that is not a JSON object ({exc})") from None
    return usage if isinstance(usage, dict) else None


async def read_engine_error(response: aiohttp.ClientResponse) -> EngineError:
    """Read a non-2xx answer in either of vLLM's error shapes (or plain text)."""
    try:
        raw = await response.content.read(MAX_ERROR_BODY)
    except (aiohttp.ClientError, TimeoutError):
        raw = b""
    finally:
        response.close()
    message, type_, code, param = raw.decode("utf-8", "replace").strip() or response.reason or "", None, None, None
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        data = None
    if isinstance(data, dict):
        inner: dict[str, Any] = data["error"] if isinstance(data.get("error"), dict) else data
        if isinstance(inner.get("message"), str):
            message = inner["message"]
        type_ = inner.get("type") if isinstance(inner.get("type"), str) else None
        code = inner.get("code") if isinstance(inner.get("code"), str | int) else None
        param = inner.get("param") if isinstance(inner.get("param"), str) else None
    return EngineError(response.status, message, type_, code, param, response.headers.get("Retry-After"))


async def first_chunk(response: aiohttp.ClientResponse) -> bytes:
    """The first bytes of a streamed answer (the caller bounds the wait).

    Raises:
        UpstreamFailure: The stream ended or broke before any byte, or carried an error event first
            (vLLM reports some failures inside a 200 stream); or (``invalid``) it is not
            ``text/event-stream``, does not begin like SSE, or its first whole event's data is not JSON.
    """
    if response.content_type != "text/event-stream":
        raise invalid(response.url, f"{response.status} to a streamed request with content type "
                                    f"{response.content_type!r}, not text/event-stream")
    try:
        chunk = await response.content.readany()
    except (aiohttp.ClientError, asyncio.IncompleteReadError) as exc:
        raise UpstreamFailure(f"{response.url} broke off before its first byte: {exc}", timeout=False) from None
    if not chunk:
        raise UpstreamFailure(f"{response.url} ended its stream before the first byte", timeout=False)
    if chunk.startswith((b'data: {"error"', b'data: {"object":"error"', b'data: {"object": "error"')):
        raise UpstreamFailure(f"{response.url} sent an error event first: "
                              f"{chunk[6:400].decode('utf-8', 'replace').strip()}", timeout=False)
    start = chunk.lstrip(b"\r\n")
    if not start.startswith(_SSE_STARTS):
        raise invalid(response.url, f"a stream that is not SSE: {chunk[:80]!r}")
    event, ended, _ = start.partition(b"\n\n")
    if ended and event.startswith(b"data:") and event.rstrip() != _DONE:
        try:
            msgspec.json.decode(event[5:])
        except msgspec.DecodeError:
            raise invalid(response.url, f"a stream whose first event is not JSON: {event[:80]!r}") from None
    return chunk


def _usage_only(event: bytes) -> bool:
    """Whether an SSE event is the usage-only chunk (``"choices":[]`` with a ``usage`` object)."""
    return event.startswith(b"data: {") and b'"choices":[]' in event and b'"usage":{' in event


def sse_error_event(message: str, type_: str, code: str) -> bytes:
    """A well-formed SSE event carrying OpenAI's error object (ends a broken stream)."""
    payload = msgspec.json.encode({"error": {"message": message, "type": type_, "param": None, "code": code}})
    return b"data: " + payload + b"\n\n"


def _count(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


class _UsageOnly(msgspec.Struct):
    """Decodes only the ``usage`` field of an answer (the rest is skipped, not built)."""

    usage: Any = None


def usage_counts(usage: Mapping[str, Any], prompt: int, completion: int) -> tuple[int, int, int]:
    """Prompt, completion and cached prompt tokens of an engine's ``usage`` object (the given
    prompt and completion where it lacks them)."""
    details = usage.get("prompt_tokens_details")
    return (_count(usage.get("prompt_tokens"), prompt), _count(usage.get("completion_tokens"), completion),
            _count(details.get("cached_tokens"), 0) if isinstance(details, dict) else 0)


class StreamUsage:
    """What an OpenAI-style SSE stream says it used, read as the bytes go by (no event is parsed
    until the end).

    Exact when the stream carries a ``usage`` object (``stream_options.include_usage``); else
    the generated tokens are counted as the events carrying non-empty text (vLLM sends one
    token per event), which is also all there is when the client leaves mid-stream.
    """

    __slots__ = ("_tail", "text_events")

    #: How much of the stream's end is kept to find the usage event in.
    TAIL = 16_384

    def __init__(self) -> None:
        self.text_events = 0
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        """Account for one chunk of the stream."""
        self.text_events += (chunk.count(b'"content":"') - chunk.count(b'"content":""')
                             + chunk.count(b'"text":"') - chunk.count(b'"text":""'))
        self._tail = (self._tail + chunk)[-self.TAIL:]

    def usage(self) -> dict[str, Any] | None:
        """The stream's ``usage`` object, if one went by (the last one)."""
        for event in reversed(self._tail.split(b"\n\n")):
            if b'"usage":{' not in event or not event.startswith(b"data: {"):
                continue
            try:
                data = msgspec.json.decode(event[6:])
            except msgspec.DecodeError:
                continue
            usage = data.get("usage") if isinstance(data, dict) else None
            if isinstance(usage, dict):
                return usage
        return None


class _EventTooLarge(Exception):
    """An event of a stream grew past the relay's limit."""


def _events_end(data: bytearray, start: int) -> int:
    """Where the last whole SSE event in ``data`` ends (0: none ends), looking from ``start`` on."""
    lf = data.rfind(b"\n\n", start)
    crlf = data.rfind(b"\r\n\r\n", start)
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


class StreamRelay:
    """Passes an engine's SSE stream to the client event by event, never buffering the answer.

    Whole events only: a chunk that ends inside an event passes on what it completes, and the rest
    waits for the event's end (engines write whole events, so nothing usually waits), so however the
    stream ends the client never gets half an event.

    :meth:`finish` runs exactly once however the stream ends: completed (``data: [DONE]`` came and
    the connection goes back to the pool), broken upstream (``broken`` is set; the client gets a
    well-formed error event): the connection broke off or timed out, the stream ended without
    ``[DONE]`` or inside an event, or an event grew past ``max_event_bytes``; or abandoned by the
    client (the upstream connection is closed, so the engine sees the disconnect and aborts the
    request). ``first`` is the stream's first chunk, already read (see :func:`first_chunk`).
    """

    __slots__ = ("_capture_limit", "_completed", "_done", "_finished", "_first", "_max_event", "_on_finish",
                 "_pending", "_response", "_strip_usage", "broken", "captured", "usage")

    def __init__(self, response: aiohttp.ClientResponse, first: bytes, on_finish: Callable[[bool], None], *,
                 capture_limit: int = 0, strip_usage: bool = False, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._response = response
        self._first = first
        self._on_finish = on_finish
        self._completed = False
        self._finished = False
        self.broken = False
        self.usage = StreamUsage()
        #: The whole stream as the engine sent it, while it is no longer than ``capture_limit`` (for the
        #: response cache); None when not capturing or when it grew longer.
        self.captured: bytearray | None = bytearray() if capture_limit > 0 else None
        self._capture_limit = capture_limit
        #: The gateway asked for a usage chunk the client did not: it is left out of what the client gets.
        self._strip_usage = strip_usage
        self._max_event = max_event_bytes
        #: The start of an event whose end has not come yet.
        self._pending = bytearray()
        #: Whether the last whole event was ``data: [DONE]``.
        self._done = False

    def _take(self, chunk: bytes) -> bytes:
        """Account for ``chunk``; the whole events it completes, for the client (see :meth:`_check`)."""
        self.usage.feed(chunk)
        if self.captured is not None:
            self.captured += chunk
            if len(self.captured) > self._capture_limit:
                self.captured = None
        pending = self._pending
        if not pending and chunk.endswith(b"\n\n"):
            whole: bytes = chunk  # the usual case: the engine wrote whole events
        else:
            searched = max(0, len(pending) - 3)  # an event's end may straddle the chunks
            pending += chunk
            cut = _events_end(pending, searched)
            whole = bytes(pending[:cut])
            del pending[:cut]
        if not whole:
            return whole
        self._done = whole.rstrip().endswith(_DONE)
        if not self._strip_usage:
            return whole
        events = whole.split(b"\n\n")
        return b"".join(e + b"\n\n" for e in events if e and not _usage_only(e))

    def _check(self) -> None:
        """Raise :class:`_EventTooLarge` when the event being read has grown past ``max_event_bytes`` (after
        the whole events before it went out)."""
        if len(self._pending) > self._max_event:
            raise _EventTooLarge

    async def chunks(self) -> AsyncIterator[bytes]:
        """The stream's bytes as they arrive (whole events)."""
        try:
            out = self._take(self._first)
            if out:
                yield out
            self._check()
            async for chunk in self._response.content.iter_any():
                out = self._take(chunk)
                if out:
                    yield out
                self._check()
            if self._done and not self._pending.strip():
                self._completed = True
            else:
                self.broken = True
                where = "inside an event" if self._pending.strip() else "without its last event ([DONE])"
                yield sse_error_event(f"The engine ended its stream {where}; the answer is incomplete.",
                                      "upstream_error", "upstream_stream_broken")
        except _EventTooLarge:
            self.broken = True
            yield sse_error_event(f"The engine sent an event larger than the gateway's limit of {self._max_event} "
                                  "bytes (upstream_max_event_bytes); the answer is incomplete.",
                                  "upstream_error", "upstream_invalid_response")
        except (aiohttp.ClientError, TimeoutError, asyncio.IncompleteReadError) as exc:
            self.broken = True
            kind = "timed out" if isinstance(exc, TimeoutError) else "broke off"
            yield sse_error_event(f"The engine {kind} mid-stream; the answer is incomplete.",
                                  "upstream_error", "upstream_stream_broken")
        finally:
            self.finish()

    def finish(self) -> None:
        """Release the upstream response and report the outcome (idempotent)."""
        if self._finished:
            return
        self._finished = True
        if self._completed:
            self._response.release()
        else:
            self._response.close()
        self._on_finish(self._completed)

    async def afinish(self) -> None:
        """:meth:`finish` as a background task, for when the client leaves mid-stream."""
        self.finish()
