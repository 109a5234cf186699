"""What the limit stores take and give, and the interface both of them implement."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

Unit = Literal["tokens", "requests", "spend"]


@dataclass(frozen=True, slots=True)
class Bucket:
    """A token bucket: one limit applied to one subject.

    Attributes:
        key: Names the bucket in storage (``"t:42:tokens_per_minute"``). Callers build keys; two
            buckets with one key are one bucket.
        capacity: The most that can be spent at once; a bucket starts full.
        refill_per_s: What flows back per second, up to ``capacity`` (0: it never refills).
        limit: The policy name of the limit (``"tokens_per_minute"``).
        unit: What the bucket counts.
    """

    key: str
    capacity: float
    refill_per_s: float
    limit: str
    unit: Unit

    def __post_init__(self) -> None:
        # Numbers are floats whatever was passed, so both stores answer with the same types.
        object.__setattr__(self, "capacity", float(self.capacity))
        object.__setattr__(self, "refill_per_s", float(self.refill_per_s))
        if not self.key:
            raise ValueError("a bucket needs a key")
        if not (math.isfinite(self.capacity) and self.capacity > 0):
            raise ValueError(f"bucket {self.key}: capacity must be a finite number > 0, not {self.capacity}")
        if not (math.isfinite(self.refill_per_s) and self.refill_per_s >= 0):
            raise ValueError(f"bucket {self.key}: refill_per_s must be a finite number >= 0, not {self.refill_per_s}")


@dataclass(frozen=True, slots=True)
class Charge:
    """An amount one request wants to take from one bucket."""

    bucket: Bucket
    amount: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "amount", float(self.amount))
        if not (math.isfinite(self.amount) and self.amount >= 0):
            raise ValueError(f"bucket {self.bucket.key}: a charge must be a finite number >= 0, not {self.amount}")


@dataclass(frozen=True, slots=True)
class BucketState:
    """What one bucket holds after an operation, as the ``x-ratelimit-*`` headers show it.

    Attributes:
        bucket: The bucket.
        limit: Its capacity (``x-ratelimit-limit-*``).
        remaining: Its level, floored at 0 (``x-ratelimit-remaining-*``).
        reset_s: Seconds until it is full again with no other traffic, rounded up to the
            millisecond (``x-ratelimit-reset-*``); ``math.inf`` for a bucket that never refills.
        level: Its level as stored: below 0 when actual usage overdrew it.
    """

    bucket: Bucket
    limit: float
    remaining: float
    reset_s: float
    level: float


@dataclass(frozen=True, slots=True)
class Admission:
    """The answer to a reservation: admitted with a reservation id, or refused and why.

    Attributes:
        admitted: Whether every amount was taken.
        reservation: The id to reconcile when the request ends; None when refused.
        refused_by: The bucket that lacked the longest (or one that can never hold its amount).
        retry_after_s: Seconds until ``refused_by`` holds the amount with no other traffic,
            rounded up to the millisecond; None when admitted, when waiting cannot help (``never``)
            or when the bucket never refills (only reconciled reservations can fill it).
        never: The request alone exceeds ``refused_by``'s capacity: no wait will admit it.
        states: Every charged bucket after the operation, in the order of the charges.
    """

    admitted: bool
    reservation: str | None
    refused_by: Bucket | None
    retry_after_s: float | None
    never: bool
    states: list[BucketState]


class LimitStore(Protocol):
    """Token buckets and reservations against them, shared by whoever shares the store.

    ``now`` is seconds on the store's own clock (the Redis server's, or the process's monotonic
    clock); None reads that clock. Pass explicit values only consistently (tests do).
    """

    async def reserve(self, charges: Sequence[Charge], ttl_s: float, now: float | None = None) -> Admission:
        """Take every amount of ``charges`` or none of them, atomically.

        Args:
            charges: What to take; charges naming one bucket key are added together.
            ttl_s: How long the reservation waits for its reconciliation before it is forgotten.
            now: The time of the operation; None reads the store's clock.

        Returns:
            The admission, with a reservation id when every bucket held its amount.

        Raises:
            ValueError: ``ttl_s`` is not > 0, or two charges give one key different buckets.
        """
        ...

    async def reconcile(self, reservation: str, actual: Mapping[str, float], now: float | None = None) -> bool:
        """Settle a reservation with what the request really used, exactly once.

        Args:
            reservation: The id :meth:`reserve` returned.
            actual: Bucket key to the amount really used; a key left out keeps its reserved
                amount, a key the reservation does not hold is ignored.
            now: The time of the operation; None reads the store's clock.

        Returns:
            True when settled; False (and nothing changes) when the reservation is unknown:
            already reconciled, or expired.

        Raises:
            ValueError: an amount of ``actual`` is not a finite number >= 0.
        """
        ...

    async def sweep(self, now: float | None = None) -> int:
        """Forget every reservation expired at ``now`` (their amounts stay spent); returns how many."""
        ...

    async def peek(self, buckets: Sequence[Bucket], now: float | None = None) -> list[BucketState]:
        """What ``buckets`` hold at ``now``, changing nothing."""
        ...

    async def aclose(self) -> None:
        """Release the store's connections."""
        ...
