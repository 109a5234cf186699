"""The Redis limit store: token buckets shared by every gateway replica."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from redis.asyncio import Redis

from switchyard.store.limits import DEFAULT_KEY_PREFIX, lua
from switchyard.store.limits.arithmetic import (
    SWEEP_BATCH,
    admission,
    check_actual,
    check_ttl,
    merge,
    new_reservation_id,
    state,
)
from switchyard.store.limits.model import Admission, Bucket, BucketState, Charge
from switchyard.store.redis_link import ScriptLink

#: Most expired reservations one sweep script call forgets.
_SWEEP_SCRIPT_BATCH = 1000


class RedisLimitStore:
    """Token buckets in Redis: each operation is one Lua script, atomic on the server.

    With ``now`` None the scripts read the Redis server's clock, so every process agrees on
    time. The key layout and what the scripts guarantee are in :mod:`switchyard.store.limits.lua`.
    The two scripts every request with limits runs (reserve, reconcile) go over one pipelined connection
    (:class:`~switchyard.store.redis_link.ScriptLink`) where the client allows it; the rest over ``client``.

    Args:
        client: The connection; the store owns it from now on and closes it in :meth:`aclose`.
        key_prefix: Prepended to every key the store writes.
    """

    def __init__(self, client: Redis, *, key_prefix: str = DEFAULT_KEY_PREFIX) -> None:
        self._client = client
        self._prefix = key_prefix
        self._index = f"{key_prefix}expiries"
        self._link = ScriptLink.of(client)
        hot = client.register_script if self._link is None else self._link.script
        self._reserve = hot(lua.RESERVE)
        self._reconcile = hot(lua.RECONCILE)
        self._sweep = client.register_script(lua.SWEEP)
        self._peek = client.register_script(lua.PEEK)

    async def reserve(self, charges: Sequence[Charge], ttl_s: float, now: float | None = None) -> Admission:
        """Take every amount or none (see :class:`~switchyard.store.limits.LimitStore`)."""
        check_ttl(ttl_s)
        merged = merge(charges)
        reservation = new_reservation_id()
        keys = [self._index, f"{self._prefix}r:{reservation}", *(f"{self._prefix}b:{c.bucket.key}" for c in merged)]
        args = [_time(now), _num(ttl_s), reservation, str(SWEEP_BATCH), self._prefix]
        for c in merged:
            args += [c.bucket.key, _num(c.amount), _num(c.bucket.capacity), _num(c.bucket.refill_per_s)]
        reply = await self._reserve(keys=keys, args=args)
        levels = [float(level) for level in reply[1:]]
        return admission(merged, levels, reservation if int(reply[0]) == 1 else None)

    async def reconcile(self, reservation: str, actual: Mapping[str, float], now: float | None = None) -> bool:
        """Settle a reservation exactly once (see :class:`~switchyard.store.limits.LimitStore`)."""
        check_actual(actual)
        args = [_time(now), self._prefix, reservation]
        for key, used in actual.items():
            args += [key, _num(used)]
        reply = await self._reconcile(keys=[self._index, f"{self._prefix}r:{reservation}"], args=args)
        return int(reply) == 1

    async def sweep(self, now: float | None = None) -> int:
        """Forget every reservation expired at ``now``, a batch per script call; returns how many."""
        forgotten = 0
        while True:
            count = int(await self._sweep(keys=[self._index],
                                          args=[_time(now), self._prefix, str(_SWEEP_SCRIPT_BATCH)]))
            forgotten += count
            if count < _SWEEP_SCRIPT_BATCH:
                return forgotten

    async def peek(self, buckets: Sequence[Bucket], now: float | None = None) -> list[BucketState]:
        """What ``buckets`` hold at ``now``, changing nothing."""
        args = [_time(now)]
        for bucket in buckets:
            args += [_num(bucket.capacity), _num(bucket.refill_per_s)]
        reply = await self._peek(keys=[f"{self._prefix}b:{b.key}" for b in buckets], args=args)
        return [state(bucket, float(level)) for bucket, level in zip(buckets, reply, strict=True)]

    async def aclose(self) -> None:
        """Close the connection pool and the pipelined connection."""
        if self._link is not None:
            await self._link.aclose()
        await self._client.aclose()


def _num(x: float) -> str:
    """``x`` as text that Lua's ``tonumber`` reads back to the same double."""
    return repr(float(x))


def _time(now: float | None) -> str:
    """The ``now`` argument of a script: empty reads the server clock."""
    return "" if now is None else _num(now)
