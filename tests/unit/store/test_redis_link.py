"""The pipelined script connection (``store.redis_link``): redis-py's replies and errors, on the real Redis
and against small servers on loopback that answer late, wrongly or not at all; on asyncio's loop and uvloop's
(the gateway's)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import hiredis
import pytest
import uvloop
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from switchyard.store.cache import RedisResponseCache
from switchyard.store.limits import create_limit_store
from switchyard.store.redis_link import LinkScript, ScriptLink
from tests.unit.store.redis_support import REDIS_URL

Run = Callable[[Awaitable[Any]], Any]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    """Runs a coroutine to its end on a new loop of either kind."""
    return asyncio.run if request.param == "asyncio" else uvloop.run  # type: ignore[return-value]


MIXED = ("redis.call('SET', KEYS[1], ARGV[1]) "
         "return {1, ARGV[1], {tonumber(ARGV[2]), false, 'x'}, redis.call('GET', KEYS[1]), redis.call('GET', KEYS[2])}")


def test_replies_are_redis_pys(run: Run) -> None:
    """A script's reply (integers, bulk strings, nested arrays, nils) and a missing key's nil are what redis-py
    gives for the same script, and the store clients use the link."""
    key = f"sytest:{uuid.uuid4().hex}"

    async def main() -> None:
        client = Redis.from_url(REDIS_URL)
        link = ScriptLink.of(client)
        assert link is not None
        try:
            ours = await link.script(MIXED)(keys=[key, key + ":none"], args=["héllo", 42])
            theirs = await client.register_script(MIXED)(keys=[key, key + ":none"], args=["héllo", 42])
            assert ours == theirs == [1, "héllo".encode(), [42, None, b"x"], "héllo".encode(), None]
            assert await link.call("GET", key + ":none") is None
            assert await link.call("DEL", key) == 1
        finally:
            await link.aclose()
            await client.aclose()

    run(main())


def test_stores_use_the_link_for_what_a_request_runs() -> None:
    limits = create_limit_store(REDIS_URL)
    cache = RedisResponseCache(REDIS_URL)
    assert isinstance(limits._reserve, LinkScript) and isinstance(limits._reconcile, LinkScript)  # type: ignore[attr-defined]
    assert all(isinstance(s, LinkScript) for s in (cache._get, cache._put, cache._vectors, cache._put_vector,
                                                   cache._drop_vectors))
    assert not isinstance(cache._sweep, LinkScript)  # the rest stays on redis-py


def test_a_script_the_server_forgot_is_sent_whole(run: Run) -> None:
    """After ``SCRIPT FLUSH`` the call still answers (``EVAL``), and the server has the script again."""
    source = f"return 'flushed-{uuid.uuid4().hex}'"

    async def main() -> None:
        client = Redis.from_url(REDIS_URL)
        link = ScriptLink.of(client)
        assert link is not None
        script = link.script(source)
        try:
            assert await script() == source[8:-1].encode()
            await client.script_flush()
            assert (await client.script_exists(script.sha)) == [False]
            assert await script() == source[8:-1].encode()
            assert (await client.script_exists(script.sha)) == [True]
            with pytest.raises(NoScriptError):
                await link.call("EVALSHA", "0" * 40, 0)
        finally:
            await link.aclose()
            await client.aclose()

    run(main())


def test_many_calls_in_flight_each_get_their_own_reply_and_an_error_stays_its_own(run: Run) -> None:
    async def main() -> None:
        link = ScriptLink()
        echo = link.script("return ARGV[1]")
        fail = link.script("if ARGV[1] == 'boom' then return redis.error_reply('boom ' .. ARGV[2]) end return 1")
        try:
            calls = [echo(args=[str(i)]) if i % 7 else fail(args=["boom", str(i)]) for i in range(700)]
            replies = await asyncio.gather(*calls, return_exceptions=True)
            for i, reply in enumerate(replies):
                if i % 7:
                    assert reply == str(i).encode()
                else:
                    assert isinstance(reply, ResponseError) and str(reply) == f"boom {i}"
        finally:
            await link.aclose()

    run(main())


def test_a_cancelled_call_leaves_the_replies_in_order(run: Run) -> None:
    """A call cancelled while Redis runs its (slow) script: the calls behind it get their own replies."""
    slow = ("local t0 = redis.call('TIME') local a = t0[1] * 1000000 + t0[2] "
            "repeat local t = redis.call('TIME') until t[1] * 1000000 + t[2] - a > 100000 return 'slow'")

    async def main() -> None:
        link = ScriptLink()
        try:
            first = asyncio.ensure_future(link.script(slow)())
            behind = [asyncio.ensure_future(link.call("ECHO", str(i))) for i in range(5)]
            await asyncio.sleep(0.03)
            first.cancel()
            assert await asyncio.gather(*behind) == [str(i).encode() for i in range(5)]
            assert first.cancelled()
            assert await link.call("ECHO", "after") == b"after"
        finally:
            await link.aclose()

    run(main())


def test_a_connection_the_server_closes_is_made_again(run: Run) -> None:
    async def main() -> None:
        link, admin = ScriptLink(), Redis.from_url(REDIS_URL)
        try:
            assert await link.call("PING") == b"PONG"
            pipe = link._pipe
            assert pipe is not None and pipe.transport is not None
            host, port = pipe.transport.get_extra_info("sockname")[:2]
            assert await admin.client_kill_filter(_type=None, addr=f"{host}:{port}") == 1
            for _ in range(200):
                if not pipe.open:
                    break
                await asyncio.sleep(0.01)
            assert not pipe.open
            assert await link.call("ECHO", "again") == b"again"
            assert link._pipe is not pipe
        finally:
            await link.aclose()
            await admin.aclose()

    run(main())


def test_a_link_moves_to_the_next_event_loop() -> None:
    link = ScriptLink()
    assert asyncio.run(link.call("ECHO", "one")) == b"one"
    assert uvloop.run(link.call("ECHO", "two")) == b"two"
    asyncio.run(link.aclose())


def test_database_and_credentials_come_from_the_client() -> None:
    link = ScriptLink.of(Redis.from_url("redis://user:secret@10.1.2.3:6390/4", socket_connect_timeout=0.5,
                                        socket_timeout=1.5))
    assert link is not None
    assert (link._host, link._port, link._db, link._username, link._password) == ("10.1.2.3", 6390, 4, "user", "secret")
    assert (link._connect_timeout_s, link._reply_timeout_s) == (0.5, 1.5)
    unix = ScriptLink.of(Redis.from_url("unix:///run/redis.sock?db=2"))
    assert unix is not None and (unix._path, unix._db) == ("/run/redis.sock", 2)
    # What the link does not reproduce stays on redis-py.
    assert ScriptLink.of(Redis.from_url("rediss://10.1.2.3:6390/0")) is None
    assert ScriptLink.of(Redis.from_url("redis://127.0.0.1:6379/0", decode_responses=True)) is None
    assert ScriptLink.of(Redis.from_url("redis://127.0.0.1:6379/0", protocol=3)) is None
    limits = create_limit_store("rediss://10.1.2.3:6390/0")
    assert limits._link is None and not isinstance(limits._reserve, LinkScript)  # type: ignore[attr-defined]


def test_a_database_is_selected() -> None:
    key = f"sytest:{uuid.uuid4().hex}"

    async def main() -> None:
        link = ScriptLink(db=5)
        other = Redis.from_url(REDIS_URL.rsplit("/", 1)[0] + "/5")
        try:
            assert await link.call("SET", key, "in five") == b"OK"
            assert await other.get(key) == b"in five"
        finally:
            await other.delete(key)
            await other.aclose()
            await link.aclose()

    asyncio.run(main())


class FakeRedis:
    """A server on loopback that reads commands and answers as ``answer`` says (None: not at all)."""

    def __init__(self, answer: Callable[[list[bytes]], bytes | None]) -> None:
        self.answer = answer
        self.commands: list[list[bytes]] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        parser = hiredis.Reader()
        while data := await reader.read(65536):
            parser.feed(data)
            while (command := parser.gets()) is not False:
                self.commands.append(command)
                reply = self.answer(command)
                if reply == b"CLOSE":
                    writer.close()
                    return
                if reply is not None:
                    writer.write(reply)
        writer.close()


def test_credentials_and_database_are_sent_first(run: Run) -> None:
    async def main() -> None:
        fake = FakeRedis(lambda command: b"+OK\r\n" if command[0] in (b"AUTH", b"SELECT") else b":7\r\n")
        async with fake as port:
            link = ScriptLink(port=port, db=3, username="app", password="pw")
            assert await link.script("return 7")(keys=["k"], args=["a"]) == 7
            await link.aclose()
        assert fake.commands[:2] == [[b"AUTH", b"app", b"pw"], [b"SELECT", b"3"]]
        assert fake.commands[2][0] == b"EVALSHA" and fake.commands[2][2:] == [b"1", b"k", b"a"]

    run(main())


def test_refused_credentials_fail_the_call_as_a_connection_error(run: Run) -> None:
    async def main() -> None:
        async with FakeRedis(lambda _: b"-WRONGPASS invalid username-password pair\r\n") as port:
            link = ScriptLink(port=port, password="wrong")
            with pytest.raises(RedisConnectionError, match="WRONGPASS"):
                await link.call("PING")

    run(main())


def test_a_late_reply_times_out_every_waiting_call_and_the_next_call_connects_again(run: Run) -> None:
    silent = [True]

    async def main() -> None:
        fake = FakeRedis(lambda _: None if silent[0] else b"+PONG\r\n")
        async with fake as port:
            link = ScriptLink(port=port, reply_timeout_s=0.2)
            started = time.monotonic()
            results = await asyncio.gather(*(link.call("PING") for _ in range(3)), return_exceptions=True)
            waited = time.monotonic() - started
            assert all(isinstance(r, RedisTimeoutError) for r in results), results
            assert 0.15 <= waited < 2.0
            silent[0] = False
            assert await link.call("PING") == b"PONG"
            assert fake.connections == 2
            await link.aclose()

    run(main())


def test_a_lost_connection_fails_the_waiting_calls(run: Run) -> None:
    async def main() -> None:
        async with FakeRedis(lambda command: b"CLOSE" if command == [b"ECHO", b"x"] else b"+PONG\r\n") as port:
            link = ScriptLink(port=port)
            results = await asyncio.gather(link.call("ECHO", "x"), link.call("PING"), return_exceptions=True)
            assert all(isinstance(r, RedisConnectionError) for r in results), results
            assert await link.call("PING") == b"PONG"
            await link.aclose()
            assert link._pipe is None
            assert await link.call("PING") == b"PONG"  # a closed link connects again, as redis-py's client does
            await link.aclose()

    run(main())


def test_an_unreadable_reply_fails_the_call(run: Run) -> None:
    async def main() -> None:
        async with FakeRedis(lambda _: b"?what\r\n") as port:
            link = ScriptLink(port=port)
            with pytest.raises(RedisConnectionError, match="cannot be read"):
                await link.call("PING")
            await link.aclose()

    run(main())


def test_a_link_closed_while_it_connects_keeps_no_connection(run: Run) -> None:
    async def main() -> None:
        async with FakeRedis(lambda _: b"+OK\r\n") as port:
            link = ScriptLink(port=port, password="pw")
            call = asyncio.ensure_future(link.call("PING"))
            await asyncio.sleep(0)  # the attempt has begun
            await link.aclose()
            with pytest.raises(RedisConnectionError, match="closed while it connected"):
                await call
            assert link._pipe is None
            assert await link.call("PING") == b"OK"  # then a new attempt
            await link.aclose()

    run(main())


def test_nobody_listening_fails_at_once(run: Run) -> None:
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        link = ScriptLink(port=port, connect_timeout_s=1.0)
        started = time.monotonic()
        with pytest.raises(RedisConnectionError, match="Error connecting"):
            await link.call("PING")
        assert time.monotonic() - started < 0.9

    run(main())
