"""How long a try may wait for its engine, and when a late first token is hedged.

Both are decided per try by the procedure (:mod:`switchyard.decide.procedure`) and carried on its
:class:`~switchyard.decide.decision.Attempt`, so the dry-run's trace shows them and every executor reads the
same numbers:

- **the first-token deadline**: the class's ``first_token_deadline``; else twice its ``ttft_objective``; else
  the model's ``first_token_timeout``; else ``resilience.first_token_timeout``. A try that has produced
  nothing by then moves on (a streamed answer's first byte; a complete answer's engine showing no progress),
  and a stream silent that long mid-answer is resumed elsewhere.
- **the hedge delay** (classes with ``hedge``, streamed requests only): a fixed delay, or a quantile of the
  pool's observed time to first token, never below ``min_delay`` and always before the deadline. No hedge
  when the quantile is not known yet.
"""

from __future__ import annotations

from collections.abc import Sequence

from switchyard.decide.classes import ClassDecision
from switchyard.decide.views import FleetView
from switchyard.policy.fleet import Model, Pool
from switchyard.policy.snapshot import PolicySnapshot
from switchyard.policy.tiers import HedgeSpec

#: The quantiles ``hedge.after`` may name, as fractions.
QUANTILES = {"p50": 0.5, "p90": 0.9, "p95": 0.95, "p99": 0.99}


def first_token_deadline(snapshot: PolicySnapshot, cls: ClassDecision, model: Model) -> float:
    """Seconds one try of a request of ``cls`` at ``model`` may go without producing (see the module doc)."""
    fallback = model.first_token_timeout or snapshot.document.resilience.first_token_timeout
    return cls.cls.deadline(fallback)


def hedge_delay(spec: HedgeSpec | None, pool: Pool, deadline_s: float, fleet: FleetView, now: float) -> float | None:
    """When to hedge a streamed try at ``pool`` whose first token has not come (seconds after the send); None:
    never (no ``hedge`` for the class, the pool's quantile not known yet, or not before the deadline)."""
    if spec is None:
        return None
    if isinstance(spec.after, str):
        observed = fleet.ttft_quantile(pool, QUANTILES[spec.after], now)
        if observed is None:
            return None
        delay = observed
    else:
        delay = spec.after
    delay = max(delay, spec.min_delay)
    return delay if delay < deadline_s else None


def hedge_blocked(spec: HedgeSpec, pools: Sequence[Pool], fleet: FleetView, now: float) -> str | None:
    """Why no hedge may be sent now (every pool of the stage at or above ``max_utilisation``), or None."""
    if not pools:
        return "no pool"
    full = [p for p in pools if fleet.pool_utilisation(p, "interactive", now) >= spec.max_utilisation]
    if len(full) == len(pools):
        return (f"the fleet is saturated ({', '.join(p.name for p in full)} at or above "
                f"{spec.max_utilisation:.0%} utilisation)")
    return None
