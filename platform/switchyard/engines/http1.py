"""The engines' client on the request path: HTTP/1.1 over kept-alive connections, parsed by httptools.

Every request a gateway serves is one POST to an engine and its answer, so this client's cost is paid on every
request. aiohttp's client is general-purpose (cookies, redirects, proxies, tracing hooks, payload types,
decompression, a task of its own to write each request's body): a POST and its answer from the overhead
scenario's instant engine cost it 77-88 µs of CPU, and this client, which does what the gateway needs and nothing
else, 20-30 µs (the same host, taking turns; the gateway's instructions a request fell 12-14%: the README's step
table under ``overhead``). The parsing is llhttp's, through httptools (the parser uvicorn serves with); what is
here is the connection pool and the request's few lines of head.

What it does:

* **POST only**, the body given whole (bytes); the head carries ``Host``, ``Content-Length`` and the caller's
  headers (checked: a CR or LF in a header is refused, never sent). No redirect is followed, nothing is
  decompressed (no ``Accept-Encoding`` is sent), no cookie is kept: an engine's answer is passed on as it came.
* **Connections kept alive** per scheme, host and port (``https`` with the system's CA store), reused most recently
  used first, and not reused after :data:`KEEPALIVE_S` idle (vLLM's server closes them at 5 s). A kept-alive
  connection the engine closed before any byte of the answer is tried once more at once, on a new connection: that
  is what a connection the engine had just closed looks like. An engine that is really gone closes the second too.
* **At most ``max_connections``** open at once: past that an idle connection (to any engine) is closed to make
  room, or the request waits for one to come free.
* **Timeouts**: connecting within ``connect_s``; every wait for the answer's next bytes (its head, then each
  part of its body) within ``read_s`` (the engine's silence, not the answer's length), a :class:`TimeoutError`.
* **Answers** of any framing llhttp reads (``Content-Length``, chunked, or ended by the connection's close), read
  as they come (:meth:`EngineResponse.readany`); reading pauses while more than :data:`PAUSE_BYTES` wait unread
  (a slow client of a stream), so memory stays bounded.

A broken answer (the connection closed or reset before its end, bytes that are no HTTP) raises
:class:`AnswerBroken` from the read. A response must be given back: :meth:`EngineResponse.release` after its
body was read to the end (the connection is reused), :meth:`EngineResponse.close` otherwise (the connection is
closed, and the engine aborts the request).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import ssl
from collections import deque
from collections.abc import Mapping
from typing import Any

import httptools
import yarl
from multidict import CIMultiDict, CIMultiDictProxy

#: Idle keep-alive connections are not reused after this long: vLLM's API server runs uvicorn with a keep-alive
#: timeout of 5 s (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``), and a request sent on a connection the server has just closed
#: fails before any answer.
KEEPALIVE_S = 4.0
#: Unread bytes of an answer past which reading from its connection pauses (until they are read).
PAUSE_BYTES = 256 * 1024
_DEFAULT_PORTS = {"http": 80, "https": 443}


class AnswerBroken(Exception):
    """The engine's answer broke off: its connection closed or was reset before the answer's end, or it sent
    bytes that are no HTTP answer."""


class EngineConnectError(OSError):
    """No connection to the engine could be made (refused, unreachable, a TLS handshake that failed)."""


class _Disconnected(AnswerBroken):
    """The connection closed before a byte of the answer came."""


def _raisable(error: BaseException) -> BaseException:
    """A copy of a kept ``error`` to raise. The one an answer keeps is never raised itself: raised, it would hold
    the frames it passed through, whose locals hold the answer that keeps it, and every broken answer would be a
    reference cycle that only the garbage collector frees, with its request's objects (the relay, the try, the
    decision) held until then."""
    return copy.copy(error)


class EngineResponse:
    """An engine's answer: its status and headers, and its body as it comes (see the module doc).

    ``content`` is the response itself (``readany``, ``read``), as aiohttp's ``ClientResponse.content`` is its
    stream, so the functions that read answers take either.
    """

    __slots__ = ("_chunks", "_complete", "_conn", "_error", "_given_back", "_headers", "_raw_headers", "_size",
                 "_waiter", "closed", "reason", "status", "url")

    def __init__(self, conn: _Connection, url: yarl.URL) -> None:
        self._conn = conn
        self.url = url
        self.status = 0
        self.reason = ""
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._headers: CIMultiDictProxy[str] | None = None
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._complete = False  # the answer's end was read off the connection
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._given_back = False
        #: Its connection was closed when it was given back (not kept for another request).
        self.closed = False

    # --- the head ---------------------------------------------------------------------------------

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        """The answer's headers (names in any case)."""
        if self._headers is None:
            self._headers = CIMultiDictProxy(CIMultiDict(
                (name.decode("latin-1"), value.decode("latin-1")) for name, value in self._raw_headers))
        return self._headers

    def _header(self, lowered: bytes) -> bytes | None:
        for name, value in self._raw_headers:
            if name.lower() == lowered:
                return value
        return None

    @property
    def content_type(self) -> str:
        """The media type of ``Content-Type`` without its parameters, lower case (``application/octet-stream``
        when it has none, as HTTP says)."""
        value = self._header(b"content-type")
        if value is None:
            return "application/octet-stream"
        return value.split(b";", 1)[0].strip().decode("latin-1").lower()

    @property
    def content_length(self) -> int | None:
        """``Content-Length``, when the answer has one."""
        value = self._header(b"content-length")
        try:
            return int(value) if value is not None else None
        except ValueError:
            return None

    @property
    def content(self) -> EngineResponse:
        """The body's reader: the response itself."""
        return self

    # --- the body ---------------------------------------------------------------------------------

    async def readany(self) -> bytes:
        """The body's bytes that came since the last read (waiting for some when none did); ``b""`` at its end.

        Raises:
            AnswerBroken: The answer broke off.
            TimeoutError: The engine sent nothing for the client's ``read_s``.
        """
        while not self._chunks:
            if self._error is not None:
                raise _raisable(self._error)
            if self._complete:
                return b""
            await self._wait()
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        if self._size > PAUSE_BYTES:
            self._conn.resume()
        self._size = 0
        return data

    async def read(self, n: int = -1) -> bytes:
        """The body to its end, or (``n`` ≥ 0) its first ``n`` bytes (fewer when it ends before); the rest stays
        unread (and the connection is then closed when given back)."""
        parts: list[bytes] = []
        got = 0
        while n < 0 or got < n:
            chunk = await self.readany()
            if not chunk:
                break
            if n >= 0 and got + len(chunk) > n:
                keep = n - got
                self._chunks.appendleft(chunk[keep:])
                self._size += len(chunk) - keep
                chunk = chunk[:keep]
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    async def _wait(self) -> None:
        waiter = self._waiter = self._conn.loop.create_future()
        timer = self._conn.loop.call_later(self._conn.read_s, _time_out, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
            # (a waiter given an error raises it with a traceback that holds this frame: without its local, the
            # waiter, its error and the frame are no reference cycle)
            del waiter

    # --- the connection's callbacks ---------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > PAUSE_BYTES:
            self._conn.pause()
        self._wake()

    def _ended(self) -> None:
        self._complete = True
        self._wake()

    def _broke(self, error: BaseException) -> None:
        if self._complete or self._error is not None:
            return
        self._error = error
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(_raisable(error))

    # --- giving it back ---------------------------------------------------------------------------

    def release(self) -> None:
        """Give the connection back: kept for the next request when the answer was read to its end and the
        engine keeps it alive, closed otherwise."""
        if self._given_back:
            return
        self._given_back = True
        self.closed = not self._conn.done(reuse=self._complete and not self._chunks)

    def close(self) -> None:
        """Close the connection (the engine sees it close and aborts the request); a read waiting for more of the
        answer raises :class:`AnswerBroken`."""
        if self._given_back:
            return
        self._given_back = self.closed = True
        self._broke(AnswerBroken("the answer was closed before its end"))
        self._conn.done(reuse=False)

    async def __aenter__(self) -> EngineResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


def _time_out(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Connection(asyncio.Protocol):
    """One connection to an engine: at most one request on it at a time."""

    def __init__(self, client: EngineClient, key: tuple[str, str, int]) -> None:
        self.client = client
        self.key = key
        self.loop = client.loop
        self.read_s = client.read_s
        #: The answer's parser; it holds this connection (its callbacks), so it goes when the connection is lost, or
        #: every connection closed would be a reference cycle, with the last answer it carried.
        self.parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.answer: EngineResponse | None = None
        self.head: asyncio.Future[None] | None = None  # the answer's head's arrival
        self.heard = False  # a byte of the answer came
        self.keep_alive = False  # the engine keeps the connection open after the answer that ended
        self.closed = False
        self.paused = False
        self.idle_since = 0.0

    # --- asyncio.Protocol ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        answer = self.answer
        if answer is None or answer._complete:  # bytes no request asked for: the connection cannot be trusted
            self.keep_alive = False
            if answer is None:
                self.shut()
            return
        parser = self.parser
        if parser is None:
            return
        self.heard = True
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._failed(AnswerBroken(f"an answer that is no HTTP ({exc})"))
            self.shut()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        answer = self.answer
        if answer is not None and not answer._complete:
            if self.head is None and self._ends_at_close():
                answer._ended()  # an answer without a length ends where its connection does
            else:
                why = f" ({exc.__class__.__name__}: {exc})" if exc is not None else ""
                self._failed((AnswerBroken if self.heard else _Disconnected)(
                    "the connection closed " + ("before the answer's end" if self.heard else "before any answer")
                    + why))
        self.parser = None
        self.client._lost(self)

    # --- httptools' callbacks ---------------------------------------------------------------------

    def on_status(self, status: bytes) -> None:
        if self.answer is not None:
            self.answer.reason = status.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.answer is not None:
            self.answer._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        answer, head = self.answer, self.head
        if answer is None:
            return
        assert self.parser is not None  # (a callback of its feed_data)
        answer.status = self.parser.get_status_code()
        if answer.status < 200:  # (an interim 1xx: the answer is still to come)
            answer._raw_headers.clear()
            return
        self.head = None
        if head is not None and not head.done():
            head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.answer is not None:
            self.answer._fed(body)

    def on_message_complete(self) -> None:
        answer = self.answer
        if answer is not None and answer.status >= 200:
            assert self.parser is not None  # (a callback of its feed_data)
            self.keep_alive = self.parser.should_keep_alive()  # (llhttp forgets it once the next message begins)
            answer._ended()

    # --- the request ------------------------------------------------------------------------------

    def _ends_at_close(self) -> bool:
        answer = self.answer
        return (answer is not None and answer.status >= 200 and answer._header(b"content-length") is None
                and answer._header(b"transfer-encoding") is None)

    def _failed(self, error: BaseException) -> None:
        head = self.head
        if head is not None:
            self.head = None
            if not head.done():
                head.set_exception(_raisable(error))
        if self.answer is not None:
            self.answer._broke(error)

    async def send(self, url: yarl.URL, request: bytes) -> EngineResponse:
        """Write ``request`` and wait for its answer's head (within ``read_s``)."""
        answer = self.answer = EngineResponse(self, url)
        self.heard = self.keep_alive = False
        head = self.head = self.loop.create_future()
        assert self.transport is not None
        self.transport.write(request)
        timer = self.loop.call_later(self.read_s, _time_out, head)
        try:
            await head
        except BaseException:
            self.head = None
            del head  # (as in EngineResponse._wait: the head's error holds this frame)
            answer._given_back = True
            self.done(reuse=False)
            raise
        finally:
            timer.cancel()
        return answer

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def done(self, reuse: bool) -> bool:
        """Its request is over: keep it for the next one (``reuse``, when the engine keeps it alive too), or close
        it. Whether it was kept."""
        self.answer = None
        self.head = None
        if reuse and not self.closed and self.keep_alive and not self.client.closed:
            self.resume()
            self.client._idle_again(self)
            return True
        self.shut()
        return False

    def shut(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()
        self.client._lost(self)


class EngineClient:
    """Connections to the engines, kept alive (see the module doc). Make it inside a running event loop.

    Args:
        connect_s: How long a connection may take to open.
        read_s: The longest wait for an answer's next bytes.
        max_connections: Connections open at most, to every engine together.
        user_agent: The ``User-Agent`` of every request.
        tls: How ``https`` engines are checked (default: the system's CA store, the host name verified).
    """

    def __init__(self, *, connect_s: float, read_s: float, max_connections: int, user_agent: str,
                 keepalive_s: float = KEEPALIVE_S, tls: ssl.SSLContext | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.connect_s = connect_s
        self.read_s = read_s
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self._agent = user_agent.encode("latin-1")
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._starts: dict[yarl.URL, bytes] = {}
        self._ssl = tls
        self.closed = False

    @property
    def open_connections(self) -> int:
        """Connections open now (in use and idle)."""
        return len(self._open)

    async def post(self, url: yarl.URL, body: bytes, headers: Mapping[str, str]) -> EngineResponse:
        """POST ``body`` to ``url`` with ``headers``; the answer once its head came.

        Raises:
            EngineConnectError: No connection could be made.
            TimeoutError: Connecting, or the answer's head, took too long.
            AnswerBroken: The connection closed (twice: a kept-alive one and a new one) or broke before the head.
            ValueError: A header holds a line break, or the URL is not ``http`` or ``https``.
        """
        if self.closed:
            raise RuntimeError("the engine client is closed")
        request = self._request(url, body, headers)
        key = (url.scheme, url.raw_host or "", url.port or _DEFAULT_PORTS.get(url.scheme, 0))
        conn = self._take(key) or await self._room(url, key)
        if conn is None:
            return await (await self._connect(url, key)).send(url, request)
        try:
            return await conn.send(url, request)
        except _Disconnected:  # the engine closed the kept-alive connection as it was sent: once more, on a new one
            return await (await self._connect(url, key)).send(url, request)

    def _request(self, url: yarl.URL, body: bytes, headers: Mapping[str, str]) -> bytes:
        start = self._starts.get(url)
        if start is None:
            start = self._starts[url] = _start_line(url) + b"User-Agent: " + self._agent + b"\r\n"
            if len(self._starts) > 4096:
                self._starts.clear()
        lines = [start]
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                raise ValueError(f"the header {name!r} cannot be sent: it holds a line break or a colon")
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        lines.append(b"Content-Length: %d\r\n\r\n" % len(body))
        lines.append(body)
        return b"".join(lines)

    def _take(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        stale_before = self.loop.time() - self.keepalive_s
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                continue
            if conn.idle_since < stale_before:
                conn.shut()
                continue
            return conn
        return None

    async def _room(self, url: yarl.URL, key: tuple[str, str, int]) -> _Connection | None:
        """Room for a new connection (None), or an idle one for ``key`` given back while this waited for room."""
        if key[0] not in _DEFAULT_PORTS:
            raise ValueError(f"{url}: only http and https engines are served")
        while len(self._open) >= self.max_connections:
            if self._close_an_idle_one():
                break
            waiter = self.loop.create_future()
            self._waiting.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiting:
                    self._waiting.remove(waiter)
            conn = self._take(key)
            if conn is not None:
                return conn
        return None

    async def _connect(self, url: yarl.URL, key: tuple[str, str, int]) -> _Connection:
        """A new connection for ``key``, open (counted among the open ones while it opens)."""
        conn = _Connection(self, key)
        self._open.add(conn)
        scheme, host, port = key
        tls = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = self._ssl
        try:
            async with asyncio.timeout(self.connect_s):
                await self.loop.create_connection(lambda: conn, host, port, ssl=tls)
        except TimeoutError:  # (an OSError too: raised as it is, a timeout)
            self._lost(conn)
            raise
        except OSError as exc:
            self._lost(conn)
            raise EngineConnectError(exc.errno, exc.strerror or str(exc)) from exc
        except BaseException:
            self._lost(conn)
            raise
        return conn

    def _close_an_idle_one(self) -> bool:
        oldest: _Connection | None = None
        for idle in self._idle.values():
            if idle and (oldest is None or idle[0].idle_since < oldest.idle_since):
                oldest = idle[0]
        if oldest is None:
            return False
        self._idle[oldest.key].remove(oldest)
        oldest.shut()
        return True

    def _idle_again(self, conn: _Connection) -> None:
        conn.idle_since = self.loop.time()
        self._idle.setdefault(conn.key, []).append(conn)
        self._wake_one()

    def _lost(self, conn: _Connection) -> None:
        if conn in self._open:
            self._open.discard(conn)
            idle = self._idle.get(conn.key)
            if idle and conn in idle:
                idle.remove(conn)
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def close(self) -> None:
        """Close every connection (the requests on them break off)."""
        self.closed = True
        for conn in list(self._open):
            conn.shut()
        self._idle.clear()
        await asyncio.sleep(0)  # (the transports' closing callbacks run)


def _start_line(url: yarl.URL) -> bytes:
    """The request line and ``Host`` of a POST to ``url``."""
    host = url.raw_host or ""
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    if url.port is not None and url.port != _DEFAULT_PORTS.get(url.scheme):
        host = f"{host}:{url.port}"
    target = url.raw_path_qs or "/"
    start = f"POST {target} HTTP/1.1\r\nHost: {host}\r\n"
    if url.user is not None:  # credentials in the endpoint's URL: Basic authentication, as aiohttp sent them
        pair = f"{url.user}:{url.password or ''}".encode()
        start += f"Authorization: Basic {base64.b64encode(pair).decode('ascii')}\r\n"
    return start.encode("latin-1")
