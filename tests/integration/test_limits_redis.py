"""The limit stores under concurrency, and the Redis store's keys, on the real Redis server.

The behaviour both stores share is tested once for both in ``tests/unit/store``; here: several
OS processes racing on one bucket, many tasks of one process racing, and what the Redis store
leaves in Redis (TTLs, the expiry index, the server's clock).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from switchyard.store.limits import (
    Bucket,
    Charge,
    LimitStore,
    MemoryLimitStore,
    RedisLimitStore,
    create_limit_store,
)
from tests.unit.store.redis_support import REDIS_URL, delete_prefix, redis_store, unique_prefix

# One gateway process: connect and load the scripts, say "ready", wait for "go", then fire
# 100 reservations of 100 tokens at once and print how many were admitted.
WORKER = """
import asyncio, sys
from switchyard.store.limits import Bucket, Charge, create_limit_store

async def main(url, prefix):
    store = create_limit_store(url, key_prefix=prefix)
    bucket = Bucket("shared", 5000, 0, "tokens_per_minute", "tokens")
    await store.peek([bucket])
    await store.reserve([], 60)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    answers = await asyncio.gather(*(store.reserve([Charge(bucket, 100)], 60) for _ in range(100)))
    print(sum(a.admitted for a in answers), flush=True)
    await store.aclose()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    """A key prefix of the test's own, deleted after it."""
    name = unique_prefix()
    yield name
    await delete_prefix(name)


@pytest.fixture
async def client() -> AsyncIterator[Redis]:
    """A plain client, to look at what the store wrote."""
    redis = Redis.from_url(REDIS_URL, decode_responses=True)
    yield redis
    await redis.aclose()


async def test_two_processes_never_admit_more_than_the_bucket_holds(prefix: str) -> None:
    workers = [await asyncio.create_subprocess_exec(sys.executable, "-c", WORKER, REDIS_URL, prefix,
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
               for _ in range(2)]
    try:
        for worker in workers:
            assert worker.stdout and await asyncio.wait_for(worker.stdout.readline(), 60) == b"ready\n"
        for worker in workers:
            assert worker.stdin
            worker.stdin.write(b"go\n")
            await worker.stdin.drain()
        admitted = [int((await asyncio.wait_for(worker.communicate(), 60))[0]) for worker in workers]
    finally:
        for worker in workers:
            if worker.returncode is None:
                worker.kill()
                await worker.wait()
    assert sum(admitted) == 50, admitted
    store = await redis_store(prefix)
    try:
        [state] = await store.peek([Bucket("shared", 5000, 0, "tokens_per_minute", "tokens")])
        assert state.level == 0.0
    finally:
        await store.aclose()


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[LimitStore]:
    """An empty store, in process or on Redis."""
    limits: LimitStore = MemoryLimitStore() if request.param == "memory" else await redis_store(prefix)
    yield limits
    await limits.aclose()


async def test_concurrent_tasks_admit_exactly_what_the_buckets_hold(store: LimitStore) -> None:
    tokens = Bucket("t:1:tokens_per_day", 1000, 0, "tokens_per_day", "tokens")
    requests = Bucket("t:1:requests_per_day", 50, 0, "requests_per_day", "requests")

    async def one_request() -> bool:
        admission = await store.reserve([Charge(tokens, 10), Charge(requests, 1)], 60)
        if admission.reservation:
            # Uses 4 tokens of the 10 reserved; the request count stays spent.
            assert await store.reconcile(admission.reservation, {tokens.key: 4})
        return admission.admitted

    admitted = await asyncio.gather(*(one_request() for _ in range(300)))
    assert sum(admitted) == 50
    assert [s.level for s in await store.peek([tokens, requests])] == [800.0, 0.0]


async def test_the_store_keeps_buckets_reservations_and_an_expiry_index(prefix: str, client: Redis) -> None:
    store = await redis_store(prefix)
    refilling = Bucket("t:1:tokens_per_minute", 1200, 20, "tokens_per_minute", "tokens")
    budget = Bucket("t:1:credits", 100, 0, "credits", "spend")
    try:
        admission = await store.reserve([Charge(refilling, 300), Charge(budget, 10)], 30, now=1000.0)
        assert admission.reservation
        assert await client.hgetall(f"{prefix}b:{refilling.key}") == {"level": "900", "since": "1000"}
        # Full again in 15 s, then the time to fill from empty (60 s), before the idle key goes.
        assert 74_000 < await client.pttl(f"{prefix}b:{refilling.key}") <= 75_000
        assert await client.pttl(f"{prefix}b:{budget.key}") == -1
        reservation = f"{prefix}r:{admission.reservation}"
        assert await client.hgetall(reservation) == {
            "expires": "1030", f"b:{refilling.key}": "300.0 1200.0 20.0", f"b:{budget.key}": "10.0 100.0 0.0"}
        assert 29_000 < await client.pttl(reservation) <= 30_000
        assert await client.zrange(f"{prefix}expiries", 0, -1, withscores=True) == [(admission.reservation, 1030.0)]
        assert await store.reconcile(admission.reservation, {}, now=1001.0)
        assert not await client.exists(reservation)
        assert await client.zcard(f"{prefix}expiries") == 0
        forgotten = await store.reserve([Charge(budget, 10)], 30, now=1001.0)
        assert await store.sweep(1031.0) == 1
        assert not await client.exists(f"{prefix}r:{forgotten.reservation}")
        assert await client.zcard(f"{prefix}expiries") == 0
    finally:
        await store.aclose()


async def test_without_now_the_scripts_read_the_server_clock(prefix: str, client: Redis) -> None:
    store = await redis_store(prefix)
    bucket = Bucket("t:1:tokens_per_minute", 1200, 20, "tokens_per_minute", "tokens")
    try:
        assert (await store.reserve([Charge(bucket, 300)], 30)).admitted
        seconds, micros = await client.time()
        since = float(await client.hget(f"{prefix}b:{bucket.key}", "since") or "nan")
        assert 0 <= seconds + micros / 1e6 - since < 5
    finally:
        await store.aclose()


async def test_an_idle_bucket_vanishes_once_full(prefix: str, client: Redis) -> None:
    store = await redis_store(prefix)
    fast = Bucket("t:1:fast", 1, 20, "tokens_per_minute", "tokens")  # full from empty in 50 ms
    try:
        assert (await store.reserve([Charge(fast, 1)], 30)).admitted
        assert await client.exists(f"{prefix}b:{fast.key}")
        await asyncio.sleep(0.3)
        assert not await client.exists(f"{prefix}b:{fast.key}")
        assert (await store.peek([fast]))[0].level == 1.0
    finally:
        await store.aclose()


async def test_the_factory_picks_the_backend_from_the_url(prefix: str) -> None:
    in_process = create_limit_store(None)
    shared = create_limit_store(REDIS_URL, key_prefix=prefix)
    assert isinstance(in_process, MemoryLimitStore) and isinstance(shared, RedisLimitStore)
    bucket = Bucket("t:1:tokens_per_minute", 1200, 20, "tokens_per_minute", "tokens")
    try:
        for limits in (in_process, shared):
            assert (await limits.reserve([Charge(bucket, 1200)], 30, now=1000.0)).admitted
            assert not (await limits.reserve([Charge(bucket, 1)], 30, now=1000.0)).admitted
    finally:
        await in_process.aclose()
        await shared.aclose()
