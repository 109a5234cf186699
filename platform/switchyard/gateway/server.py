"""The gateway's HTTP server: uvicorn's httptools protocol with limits on what a client controls.

uvicorn (0.54, httptools) bounds neither a request's head nor the time a client takes to send
it: a head may grow without end, and a client that sends one header line a second (slowloris),
or stops half-way through a body, holds its connection (and its buffers) for ever. This protocol
adds, per connection:

* **head size**: a request line plus headers longer than ``max_header_bytes`` is answered 431
  and the connection closed. The parsed URL and headers are counted as they come, and so are
  the raw bytes of a head still incomplete (the parser buffers a header until its end), so a
  head never holds more than the limit plus one read;
* **head time**: a head not complete ``header_timeout_s`` after the connection opened, or after
  the first byte of the next request on a kept-alive connection, is answered 408 (or, when
  nothing of it came, the connection is just closed). An idle kept-alive connection is uvicorn's
  ``timeout_keep_alive``'s;
* **body pauses**: a client that sends nothing of a started body for ``body_timeout_s`` is
  answered 408 (the application sees the client leave) and the connection closed. The clock does
  not run while the server itself holds back: reading paused for a slow application, a
  pipelined request waiting its turn, or a ``100-continue`` not yet sent.

Every refusal is OpenAI's error object, followed by a lingering close (as nginx's): the server
stops writing, reads and drops what the client still sends for up to :data:`LINGER_S`, then
closes. Closing a socket with unread data in it resets the connection, and the reset can destroy
the answer before the client reads it.

Bodies' own limits (size, JSON depth) are the application's (``switchyard.app``, ``gateway.body``).

An answer's head is written with its first body bytes, where uvicorn writes each in a call of its own
(:class:`OnePieceCycle`): a whole answer (every non-streamed completion) goes in one piece, one system call and
one TCP segment instead of two, the client woken once; a stream's head goes with its first chunk when the
application sends that chunk in the same turn of the event loop (the gateway does: it answers a stream once its
first chunk has come), else at the end of that turn.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from asyncio import TimerHandle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.server import ServerState

from switchyard.api.errors import error_body
from switchyard.settings import Settings

log = logging.getLogger("switchyard.gateway.server")
#: uvicorn's checks of a header's name and value (:data:`HEADER_RE`, :data:`HEADER_VALUE_RE`), on text: latin-1 maps
#: each character below 256 to the byte of the same value, and anything above cannot be encoded at all.
_BAD_NAME = re.compile(HEADER_RE.pattern.decode("latin-1"))
_BAD_VALUE = re.compile(HEADER_VALUE_RE.pattern.decode("latin-1"))
#: Every byte :data:`HEADER_VALUE_RE` allows in a value: what ``bytes.translate`` deletes to find, in one pass (about
#: half what the regular expression costs), whether any other is there.
_VALUE_BYTES = bytes([0x09, *range(0x20, 0x7F), *range(0x80, 0x100)])
#: Header names found good already (answers' names come from the gateway's code: a few dozen; bounded all the same).
_GOOD_NAMES: set[str] = set()
_GOOD_NAMES_KEPT = 1024
#: Names whose value would change how uvicorn frames or ends an answer: an answer naming one goes uvicorn's way.
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection"})
#: How long a refused connection is read (and what comes dropped) before it is closed.
LINGER_S = 2.0


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """What a client may take of a connection (see the module doc)."""

    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 30.0
    body_timeout_s: float = 30.0

    @classmethod
    def from_settings(cls, settings: Settings) -> ClientLimits:
        """The limits ``settings`` name."""
        return cls(settings.max_header_bytes, settings.client_header_timeout_s, settings.client_body_timeout_s)


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with :class:`ClientLimits` (made by :func:`protocol_factory`).

    An ordinary request (its head, and its body if any, in one read) costs a few attribute checks
    more than uvicorn's own protocol: the clocks are started only for a head or a body left
    incomplete by a read (and once per connection, for a connection that sends nothing).
    """

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, limits: ClientLimits | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits or ClientLimits()
        #: Between a request's head and its end the connection carries a body; otherwise a head.
        self._in_head = True
        #: Raw bytes received of the head being read.
        self._head_raw = 0
        self._head_timer: TimerHandle | None = None
        self._body_timer: TimerHandle | None = None
        #: When body bytes last came (loop time; kept while a body is incomplete).
        self._body_seen = 0.0
        #: Set when the head is too large: the request is not started, and it is answered 431.
        self._refused = False
        #: Answered and closing: what still comes is dropped (see the module doc).
        self._lingering: TimerHandle | None = None

    # --- connection -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer(self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._lingering is not None:
            self._lingering.cancel()
            self._lingering = None
        super().connection_lost(exc)
        cycle = self.cycle
        if isinstance(cycle, OnePieceCycle) and cycle.disconnected:
            cycle.client_gone()

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:
            return
        if self._in_head:
            self._head_raw += len(data)
        elif self._body_timer is not None:  # more of a body
            self._body_seen = self.loop.time()
        super().data_received(data)
        if self.transport.is_closing():
            return
        limits = self.limits
        if self._in_head:
            if self._refused or self._head_raw > limits.max_header_bytes:
                self._refuse(431, f"The request's headers are larger than the {limits.max_header_bytes} bytes "
                             "allowed.", "headers_too_large")
            elif self._head_raw and self._head_timer is None:  # part of a head came: its clock starts
                self._arm_head_timer(limits.header_timeout_s)
        elif self._body_timer is None:  # part of a body came: its clock starts
            self._body_seen = self.loop.time()
            self._body_timer = self.loop.call_later(limits.body_timeout_s, self._body_timeout)

    # --- parser callbacks -----------------------------------------------------------------

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        most = self.limits.max_header_bytes
        if self._head_raw > most and self._head_size() > most:
            self._refused = True  # never started: data_received answers 431
            return
        self._in_head = False
        self._head_raw = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.__class__ is RequestResponseCycle:  # (the request's, made just now)
            cycle.__class__ = OnePieceCycle

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._in_head = True
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    # --- limits ---------------------------------------------------------------------------

    def _head_size(self) -> int:
        """The parsed head's size: its URL and its headers, with separators."""
        return len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)

    def _arm_head_timer(self, delay: float) -> None:
        self._head_timer = self.loop.call_later(delay, self._head_timeout)

    def _head_timeout(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:  # a pipelined head waits for the answer before it
            self._arm_head_timer(self.limits.header_timeout_s)
            return
        if self._head_raw:
            self._refuse(408, f"The request's headers did not arrive within {self.limits.header_timeout_s:g} s.",
                         "request_timeout")
        else:  # nothing of a request came: nobody to answer
            self.transport.close()

    def _body_timeout(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if self._in_head or cycle is None or not cycle.more_body or self.transport.is_closing():
            return
        now = self.loop.time()
        if self.flow.read_paused or cycle.waiting_for_100_continue:
            self._body_seen = now  # the server holds the body back, not the client
        left = self._body_seen + self.limits.body_timeout_s - now
        if left > 0:
            self._body_timer = self.loop.call_later(left, self._body_timeout)
            return
        if cycle.response_started:  # answered already (say, a 413): nothing more can be said
            self.transport.close()
            return
        # The application reading the body sees the client leave; what it answers is dropped.
        cycle.disconnected = True
        cycle.message_event.set()
        if isinstance(cycle, OnePieceCycle):
            cycle.client_gone()
        self._refuse(408, f"The request body stopped arriving for {self.limits.body_timeout_s:g} s.",
                     "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` with OpenAI's error object and close the connection, lingering (see the module doc)."""
        log.debug("%s:%s: %s", *(self.client or ("-", 0)), message)
        self._cancel_timers()
        body = error_body(message, "invalid_request_error", code)
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(),
                 b"\r\nconnection: close\r\n\r\n", body]
        transport = self.transport
        transport.write(b"".join(head))
        if transport.can_write_eof():
            transport.write_eof()
            self._lingering = self.loop.call_later(LINGER_S, transport.close)
        else:
            transport.close()

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None


class OnePieceCycle(RequestResponseCycle):
    """uvicorn's request cycle, but an answer's head is held back and written with its first body bytes (see the
    module doc):

    - an answer with a ``content-length``: its body message follows its head message at once (a whole answer is
      sent in one go), so its head waits for it;
    - a stream (chunked): its head waits at most until the end of the event loop's turn, for a first chunk sent
      in the same turn;
    - a HEAD request's head and a bodiless status's are written at once, as uvicorn does.

    The gateway's own routes (``gateway.fast_routes``) hand it their answers' heads as a status and a mapping
    (:meth:`send_whole`, :meth:`start_stream`) rather than as ASGI messages: the same bytes, made in one pass.

    A client that goes while its answer is unfinished is told to :attr:`on_client_gone` as well (the gateway's
    stream relay stops there rather than in a task of its own that waits for ``receive``'s ``http.disconnect``).

    (The protocol makes each request's cycle uvicorn's way and then gives it this class: same state, a few methods.)
    """

    #: Called once, at once, when the client goes before its answer is complete: its connection is lost, or its body
    #: stopped arriving (the protocol marks the cycle ``disconnected``, and ``receive`` answers ``http.disconnect``).
    on_client_gone: Callable[[], object] | None = None

    def client_gone(self) -> None:
        """The client went before its answer was complete: call :attr:`on_client_gone` (once)."""
        hook, self.on_client_gone = self.on_client_gone, None
        if hook is not None:
            hook()

    def send_whole(self, status: int, headers: Mapping[str, Any], media_type: bytes, body: bytes) -> bool:
        """Write a whole answer (``status``, ``headers``, a ``content-type`` of ``media_type`` unless ``headers``
        name one, a ``content-length``, ``body``) at once, and end the response: what uvicorn's :meth:`send` of its
        start and of its body does (the same bytes, checks and connection handling), without two ASGI messages,
        uvicorn's check of each header in turn and the held head (about 4% of a whole answer's instructions in the
        gateway; the README's fourth look under ``overhead``).

        False, with nothing done, where it is not that simple (:meth:`_head`); :meth:`send` then does it.

        Raises:
            RuntimeError: A header's name or value has a character HTTP does not allow (as uvicorn's :meth:`send`).
        """
        head = self._head(status, headers, media_type, len(body))
        if head is None:
            return False
        self.response_complete = True
        self.expected_content_length = 0
        self.transport.writelines((head, body))  # (one writev: the body is not copied)
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        self.on_response()
        return True

    def start_stream(self, status: int, headers: Mapping[str, Any], media_type: bytes) -> bool:
        """Start a chunked answer (``status``, ``headers``, a ``content-type`` of ``media_type`` unless ``headers``
        name one): what :meth:`send` of its start message does, its head held for a first chunk sent in this turn
        of the event loop. Its chunks are then sent as ASGI messages.

        False, with nothing done, where it is not that simple (:meth:`_head`); :meth:`send` then does it.

        Raises:
            RuntimeError: As :meth:`send_whole`.
        """
        head = self._head(status, headers, media_type, None)
        if head is None:
            return False
        held = _HeldHead(self, self.transport)
        held.head = head
        self.transport = held  # type: ignore[assignment]
        asyncio.get_running_loop().call_soon(held.let_go, b"")
        return True

    def _head(self, status: int, headers: Mapping[str, Any], media_type: bytes, length: int | None) -> bytes | None:
        """The answer's head as uvicorn's :meth:`send` writes it (its ``content-length`` ``length``, or chunked when
        None), the response marked started; None, with nothing done, where the response has begun, the client is
        gone, writing is paused (the send waits for the transport to drain), the request is a HEAD, a stream's
        status has no body, there is an access log to write, or ``headers`` name the answer's length, transfer
        encoding or connection.

        Raises:
            RuntimeError: A header's name or value has a character HTTP does not allow.
        """
        if (self.response_started or self.disconnected or self.flow.write_paused or self.access_log
                or self.scope["method"] == "HEAD" or (length is None and status in (204, 304))):
            return None
        names = [name.lower() for name in headers]
        if not _FRAMING.isdisjoint(names):
            return None
        if not _GOOD_NAMES.issuperset(names):
            if _BAD_NAME.search("-".join(names)):  # (neither "-" nor a tab is one of the characters looked for)
                raise RuntimeError("Invalid HTTP header name.")
            if len(_GOOD_NAMES) < _GOOD_NAMES_KEPT:
                _GOOD_NAMES.update(names)
        values = [str(value) for value in headers.values()]
        joined = "\t".join(values)
        try:
            clean = not joined.encode("latin-1").translate(None, _VALUE_BYTES)
        except UnicodeEncodeError:  # (not latin-1: the regular expression says whether it is also refused)
            clean = False
        if not clean and _BAD_VALUE.search(joined):
            raise RuntimeError("Invalid HTTP header value.")
        lines = [STATUS_LINE[status]]
        for name, value in self.default_headers:
            lines += (name, b": ", value, b"\r\n")
        lines.append("".join([f"{name}: {value}\r\n" for name, value in zip(names, values, strict=True)])
                     .encode("latin-1"))
        if "content-type" not in names:
            lines += (b"content-type: ", media_type, b"\r\n")
        if length is None:
            lines.append(b"transfer-encoding: chunked\r\n")
        else:
            lines += (b"content-length: ", b"%d" % length, b"\r\n")
        if not self.keep_alive:
            lines.append(b"connection: close\r\n")
        lines.append(b"\r\n")
        self.response_started = True
        self.waiting_for_100_continue = False
        self.chunked_encoding = length is None
        self.expected_content_length = 0
        return b"".join(lines)

    async def send(self, message: Any) -> None:
        if self.response_started or message["type"] != "http.response.start":
            await super().send(message)
            return
        transport = self.transport
        held = _HeldHead(self, transport)
        self.transport = held  # type: ignore[assignment]  # (uvicorn's send writes the head through it)
        try:
            await super().send(message)
        finally:
            if held.head is None or self.chunked_encoding is None or self.scope["method"] == "HEAD":
                held.let_go(b"")
            elif self.chunked_encoding:  # a stream: its first chunk may come later, and its head must not wait
                asyncio.get_running_loop().call_soon(held.let_go, b"")


class _HeldHead:
    """The transport of a :class:`OnePieceCycle` between its answer's head and its body: the first write (the head)
    is kept, the next one sends it with its own bytes and hands the cycle its transport back (as does
    :meth:`let_go` itself, which may come later and then does nothing more); anything else is the transport's."""

    __slots__ = ("cycle", "head", "transport")

    def __init__(self, cycle: RequestResponseCycle, transport: asyncio.Transport) -> None:
        self.cycle = cycle
        self.transport = transport
        self.head: bytes | None = None

    def write(self, data: bytes) -> None:
        if self.head is None:
            self.head = data
        else:
            self.let_go(data)

    def let_go(self, data: bytes) -> None:
        """Write the head held (if any) and ``data``, and give the cycle its transport back."""
        transport = self.transport
        self.cycle.transport = transport
        head, self.head = self.head, None
        if head is None or transport.is_closing():
            return
        if data:
            transport.writelines((head, data))  # (one writev: the body is not copied)
        else:
            transport.write(head)

    def close(self) -> None:
        self.let_go(b"")
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


def protocol_factory(settings: Settings) -> type[asyncio.Protocol]:
    """What to pass uvicorn as ``http=``: :class:`LimitedHttpToolsProtocol` with ``settings``' limits.

    (A partial, not a class: uvicorn only calls it, and it pickles for ``--workers`` processes.)
    """
    factory = functools.partial(LimitedHttpToolsProtocol, limits=ClientLimits.from_settings(settings))
    return cast("type[asyncio.Protocol]", factory)
