"""An engine's streamed (SSE) answer: its first bytes checked, then relayed to the client event by
event, with the usage it reports read as the bytes go by.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgspec

from switchyard.engines.upstream import UpstreamFailure, invalid

#: The default of ``Settings.upstream_max_event_bytes``: the largest single SSE event of a stream the
#: gateway reads from an engine.
MAX_EVENT_BYTES = 16 * 1024 * 1024
#: What an answer's first bytes may be, as a stream: an SSE field or comment.
_SSE_STARTS = (b"data:", b":", b"event:", b"id:", b"retry:")
#: The last event of every engine stream that ran to its end.
_DONE = b"data: [DONE]"


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
