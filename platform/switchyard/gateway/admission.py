"""Admission: reserve a request's estimated tokens against every limit, settle with what it used.

``decide.admit`` says which limits apply, how much to reserve and what a refusal tells the client;
this module carries the reservation out on the limit store (in process, or Redis shared by every
replica), answering with the store's answer and OpenAI's ``x-ratelimit-*`` headers (sent on
admitted responses and refusals alike). A :class:`Lease` is settled exactly once, on the store it
reserved on, however the request ends: completed, failed, or abandoned by its client mid-stream; a
process that dies before settling leaves the reservation to expire in the store. When Redis cannot
be reached, the policy's ``resilience.dependencies.redis`` says whether limits are enforced per
process meanwhile (``fail_open``) or requests with limits are refused (``fail_closed``): see
:class:`Admitter`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from switchyard.api.errors import Overloaded
from switchyard.decide.admit import LimitAnswer, LimitCharge, actual_amounts, duration
from switchyard.policy.resilience import FailureMode
from switchyard.store.limits import Admission, BucketState, Charge, LimitStore, MemoryLimitStore, answer_of, charges_of

log = logging.getLogger("switchyard.admission")

#: How long a reservation may stay unsettled before the store forgets it (longer than any request).
RESERVATION_TTL_S = 3600.0
#: After the limit store failed, seconds during which requests go straight to the fallback.
STORE_BACKOFF_S = 1.0
#: Least seconds between two warnings that requests fall back (the recovery is logged once).
WARN_EVERY_S = 30.0


#: The headers of each unit that has them (limit, remaining, reset), in the order they are sent.
_HEADER_NAMES = {unit: (f"x-ratelimit-limit-{unit}", f"x-ratelimit-remaining-{unit}", f"x-ratelimit-reset-{unit}")
                 for unit in ("tokens", "requests")}


def ratelimit_headers(states: Sequence[BucketState]) -> dict[str, str]:
    """``x-ratelimit-{limit,remaining,reset}-{tokens,requests}`` from the tightest bucket of each unit (the lowest
    share left; the first of equals). Every admitted request's answer carries them: one pass, no key functions."""
    tightest: dict[str, BucketState] = {}
    for state in states:
        unit = state.bucket.unit
        if unit in _HEADER_NAMES:
            best = tightest.get(unit)
            if best is None or state.remaining / state.limit < best.remaining / best.limit:
                tightest[unit] = state
    headers: dict[str, str] = {}
    for measured, (limit, remaining, reset) in _HEADER_NAMES.items():
        tight = tightest.get(measured)
        if tight is not None:
            headers[limit] = f"{tight.limit:.0f}"
            headers[remaining] = str(math.floor(tight.remaining))  # (remaining is at least 0)
            headers[reset] = duration(tight.reset_s)
    return headers


ADMITTED = LimitAnswer(True)


@dataclass(slots=True)
class Lease:
    """An admitted request's reservation, to settle once when it ends.

    ``store`` is the store it was reserved on (the shared one, or this process's own while the
    shared one was unreachable); None for a request without limits.
    """

    store: LimitStore | None
    reservation: str | None
    charges: list[LimitCharge]
    headers: dict[str, str] = field(default_factory=dict)
    settled: bool = False

    async def settle(self, tokens: int, spend: float) -> None:
        """Charge what the request really used (prompt plus generated tokens, its price); idempotent.

        A store that cannot be reached is logged, not raised: the answer has been given, and the
        reservation expires in the store.
        """
        if self.settled:
            return
        self.settled = True
        if self.store is not None and self.reservation is not None:
            try:
                await self.store.reconcile(self.reservation, actual_amounts(self.charges, tokens, spend))
            except Exception as exc:  # the limit store is down: see the module doc
                log.warning("could not settle reservation %s: %s", self.reservation, exc)


#: The lease of a request that reserved nothing (yet).
NO_LEASE = Lease(None, None, [], settled=True)


class Admitter:
    """Reserves against the limit store.

    When the shared store (Redis) cannot be reached, the policy's ``resilience.dependencies.redis``
    says what happens to requests with limits (those without never touch a store):

    - ``fail_open``: they reserve on a store of this process (:attr:`local`) instead, so every
      limit is still enforced, per gateway replica; the lease settles where it reserved.
    - ``fail_closed``: they are refused with 503 ``limits_unavailable`` and ``Retry-After``.

    Either way each such request is counted (``switchyard_dependency_failures_total{dependency=
    "redis",mode}``, through ``counted``), the fallback is logged at most once per ``warn_every_s``
    and the recovery once. After a failed call the shared store is left alone for ``backoff_s``:
    requests go straight to the fallback, then one request tries it again (and so on), so an
    outage does not cost each request a connection attempt or timeout.

    Args:
        store: The limit store: Redis shared by every replica, or this process's own.
        counted: Called with ``fail_open`` or ``fail_closed`` for each request served or refused
            while ``store`` is unreachable.
        local: The store a ``fail_open`` request falls back to (default: a new in-process one).
        backoff_s: How long the shared store is skipped after it failed.
        warn_every_s: Least seconds between two warnings about the fallback.
        clock: Monotonic seconds (tests pass their own).
    """

    def __init__(self, store: LimitStore, counted: Callable[[FailureMode], None] = lambda _mode: None, *,
                 local: LimitStore | None = None, backoff_s: float = STORE_BACKOFF_S,
                 warn_every_s: float = WARN_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.local: LimitStore = local if local is not None else MemoryLimitStore()
        self._counted = counted
        self._backoff_s = backoff_s
        self._warn_every_s = warn_every_s
        self._clock = clock
        self._down_since: float | None = None  # when the shared store last started failing
        self._retry_at = 0.0  # the shared store is skipped until then
        self._warned_at = -math.inf
        self._unwarned = 0  # requests that fell back since the last warning
        self._error = ""  # the shared store's last failure

    @property
    def store_down(self) -> bool:
        """Whether the shared store failed and has not answered since."""
        return self._down_since is not None

    async def reserve(self, charges: Sequence[LimitCharge],
                      redis: FailureMode = "fail_open") -> tuple[Lease, LimitAnswer]:
        """Reserve every charge at once: the lease to settle (its ``reservation`` None when refused) and the
        store's answer.

        Args:
            charges: The request's limits and amounts (``decide.admit``).
            redis: What to do when the limit store cannot be reached (the policy's
                ``resilience.dependencies.redis``).

        Raises:
            Overloaded: the limit store cannot be reached and ``redis`` is ``fail_closed`` (503,
                code ``limits_unavailable``).
        """
        if not charges:
            return Lease(None, None, []), ADMITTED
        wanted = charges_of(charges)
        store = self.store
        answer = await self._shared(wanted)
        if answer is None:
            self._fell_back(redis)
            if redis == "fail_closed":
                raise Overloaded("Rate limits cannot be checked right now (the limit store is unreachable); "
                                 "please retry shortly.", code="limits_unavailable",
                                 headers={"Retry-After": str(math.ceil(max(1.0, self._backoff_s)))})
            store = self.local
            answer = await store.reserve(wanted, RESERVATION_TTL_S)
        headers = ratelimit_headers(answer.states)
        if answer.admitted:
            return Lease(store, answer.reservation, list(charges), headers, False), ADMITTED
        return Lease(None, None, list(charges), headers), answer_of(answer)

    async def _shared(self, wanted: list[Charge]) -> Admission | None:
        """The shared store's answer, or None when it failed or is being left alone after a failure."""
        now = self._clock()
        if self._down_since is not None:
            if now < self._retry_at:
                return None
            self._retry_at = now + self._backoff_s  # this request tries it; the others keep falling back
        try:
            answer = await self.store.reserve(wanted, RESERVATION_TTL_S)
        except Exception as exc:  # unreachable, timed out, failing: see the class doc
            now = self._clock()
            self._retry_at = now + self._backoff_s
            self._error = f"{exc.__class__.__name__}: {exc}"
            if self._down_since is None:
                self._down_since = now
                self._warned_at = -math.inf  # the outage's first fallback is logged at once
            return None
        if self._down_since is not None:
            log.warning("limit store answers again after %.1f s unreachable; %d requests since the last warning "
                        "were served on this process's own limits or refused", now - self._down_since,
                        self._unwarned)
            self._down_since = None
            self._unwarned = 0
        return answer

    def _fell_back(self, mode: FailureMode) -> None:
        """Count one request that the shared store could not serve; warn now and then."""
        self._counted(mode)
        self._unwarned += 1
        now = self._clock()
        if now - self._warned_at >= self._warn_every_s:
            what = ("enforcing limits in this process only" if mode == "fail_open"
                    else "refusing requests with limits (503)")
            log.warning("limit store unreachable for %.1f s (%s): %s (policy resilience.dependencies.redis: %s); "
                        "%d requests since the last warning", now - (self._down_since or now), self._error, what,
                        mode, self._unwarned)
            self._warned_at = now
            self._unwarned = 0
