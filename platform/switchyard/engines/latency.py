"""Each pool's observed time to first token: the quantiles a hedge waits for.

The last :data:`SAMPLES` first-byte times of the pool's streamed tries are kept in a ring; a quantile is
read from them sorted, sorted again at most once per :data:`RESORT_S` (a hedge decision is made for every
streamed try of a hedging class, and a sort of a few hundred numbers is cheap but not free). Fewer than
:data:`MIN_SAMPLES` observations say nothing.
"""

from __future__ import annotations

import math

#: First-token times kept per pool.
SAMPLES = 256
#: Observations below which no quantile is given.
MIN_SAMPLES = 20
#: How long a sorted copy is reused (seconds).
RESORT_S = 1.0


class TtftWindow:
    """One pool's recent first-token times (seconds)."""

    __slots__ = ("_next", "_samples", "_sorted", "_sorted_at")

    def __init__(self) -> None:
        self._samples: list[float] = []
        self._next = 0
        self._sorted: list[float] = []
        self._sorted_at = -math.inf

    def add(self, seconds: float) -> None:
        """One streamed try's time from its send to its first byte."""
        if len(self._samples) < SAMPLES:
            self._samples.append(seconds)
        else:
            self._samples[self._next] = seconds
            self._next = (self._next + 1) % SAMPLES

    def quantile(self, q: float, now: float) -> float | None:
        """The ``q`` quantile of the window (nearest rank), None with fewer than :data:`MIN_SAMPLES`."""
        if len(self._samples) < MIN_SAMPLES:
            return None
        if now - self._sorted_at >= RESORT_S or len(self._sorted) != len(self._samples):
            self._sorted = sorted(self._samples)
            self._sorted_at = now
        ranked = self._sorted
        return ranked[min(len(ranked) - 1, max(0, math.ceil(q * len(ranked)) - 1))]


class PoolLatencies:
    """Every pool's :class:`TtftWindow`, by pool name (created on first use; they outlive policy reloads)."""

    __slots__ = ("_pools",)

    def __init__(self) -> None:
        self._pools: dict[str, TtftWindow] = {}

    def window(self, pool: str) -> TtftWindow:
        found = self._pools.get(pool)
        if found is None:
            found = self._pools[pool] = TtftWindow()
        return found

    def quantile(self, pool: str, q: float, now: float) -> float | None:
        found = self._pools.get(pool)
        return None if found is None else found.quantile(q, now)
