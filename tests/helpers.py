"""Small helpers shared by tests."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Coroutine
from typing import Any


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TcpForwarder:
    """A loopback TCP forwarder to ``target_host:target_port`` that a test can cut and restore.

    It listens on :attr:`port` (127.0.0.1) and pipes each connection to the target, in an event
    loop of its own thread, so it works from synchronous tests. :meth:`cut` stops listening (new
    connections are refused) and resets every open connection, which is what a process sees when
    its Redis or database goes away; :meth:`restore` listens on the same port again.
    """

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"forwarder-{self.port}", daemon=True)
        self._thread.start()
        self._server: asyncio.Server | None = None
        self._transports: set[asyncio.WriteTransport] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self.restore()

    def _call(self, work: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout=10)

    @property
    def up(self) -> bool:
        """Whether it forwards (listens) now."""
        return self._server is not None

    def restore(self) -> None:
        """Listen (again) on :attr:`port`; a no-op while listening."""
        self._call(self._listen())

    def cut(self) -> None:
        """Refuse new connections and reset the open ones; a no-op while cut."""
        self._call(self._cut())

    def close(self) -> None:
        """Cut, and stop the forwarder's thread."""
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> TcpForwarder:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._accepted, "127.0.0.1", self.port, reuse_address=True)

    async def _cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for transport in list(self._transports):
            transport.abort()  # RST: both ends see the connection reset
        self._transports.clear()
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=5)
        if server is not None:
            await server.wait_closed()

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer.transport, up_writer.transport)
        self._transports.update(pair)
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            self._transports.difference_update(pair)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()  # one side ended: end the other (a reset connection is already gone)
