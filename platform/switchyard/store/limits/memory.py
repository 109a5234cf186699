"""The in-process limit store: token buckets for one gateway process."""

from __future__ import annotations

import heapq
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from switchyard.store.limits.arithmetic import (
    SWEEP_BATCH,
    admission,
    check_actual,
    check_ttl,
    fits,
    merge,
    new_reservation_id,
    refilled,
    settled,
    state,
)
from switchyard.store.limits.model import Admission, Bucket, BucketState, Charge

#: Index entries of settled reservations tolerated beyond the live ones before a rebuild.
_COMPACT_SLACK = 64


@dataclass(slots=True)
class _Level:
    """A bucket's level at a time (its definition kept so that a full one can be dropped)."""

    bucket: Bucket
    level: float
    since: float


@dataclass(frozen=True, slots=True)
class _Reservation:
    expires_at: float
    charges: tuple[Charge, ...]


class MemoryLimitStore:
    """Token buckets in a dict, for a gateway that runs as one process.

    Every operation runs to its end without awaiting, so concurrent tasks of one event loop see
    each other's operations whole; it is not meant to be shared between threads. An absent
    bucket is a full one, which is what lets :meth:`sweep` drop full buckets.
    """

    def __init__(self) -> None:
        self._buckets: dict[str, _Level] = {}
        self._reservations: dict[str, _Reservation] = {}
        # (expires_at, id), cleaned lazily: a settled reservation's entry stays until it is
        # popped as expired or the index is rebuilt.
        self._expiries: list[tuple[float, str]] = []

    async def reserve(self, charges: Sequence[Charge], ttl_s: float, now: float | None = None) -> Admission:
        """Take every amount or none (see :class:`~switchyard.store.limits.LimitStore`)."""
        check_ttl(ttl_s)
        merged = merge(charges)
        at = time.monotonic() if now is None else now
        self._forget_expired(at, SWEEP_BATCH)
        current = [self._refilled(c.bucket, at) for c in merged]
        if not all(fits(c, level) for c, (level, _) in zip(merged, current, strict=True)):
            return admission(merged, [level for level, _ in current], None)
        for charge, (level, since) in zip(merged, current, strict=True):
            self._set(charge.bucket, level - charge.amount, since)
        reservation = new_reservation_id()
        self._reservations[reservation] = _Reservation(at + ttl_s, tuple(merged))
        heapq.heappush(self._expiries, (at + ttl_s, reservation))
        return admission(merged, [level for level, _ in current], reservation)

    async def reconcile(self, reservation: str, actual: Mapping[str, float], now: float | None = None) -> bool:
        """Settle a reservation exactly once (see :class:`~switchyard.store.limits.LimitStore`)."""
        check_actual(actual)
        at = time.monotonic() if now is None else now
        held = self._reservations.pop(reservation, None)
        if held is None:
            return False
        if len(self._expiries) > 2 * len(self._reservations) + _COMPACT_SLACK:
            # Settled reservations leave their index entries behind; rebuilding once they
            # outnumber the live ones keeps the index within twice the outstanding reservations.
            self._expiries = [(r.expires_at, rid) for rid, r in self._reservations.items()]
            heapq.heapify(self._expiries)
        if held.expires_at <= at:
            return False
        for charge in held.charges:
            level, since = self._refilled(charge.bucket, at)
            used = actual.get(charge.bucket.key, charge.amount)
            self._set(charge.bucket, settled(charge.bucket, level, charge.amount, used), since)
        return True

    async def sweep(self, now: float | None = None) -> int:
        """Forget expired reservations and drop full buckets; returns how many reservations went."""
        at = time.monotonic() if now is None else now
        forgotten = self._forget_expired(at, None)
        full = [key for key, held in self._buckets.items()
                if refilled(held.bucket, held.level, held.since, at)[0] >= held.bucket.capacity]
        for key in full:
            del self._buckets[key]
        return forgotten

    async def peek(self, buckets: Sequence[Bucket], now: float | None = None) -> list[BucketState]:
        """What ``buckets`` hold at ``now``, changing nothing."""
        at = time.monotonic() if now is None else now
        return [state(bucket, self._refilled(bucket, at)[0]) for bucket in buckets]

    async def aclose(self) -> None:
        """Nothing to release: the buckets live and die with the process."""

    def _set(self, bucket: Bucket, level: float, since: float) -> None:
        """``bucket`` holds ``level`` as of ``since`` (its level object changed in place: every request's
        reservation and settlement pass here)."""
        held = self._buckets.get(bucket.key)
        if held is None:
            self._buckets[bucket.key] = _Level(bucket, level, since)
        else:
            held.bucket, held.level, held.since = bucket, level, since

    def _refilled(self, bucket: Bucket, now: float) -> tuple[float, float]:
        held = self._buckets.get(bucket.key)
        if held is None:
            return bucket.capacity, now
        return refilled(bucket, held.level, held.since, now)

    def _forget_expired(self, now: float, most: int | None) -> int:
        """Drop reservations expired at ``now``, looking at ``most`` index entries (None: all)."""
        forgotten = looked = 0
        while self._expiries and self._expiries[0][0] <= now and (most is None or looked < most):
            _, reservation = heapq.heappop(self._expiries)
            looked += 1
            if self._reservations.pop(reservation, None) is not None:
                forgotten += 1
        return forgotten
