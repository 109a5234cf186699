"""The Lua scripts a request runs, over one pipelined Redis connection per process.

A gateway with Redis runs three scripts a request (the exact cache's lookup, the limits' reserve and their
reconcile). Through redis-py's asyncio client each cost 60-150 µs of the gateway's CPU (its pool, its locks,
retries, timeouts and events around every command): together about a third of a request's CPU. A
:class:`ScriptLink` (one per store and process) sends the same ``EVALSHA`` commands on one connection, one after
another without waiting (Redis answers a connection's commands in order), packed and parsed by hiredis, the C
library redis-py itself uses for both: 8-12 µs a script with several in flight, 31-46 µs with one.

What a caller sees is what redis-py gives: the same replies (bytes, integers, lists, None), a script the server
has not cached is sent whole (``EVAL``) and cached by it, an error reply raises ``redis.exceptions.ResponseError``
(``NoScriptError`` for ``NOSCRIPT``), a connection that cannot be made or is lost raises
``redis.exceptions.ConnectionError``, and a reply later than the reply timeout raises
``redis.exceptions.TimeoutError``. A late reply holds up every command behind it on the connection, so the
connection is then closed (as redis-py closes a connection whose read timed out) and every waiting call fails;
the next call connects again. A call cancelled while it waits leaves its reply to be read and dropped.

Everything else (sweeps, purges, statistics) stays on redis-py, and so does a client this module does not
reproduce exactly: TLS (``rediss://``), replies decoded to text, RESP3, or a connection class of its own
(:meth:`ScriptLink.of` returns None and the stores register their scripts on the client as before).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
from collections.abc import Sequence
from typing import Any, cast

import hiredis
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

#: When the client names none: how long a connection may take, and a reply.
CONNECT_TIMEOUT_S = 1.0
REPLY_TIMEOUT_S = 2.0

Arg = str | bytes | int | float


class _Pipe(asyncio.Protocol):
    """One connection: commands written as they come, replies handed to their callers in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, reply_timeout_s: float) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.open = False
        self._reader = hiredis.Reader(protocolError=InvalidResponse, replyError=ResponseError)
        self._waiting: collections.deque[tuple[asyncio.Future[Any], float]] = collections.deque()
        self._reply_timeout_s = reply_timeout_s
        self._timer: asyncio.TimerHandle | None = None
        self._lost: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's transports do not subclass asyncio's)
        self.open = True

    def send(self, args: Sequence[Arg]) -> asyncio.Future[Any]:
        """Write one command; the future gets its reply (or its error)."""
        assert self.transport is not None
        future = self.loop.create_future()
        self.transport.write(hiredis.pack_command(tuple(args)))  # type: ignore[arg-type]  # (its stub types a 1-tuple)
        deadline = self.loop.time() + self._reply_timeout_s
        self._waiting.append((future, deadline))
        if self._timer is None:
            self._timer = self.loop.call_at(deadline, self._check_late)
        return future

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        try:
            while (reply := self._reader.gets()) is not False:
                if not self._waiting:
                    self.close(RedisConnectionError("Redis sent a reply nobody asked for"))
                    return
                future, _ = self._waiting.popleft()
                if future.done():  # its caller was cancelled
                    continue
                if isinstance(reply, ResponseError):
                    future.set_exception(NoScriptError(str(reply)) if str(reply).startswith("NOSCRIPT") else reply)
                else:
                    future.set_result(reply)
        except InvalidResponse as exc:
            self.close(RedisConnectionError(f"Redis sent a reply that cannot be read: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self._fail_waiting(self._lost or RedisConnectionError(
            f"Connection to Redis lost{f': {exc}' if exc is not None else ''}"))

    def _check_late(self) -> None:
        self._timer = None
        if not self._waiting:
            return
        deadline = self._waiting[0][1]
        if deadline <= self.loop.time():
            self.close(RedisTimeoutError(f"Timeout reading from Redis (no reply in {self._reply_timeout_s:g} s)"))
        else:
            self._timer = self.loop.call_at(deadline, self._check_late)

    def close(self, error: Exception) -> None:
        """Close the connection; every call waiting gets ``error``."""
        self.open = False
        self._lost = error
        self._fail_waiting(error)
        if self.transport is not None:
            self.transport.abort()

    def _fail_waiting(self, error: Exception) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._waiting:
            future, _ = self._waiting.popleft()
            if not future.done():  # (each caller its own exception: one raised in many tasks gathers their frames)
                future.set_exception(type(error)(*error.args))


class ScriptLink:
    """One pipelined connection to Redis for the scripts on the request path, made when first used.

    Args:
        host, port: The server, over TCP; or ``path``, a Unix socket.
        db: The database to ``SELECT`` (0: none sent).
        username, password: Sent with ``AUTH`` when a password is given.
        connect_timeout_s: The longest a connection (with its ``AUTH`` and ``SELECT``) may take.
        reply_timeout_s: The longest a reply may take.
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 6379, path: str | None = None, db: int = 0,
                 username: str | None = None, password: str | None = None,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, reply_timeout_s: float = REPLY_TIMEOUT_S) -> None:
        self._host, self._port, self._path, self._db = host, port, path, int(db)
        self._username, self._password = username, password
        self._connect_timeout_s = connect_timeout_s
        self._reply_timeout_s = reply_timeout_s
        self._pipe: _Pipe | None = None
        self._connecting: asyncio.Future[_Pipe] | None = None
        self._connect_task: asyncio.Task[None] | None = None  # (held: the loop keeps only a weak reference)
        self._generation = 0  # (one more at each aclose: a connection made for an earlier one is not kept)

    @classmethod
    def of(cls, client: Redis) -> ScriptLink | None:
        """A link to the server ``client`` talks to, with its database, credentials and timeouts; None when the
        client is one this module does not reproduce exactly (TLS, decoded replies, another connection class)."""
        pool = getattr(client, "connection_pool", None)
        if pool is None or pool.connection_class not in (Connection, UnixDomainSocketConnection):
            return None
        kw = pool.connection_kwargs
        if kw.get("decode_responses") or kw.get("protocol") not in (None, 2, "2") or kw.get("credential_provider"):
            return None
        common: dict[str, Any] = {
            "db": kw.get("db") or 0, "username": kw.get("username"), "password": kw.get("password"),
            "connect_timeout_s": kw.get("socket_connect_timeout") or CONNECT_TIMEOUT_S,
            "reply_timeout_s": kw.get("socket_timeout") or REPLY_TIMEOUT_S}
        if pool.connection_class is UnixDomainSocketConnection:
            return cls(path=kw["path"], **common)
        return cls(host=kw.get("host", "localhost"), port=int(kw.get("port", 6379)), **common)

    def script(self, source: str) -> LinkScript:
        """``source`` as a script to call like redis-py's: ``await script(keys=[...], args=[...])``."""
        return LinkScript(self, source)

    async def call(self, *args: Arg) -> Any:
        """One command's reply."""
        loop = asyncio.get_running_loop()
        pipe = self._pipe
        if pipe is None or not pipe.open or pipe.loop is not loop:
            pipe = await self._connected(loop)
        return await pipe.send(args)

    async def aclose(self) -> None:
        """Close the connection (and drop one being made): calls waiting fail with ``ConnectionError``; a later
        call connects again, as a redis-py client does after its ``aclose``."""
        self._generation += 1
        self._connecting = None
        if self._pipe is not None:
            self._pipe.close(RedisConnectionError("the Redis link was closed"))
            self._pipe = None

    async def _connected(self, loop: asyncio.AbstractEventLoop) -> _Pipe:
        """The open connection on ``loop``, made now if there is none (one attempt shared by every caller)."""
        connecting = self._connecting
        if connecting is None or connecting.get_loop() is not loop:
            old = self._pipe
            if old is not None and old.open and old.loop is not loop:  # a pipe of another event loop
                with contextlib.suppress(RuntimeError):  # that loop is closed: its socket goes with it
                    old.close(RedisConnectionError("the Redis link moved to another event loop"))
            self._pipe = None
            connecting = self._connecting = loop.create_future()
            self._connect_task = loop.create_task(self._connect(loop, connecting, self._generation))
        return await asyncio.shield(connecting)

    async def _connect(self, loop: asyncio.AbstractEventLoop, done: asyncio.Future[_Pipe], generation: int) -> None:
        where = self._path or f"{self._host}:{self._port}"
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                if self._path is not None:
                    _, pipe = await loop.create_unix_connection(lambda: _Pipe(loop, self._reply_timeout_s), self._path)
                else:
                    _, pipe = await loop.create_connection(lambda: _Pipe(loop, self._reply_timeout_s),
                                                           self._host, self._port)
                try:
                    if self._password is not None:
                        credentials = (self._password,) if self._username is None else (self._username, self._password)
                        await pipe.send(("AUTH", *credentials))
                    if self._db:
                        await pipe.send(("SELECT", self._db))
                except BaseException:
                    pipe.close(RedisConnectionError("the connection's set-up failed"))
                    raise
        except ResponseError as exc:
            error: Exception = RedisConnectionError(f"Redis at {where} refused the connection's set-up: {exc}")
        except (TimeoutError, RedisTimeoutError):
            error = RedisTimeoutError(f"Timeout connecting to Redis at {where} ({self._connect_timeout_s:g} s)")
        except (OSError, RedisConnectionError) as exc:
            error = RedisConnectionError(f"Error connecting to Redis at {where}: {exc}")
        else:
            if generation != self._generation:
                error = RedisConnectionError("the Redis link was closed while it connected")
                pipe.close(error)
            else:
                self._pipe = pipe
                self._connecting = None
                done.set_result(pipe)
                return
        if self._connecting is done:
            self._connecting = None
        done.set_exception(error)
        done.exception()  # retrieved here too: a failed attempt nobody awaited any more is not an unhandled error


class LinkScript:
    """A Lua script sent by its SHA1 (``EVALSHA``), and whole (``EVAL``) when the server has not cached it."""

    def __init__(self, link: ScriptLink, source: str) -> None:
        self.link = link
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()  # Redis names scripts so

    async def __call__(self, keys: Sequence[Arg] = (), args: Sequence[Arg] = ()) -> Any:
        try:
            return await self.link.call("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self.link.call("EVAL", self.source, len(keys), *keys, *args)
