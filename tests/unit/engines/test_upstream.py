"""The upstream POST against a loopback server that closes connections without answering."""

from __future__ import annotations

import asyncio

import pytest

from switchyard.engines.upstream import UpstreamFailure, UpstreamTimeouts, create_client_session, post

BODY = b'{"ok": true}'
ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY)


class ClosingServer:
    """Reads each request, then closes the first ``drops`` connections without a byte of answer."""

    def __init__(self, drops: int) -> None:
        self.drops = drops
        self.requests = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            self.requests += 1
            if self.requests <= self.drops:
                writer.close()
                return
            writer.write(ANSWER)
            await writer.drain()


async def _post_to(server: ClosingServer) -> tuple[int, int]:
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    timeouts = UpstreamTimeouts(connect_s=2, read_s=5)
    session = create_client_session(timeouts, max_connections=4)
    fresh = create_client_session(timeouts, max_connections=4, fresh=True)
    try:
        response = await post(session, f"http://127.0.0.1:{port}/v1/completions", b'{"prompt": "x"}',
                              {"content-type": "application/json"}, fresh)
        body = await response.read()
        assert body == BODY
        return response.status, server.requests
    finally:
        await session.close()
        await fresh.close()
        listener.close()
        await listener.wait_closed()


async def test_a_connection_closed_before_any_answer_is_tried_once_more() -> None:
    status, requests = await _post_to(ClosingServer(drops=1))
    assert (status, requests) == (200, 2)


async def test_a_second_close_is_a_broken_upstream_not_a_third_try() -> None:
    server = ClosingServer(drops=2)
    with pytest.raises(UpstreamFailure) as failure:
        await _post_to(server)
    assert failure.value.kind == "broken" and "ServerDisconnected" in str(failure.value)
    assert server.requests == 2

