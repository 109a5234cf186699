"""Listening sockets, and closing and reopening one engine's while its uvicorn server runs on.

Fault mode ``down`` has to refuse connections without stopping the engine: the server's
listening socket is closed and the transports of its open connections are aborted (their
requests see a disconnect and are aborted in the engine); leaving ``down`` binds the same host
and port again (``SO_REUSEADDR``: the dropped connections' ``TIME_WAIT`` does not block it) and
serves it with the same server, app and engine.
"""

from __future__ import annotations

import asyncio
import socket

import uvicorn


def bind_socket(host: str, port: int) -> socket.socket:
    """A non-blocking TCP socket listening on ``host:port`` (port 0: any free port).

    Raises:
        OSError: The address cannot be bound (in use, not an interface of this machine).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class EngineListener:
    """The listening side of one engine's uvicorn server (see ``EngineRuntime.listener``).

    Args:
        server: The server, started (it has its protocol class and asyncio servers).
        host: Address it listens on.
        port: Port it listens on (the bound one, never 0).
    """

    def __init__(self, server: uvicorn.Server, host: str, port: int) -> None:
        self.server = server
        self.host = host
        self.port = port
        self._listening = True

    @property
    def listening(self) -> bool:
        """Whether connections are accepted."""
        return self._listening

    def close(self) -> None:
        """Close the listening socket and abort every open connection (idle keep-alive ones too)."""
        self._listening = False
        for server in self.server.servers:
            server.close()
        for connection in list(self.server.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()

    async def reopen(self) -> None:
        """Listen on the same address again, served by the same server and app.

        Raises:
            OSError: The address cannot be bound (someone took the port meanwhile).
        """
        sock = bind_socket(self.host, self.port)
        server, config = self.server, self.server.config
        loop = asyncio.get_running_loop()

        def protocol() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=server.server_state, app_state=server.lifespan.state, _loop=loop)

        try:
            listening = await loop.create_server(protocol, sock=sock, backlog=config.backlog)
        except BaseException:
            sock.close()
            raise
        server.servers = [listening]
        self._listening = True
