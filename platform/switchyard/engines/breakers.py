"""Circuit breakers: stop sending requests where they keep failing, and try again carefully.

One breaker per endpoint and one per pool (fed by all of the pool's endpoints), parameters from the
policy's ``resilience.breakers`` (:class:`switchyard.policy.resilience.BreakerSpec`):

- **closed**: requests flow. Each outcome is counted in one-second buckets over ``window``; the
  breaker opens after ``consecutive_failures`` failures in a row, or when at least ``min_requests``
  outcomes in the window include a share of failures of ``error_rate`` or more.
- **open**: no client request is sent for ``open_for`` seconds.
- **half-open**: the gateway sends up to ``half_open_requests`` trial requests of its own at a time
  (:class:`switchyard.engines.health.HealthProber`: a one-token completion); when that many have
  succeeded the breaker closes (and forgets its window); a failed trial opens it again for
  ``open_for``. Client requests are never trials: none waits on an engine that may still be broken,
  and a healed engine is back within ``open_for`` plus a trial, however long it was broken.

Outcomes are *success*, *failure* (the engine could not serve: refused or broken connection, timeout,
first-token timeout, 5xx) or *neutral* (the engine answered but the request was the problem or the
client left: not evidence either way). Time is passed in (monotonic seconds), so the logic is
tested without sleeping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from switchyard.engines.window import SlidingCounts
from switchyard.policy.resilience import BreakerSpec

State = Literal["closed", "open", "half_open"]
#: Gauge values of the states (``switchyard_breaker_state``).
STATE_VALUE: dict[State, int] = {"closed": 0, "half_open": 1, "open": 2}

#: Called on every state change: (breaker, the state entered, why).
Listener = Callable[["CircuitBreaker", State, str], None]


class CircuitBreaker:
    """The breaker of one endpoint or pool."""

    __slots__ = ("_buckets", "_listener", "consecutive", "last_reason", "name", "open_until", "scope", "spec",
                 "state_", "trials_in_flight", "trials_ok")

    def __init__(self, scope: str, name: str, spec: BreakerSpec, listener: Listener | None = None) -> None:
        self.scope = scope
        self.name = name
        self.spec = spec
        self._listener = listener
        self.state_: State = "closed"
        self.consecutive = 0
        #: Successes and failures per second over the window.
        self._buckets = SlidingCounts()
        self.open_until = 0.0
        self.trials_in_flight = 0
        self.trials_ok = 0
        self.last_reason: str | None = None

    def state(self, now: float) -> State:
        """The state at ``now`` (an open breaker whose time is up is half-open)."""
        if self.state_ == "open" and now >= self.open_until:
            self._enter("half_open", "open_for elapsed")
            self.trials_in_flight = self.trials_ok = 0
        return self.state_

    def allows(self, now: float) -> bool:
        """Whether a client request may be sent now (the breaker is closed)."""
        return self.state(now) == "closed"

    def wants_trial(self, now: float) -> bool:
        """Whether a trial request should be sent now (half-open, with a trial slot free)."""
        return self.state(now) == "half_open" and self.trials_in_flight < self.spec.half_open_requests

    def retry_in(self, now: float) -> float:
        """Seconds until an open breaker lets trial requests through (0 when it does now)."""
        return max(0.0, self.open_until - now) if self.state(now) == "open" else 0.0

    def attempt(self, now: float) -> bool:
        """Count a request sent now; True when it takes a half-open trial slot (report its outcome with ``trial``)."""
        if self.wants_trial(now):
            self.trials_in_flight += 1
            return True
        return False

    def success(self, now: float, trial: bool = False) -> None:
        """The engine served a request."""
        self.consecutive = 0
        if trial:
            self.trials_in_flight = max(0, self.trials_in_flight - 1)
            if self.state_ == "half_open":
                self.trials_ok += 1
                if self.trials_ok >= self.spec.half_open_requests:
                    self._buckets.clear()
                    self._enter("closed", f"{self.trials_ok} trial requests succeeded")
            return
        if self.state_ == "closed":
            self._count(now, ok=True)

    def failure(self, now: float, reason: str, trial: bool = False) -> None:
        """The engine failed a request (refused, broke off, timed out, 5xx)."""
        if trial:
            self.trials_in_flight = max(0, self.trials_in_flight - 1)
        state = self.state(now)
        if state != "open":  # (an open breaker keeps saying why it opened)
            self.last_reason = reason
        if state == "half_open":
            # A failed trial (or a request sent before the breaker opened, failing now) re-opens it.
            self._open(now, f"trial failed: {reason}")
            return
        if state == "open":
            return
        self.consecutive += 1
        self._count(now, ok=False)
        spec = self.spec
        if self.consecutive >= spec.consecutive_failures:
            self._open(now, f"{self.consecutive} failures in a row (last: {reason})")
            return
        ok, failed = self._window(now)
        total = ok + failed
        if total >= spec.min_requests and failed / total >= spec.error_rate:
            self._open(now, f"{failed} of {total} requests failed in {spec.window:g} s (last: {reason})")

    def trip(self, now: float, reason: str) -> bool:
        """Open now, whatever the counts say (a hung engine: it fails every request it holds without a
        sign); False when it was open already."""
        if self.state(now) == "open":
            return False
        self.last_reason = reason
        self._open(now, reason)
        return True

    def neutral(self, trial: bool = False) -> None:
        """A request that says nothing of the engine's health ended (client error, client gone)."""
        if trial:
            self.trials_in_flight = max(0, self.trials_in_flight - 1)

    def window_counts(self, now: float) -> tuple[int, int]:
        """Successes and failures within the window (closed state only; empty otherwise)."""
        return self._window(now)

    def _open(self, now: float, reason: str) -> None:
        self.open_until = now + self.spec.open_for
        self.consecutive = 0
        self._buckets.clear()
        self.trials_in_flight = self.trials_ok = 0
        self._enter("open", reason)

    def _enter(self, state: State, reason: str) -> None:
        self.state_ = state
        if state != "closed":
            self.last_reason = reason
        if self._listener is not None:
            self._listener(self, state, reason)

    def _count(self, now: float, ok: bool) -> None:
        self._buckets.add(now, self.spec.window, 0 if ok else 1)

    def _window(self, now: float) -> tuple[int, int]:
        return self._buckets.totals(now, self.spec.window)


@dataclass(slots=True)
class Trial:
    """One request sent to an endpoint, as its breakers (the endpoint's and its pool's) count it.

    Exactly one outcome is reported (the first; later ones are ignored), and a half-open breaker's
    trial slot is given back with it.
    """

    endpoint: CircuitBreaker
    pool: CircuitBreaker
    endpoint_trial: bool
    pool_trial: bool
    done: bool = False

    @classmethod
    def start(cls, endpoint: CircuitBreaker, pool: CircuitBreaker, now: float) -> Trial:
        """Count a request sent to ``endpoint`` (of ``pool``) now."""
        return cls(endpoint, pool, endpoint.attempt(now), pool.attempt(now))

    def succeeded(self, now: float) -> None:
        """The engine served it."""
        if not self.done:
            self.done = True
            self.endpoint.success(now, self.endpoint_trial)
            self.pool.success(now, self.pool_trial)

    def failed(self, now: float, reason: str) -> None:
        """The engine failed it."""
        if not self.done:
            self.done = True
            self.endpoint.failure(now, reason, self.endpoint_trial)
            self.pool.failure(now, reason, self.pool_trial)

    def neutral(self) -> None:
        """It ended saying nothing of the engine's health (a client error, the client left)."""
        if not self.done:
            self.done = True
            self.endpoint.neutral(self.endpoint_trial)
            self.pool.neutral(self.pool_trial)
