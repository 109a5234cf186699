"""Counts over a sliding window of whole seconds (circuit breakers' outcomes, the retry budget)."""

from __future__ import annotations

import math
from collections import deque


class SlidingCounts:
    """Two counters kept per second for the last ``window`` seconds (time is passed in, monotonic).

    ``window`` may change between calls (a policy reload); it is read at each call.
    """

    __slots__ = ("_buckets",)

    def __init__(self) -> None:
        #: [second, first counter, second counter], oldest first.
        self._buckets: deque[list[int]] = deque()

    @staticmethod
    def _span(window: float) -> int:
        return max(1, math.ceil(window))

    def add(self, now: float, window: float, which: int, amount: int = 1) -> None:
        """Add ``amount`` to counter ``which`` (0 or 1) at ``now``, forgetting seconds out of the window."""
        second = int(now)
        buckets = self._buckets
        if not buckets or buckets[-1][0] != second:
            buckets.append([second, 0, 0])
            horizon = second - self._span(window)
            while buckets and buckets[0][0] <= horizon:
                buckets.popleft()
        buckets[-1][1 + which] += amount

    def totals(self, now: float, window: float) -> tuple[int, int]:
        """Both counters summed over the window ending at ``now``."""
        horizon = int(now) - self._span(window)
        first = second = 0
        for at, a, b in self._buckets:
            if at > horizon:
                first += a
                second += b
        return first, second

    def clear(self) -> None:
        """Forget everything."""
        self._buckets.clear()
