"""The ``failover`` scenario's timeline: each staged outage's moments, and the counters read at its edges (the
gateway's upstream attempts, fallbacks, exhausted retry budget, hedges, stream resumes and hangs; what each
region's engines received)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from switchyard.bench.sampler import by_label, samples, sum_series

ATTEMPTS = "switchyard_upstream_attempts_total"
FALLBACKS = "switchyard_fallbacks_total"
BUDGET = "switchyard_retry_budget_exhausted_total"
HEDGES = "switchyard_hedges_total"
RESUMES = "switchyard_stream_resumes_total"
BROKEN = "switchyard_streams_broken_total"
HANGS = "switchyard_endpoint_hangs_total"
FINISHED = "vllm:request_success_total"
#: Requests an engine holds (a request it received is finished, aborted, running or waiting).
HELD = ("vllm:num_requests_running", "vllm:num_requests_waiting")
#: Hedge outcomes that sent a second request to an engine (``not_sent``: the budget or the load said no).
HEDGES_SENT = ("won", "lost", "failed")


def engine_received(metrics: str | None, aborted: float | None) -> float | None:
    """Requests one engine received so far: finished (any reason), running and waiting (its ``/metrics``), and
    aborted by their client (the simulator's ``/sim/state``: vLLM counts no abandoned request); None: unread."""
    if metrics is None or aborted is None:
        return None
    return aborted + sum(sum_series(metrics, name) for name in (FINISHED, *HELD))


@dataclass
class Counters:
    """Counters read at one instant: the gateway's and each region's engines'.

    Attributes:
        at_s: When they were read (the load's clock).
        attempts: Gateway upstream attempts by pool and outcome (None: the gateway was not read).
        fallbacks: Gateway fallbacks by reason (None: not read, or not exported).
        budget_exhausted: Retries refused for an empty retry budget (None: not read, or not exported).
        hedges: Hedges by outcome (None: not read, or not exported).
        resumes: Broken streams by what became of them (None: not read, or not exported).
        broken: Streams broken off by their engine (None: not read, or not exported).
        hangs: Engines found hung (None: not read, or not exported).
        engines: Requests each region's engines received so far, by region (None: one was not read).
    """

    at_s: float
    attempts: dict[str, dict[str, float]] | None = None
    fallbacks: dict[str, float] | None = None
    budget_exhausted: float | None = None
    hedges: dict[str, float] | None = None
    resumes: dict[str, float] | None = None
    broken: float | None = None
    hangs: float | None = None
    engines: dict[str, float | None] = field(default_factory=dict)


def exported(text_: str, name: str) -> bool:
    """Whether a Prometheus text exposition declares counter ``name`` (``…_total``), with or without samples."""
    return any(f"# TYPE {family} " in text_ for family in (name, name.removesuffix("_total")))


def _labelled(text_: str, name: str, label: str) -> dict[str, float] | None:
    return by_label(text_, name, label) if exported(text_, name) else None


def _summed(text_: str, name: str) -> float | None:
    return sum(v for _, v in samples(text_, name)) if exported(text_, name) else None


def read_counters(at_s: float, gateway: str | None, engines: Mapping[str, Sequence[float | None]]) -> Counters:
    """:class:`Counters` from the gateway's ``/metrics`` text and each engine's received count (region → one
    count per engine, from :func:`engine_received`; None: unread)."""
    received = {region: None if not counts or any(c is None for c in counts) else
                sum(c for c in counts if c is not None) for region, counts in engines.items()}
    out = Counters(at_s, engines=received)
    if gateway is None:
        return out
    attempts: dict[str, dict[str, float]] = {}
    for labels, value in samples(gateway, ATTEMPTS):
        by_outcome = attempts.setdefault(labels.get("pool", "-"), {})
        outcome = labels.get("outcome", "-")
        by_outcome[outcome] = by_outcome.get(outcome, 0.0) + value
    out.attempts = attempts
    out.fallbacks = _labelled(gateway, FALLBACKS, "reason")
    out.budget_exhausted = _summed(gateway, BUDGET)
    out.hedges = _labelled(gateway, HEDGES, "outcome")
    out.resumes = _labelled(gateway, RESUMES, "outcome")
    out.broken = _summed(gateway, BROKEN)
    out.hangs = _summed(gateway, HANGS)
    return out


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _grown(lo: Mapping[str, float] | None, hi: Mapping[str, float] | None) -> dict[str, float] | None:
    if lo is None or hi is None:
        return None
    return {k: v - lo.get(k, 0.0) for k, v in hi.items() if v - lo.get(k, 0.0)}


def counter_deltas(lo: Counters | None, hi: Counters | None) -> dict[str, Any]:
    """What the counters grew by from ``lo`` to ``hi`` (None where either side is unknown).

    ``received``: per region (an engine restarted in between makes it meaningless: see :func:`run_received`);
    ``hedges``: hedges sent (won, lost or failed); ``resumes``: streams resumed on another endpoint.
    """
    out: dict[str, Any] = dict.fromkeys(("attempts", "attempts_by_pool", "fallbacks", "fallbacks_by_reason",
                                         "budget_exhausted", "hedges", "hedges_by_outcome", "resumes",
                                         "resumes_by_outcome", "broken", "hangs"))
    out["received"] = {}
    if lo is None or hi is None:
        return out
    if lo.attempts is not None and hi.attempts is not None:
        pools: dict[str, dict[str, float]] = {}
        for pool, outcomes in hi.attempts.items():
            grown = _grown(lo.attempts.get(pool, {}), outcomes)
            if grown:
                pools[pool] = grown
        out["attempts_by_pool"] = pools
        out["attempts"] = sum(v for outcomes in pools.values() for v in outcomes.values())
    for key, lo_value, hi_value in (("fallbacks", lo.fallbacks, hi.fallbacks), ("hedges", lo.hedges, hi.hedges),
                                    ("resumes", lo.resumes, hi.resumes)):
        grown = _grown(lo_value, hi_value)
        out[f"{key}_by_{'reason' if key == 'fallbacks' else 'outcome'}"] = grown
        if grown is not None:
            out[key] = (sum(grown.values()) if key == "fallbacks" else
                        sum(grown.get(k, 0.0) for k in HEDGES_SENT) if key == "hedges" else grown.get("resumed", 0.0))
    out["budget_exhausted"] = _minus(hi.budget_exhausted, lo.budget_exhausted)
    out["broken"] = _minus(hi.broken, lo.broken)
    out["hangs"] = _minus(hi.hangs, lo.hangs)
    out["received"] = {region: _minus(hi.engines.get(region), lo.engines.get(region)) for region in hi.engines}
    return out


@dataclass
class Outage:
    """One staged outage of the ``HOME`` region's engines, in seconds on the load's clock (from its start).

    Attributes:
        kind: ``down`` or ``hang`` (the control server's fault modes), or ``kill`` (the process SIGKILLed).
        start_s: The fault was sent (the kill signal, for ``kill``).
        applied_s: It was in effect (the control server answered; the killed process was reaped).
        end_s: ``mode: none`` was sent (for ``kill``: the new process is started from here).
        restored_s: The control server answered it (for ``kill``: the new process and its control server answered).
        ready_s: Every engine of the region answered ``/health`` again.
        back_s: The gateway had every engine of the region back in service (its admin API; None: unseen).
        before: Counters read just before the fault.
        after: Counters read just before the end.
        restarted: The region whose engines are a new process after it (their counters start from zero).
    """

    kind: str
    start_s: float | None = None
    applied_s: float | None = None
    end_s: float | None = None
    restored_s: float | None = None
    ready_s: float | None = None
    back_s: float | None = None
    before: Counters | None = None
    after: Counters | None = None
    restarted: str | None = None


@dataclass(frozen=True, slots=True)
class EndpointChange:
    """An endpoint going out of service or back, as the gateway's admin API showed it.

    Attributes:
        at_s: When it was seen (the load's clock; the admin API is polled, so up to one interval late).
        url: The endpoint.
        in_service: Whether the gateway sends client requests there (healthy, its breakers closed).
        breaker: The endpoint's breaker state (``closed``, ``open``, ``half_open``).
        reason: Why it is out: the breaker's last reason, or the health failure.
    """

    at_s: float
    url: str
    in_service: bool
    breaker: str
    reason: str | None


@dataclass
class Timeline:
    """The run's outages, the counters at its edges and what the gateway's admin API showed.

    Attributes:
        start: Loop time of the load's start.
        wall_start: The same instant in seconds since the epoch (to place the request log's records).
        outages: The outages staged, in order.
        first: Counters read before the load began (at 0).
        last: Counters read after every request ended.
        changes: The ``HOME`` endpoints going out of service and back, in order.
        records: The gateway's request log records seen, by request id.
        errors: What went wrong while staging.
    """

    start: float | None = None
    wall_start: float | None = None
    outages: list[Outage] = field(default_factory=list)
    first: Counters | None = None
    last: Counters | None = None
    changes: list[EndpointChange] = field(default_factory=list)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def run_received(line: Timeline) -> dict[str, float | None]:
    """Requests each region's engines received over the whole run, across a restart (a restarted process
    counts from zero: what the old one had received by the kill is added); None: a reading is missing."""
    if line.first is None or line.last is None:
        return {}
    out: dict[str, float | None] = {}
    for region, last in line.last.engines.items():
        total: float | None = 0.0
        lo = line.first.engines.get(region)
        for outage in line.outages:
            if outage.restarted == region and outage.before is not None:
                grown = _minus(outage.before.engines.get(region), lo)
                total = None if total is None or grown is None else total + grown
                lo = 0.0
        grown = _minus(last, lo)
        out[region] = None if total is None or grown is None else total + grown
    return out
