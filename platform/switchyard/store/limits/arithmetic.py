"""The bucket arithmetic both stores share, so that they agree to the last bit.

The Redis store's Lua scripts repeat :func:`refilled`, :func:`fits` and :func:`settled`
operation for operation (IEEE doubles on both sides, numbers passed as text that round-trips);
everything else (which bucket refused, how long to wait, the header values) is computed here
from the levels a store reports.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping, Sequence

from switchyard.store.limits.model import Admission, Bucket, BucketState, Charge

#: Most expired reservations one reserve looks at, so that no request pays for a backlog.
SWEEP_BATCH = 16


def merge(charges: Sequence[Charge]) -> list[Charge]:
    """``charges`` with those of one bucket key added together, in order of first appearance.

    Raises:
        ValueError: two charges give one key different buckets (capacity, refill, limit or unit).
    """
    merged: dict[str, Charge] = {}
    for charge in charges:
        seen = merged.get(charge.bucket.key)
        if seen is None:
            merged[charge.bucket.key] = charge
        elif seen.bucket != charge.bucket:
            raise ValueError(f"bucket {charge.bucket.key}: charged as two different buckets "
                             f"({seen.bucket} and {charge.bucket})")
        else:
            merged[charge.bucket.key] = Charge(seen.bucket, seen.amount + charge.amount)
    return list(merged.values())


def check_ttl(ttl_s: float) -> None:
    """Refuse a reservation lifetime that is not a finite number > 0."""
    if not (math.isfinite(ttl_s) and ttl_s > 0):
        raise ValueError(f"ttl_s must be a finite number > 0, not {ttl_s}")


def check_actual(actual: Mapping[str, float]) -> None:
    """Refuse actual usage that is not a finite number >= 0."""
    for key, used in actual.items():
        if not (math.isfinite(used) and used >= 0):
            raise ValueError(f"bucket {key}: actual usage must be a finite number >= 0, not {used}")


class _Ids:
    """Reservation ids: 64 random bits drawn once per process (again in a forked child) and a counter.

    A ``uuid4`` per admission asked the kernel for randomness on every request, a system call on the event
    loop at which a busy worker thread took the GIL (`switchyard bench --scenario overhead`'s stall sampler
    found the loop there in most runs).
    """

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self.prefix = os.urandom(8).hex()
        self.counter = itertools.count()

    def next(self) -> str:
        return f"{self.prefix}{next(self.counter):016x}"


_IDS = _Ids()


def new_reservation_id() -> str:
    """A reservation id no other process will draw (32 hex digits, as a ``uuid4().hex`` was)."""
    return _IDS.next()


def refilled(bucket: Bucket, level: float, since: float, now: float) -> tuple[float, float]:
    """The level of ``bucket`` at ``now`` and the time it counts from, given ``level`` at ``since``.

    A clock that went back (``now`` before ``since``) refills nothing and keeps ``since``, so
    the same interval is never credited twice.
    """
    if now > since:
        return min(bucket.capacity, level + (now - since) * bucket.refill_per_s), now
    return min(bucket.capacity, level), since


def fits(charge: Charge, level: float) -> bool:
    """Whether a bucket at ``level`` can give ``charge``'s amount now."""
    return charge.amount <= charge.bucket.capacity and level >= charge.amount


def settled(bucket: Bucket, level: float, reserved: float, used: float) -> float:
    """The level after a reservation of ``reserved`` turned out to use ``used``.

    What was not used flows back, up to the capacity; what was used beyond the reservation is
    taken even if the level goes below 0: actual usage is always charged. (``level`` is at most
    the capacity, so the cap only ever bounds a give-back.)
    """
    return min(bucket.capacity, level + (reserved - used))


def state(bucket: Bucket, level: float) -> BucketState:
    """``bucket`` at ``level``, as the rate-limit headers show it."""
    if level >= bucket.capacity:
        reset = 0.0
    elif bucket.refill_per_s > 0:
        reset = _up_to_ms((bucket.capacity - level) / bucket.refill_per_s)
    else:
        reset = math.inf
    return BucketState(bucket, bucket.capacity, max(0.0, level), reset, level)


def admission(charges: Sequence[Charge], levels: Sequence[float], reservation: str | None) -> Admission:
    """The admission of merged ``charges`` given each bucket's level before anything was taken.

    Args:
        charges: The merged charges.
        levels: Each charge's bucket level at the time of the operation, refilled, before taking.
        reservation: The id recorded when every charge fitted (the store decided); None when not.
    """
    if reservation is not None:
        states = [state(c.bucket, level - c.amount) for c, level in zip(charges, levels, strict=True)]
        return Admission(True, reservation, None, None, False, states)
    states = [state(c.bucket, level) for c, level in zip(charges, levels, strict=True)]
    for charge in charges:
        if charge.amount > charge.bucket.capacity:
            return Admission(False, None, charge.bucket, None, True, states)
    waits = [(_wait(c, level), c.bucket) for c, level in zip(charges, levels, strict=True) if not fits(c, level)]
    wait, bucket = max(waits, key=lambda w: w[0])
    return Admission(False, None, bucket, None if math.isinf(wait) else wait, False, states)


def _wait(charge: Charge, level: float) -> float:
    """Seconds until a bucket at ``level`` holds ``charge``'s amount; ``math.inf`` if it never refills."""
    rate = charge.bucket.refill_per_s
    if rate == 0:
        return math.inf
    wait = _up_to_ms((charge.amount - level) / rate)
    # A quotient rounded down by an ulp would leave the retry short by as much.
    return wait if level + wait * rate >= charge.amount else wait + 0.001


def _up_to_ms(seconds: float) -> float:
    """``seconds`` rounded up to the millisecond, so that waiting that long is always enough."""
    return math.ceil(seconds * 1000) / 1000
