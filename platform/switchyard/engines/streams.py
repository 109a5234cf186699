"""An engine's streamed (SSE) answer: its first bytes checked, then relayed to the client event by
event, with the usage it reports read as the bytes go by; when the engine breaks it off, a continuation from
another engine may take over (:mod:`switchyard.engines.splice`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from switchyard.engines.splice import Splice, Transcript
from switchyard.engines.upstream import BROKEN, Answer, UpstreamFailure, invalid

#: The default of ``Settings.upstream_max_event_bytes``: the largest single SSE event of a stream the
#: gateway reads from an engine.
MAX_EVENT_BYTES = 16 * 1024 * 1024
#: What an answer's first bytes may be, as a stream: an SSE field or comment.
_SSE_STARTS = (b"data:", b":", b"event:", b"id:", b"retry:")
#: The last event of every engine stream that ran to its end.
_DONE = b"data: [DONE]"


async def first_chunk(response: Answer) -> bytes:
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
    except (*BROKEN, asyncio.IncompleteReadError) as exc:
        raise UpstreamFailure(f"{response.url} broke off before its first byte: {exc}", timeout=False) from None
    if not chunk:
        raise UpstreamFailure(f"{response.url} ended its stream before the first byte", timeout=False)
    if chunk.startswith(_ERROR_STARTS):
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

    __slots__ = ("_tail", "events", "text_events")

    #: How much of the stream's end is kept to find the usage event in.
    TAIL = 16_384

    def __init__(self) -> None:
        self.text_events = 0
        #: Events seen (counted only where the dialect numbers them: the Responses API's ``sequence_number``).
        self.events = 0
        self._tail = b""

    def done_in(self, whole: bytes) -> bool:
        """Whether ``whole`` (the latest whole events) ends the stream: ``data: [DONE]``."""
        return whole.rstrip().endswith(_DONE)

    def break_event(self, why: str, kind: str) -> bytes:
        """The error event that ends a stream whose engine broke it off and that was not continued."""
        code = "upstream_invalid_response" if kind == "invalid" else "upstream_stream_broken"
        return sse_error_event(f"The engine {why}; the answer is incomplete.", "upstream_error", code)

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


class ResponsesUsage(StreamUsage):
    """A Responses API stream (``/v1/responses``): named events (``event: response.output_text.delta``), no
    ``[DONE]``: it ends with ``response.completed`` (or ``response.incomplete``, ``response.failed``), whose
    ``response`` carries the ``usage`` (``input_tokens``, ``output_tokens``)."""

    __slots__ = ()

    #: The events that end a Responses API stream.
    ENDS = (b"event: response.completed", b"event: response.incomplete", b"event: response.failed")

    def feed(self, chunk: bytes) -> None:
        """Account for one chunk of the stream."""
        self.text_events += chunk.count(b"event: response.output_text.delta")
        self.events += chunk.count(b"event: ")
        self._tail = (self._tail + chunk)[-self.TAIL:]

    def done_in(self, whole: bytes) -> bool:
        """Whether ``whole`` holds the stream's last event."""
        last = whole.rstrip().rpartition(b"\n\n")[2].lstrip(b"\r\n")
        return last.startswith(self.ENDS)

    def usage(self) -> dict[str, Any] | None:
        """The ``usage`` of the response the stream's last event carries, if it went by."""
        for event in reversed(self._tail.split(b"\n\n")):
            if b'"usage":{' not in event:
                continue
            _, found, data = event.partition(b"data: ")
            if not found:
                continue
            try:
                decoded = msgspec.json.decode(data)
            except msgspec.DecodeError:
                continue
            response = decoded.get("response") if isinstance(decoded, dict) else None
            usage = response.get("usage") if isinstance(response, dict) else None
            if isinstance(usage, dict):
                return usage
        return None

    def break_event(self, why: str, kind: str) -> bytes:
        """An ``error`` event in the Responses API's shape, numbered after the last event passed on."""
        code = "upstream_invalid_response" if kind == "invalid" else "upstream_stream_broken"
        payload = msgspec.json.encode({"type": "error", "code": code,
                                       "message": f"The engine {why}; the answer is incomplete.", "param": None,
                                       "sequence_number": self.events})
        return b"event: error\ndata: " + payload + b"\n\n"


class _EventTooLarge(Exception):
    """An event of a stream grew past the relay's limit."""


def _events_end(data: bytearray, start: int) -> int:
    """Where the last whole SSE event in ``data`` ends (0: none ends), looking from ``start`` on."""
    lf = data.rfind(b"\n\n", start)
    crlf = data.rfind(b"\r\n\r\n", start)
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


class _ErrorEvent(Exception):
    """An engine sent an error event in the middle of its stream (vLLM reports some failures inside a 200)."""

    def __init__(self, event: bytes) -> None:
        super().__init__(event[6:400].decode("utf-8", "replace").strip())
        self.event = event


#: What an error event starts with, in vLLM's shapes (the first chunk is checked by :func:`first_chunk`); the
#: Responses API's is a named event.
_ERROR_STARTS = (b'data: {"error"', b'data: {"object":"error"', b'data: {"object": "error"', b"event: error\n")


def _error_event(whole: bytes) -> bytes | None:
    """The first error event among whole events, if one is (cheap when none is: four substring searches)."""
    if (b'{"error"' not in whole and b'"object":"error"' not in whole and b'"object": "error"' not in whole
            and b"event: error\n" not in whole):
        return None
    for event in whole.split(b"\n\n"):
        if event.lstrip(b"\r\n").startswith(_ERROR_STARTS):
            return event.lstrip(b"\r\n") + b"\n\n"
    return None


@dataclass(slots=True)
class LegEnd:
    """How one engine's part of a stream ended.

    Attributes:
        completed: Its ``data: [DONE]`` came.
        broken: Why the engine broke it off (None: completed, or the client left).
        kind: The break's kind (``broken``, ``timeout``, ``stalled``, ``error_event``, ``invalid``; empty when not
            broken).
        usage: What the leg's events said it used.
    """

    completed: bool
    broken: str | None
    kind: str
    usage: StreamUsage


@dataclass(slots=True)
class Leg:
    """One engine's part of a streamed answer.

    Attributes:
        response: The engine's response (its first chunk already read: ``first``).
        first: The first chunk.
        ended: Told once how the leg ended.
        splice: How a continuation's events are rewritten into the client's stream (None: the first leg, passed
            on as it comes).
    """

    response: Answer
    first: bytes
    ended: Callable[[LegEnd], None]
    splice: Splice | None = None
    usage: StreamUsage = field(default_factory=StreamUsage)


@dataclass(slots=True)
class Break:
    """A leg of ``relay`` broke off: why, and what the client has received (:meth:`Transcript.read`, if one is
    kept)."""

    why: str
    kind: str
    transcript: Transcript | None
    relay: StreamRelay


#: What a stream does after a break: a continuation to splice in, the bytes that end the answer (it needed no
#: more text), or None (the stream ends with an error event).
Resumed = Leg | bytes | None
Resume = Callable[[Break], Awaitable[Resumed]]


class StreamRelay:
    """Passes an engine's SSE stream to the client event by event, never buffering the answer.

    Whole events only: a chunk that ends inside an event passes on what it completes, and the rest
    waits for the event's end (engines write whole events, so nothing usually waits), so however the
    stream ends the client never gets half an event.

    A stream is one or more *legs*: the engine that answered first, then, when ``resume`` is given and a
    leg breaks, the continuations it returns (:mod:`switchyard.engines.splice`). A leg breaks when its
    connection breaks off or times out, when :meth:`abort` cuts it (a stall), when it ends without
    ``[DONE]`` or inside an event, sends an error event, or an event grows past ``max_event_bytes``. With
    ``resume`` the events the client received are kept (``transcript``) for the resume to read.

    :meth:`finish` runs exactly once however the stream ends: completed (``data: [DONE]`` came and
    the connection goes back to the pool), broken (``broken`` is set; the client gets a well-formed error
    event, unless a continuation took over), or abandoned by the client (the upstream connection is
    closed, so the engine sees the disconnect and aborts the request). Each leg's ``ended`` is told first.
    """

    __slots__ = ("_capture_limit", "_completed", "_done", "_finished", "_leg", "_leg_done", "_max_event",
                 "_on_finish", "_pending", "_resume", "_stalled", "_strip_usage", "broken", "captured", "last_byte_at",
                 "resumed", "transcript", "usage")

    def __init__(self, leg: Leg, on_finish: Callable[[bool], None], *, capture_limit: int = 0,
                 strip_usage: bool = False, max_event_bytes: int = MAX_EVENT_BYTES, resume: Resume | None = None,
                 transcript: Transcript | None = None) -> None:
        self._leg = leg
        self._on_finish = on_finish
        self._completed = False
        self._finished = False
        self._leg_done = False
        self.broken = False
        self.resumed = 0
        #: The first leg's usage (the usage of every leg is in its own :class:`Leg`).
        self.usage = leg.usage
        #: The whole stream as the engine sent it, while it is no longer than ``capture_limit`` (for the
        #: response cache); None when not capturing, when it grew longer, or once a continuation was spliced in.
        self.captured: bytearray | None = bytearray() if capture_limit > 0 else None
        self._capture_limit = capture_limit
        #: The gateway asked for a usage chunk the client did not: it is left out of what the client gets.
        self._strip_usage = strip_usage
        self._max_event = max_event_bytes
        #: The start of an event whose end has not come yet.
        self._pending = bytearray()
        #: Whether the last whole event was ``data: [DONE]``.
        self._done = False
        self._resume = resume
        self.transcript = transcript
        #: Why :meth:`abort` cut the current leg (None: it did not).
        self._stalled: str | None = None
        #: When the last byte came from the current leg's engine (monotonic seconds).
        self.last_byte_at = time.monotonic()

    @property
    def leg(self) -> Leg:
        """The leg being passed on."""
        return self._leg

    def abort(self, why: str) -> None:
        """Cut the current leg now (it stalled): it breaks with ``why``, and may be resumed."""
        if self._stalled is None:
            self._stalled = why
            self._leg.response.close()

    def _take(self, chunk: bytes) -> bytes:
        """Account for ``chunk``; the whole events it completes, for the client (see :meth:`_check`)."""
        leg = self._leg
        leg.usage.feed(chunk)
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
        self._done = leg.usage.done_in(whole)
        error = _error_event(whole)
        if error is not None:
            before, _, _ = whole.partition(error.rstrip(b"\n"))
            raise _ErrorEvent(error) if not before.strip() else _ErrorAfter(self._out(before), error)
        return self._out(whole)

    def _out(self, whole: bytes) -> bytes:
        """What the client gets of whole events."""
        splice = self._leg.splice
        if splice is not None:
            out = splice.events(whole)
        elif not self._strip_usage:
            out = whole
        else:
            events = whole.split(b"\n\n")
            out = b"".join(e + b"\n\n" for e in events if e and not _usage_only(e))
        if self.transcript is not None and out:
            self.transcript.feed(out)
        return out

    def _check(self) -> None:
        """Raise :class:`_EventTooLarge` when the event being read has grown past ``max_event_bytes`` (after
        the whole events before it went out)."""
        if len(self._pending) > self._max_event:
            raise _EventTooLarge

    async def chunks(self) -> AsyncIterator[bytes]:
        """The stream's bytes as they arrive (whole events), leg after leg."""
        try:
            while True:
                why, kind, event = "", "", b""
                try:
                    out = self._take(self._leg.first)
                    if out:
                        yield out
                    self._check()
                    content = self._leg.response.content
                    while True:
                        chunk = await content.readany()
                        if not chunk:
                            break
                        self.last_byte_at = time.monotonic()
                        out = self._take(chunk)
                        if out:
                            yield out
                        self._check()
                    if self._done and not self._pending.strip():
                        self._completed = True
                        return
                    why = ("ended its stream inside an event" if self._pending.strip() else
                           "ended its stream without its last event ([DONE])")
                    kind = "broken"
                except _ErrorAfter as late:
                    yield late.out
                    why, kind, event = f"sent an error event: {late.error}", "error_event", late.error.event
                except _ErrorEvent as error:
                    why, kind, event = f"sent an error event: {error}", "error_event", error.event
                except _EventTooLarge:
                    why = (f"sent an event larger than the gateway's limit of {self._max_event} bytes "
                           "(upstream_max_event_bytes)")
                    kind = "invalid"
                except (*BROKEN, TimeoutError, asyncio.IncompleteReadError) as exc:
                    if self._stalled is not None:
                        why, kind = self._stalled, "stalled"
                    elif isinstance(exc, TimeoutError):
                        why, kind = "timed out mid-stream", "timeout"
                    else:
                        why, kind = f"broke off mid-stream ({exc.__class__.__name__})", "broken"
                self.broken = True
                self._end_leg(why, kind)
                resumed = await self._resume(Break(why, kind, self.transcript, self)) if self._resume else None
                if isinstance(resumed, Leg):
                    self.resumed += 1
                    self.captured = None  # a spliced answer is not what one engine said: never cached
                    self._leg, self._leg_done, self._stalled, self._done = resumed, False, None, False
                    self._pending.clear()
                    self.last_byte_at = time.monotonic()
                    continue
                if isinstance(resumed, bytes):
                    self._completed = True
                    if self.transcript is not None:
                        self.transcript.feed(resumed)
                    yield resumed
                    return
                yield event or self._leg.usage.break_event(why, kind)
                return
        finally:
            self.finish()

    def _end_leg(self, broken: str | None, kind: str) -> None:
        """Tell the current leg how it ended (once) and let its connection go."""
        if self._leg_done:
            return
        self._leg_done = True
        leg = self._leg
        if self._completed:
            leg.response.release()
        else:
            leg.response.close()
        ended, leg.ended = leg.ended, _leg_ended
        ended(LegEnd(self._completed, broken, kind, leg.usage))

    def finish(self) -> None:
        """Release the upstream response and report the outcome (idempotent)."""
        if self._finished:
            return
        self._finished = True
        self._end_leg(None, "")
        on_finish, self._on_finish = self._on_finish, _finished
        self._resume = None  # (the hooks refer back to the request: left set, they made a cycle per stream)
        on_finish(self._completed)

    async def afinish(self) -> None:
        """:meth:`finish` as a background task, for when the client leaves mid-stream."""
        self.finish()


def _finished(_completed: bool) -> None:
    """A finished relay's ``on_finish``: it was called."""


def _leg_ended(_end: LegEnd) -> None:
    """An ended leg's ``ended``: it was called (the try it told refers back to the relay: a cycle, left set)."""


class _ErrorAfter(Exception):
    """An error event after whole events that must still reach the client (``out``)."""

    def __init__(self, out: bytes, event: bytes) -> None:
        super().__init__()
        self.out = out
        self.error = _ErrorEvent(event)
