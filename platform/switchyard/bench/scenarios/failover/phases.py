"""The ``failover`` scenario's phases and what one request's result says: which phase a request belongs to,
whether it was answered completely, how long its client waited, where it was served and whether it tried the
failing region first; and the figures per phase (per home region, and the load the phase put on the engines)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

from switchyard.bench.results import Result
from switchyard.bench.scenarios.failover.timeline import Counters, Timeline, counter_deltas
from switchyard.bench.scenarios.failover.workload import HEALTHY, HOME, PHASES, POOLS, REGIONS
from switchyard.bench.stats import percentiles

#: A phase: its name, start and end (send time; None: unbounded) and the counters read at both edges.
Window = tuple[str, float | None, float | None, Counters | None, Counters | None]


def complete(result: Result) -> bool:
    """Answered completely: 2xx, no error (an in-stream error event, a stream cut before ``[DONE]``), and a
    ``finish_reason``."""
    return result.ok and result.finish_reason is not None


def failure_kind(result: Result) -> str:
    """How a request that was not answered completely ended: ``502 upstream_error``, ``200 stream_truncated``,
    ``200 no finish_reason``."""
    if result.ok:
        return f"{result.status} no finish_reason"
    return f"{result.status or '-'} {result.error_type or ''}".strip()


def failure_kinds(results: Sequence[Result]) -> dict[str, int]:
    """The requests not answered completely, counted by :func:`failure_kind`."""
    kinds = Counter(failure_kind(r) for r in results if not complete(r))
    return dict(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))


def describe_kinds(kinds: Mapping[str, int]) -> str:
    """``502 upstream_error (3), 0 timeout (1)`` ('' when none)."""
    return ", ".join(f"{kind} ({count})" for kind, count in kinds.items())


def wait_s(result: Result) -> float:
    """How long the client waited for its answer to start, from the scheduled time: a stream's first token; a
    complete answer's whole time (an upper bound of its wait); a request that got nothing, its whole time."""
    return result.ttft_s if result.ttft_s is not None else result.e2e_s


def longest_gap_s(result: Result) -> float | None:
    """The longest silence between two content chunks of a stream (where a resumed stream paused)."""
    return max(result.itl_s) if result.itl_s else None


def served_region(result: Result) -> str | None:
    """The region that served ``result`` (from its route header: where its answer started)."""
    return result.route_fields.get("region")


def served_at(result: Result) -> float:
    """When ``result`` was served: its first token (its end when none came)."""
    return result.first_token_s if result.first_token_s is not None else result.done_s


def attempts_of(result: Result) -> int:
    """Endpoints the gateway tried for ``result``: ``attempt=`` of its route header (a success), else its
    ``x-switchyard-attempts`` header (a failure after several), else 1."""
    attempt = result.route_fields.get("attempt")
    if attempt is not None and attempt.isdigit():
        return int(attempt)
    return result.attempts or 1


def tried_first(result: Result, urls: Collection[str]) -> bool:
    """Whether the gateway tried one of ``urls`` before the endpoint that started ``result``'s answer
    (``moved_on=<endpoint> <why>, …`` in its route header)."""
    moved = result.route_fields.get("moved_on") or ""
    return any(part.split(" ", 1)[0] in urls for part in moved.split(", ") if part)


def sent_between(results: Sequence[Result], lo: float | None, hi: float | None) -> list[Result]:
    """The results sent in ``[lo, hi)`` (None: unbounded)."""
    return [r for r in results if (lo is None or r.sent_s >= lo) and (hi is None or r.sent_s < hi)]


def in_phase(results: Sequence[Result], lo: float, hi: float | None) -> list[Result]:
    """The requests of a phase: sent in ``[lo, hi)``, or sent before ``lo`` and still running at ``lo``."""
    return [r for r in results if (r.sent_s >= lo and (hi is None or r.sent_s < hi)) or r.sent_s < lo < r.done_s]


def phase_windows(line: Timeline) -> list[Window]:
    """The run's phases by send time: name (:data:`PHASES`), start, end and the counters read at both edges.

    ``before`` runs up to the first outage, each outage from its fault to its end, the healthy phase after it
    from its end to the next one's fault (``after`` from the last end); an outage that was never staged ends
    the list there (its time belongs to the phase before it).
    """
    out: list[Window] = []
    name, lo, counters_lo = PHASES[0], None, line.first
    for index, outage in enumerate(line.outages):
        if outage.start_s is None:
            break
        out.append((name, lo, outage.start_s, counters_lo, outage.before))
        if outage.end_s is None:
            name, lo, counters_lo = outage.kind, outage.start_s, outage.before
            break
        out.append((outage.kind, outage.start_s, outage.end_s, outage.before, outage.after))
        name = PHASES[2 * index + 2] if 2 * index + 2 < len(PHASES) else "after"
        lo, counters_lo = outage.end_s, outage.after
        if outage.restarted and outage.after is not None:  # the new process counts from zero
            counters_lo = replace(outage.after, engines={**outage.after.engines, outage.restarted: 0.0})
    out.append((name, lo, None, counters_lo, line.last))
    return out


def phase_of(result: Result, windows: Sequence[Window]) -> str:
    """The phase ``result`` was sent in."""
    return next((name for name, lo, hi, _, _ in windows
                 if (lo is None or result.sent_s >= lo) and (hi is None or result.sent_s < hi)), "-")


def phase_rows(results: Sequence[Result], line: Timeline) -> list[dict[str, Any]]:
    """Per phase (by send time) and home region: requests, answered completely, fallbacks, where they were
    served, TTFT of the streams, the longest wait."""
    rows = []
    for phase, lo, hi, _, _ in phase_windows(line):
        window = sent_between(results, lo, hi)
        for home in REGIONS:
            rs = [r for r in window if r.request_class == home]
            ok = [r for r in rs if complete(r)]
            ttfts = [r.ttft_s for r in ok if r.stream and r.ttft_s is not None]
            ttft = percentiles(ttfts, (50, 99))
            rows.append({"phase": phase, "home": home, "from_s": lo, "to_s": hi, "requests": len(rs),
                         "complete_rate": len(ok) / len(rs) if rs else None,
                         "fallback_rate": sum(r.fell_back for r in rs) / len(rs) if rs else None,
                         "in_home": sum(served_region(r) == home for r in ok) / len(ok) if ok else None,
                         "ttft_p50_s": ttft["p50"], "ttft_p99_s": ttft["p99"],
                         "ttft_max_s": max(ttfts) if ttfts else None,
                         "wait_max_s": max((wait_s(r) for r in rs), default=None)})
    return rows


def _pool_attempts(pools: Mapping[str, Mapping[str, float]] | None, pool: str, *,
                   failed: bool = False) -> float | None:
    if pools is None:
        return None
    return sum(v for k, v in pools.get(pool, {}).items() if not (failed and k == "ok"))


def load_figures(requests: int, lo: Counters | None, hi: Counters | None) -> dict[str, Any]:
    """The load of a window in which ``requests`` client requests were sent: the gateway's counters and what
    each region's engines received, from ``lo`` to ``hi`` (engines per client request: None where a region's
    engines could not be read at an edge, as while they are down)."""
    deltas = counter_deltas(lo, hi)
    pools = deltas["attempts_by_pool"]
    received = deltas["received"]
    both = None if len(received) < len(REGIONS) or any(received.get(r) is None for r in REGIONS) else \
        sum(received[r] for r in REGIONS)
    return {**deltas, "home_attempts": _pool_attempts(pools, POOLS[HOME]),
            "home_failed_attempts": _pool_attempts(pools, POOLS[HOME], failed=True),
            "healthy_attempts": _pool_attempts(pools, POOLS[HEALTHY]),
            "home_received": received.get(HOME), "healthy_received": received.get(HEALTHY),
            "engine_requests": both, "engine_ratio": both / requests if both is not None and requests else None,
            "healthy_ratio": received[HEALTHY] / requests if received.get(HEALTHY) is not None and requests
            else None}


def load_rows(results: Sequence[Result], line: Timeline) -> list[dict[str, Any]]:
    """Per phase: client requests sent, the gateway's attempts, hedges and resumes, what each region's engines
    received."""
    rows = []
    for phase, lo, hi, counters_lo, counters_hi in phase_windows(line):
        sent = len(sent_between(results, lo, hi))
        rows.append({"phase": phase, "requests": sent, **load_figures(sent, counters_lo, counters_hi)})
    return rows
