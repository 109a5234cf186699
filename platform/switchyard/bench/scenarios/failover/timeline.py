"""The ``failover`` scenario's timeline: each staged outage's moments, and the counters read at its edges (the
gateway's upstream attempts, fallbacks and exhausted retry budget; what the healthy region's engines received)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from switchyard.bench.sampler import samples, sum_series

ATTEMPTS = "switchyard_upstream_attempts_total"
FALLBACKS = "switchyard_fallbacks_total"
BUDGET = "switchyard_retry_budget_exhausted_total"
FINISHED = "vllm:request_success_total"
#: Requests an engine holds (a request it received is finished, running or waiting).
HELD = ("vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass
class Counters:
    """Counters read at one instant: the gateway's and the healthy region's engines'.

    Attributes:
        at_s: When they were read (the load's clock).
        attempts: Gateway upstream attempts by pool and outcome (None: the gateway was not read).
        fallbacks: Gateway fallbacks by reason (None: not read, or not exported).
        budget_exhausted: Retries refused for an empty retry budget (None: not read, or not exported).
        healthy_received: Requests the healthy region's engines received so far: finished (any reason),
            running or waiting (None: one was not read).
    """

    at_s: float
    attempts: dict[str, dict[str, float]] | None = None
    fallbacks: dict[str, float] | None = None
    budget_exhausted: float | None = None
    healthy_received: float | None = None


def exported(text_: str, name: str) -> bool:
    """Whether a Prometheus text exposition declares counter ``name`` (``…_total``), with or without samples."""
    return any(f"# TYPE {family} " in text_ for family in (name, name.removesuffix("_total")))


def read_counters(at_s: float, gateway: str | None, healthy: Sequence[str | None]) -> Counters:
    """:class:`Counters` from the gateway's ``/metrics`` text and the healthy engines' (None: unread)."""
    attempts: dict[str, dict[str, float]] | None = None
    fallbacks: dict[str, float] | None = None
    budget: float | None = None
    if gateway is not None:
        attempts = {}
        for labels, value in samples(gateway, ATTEMPTS):
            by_outcome = attempts.setdefault(labels.get("pool", "-"), {})
            outcome = labels.get("outcome", "-")
            by_outcome[outcome] = by_outcome.get(outcome, 0.0) + value
        if exported(gateway, FALLBACKS):
            fallbacks = {}
            for labels, value in samples(gateway, FALLBACKS):
                reason = labels.get("reason", "-")
                fallbacks[reason] = fallbacks.get(reason, 0.0) + value
        if exported(gateway, BUDGET):
            budget = sum(v for _, v in samples(gateway, BUDGET))
    received = None if not healthy or any(t is None for t in healthy) else \
        sum(sum_series(t, name) for t in healthy if t is not None for name in (FINISHED, *HELD))
    return Counters(at_s, attempts, fallbacks, budget, received)


def counter_deltas(lo: Counters | None, hi: Counters | None) -> dict[str, Any]:
    """What the counters grew by from ``lo`` to ``hi`` (None where either side is unknown)."""

    def minus(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a - b

    out: dict[str, Any] = {"attempts": None, "attempts_by_pool": None, "fallbacks": None, "fallbacks_by_reason": None,
                           "budget_exhausted": None, "healthy_received": None}
    if lo is None or hi is None:
        return out
    if lo.attempts is not None and hi.attempts is not None:
        pools: dict[str, dict[str, float]] = {}
        for pool, outcomes in hi.attempts.items():
            for outcome, value in outcomes.items():
                grown = value - lo.attempts.get(pool, {}).get(outcome, 0.0)
                if grown:
                    pools.setdefault(pool, {})[outcome] = grown
        out["attempts_by_pool"] = pools
        out["attempts"] = sum(v for outcomes in pools.values() for v in outcomes.values())
    if lo.fallbacks is not None and hi.fallbacks is not None:
        reasons = {k: v - lo.fallbacks.get(k, 0.0) for k, v in hi.fallbacks.items() if v - lo.fallbacks.get(k, 0.0)}
        out["fallbacks_by_reason"] = reasons
        out["fallbacks"] = sum(reasons.values())
    out["budget_exhausted"] = minus(hi.budget_exhausted, lo.budget_exhausted)
    out["healthy_received"] = minus(hi.healthy_received, lo.healthy_received)
    return out


@dataclass
class Outage:
    """One staged outage of the us-east engines, in seconds on the load's clock (from its start).

    Attributes:
        kind: The fault mode (``down`` or ``hang``).
        start_s: The fault was sent to the control server.
        applied_s: The control server answered (every us-east engine is in the mode).
        end_s: ``mode: none`` was sent.
        restored_s: The control server answered it.
        ready_s: Every us-east engine answered ``/health`` again.
        before: Counters read just before the fault.
        after: Counters read just before the end.
    """

    kind: str
    start_s: float | None = None
    applied_s: float | None = None
    end_s: float | None = None
    restored_s: float | None = None
    ready_s: float | None = None
    before: Counters | None = None
    after: Counters | None = None


@dataclass
class Timeline:
    """The run's outages and the counters at its edges.

    Attributes:
        start: Loop time of the load's start.
        outages: The outages staged, in order.
        first: Counters read before the load began (at 0).
        last: Counters read after every request ended.
        errors: What went wrong while staging.
    """

    start: float | None = None
    outages: list[Outage] = field(default_factory=list)
    first: Counters | None = None
    last: Counters | None = None
    errors: list[str] = field(default_factory=list)
