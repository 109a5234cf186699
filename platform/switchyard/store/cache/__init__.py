"""The response cache: complete answers by rule and key, in process or in Redis.

Owns: the entries, their expiry and the bound on each rule's entries (least recently used go
first), the semantic vectors by (rule, context), and the counts of what was evicted and why.
Must not touch: the policy or the request (``decide.cache.plan_cache`` says which rule applies
and builds the keys; the gateway embeds text and builds :class:`CacheEntry` values) or HTTP.

**Entries** live ``ttl_s`` from their put, whatever their use; a get or a semantic hit marks
one used. Each entry names its owner (``tenant``, None for a global rule) and a get never
returns an entry another tenant owns, on top of the keys being scoped by tenant already.

**Semantic lookups** compare a query vector with the vectors put under the same rule and
context (cosine similarity of unit vectors) and return the best live entry at or above the
threshold; a vector whose entry has expired, been evicted or purged is skipped and forgotten.

**Backends.** :class:`MemoryResponseCache` for one process (bounds per process);
:class:`RedisResponseCache` for replicas sharing one Redis server (bounds per deployment, one
Lua script per change). :func:`create_response_cache` picks one from the settings' ``redis_url``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from switchyard.store.cache.memory import MemoryResponseCache
from switchyard.store.cache.model import (
    SIMILARITY_EPSILON,
    VECTORS_PER_CONTEXT,
    CacheEntry,
    CacheStats,
    EvictionReason,
    ResponseCache,
)

if TYPE_CHECKING:
    from switchyard.store.cache.redis_store import RedisResponseCache

__all__ = [
    "DEFAULT_KEY_PREFIX",
    "SIMILARITY_EPSILON",
    "VECTORS_PER_CONTEXT",
    "CacheEntry",
    "CacheStats",
    "EvictionReason",
    "MemoryResponseCache",
    "RedisResponseCache",
    "ResponseCache",
    "create_response_cache",
]

#: Prepended to every Redis key of the cache.
DEFAULT_KEY_PREFIX = "sy:"


def create_response_cache(redis_url: str | None, key_prefix: str = DEFAULT_KEY_PREFIX) -> ResponseCache:
    """The in-process cache when ``redis_url`` is None, else a Redis cache on that server.

    Args:
        redis_url: A ``redis://`` URL, or None for one gateway process.
        key_prefix: Prepended to every Redis key (``{prefix}cache:{rule}:{key}``).
    """
    if redis_url is None:
        return MemoryResponseCache()
    from switchyard.store.cache.redis_store import RedisResponseCache

    return RedisResponseCache(redis_url, key_prefix)


def __getattr__(name: str) -> Any:
    """:class:`RedisResponseCache`, imported when first asked for (it loads the Redis client: see
    ``switchyard.store.limits``)."""
    if name == "RedisResponseCache":
        from switchyard.store.cache.redis_store import RedisResponseCache

        return RedisResponseCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
