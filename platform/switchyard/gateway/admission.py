"""Admission: reserve a request's estimated tokens against every limit, settle with what it used.

``decide.admit`` says which limits apply and how much to reserve; this module carries it out on
the limit store (in process, or Redis shared by every replica) and turns the answer into HTTP: a
429 naming the limit, ``Retry-After``, and OpenAI's ``x-ratelimit-*`` headers (on admitted
responses too). A :class:`Lease` is settled exactly once, however the request ends: completed,
failed, or abandoned by its client mid-stream; a process that dies before settling leaves the
reservation to expire in the store.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from switchyard.decide.admit import LimitCharge, actual_amounts, refusal_code
from switchyard.gateway.errors import RateLimited
from switchyard.store.limits import BucketState, LimitStore, charges_of

log = logging.getLogger("switchyard.admission")

#: How long a reservation may stay unsettled before the store forgets it (longer than any request).
RESERVATION_TTL_S = 3600.0


def duration(seconds: float) -> str:
    """A duration as OpenAI's ``x-ratelimit-reset-*`` headers write it: ``1s``, ``6m0s``, ``120ms``."""
    if not math.isfinite(seconds):
        return "never"
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def ratelimit_headers(states: Sequence[BucketState]) -> dict[str, str]:
    """``x-ratelimit-{limit,remaining,reset}-{tokens,requests}`` from the tightest bucket of each unit."""
    headers: dict[str, str] = {}
    for unit in ("tokens", "requests"):
        ours = [s for s in states if s.bucket.unit == unit]
        if not ours:
            continue
        tight = min(ours, key=lambda s: s.remaining / s.limit)
        headers[f"x-ratelimit-limit-{unit}"] = f"{tight.limit:.0f}"
        headers[f"x-ratelimit-remaining-{unit}"] = f"{math.floor(tight.remaining):.0f}"
        headers[f"x-ratelimit-reset-{unit}"] = duration(tight.reset_s)
    return headers


@dataclass(slots=True)
class Lease:
    """An admitted request's reservation, to settle once when it ends."""

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


class Admitter:
    """Reserves against the limit store; answers 429 when a limit lacks room.

    When the store cannot be reached (Redis down), requests are admitted without a reservation
    and ``switchyard_admission_store_errors_total`` counts them: a limit store failure must not
    take the product down, and the operator sees that limits were not enforced meanwhile.
    """

    def __init__(self, store: LimitStore, errors: Callable[[], None] = lambda: None) -> None:
        self.store = store
        self._errors = errors

    async def admit(self, charges: list[LimitCharge]) -> Lease:
        """Reserve every charge at once.

        Raises:
            RateLimited: a limit has no room for the request (or could never hold it).
        """
        if not charges:
            return Lease(None, None, charges)
        try:
            answer = await self.store.reserve(charges_of(charges), RESERVATION_TTL_S)
        except Exception as exc:  # fail open, counted: see the class doc
            self._errors()
            log.warning("limit store unreachable, admitting without limits: %s", exc)
            return Lease(None, None, charges)
        headers = ratelimit_headers(answer.states)
        if answer.admitted:
            return Lease(self.store, answer.reservation, charges, headers, False)
        refused = answer.refused_by
        assert refused is not None
        charge = next(c for c in charges if c.key == refused.key)
        state = next(s for s in answer.states if s.bucket.key == refused.key)
        what = f"{charge.limit} ({charge.scope})"
        amount = f"{charge.amount:.6g} {charge.unit}"
        if answer.never:
            raise RateLimited(f"This request alone needs {amount}, more than the {what} limit of "
                              f"{charge.capacity:.6g}; ask for fewer tokens (max_tokens) or a higher limit.",
                              code=refusal_code(charge.unit, True), limit=charge.limit, headers=headers)
        wait = answer.retry_after_s
        headers["Retry-After"] = str(max(1, math.ceil(wait))) if wait is not None else "60"
        raise RateLimited(f"Rate limit reached for {what}: limit {charge.capacity:.6g}, remaining "
                          f"{state.remaining:.6g}, requested {amount}. "
                          + (f"Please try again in {duration(wait)}." if wait is not None else ""),
                          code=refusal_code(charge.unit, False),
                          limit=charge.limit, headers=headers)
