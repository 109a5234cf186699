"""The engines' client's own rules (``engines/http1.py``) against loopback servers: keep-alive and its idle limit,
the connection limit, timeouts, an answer's framing, bounded reading, and what it refuses to send."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import yarl

from switchyard.engines import http1
from switchyard.engines.http1 import AnswerBroken, EngineClient, EngineConnectError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head, await reader.readexactly(length)


def answer(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


class Server:
    """A loopback server that runs ``handler`` per connection and counts its connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.listener: asyncio.Server | None = None

    async def start(self) -> yarl.URL:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        self.listener = await asyncio.start_server(handle, "127.0.0.1", 0)
        return yarl.URL(f"http://127.0.0.1:{self.listener.sockets[0].getsockname()[1]}/v1/completions")

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()


async def echo_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers every request on the connection with its own head and body, as JSON-ish text."""
    while True:
        head, body = await read_request(reader)
        writer.write(answer(body, b"x-head-bytes: %d\r\n" % len(head)))
        await writer.drain()


@pytest.fixture
async def client() -> AsyncIterator[EngineClient]:
    engines = EngineClient(connect_s=2, read_s=1, max_connections=4, user_agent="switchyard-test")
    yield engines
    await engines.close()


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[tuple[Server, yarl.URL]]:
    """A :class:`Server` running ``handler``, and its URL."""
    server = Server(handler)
    url = await server.start()
    try:
        yield server, url
    finally:
        server.close()


def answering(raw: bytes, hold_s: float = 0.0) -> Handler:
    """Reads one request, writes ``raw`` (nothing when empty), then holds the connection ``hold_s`` and closes it."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if raw:
            writer.write(raw)
            await writer.drain()
        await asyncio.sleep(hold_s)

    return handler


def recording(heads: list[bytes]) -> Handler:
    """Answers one request ``{}``, keeping its head in ``heads``."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        heads.append(head)
        writer.write(answer(b"{}"))
        await writer.drain()

    return handler


async def test_a_connection_is_kept_alive_and_reused(client: EngineClient) -> None:
    async with serving(echo_forever) as (server, url):
        for i in range(5):
            response = await client.post(url, b'{"n": %d}' % i, {"Content-Type": "application/json"})
            assert response.status == 200 and await response.read() == b'{"n": %d}' % i
            assert response.content_type == "application/json" and response.content_length == len(b'{"n": 0}')
            response.release()
            assert not response.closed
        assert server.connections == 1 and client.open_connections == 1


async def test_the_request_head_names_the_host_agent_length_and_the_callers_headers(client: EngineClient) -> None:
    heads: list[bytes] = []
    async with serving(recording(heads)) as (_, url):
        response = await client.post(url.with_query(a="1"), b"{}", {"X-Request-Id": "r-1"})
        await response.read()
        response.release()
    lines = heads[0].split(b"\r\n")
    assert lines[0] == b"POST /v1/completions?a=1 HTTP/1.1"
    assert f"Host: 127.0.0.1:{url.port}".encode() in lines
    assert b"User-Agent: switchyard-test" in lines and b"X-Request-Id: r-1" in lines
    assert b"Content-Length: 2" in lines
    assert not any(line.lower().startswith((b"accept-encoding", b"cookie", b"authorization")) for line in lines)


async def test_credentials_in_an_endpoints_url_are_sent_as_basic_authentication(client: EngineClient) -> None:
    heads: list[bytes] = []
    async with serving(recording(heads)) as (_, url):
        response = await client.post(url.with_user("svc").with_password("s3cret"), b"{}", {})
        await response.read()
        response.release()
    lines = heads[0].split(b"\r\n")
    assert b"Authorization: Basic c3ZjOnMzY3JldA==" in lines and f"Host: 127.0.0.1:{url.port}".encode() in lines


async def test_a_header_with_a_line_break_is_never_sent(client: EngineClient) -> None:
    async with serving(echo_forever) as (server, url):
        with pytest.raises(ValueError, match="line break"):
            await client.post(url, b"{}", {"X-Evil": "a\r\nX-Injected: 1"})
        assert server.connections == 0


async def test_an_idle_connection_past_the_keepalive_is_not_reused(client: EngineClient) -> None:
    client.keepalive_s = 0.05
    async with serving(echo_forever) as (server, url):
        for _ in range(2):
            response = await client.post(url, b"{}", {})
            await response.read()
            response.release()
            await asyncio.sleep(0.1)
        assert server.connections == 2 and client.open_connections == 1  # the stale one was closed


async def test_past_the_connection_limit_a_request_waits_for_one_to_come_free(client: EngineClient) -> None:
    release = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            await release.wait()
            writer.write(answer(b"{}"))
            await writer.drain()

    async with serving(slow) as (server, url):
        posts = [asyncio.create_task(client.post(url, b"{}", {})) for _ in range(6)]
        await asyncio.sleep(0.1)
        assert client.open_connections == 4 and server.connections == 4 and not any(p.done() for p in posts)
        release.set()
        for post in posts:
            response = await post
            assert await response.read() == b"{}"
            response.release()
        assert server.connections == 4  # the last two went on connections given back


async def test_at_the_limit_an_idle_connection_to_another_engine_makes_room(client: EngineClient) -> None:
    async with contextlib.AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(serving(echo_forever)) for _ in range(5)]
        for _server, url in servers:
            response = await client.post(url, b"{}", {})
            await response.read()
            response.release()
        assert client.open_connections == 4 and sum(s.connections for s, _ in servers) == 5


async def test_an_engine_silent_past_the_read_timeout_is_a_timeout(client: EngineClient) -> None:
    async with serving(answering(b"", hold_s=5)) as (_, url):
        client.read_s = 0.1
        with pytest.raises(TimeoutError):
            await client.post(url, b"{}", {})
        assert client.open_connections == 0  # the connection is closed, not kept


async def test_a_body_that_stops_coming_is_a_timeout_and_its_connection_closed(client: EngineClient) -> None:
    async with serving(answering(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n12345", hold_s=5)) as (_, url):
        response = await client.post(url, b"{}", {})
        response._conn.read_s = 0.1
        assert await response.readany() == b"12345"
        with pytest.raises(TimeoutError):
            await response.readany()
        response.close()
        assert response.closed and client.open_connections == 0


async def test_a_refused_connection_is_a_connect_error(client: EngineClient) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(EngineConnectError):
        await client.post(yarl.URL(f"http://127.0.0.1:{port}/v1/completions"), b"{}", {})
    assert client.open_connections == 0


async def test_a_connection_that_does_not_open_in_time_is_a_timeout_not_a_refusal(
        client: EngineClient, monkeypatch: pytest.MonkeyPatch) -> None:
    async def never(*_args: object, **_kwargs: object) -> None:
        await asyncio.sleep(5)

    client.connect_s = 0.05
    monkeypatch.setattr(client.loop, "create_connection", never)
    with pytest.raises(TimeoutError) as raised:
        await client.post(yarl.URL("http://127.0.0.1:9/v1/completions"), b"{}", {})
    assert not isinstance(raised.value, EngineConnectError) and client.open_connections == 0


async def test_an_answer_ended_by_the_connections_close_is_read_whole(client: EngineClient) -> None:
    async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n\r\nall of ")
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(b"it")
        await writer.drain()

    async with serving(closing) as (_, url):
        response = await client.post(url, b"{}", {})
        assert await response.read() == b"all of it"
        response.release()
        assert response.closed  # the engine said close


@pytest.mark.parametrize(("raw", "where", "why"), [
    (b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this", "read", "before the answer's end"),
    (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "post", "no HTTP"),
])
async def test_an_answer_cut_short_or_that_is_no_http_is_broken(client: EngineClient, raw: bytes, where: str,
                                                                  why: str) -> None:
    async with serving(answering(raw, hold_s=0 if where == "read" else 1)) as (_, url):
        with pytest.raises(AnswerBroken, match=why):
            response = await client.post(url, b"{}", {})
            await response.read()
        assert where == "read" or client.open_connections == 0


async def test_reading_pauses_while_much_is_unread_and_nothing_is_lost(client: EngineClient,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http1, "PAUSE_BYTES", 64 * 1024)
    part = b"x" * 16_384
    parts = 256  # 4 MiB in all

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(parts):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with serving(big) as (_, url):
        response = await client.post(url, b"{}", {})
        await asyncio.sleep(0.3)  # the engine writes while nobody reads
        assert response._size < 64 * 1024 + 1024 * 1024  # (the pause, and what the kernel's buffers held)
        assert response._conn.paused
        total = 0
        while chunk := await response.readany():
            total += len(chunk)
        assert total == len(part) * parts
        response.release()
        assert not response.closed


async def test_a_request_cancelled_while_it_waits_closes_its_connection(client: EngineClient) -> None:
    seen = asyncio.Event()
    gone = asyncio.Event()

    async def waits(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        seen.set()
        if not await reader.read(1):  # the client closed its side
            gone.set()

    async with serving(waits) as (_, url):
        post = asyncio.create_task(client.post(url, b"{}", {}))
        await seen.wait()
        post.cancel()
        with pytest.raises(asyncio.CancelledError):
            await post
        await asyncio.wait_for(gone.wait(), 2)  # the engine sees the connection close (and aborts the request)
        assert client.open_connections == 0


async def test_an_error_status_is_an_answer_with_its_reason_and_headers(client: EngineClient) -> None:
    busy = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 3\r\ncontent-length: 4\r\n\r\nbusy"
    async with serving(answering(busy, hold_s=1)) as (_, url):
        response = await client.post(url, b"{}", {})
        assert (response.status, response.reason, response.headers["retry-after"]) == (503, "Service Unavailable",
                                                                                        "3")
        assert await response.content.read(2) == b"bu"
        response.release()
        assert response.closed  # what was left unread never goes back to the pool


def _tls_pair(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a certificate for ``localhost`` signed by a CA made here, and a client context that
    trusts only that CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str, signer: ec.EllipticCurvePrivateKey,
                    ca: bool) -> x509.Certificate:
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(hours=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(subject)]), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_cert = certificate("test CA", ca_key, "test CA", ca_key, ca=True)
    server_cert = certificate("localhost", server_key, "test CA", ca_key, ca=False)
    (tmp_path / "server.pem").write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "server.key").write_bytes(server_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp_path / "server.pem", tmp_path / "server.key")
    client = ssl.create_default_context(cadata=ca_cert.public_bytes(serialization.Encoding.PEM).decode())
    return server, client


async def test_an_https_engine_is_reached_over_tls_and_its_certificate_checked(tmp_path: Path) -> None:
    server_tls, client_tls = _tls_pair(tmp_path)
    listener = await asyncio.start_server(echo_forever, "127.0.0.1", 0, ssl=server_tls)
    port = listener.sockets[0].getsockname()[1]
    trusting = EngineClient(connect_s=2, read_s=2, max_connections=2, user_agent="t", tls=client_tls)
    strict = EngineClient(connect_s=2, read_s=2, max_connections=2, user_agent="t")  # the system's CA store
    try:
        for _ in range(2):
            response = await trusting.post(yarl.URL(f"https://localhost:{port}/v1/completions"), b'{"x": 1}', {})
            assert await response.read() == b'{"x": 1}'
            response.release()
        assert trusting.open_connections == 1  # kept alive over TLS too
        with pytest.raises(EngineConnectError):  # a certificate no trusted CA signed
            await strict.post(yarl.URL(f"https://localhost:{port}/v1/completions"), b"{}", {})
        with pytest.raises(EngineConnectError):  # a certificate for another name
            await trusting.post(yarl.URL(f"https://127.0.0.1:{port}/v1/completions"), b"{}", {})
    finally:
        await trusting.close()
        await strict.close()
        listener.close()
