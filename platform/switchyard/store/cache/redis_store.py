"""The Redis response cache: answers shared by every gateway replica."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis

from switchyard.store.cache import DEFAULT_KEY_PREFIX, lua
from switchyard.store.cache.model import (
    VECTORS_PER_CONTEXT,
    CacheEntry,
    CacheStats,
    check_put,
    pack_vector,
    ranked,
    served_to,
    unit_vector,
    unpack_vector,
)
from switchyard.store.limits import (
    REDIS_CONNECT_TIMEOUT_S,
    REDIS_POOL_SIZE,
    REDIS_POOL_TIMEOUT_S,
    REDIS_SOCKET_TIMEOUT_S,
)
from switchyard.store.redis_link import ScriptLink

#: Expired entries one put sweeps (of its own rule), and one script call of a full sweep or purge.
_BATCH = 100
_SCRIPT_BATCH = 1000
#: The longest TTL set on a key; longer ones are cut to it.
_MAX_TTL_MS = 10**12


class RedisResponseCache:
    """Entries, their bookkeeping and semantic vectors in Redis; each change is one Lua script.

    The key layout and what the scripts guarantee are in :mod:`switchyard.store.cache.lua`.
    Similarity is computed here: a lookup fetches its context's vectors (at most
    :data:`VECTORS_PER_CONTEXT`). Connection errors propagate. What a request runs (a lookup, exact or
    semantic, and a put) goes over one pipelined connection (:class:`~switchyard.store.redis_link.ScriptLink`)
    where the client allows it; sweeps, purges and statistics over the client.

    Args:
        redis_url: A ``redis://`` URL (a pool is opened, as for the limit store), or a connection;
            either way the cache owns it and closes it in :meth:`aclose`.
        key_prefix: Prepended to every key the cache writes.
        vectors_per_context: The bound on one context's vectors.
    """

    def __init__(self, redis_url: str | Redis, key_prefix: str = DEFAULT_KEY_PREFIX, *,
                 vectors_per_context: int = VECTORS_PER_CONTEXT) -> None:
        client = _connect(redis_url) if isinstance(redis_url, str) else redis_url
        self._client = client
        self._prefix = key_prefix
        self._per_context = vectors_per_context
        self._link = ScriptLink.of(client)
        hot = client.register_script if self._link is None else self._link.script
        self._put = hot(lua.PUT)
        self._get = hot(lua.GET)
        self._put_vector = hot(lua.PUT_VECTOR)
        self._drop_vectors = hot(lua.DROP_VECTORS)
        self._vectors = hot(lua.VECTORS)
        self._sweep = client.register_script(lua.SWEEP)
        self._purge = client.register_script(lua.PURGE)
        self._stats = client.register_script(lua.STATS_READ)

    async def get(self, rule: str, key: str, tenant: str | None) -> CacheEntry | None:
        """The live entry under ``key`` (see :class:`~switchyard.store.cache.ResponseCache`)."""
        entry = await self._fetch(rule, key)
        return entry if entry is not None and served_to(entry, tenant) else None

    async def put(self, rule: str, key: str, entry: CacheEntry, ttl_s: float, max_entries: int) -> bool:
        """Store ``entry`` (see :class:`~switchyard.store.cache.ResponseCache`)."""
        if not check_put(ttl_s, max_entries):
            return False
        meta: list[Any] = [len(entry.body), entry.model]
        if entry.tenant is not None:
            meta.append(entry.tenant)
        await self._put(args=[self._prefix, rule, key, entry.encode(), _ms(ttl_s), str(max_entries),
                              json.dumps(meta, ensure_ascii=False), str(_BATCH)])
        return True

    async def nearest(self, rule: str, context: str, vector: Sequence[float], min_similarity: float,
                      tenant: str | None) -> tuple[CacheEntry, float] | None:
        """The closest live entry in ``context`` (see :class:`~switchyard.store.cache.ResponseCache`)."""
        query = unit_vector(vector)
        if query is None:
            return None
        flat = await self._vectors(args=[self._prefix, rule, context])
        stored = [(_text(flat[i]), unpack_vector(flat[i + 1])) for i in range(0, len(flat), 2)]
        gone: list[str] = []
        found: tuple[CacheEntry, float] | None = None
        for similarity, key in ranked(query, stored, min_similarity):
            entry = await self._fetch(rule, key)
            if entry is None:
                gone.append(key)
            elif served_to(entry, tenant):
                found = entry, similarity
                break
        if gone:
            await self._drop_vectors(args=[self._prefix, rule, context, *gone])
        return found

    async def put_vector(self, rule: str, context: str, key: str, vector: Sequence[float], ttl_s: float,
                         max_entries: int) -> None:
        """Remember ``vector`` for ``key`` (see :class:`~switchyard.store.cache.ResponseCache`)."""
        unit = unit_vector(vector)
        if unit is None or not check_put(ttl_s, max_entries):
            return
        await self._put_vector(args=[self._prefix, rule, context, key, pack_vector(unit), _ms(ttl_s),
                                     str(min(self._per_context, max_entries))])

    async def purge(self, tenant: str | None = None, model: str | None = None) -> int:
        """Remove matching live entries (see :class:`~switchyard.store.cache.ResponseCache`)."""
        tenants, models = f"{self._prefix}cache-tenant:{tenant}", f"{self._prefix}cache-model:{model}"
        if tenant is not None and model is not None:
            return await self._purge_all_of("both", tenants, models)
        if tenant is not None:
            return await self._purge_all_of("set", tenants)
        if model is not None:
            return await self._purge_all_of("set", models)
        rules, _ = await self._stats(args=[self._prefix])
        removed = 0
        for rule in rules:
            removed += await self._purge_all_of("rule", _text(rule))
        vectors = [k async for k in self._client.scan_iter(match=f"{_glob(self._prefix)}cache-vec*", count=1000)]
        for i in range(0, len(vectors), _SCRIPT_BATCH):
            await self._client.delete(*vectors[i:i + _SCRIPT_BATCH])
        return removed

    async def stats(self) -> CacheStats:
        """Entries, bytes and evictions now, deployment-wide (every rule swept of expired entries first)."""
        rules, _ = await self._stats(args=[self._prefix])
        for rule in rules:
            while int(await self._sweep(args=[self._prefix, _text(rule), str(_SCRIPT_BATCH)])) == _SCRIPT_BATCH:
                pass
        _, (entries, size, ttl, evicted) = await self._stats(args=[self._prefix])
        return CacheStats(int(entries), int(size), {"ttl": int(ttl), "size": int(evicted)})

    async def aclose(self) -> None:
        """Close the connection pool and the pipelined connection."""
        if self._link is not None:
            await self._link.aclose()
        await self._client.aclose()

    async def _fetch(self, rule: str, key: str) -> CacheEntry | None:
        """The entry under ``key`` whoever owns it, marked used; None when absent."""
        raw = await self._get(args=[self._prefix, rule, key])
        return None if raw is None else CacheEntry.decode(raw)

    async def _purge_all_of(self, mode: str, *source: str) -> int:
        """Run the purge script on ``source`` until it has nothing left; the live entries removed."""
        removed = 0
        while True:
            live, looked = await self._purge(args=[self._prefix, mode, str(_SCRIPT_BATCH), *source])
            removed += int(live)
            if int(looked) < _SCRIPT_BATCH:
                return removed


def _connect(redis_url: str) -> Redis:
    """A client on a blocking pool with the limit store's sizes and timeouts."""
    pool = BlockingConnectionPool.from_url(redis_url, max_connections=REDIS_POOL_SIZE, timeout=REDIS_POOL_TIMEOUT_S,
                                           socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
                                           socket_timeout=REDIS_SOCKET_TIMEOUT_S)
    return Redis.from_pool(pool)


def _ms(seconds: float) -> str:
    """Seconds as whole milliseconds for ``PX`` and ``PEXPIRE``: at least 1, at most ~31 years."""
    return str(max(1, min(_MAX_TTL_MS, math.ceil(seconds * 1000))))


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _glob(text: str) -> str:
    """``text`` with the glob characters of ``SCAN MATCH`` escaped."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)
