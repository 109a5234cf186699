"""Counters for admission: token buckets and reservations against them, in process or in Redis.

Owns: the levels of the buckets, the reservations outstanding against them, and the arithmetic
both backends share. Must not touch: the policy (callers turn limits into :class:`Bucket` values
and build their keys) or HTTP (callers turn :class:`BucketState` into headers).

**Buckets.** A limit applied to one subject is a token bucket (``tokens_per_minute: 20000`` for
tenant 42 is ``Bucket("t:42:tokens_per_minute", 20000, 20000 / 60, ...)``; a day refills over
86400 s, a month over 30 days). It starts full, refills continuously at ``refill_per_s`` up to
its ``capacity``, and can give at most ``capacity`` at once: there are no window boundaries, so
no double burst across one.

**Reserve.** :meth:`LimitStore.reserve` refills every charged bucket to ``now`` and, if each
holds at least its amount, takes every amount and records a reservation (id, amounts, expiry at
``now + ttl_s``); otherwise it takes nothing. Atomically, across all charges and, on Redis,
across processes. A refusal names the lacking bucket with the longest wait and that wait (with
no other traffic, rounded up to the millisecond); an amount above a bucket's capacity is refused
with ``never=True`` and no wait, since no wait can admit it; a bucket that never refills
(``refill_per_s=0``) refuses with no wait too (only give-backs can fill it). A bucket in debt
(level below 0) refuses even a charge of 0. Charges naming one key add up. Every answer carries
each bucket's state for the rate-limit headers.

**Reconcile.** When the request ends, :meth:`LimitStore.reconcile` charges what it really used:
the unused part of each amount flows back (never above capacity), usage beyond the reservation
is taken even below 0, because actual usage is always charged. The reservation is then gone, so
it is settled exactly once; an unknown one (settled or expired) returns False and changes nothing.

**Expiry.** A reservation not reconciled within its ``ttl_s`` (a gateway crashed mid-request) is
forgotten: its amounts stay spent and come back only as the buckets refill. Refunding it could
give back tokens the lost request did use; keeping it spent costs at most one refill period, and
nothing leaks forever. Every reserve forgets a bounded batch of expired reservations;
:meth:`LimitStore.sweep` forgets all of them.

**Reading.** :meth:`LimitStore.peek` tells what buckets hold without changing them (for a usage
page or the console). ``now`` is the store's clock: the Redis server's (``TIME``, so replicas
agree) or the process's monotonic one; tests pass explicit times instead.

**Backends.** :class:`MemoryLimitStore` for one process; :class:`RedisLimitStore` for replicas
sharing one Redis server (one Lua script per operation, the server's clock); both give the same
answers to the same calls. :func:`create_limit_store` picks one from the settings' ``redis_url``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from switchyard.decide.admit import LimitAnswer, LimitCharge
from switchyard.store.limits.memory import MemoryLimitStore
from switchyard.store.limits.model import Admission, Bucket, BucketState, Charge, LimitStore, Unit

if TYPE_CHECKING:
    from switchyard.store.limits.redis_store import RedisLimitStore

__all__ = [
    "DEFAULT_KEY_PREFIX",
    "Admission",
    "Bucket",
    "BucketState",
    "Charge",
    "LimitStore",
    "MemoryLimitStore",
    "RedisLimitStore",
    "Unit",
    "answer_of",
    "charges_of",
    "create_limit_store",
]

#: Prepended to every Redis key of the limits.
DEFAULT_KEY_PREFIX = "sy:lim:"
#: Connections one process opens to Redis; a burst beyond them waits for one (up to the timeout)
#: instead of failing, as redis-py's default pool would.
REDIS_POOL_SIZE = 64
REDIS_POOL_TIMEOUT_S = 5.0
#: A Redis that does not accept a connection, or answer a script, within these fails the call
#: (the gateway then falls back as its policy says) instead of holding the request.
REDIS_CONNECT_TIMEOUT_S = 1.0
REDIS_SOCKET_TIMEOUT_S = 2.0


def charges_of(limits: Sequence[LimitCharge]) -> list[Charge]:
    """The store's charges for the limits ``decide.admit`` says a request is charged against
    (each limit refills its whole capacity over its period)."""
    return [Charge(_bucket(c.key, c.capacity, c.period_s, c.limit, c.unit), c.amount) for c in limits]


@functools.lru_cache(maxsize=4096)
def _bucket(key: str, capacity: float, period_s: float, limit: str, unit: Unit) -> Bucket:
    """The bucket of one limit of one subject, made (and checked) once while it is in use, not per request."""
    return Bucket(key, capacity, capacity / period_s, limit, unit)


def answer_of(admission: Admission) -> LimitAnswer:
    """The store's answer as the decisions read it (which bucket refused, and when it will have room)."""
    refused = admission.refused_by
    if admission.admitted or refused is None:
        return LimitAnswer(True)
    state = next(s for s in admission.states if s.bucket.key == refused.key)
    return LimitAnswer(False, refused.key, admission.never, admission.retry_after_s, state.remaining)


def create_limit_store(redis_url: str | None, *, key_prefix: str = DEFAULT_KEY_PREFIX) -> LimitStore:
    """The in-process store when ``redis_url`` is None, else a Redis store on that server.

    Args:
        redis_url: A ``redis://`` URL, or None for one gateway process.
        key_prefix: Prepended to every Redis key.
    """
    if redis_url is None:
        return MemoryLimitStore()
    from redis.asyncio import BlockingConnectionPool, Redis

    from switchyard.store.limits.redis_store import RedisLimitStore

    pool = BlockingConnectionPool.from_url(redis_url, max_connections=REDIS_POOL_SIZE, timeout=REDIS_POOL_TIMEOUT_S,
                                           socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
                                           socket_timeout=REDIS_SOCKET_TIMEOUT_S)
    return RedisLimitStore(Redis.from_pool(pool), key_prefix=key_prefix)


def __getattr__(name: str) -> Any:
    """:class:`RedisLimitStore`, imported when first asked for: it loads the Redis client, which a gateway without
    ``redis_url`` never needs (it costs the start of every process about a tenth of a second)."""
    if name == "RedisLimitStore":
        from switchyard.store.limits.redis_store import RedisLimitStore

        return RedisLimitStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
