"""The retry budget: how many retries one gateway process sends, as a share of its traffic.

A request's first attempt is free; every later one (the next replica, region or model after a
failure) is a retry and needs the budget's consent. Over the last ``budget_window`` seconds the
process may send ``budget_ratio`` retries per request plus ``min_retries_per_s`` per second (so
that light traffic can retry at all). When a region fails, its requests' retries land on the
healthy region: the budget caps that extra load at ``1 + budget_ratio`` times the traffic, where
unbounded retries would multiply it by ``max_attempts``. (Requests that skip an endpoint known to
be out, by health or an open breaker, send it nothing and spend no budget: their first attempt goes
where it can succeed.)

Counts are kept in one-second buckets; time is passed in (monotonic seconds).
"""

from __future__ import annotations

import math

from switchyard.engines.window import SlidingCounts
from switchyard.policy.resilience import RetrySpec


class RetryBudget:
    """Counts requests and retries over a sliding window."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        #: Requests (first attempts) and retries per second.
        self._counts = SlidingCounts()

    def request(self, now: float, spec: RetrySpec) -> None:
        """Count a request's first attempt."""
        self._counts.add(now, spec.budget_window, 0)

    def allow_retry(self, now: float, spec: RetrySpec) -> bool:
        """Whether a retry may be sent now; counts it when it may."""
        requests, retries = self.counts(now, spec)
        window = max(1, math.ceil(spec.budget_window))
        if retries + 1 > spec.budget_ratio * requests + spec.min_retries_per_s * window:
            return False
        self._counts.add(now, spec.budget_window, 1)
        return True

    def counts(self, now: float, spec: RetrySpec) -> tuple[int, int]:
        """Requests and retries within the window."""
        return self._counts.totals(now, spec.budget_window)
