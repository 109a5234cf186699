"""The response caches' behaviour, each test run in process and on the real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from switchyard.store.cache import (
    CacheEntry,
    MemoryResponseCache,
    RedisResponseCache,
    ResponseCache,
    create_response_cache,
)
from tests.unit.store.redis_support import REDIS_URL, delete_prefix, unique_prefix

TTL = 60.0
SHORT_TTL = 0.15


@pytest.fixture(params=["memory", "redis"])
async def cache(request: pytest.FixtureRequest) -> AsyncIterator[ResponseCache]:
    """An empty response cache: in process, then on Redis under a prefix of its own (deleted after)."""
    if request.param == "memory":
        yield MemoryResponseCache()
        return
    prefix = unique_prefix()
    client = Redis.from_url(REDIS_URL)
    try:
        await client.ping()
    except RedisConnectionError as exc:
        pytest.fail(f"Redis at {REDIS_URL} does not answer ({exc}); start it (see .ci/run)")
    store = RedisResponseCache(client, prefix)
    try:
        yield store
    finally:
        await store.aclose()
        await delete_prefix(prefix)


def entry(text: str = "4", *, tenant: str | None = "t1", model: str = "small", rule: str = "r") -> CacheEntry:
    body = f'{{"choices":[{{"message":{{"role":"assistant","content":"{text}"}}}}]}}'.encode()
    return CacheEntry(body=body, model=model, tenant=tenant, rule=rule, created=1.7e9, prompt_tokens=12,
                      completion_tokens=3)


def test_an_entry_round_trips_through_its_encoding() -> None:
    for e in (entry(), entry(tenant=None), CacheEntry(b"\x00\xff", "m", "tênant", "r", 0.5, 0, 0)):
        assert CacheEntry.decode(e.encode()) == e


async def test_put_then_get(cache: ResponseCache) -> None:
    assert await cache.get("r", "k1", "t1") is None
    assert await cache.put("r", "k1", entry("4"), TTL, 10)
    assert await cache.get("r", "k1", "t1") == entry("4")
    assert await cache.get("other-rule", "k1", "t1") is None
    assert await cache.get("r", "k2", "t1") is None
    assert await cache.put("r", "k1", entry("four"), TTL, 10)
    assert await cache.get("r", "k1", "t1") == entry("four")
    stats = await cache.stats()
    assert (stats.entries, stats.bytes, stats.evictions) == (1, len(entry("four").body), {"ttl": 0, "size": 0})


async def test_nothing_is_stored_without_time_or_room(cache: ResponseCache) -> None:
    assert not await cache.put("r", "k", entry(), 0, 10)
    assert not await cache.put("r", "k", entry(), -1, 10)
    assert not await cache.put("r", "k", entry(), float("nan"), 10)
    assert not await cache.put("r", "k", entry(), TTL, 0)
    assert await cache.get("r", "k", "t1") is None
    assert (await cache.stats()).entries == 0


async def test_entries_expire(cache: ResponseCache) -> None:
    assert await cache.put("r", "short", entry("a"), SHORT_TTL, 10)
    assert await cache.put("r", "long", entry("b"), TTL, 10)
    assert await cache.get("r", "short", "t1") is not None
    await asyncio.sleep(SHORT_TTL + 0.1)
    assert await cache.get("r", "short", "t1") is None
    assert await cache.get("r", "long", "t1") == entry("b")
    stats = await cache.stats()
    assert (stats.entries, stats.bytes, stats.evictions) == (1, len(entry("b").body), {"ttl": 1, "size": 0})


async def test_the_least_recently_used_go_first(cache: ResponseCache) -> None:
    for key in "abc":
        assert await cache.put("r", key, entry(key), TTL, 3)
    assert await cache.get("r", "a", "t1") is not None  # a is now the most recently used
    assert await cache.put("r", "d", entry("d"), TTL, 3)
    assert await cache.get("r", "b", "t1") is None
    assert [await cache.get("r", k, "t1") is not None for k in "acd"] == [True, True, True]
    assert await cache.put("r", "e", entry("e"), TTL, 2)  # a smaller bound evicts two at once
    stats = await cache.stats()
    assert (stats.entries, stats.evictions) == (2, {"ttl": 0, "size": 3})
    assert [await cache.get("r", k, "t1") is not None for k in "acde"] == [False, False, True, True]
    # Bounds are per rule.
    assert await cache.put("other", "x", entry("x"), TTL, 1)
    assert (await cache.stats()).entries == 3


async def test_purge_by_tenant_model_or_everything(cache: ResponseCache) -> None:
    stored = {"k1": entry(tenant="a", model="small"), "k2": entry(tenant="a", model="large"),
              "k3": entry(tenant="b", model="small"), "k4": entry(tenant=None, model="small"),
              "k5": entry(tenant="b", model="large")}
    for key, e in stored.items():
        assert await cache.put("r1" if key < "k4" else "r2", key, e, TTL, 10)
    assert await cache.purge(tenant="a", model="small") == 1
    assert await cache.purge(tenant="nobody") == 0
    assert await cache.purge(tenant="a") == 1
    assert await cache.purge(model="large") == 1
    assert (await cache.stats()).entries == 2
    assert await cache.get("r2", "k4", None) is not None
    assert await cache.purge() == 2
    assert await cache.get("r2", "k4", None) is None
    stats = await cache.stats()
    assert (stats.entries, stats.bytes, stats.evictions) == (0, 0, {"ttl": 0, "size": 0})


async def test_purge_does_not_count_expired_entries(cache: ResponseCache) -> None:
    assert await cache.put("r", "gone", entry(), SHORT_TTL, 10)
    assert await cache.put("r", "here", entry(), TTL, 10)
    await asyncio.sleep(SHORT_TTL + 0.1)
    assert await cache.purge(tenant="t1") == 1
    assert (await cache.stats()).evictions["ttl"] == 1


async def test_a_tenant_never_gets_another_tenants_entry(cache: ResponseCache) -> None:
    assert await cache.put("r", "k", entry(tenant="a"), TTL, 10)
    assert await cache.get("r", "k", "b") is None
    assert await cache.get("r", "k", None) is None
    assert await cache.get("r", "k", "a") is not None
    await cache.put_vector("r", "ctx", "k", [1.0, 0.0], TTL, 10)
    assert await cache.nearest("r", "ctx", [1.0, 0.0], 0.5, "b") is None
    assert await cache.nearest("r", "ctx", [1.0, 0.0], 0.5, "a") is not None
    assert await cache.put("r", "g", entry(tenant=None), TTL, 10)
    assert await cache.get("r", "g", "b") is not None and await cache.get("r", "g", None) is not None


async def test_nearest_finds_the_most_similar_above_the_threshold(cache: ResponseCache) -> None:
    vectors = {"north": [0.0, 1.0, 0.0], "east": [1.0, 0.0, 0.0], "northeast": [1.0, 1.0, 0.0]}
    for key, vector in vectors.items():
        assert await cache.put("r", key, entry(key), TTL, 10)
        await cache.put_vector("r", "ctx", key, vector, TTL, 10)
    found = await cache.nearest("r", "ctx", [0.1, 2.0, 0.0], 0.9, "t1")
    assert found is not None and found[0] == entry("north") and found[1] == pytest.approx(0.99875, abs=1e-4)
    found = await cache.nearest("r", "ctx", [2.0, 1.6, 0.0], 0.9, "t1")
    assert found is not None and found[0] == entry("northeast")
    assert await cache.nearest("r", "ctx", [0.0, 0.0, 1.0], 0.1, "t1") is None
    assert await cache.nearest("r", "ctx", [1.0, -1.0, 0.0], 0.75, "t1") is None  # 0.707 to east
    # Other contexts, rules, dimensions and directionless queries find nothing.
    assert await cache.nearest("r", "other", [0.0, 1.0, 0.0], 0.5, "t1") is None
    assert await cache.nearest("r2", "ctx", [0.0, 1.0, 0.0], 0.5, "t1") is None
    assert await cache.nearest("r", "ctx", [0.0, 1.0], 0.5, "t1") is None
    assert await cache.nearest("r", "ctx", [0.0, 0.0, 0.0], 0.5, "t1") is None
    # An identical vector matches a threshold of 1 despite float32 storage.
    odd = [0.1234567, 0.7654321, 0.333]
    assert await cache.put("r", "odd", entry("odd"), TTL, 10)
    await cache.put_vector("r", "ctx", "odd", odd, TTL, 10)
    found = await cache.nearest("r", "ctx", odd, 1.0, "t1")
    assert found is not None and found[0] == entry("odd") and found[1] <= 1.0


async def test_vectors_of_entries_that_are_gone_are_never_returned(cache: ResponseCache) -> None:
    assert await cache.put("r", "expiring", entry("expiring"), SHORT_TTL, 3)
    await cache.put_vector("r", "ctx", "expiring", [1.0, 0.0], TTL, 3)
    assert await cache.put("r", "second", entry("second"), TTL, 3)
    await cache.put_vector("r", "ctx", "second", [0.9, 0.1], TTL, 3)
    await cache.put_vector("r", "ctx", "never-stored", [1.0, 0.0], TTL, 3)
    await asyncio.sleep(SHORT_TTL + 0.1)
    found = await cache.nearest("r", "ctx", [1.0, 0.0], 0.9, "t1")
    assert found is not None and found[0] == entry("second")
    # Evicted by the bound: the third put pushes out "second", the least recently used.
    for key in ("third", "fourth", "fifth"):
        assert await cache.put("r", key, entry(key), TTL, 3)
    await cache.put_vector("r", "ctx", "fifth", [0.0, 1.0], TTL, 3)
    assert await cache.get("r", "second", "t1") is None
    assert await cache.nearest("r", "ctx", [1.0, 0.0], 0.9, "t1") is None
    # Purged.
    assert await cache.nearest("r", "ctx", [0.0, 1.0], 0.9, "t1") is not None
    assert await cache.purge(tenant="t1") == 3
    assert await cache.nearest("r", "ctx", [0.0, 1.0], 0.9, "t1") is None


async def test_a_context_keeps_a_bounded_number_of_vectors(cache: ResponseCache) -> None:
    for i in range(4):
        assert await cache.put("r", f"k{i}", entry(f"{i}"), TTL, 10)
        await cache.put_vector("r", "ctx", f"k{i}", [1.0, 0.01 * i], TTL, 2)
    assert await cache.nearest("r", "ctx", [1.0, 0.0], 0.999, "t1") is not None
    for i, live in enumerate([False, False, True, True]):
        found = await cache.nearest("r", "ctx", [1.0, 0.01 * i], 0.9999999, "t1")
        assert (found is not None and found[0] == entry(f"{i}")) is live


async def test_a_semantic_hit_counts_as_a_use(cache: ResponseCache) -> None:
    for key in ("a", "b"):
        assert await cache.put("r", key, entry(key), TTL, 2)
    await cache.put_vector("r", "ctx", "a", [1.0], TTL, 2)
    assert await cache.nearest("r", "ctx", [1.0], 0.9, "t1") is not None
    assert await cache.put("r", "c", entry("c"), TTL, 2)
    assert await cache.get("r", "a", "t1") is not None and await cache.get("r", "b", "t1") is None


async def test_replicas_share_entries_and_the_bound_holds_under_races() -> None:
    prefix = unique_prefix()
    replicas = [create_response_cache(REDIS_URL, prefix) for _ in range(3)]
    try:
        assert await replicas[0].put("r", "k", entry("shared"), TTL, 10)
        assert await replicas[1].get("r", "k", "t1") == entry("shared")
        await asyncio.gather(*(replicas[i % 3].put("r", f"k{i}", entry(str(i)), TTL, 10) for i in range(60)))
        stats = await replicas[2].stats()
        assert (stats.entries, stats.evictions["size"]) == (10, 51)
        assert sum([await replicas[0].get("r", f"k{i}", "t1") is not None for i in range(60)]) == 10
    finally:
        for replica in replicas:
            await replica.aclose()
        await delete_prefix(prefix)


async def test_redis_failures_propagate() -> None:
    broken = create_response_cache("redis://127.0.0.1:1/0", unique_prefix())
    assert isinstance(broken, RedisResponseCache)
    try:
        with pytest.raises(RedisConnectionError):
            await broken.get("r", "k", "t1")
        with pytest.raises(RedisConnectionError):
            await broken.put("r", "k", entry(), TTL, 10)
    finally:
        await broken.aclose()


def test_create_picks_the_backend() -> None:
    assert isinstance(create_response_cache(None, "x:"), MemoryResponseCache)


async def test_a_huge_ttl_is_accepted(cache: ResponseCache) -> None:
    assert await cache.put("r", "k", entry(), 1e300, 10)
    await cache.put_vector("r", "ctx", "k", [1.0], 1e300, 10)
    assert await cache.nearest("r", "ctx", [1.0], 0.9, "t1") is not None
