"""The ``failover`` scenario's figures: per outage (success, time to detect and to recover, requests that tried
the failed region first or waited out the first-token timeout, the load on each region), per phase and home
region, the load per phase, and every failed request."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from switchyard.bench.results import Result
from switchyard.bench.scenarios.failover.timeline import Counters, Outage, Timeline, counter_deltas
from switchyard.bench.scenarios.failover.workload import FIRST_TOKEN_TIMEOUT_S, HOME, POOLS, REGIONS
from switchyard.bench.stats import percentiles

#: Failed requests listed one by one in the report, at most.
FAILURES_LISTED = 30


def served_region(result: Result) -> str | None:
    """The region that served ``result`` (from its route header)."""
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


def tried_first(result: Result) -> bool:
    """Whether the gateway tried another endpoint before the one that served ``result``."""
    return attempts_of(result) > 1


def sent_between(results: Sequence[Result], lo: float | None, hi: float | None) -> list[Result]:
    """The results sent in ``[lo, hi)`` (None: unbounded)."""
    return [r for r in results if (lo is None or r.sent_s >= lo) and (hi is None or r.sent_s < hi)]


def failure_kinds(results: Sequence[Result]) -> dict[str, int]:
    """Failed requests counted by status and error type (``502 upstream_error``)."""
    kinds = Counter(f"{r.status or '-'} {r.error_type or ''}".strip() for r in results if not r.ok)
    return dict(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))


def describe_kinds(kinds: Mapping[str, int]) -> str:
    """``502 upstream_error (3), 0 timeout (1)`` ('' when none)."""
    return ", ".join(f"{kind} ({count})" for kind, count in kinds.items())


def phase_windows(line: Timeline) -> list[tuple[str, float | None, float | None, Counters | None, Counters | None]]:
    """The run's phases by send time: name, start, end and the counters read at both edges.

    ``before`` runs up to the first outage, each outage from its fault to its end, ``between``
    from one outage's end to the next one's fault, ``after`` from the last end; an outage that
    was never staged ends the list there (its time belongs to the phase before it).
    """
    out: list[tuple[str, float | None, float | None, Counters | None, Counters | None]] = []
    name, lo, counters_lo = "before", None, line.first
    staged = [o for o in line.outages if o.start_s is not None]
    for index, outage in enumerate(staged):
        out.append((name, lo, outage.start_s, counters_lo, outage.before))
        if outage.end_s is None:
            name, lo, counters_lo = outage.kind, outage.start_s, outage.before
            break
        out.append((outage.kind, outage.start_s, outage.end_s, outage.before, outage.after))
        name = "between" if index < len(staged) - 1 else "after"
        lo, counters_lo = outage.end_s, outage.after
    out.append((name, lo, None, counters_lo, line.last))
    return out


def phase_rows(results: Sequence[Result], line: Timeline) -> list[dict[str, Any]]:
    """Per phase and home region: requests, success, fallbacks, where they were served, TTFT."""
    rows = []
    for phase, lo, hi, _, _ in phase_windows(line):
        window = sent_between(results, lo, hi)
        for home in REGIONS:
            rs = [r for r in window if r.request_class == home]
            ok = [r for r in rs if r.ok]
            ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
            ttft = percentiles(ttfts, (50, 90, 99))
            rows.append({"phase": phase, "home": home, "from_s": lo, "to_s": hi, "requests": len(rs),
                         "ok_rate": len(ok) / len(rs) if rs else None,
                         "fallback_rate": sum(r.fell_back for r in rs) / len(rs) if rs else None,
                         "in_home": sum(served_region(r) == home for r in ok) / len(ok) if ok else None,
                         "ttft_p50_s": ttft["p50"], "ttft_p90_s": ttft["p90"], "ttft_p99_s": ttft["p99"],
                         "ttft_max_s": max(ttfts) if ttfts else None})
    return rows


def _pool_attempts(pools: Mapping[str, Mapping[str, float]] | None, pool: str, *,
                   failed: bool = False) -> float | None:
    if pools is None:
        return None
    return sum(v for k, v in pools.get(pool, {}).items() if not (failed and k == "ok"))


def analyse_outage(results: Sequence[Result], outage: Outage, *, home: str = HOME,
                   first_token_timeout_s: float = FIRST_TOKEN_TIMEOUT_S) -> dict[str, Any]:
    """One outage's figures: success, detection, recovery, and the load the gateway put on each region."""
    start, end = outage.start_s, outage.end_s
    row: dict[str, Any] = {"outage": outage.kind, "start_s": start, "end_s": end,
                           "duration_s": end - start if start is not None and end is not None else None}
    window = sent_between(results, start, end) if start is not None else []
    ours = [r for r in window if r.request_class == home]
    ok = [r for r in window if r.ok]
    ours_ok = [r for r in ours if r.ok]
    row.update(requests=len(window), ok=len(ok), ok_rate=len(ok) / len(window) if window else None,
               home_requests=len(ours), home_ok_rate=len(ours_ok) / len(ours) if ours else None,
               failures=describe_kinds(failure_kinds(window)))
    away = [served_at(r) for r in ours_ok if served_region(r) != home]
    row["detect_s"] = min(away) - start if away and start is not None else None
    back = [served_at(r) for r in results if r.request_class == home and r.ok and end is not None
            and r.sent_s >= end and served_region(r) == home]
    row["recover_s"] = min(back) - end if back and end is not None else None
    retried = [r for r in ours_ok if tried_first(r)]
    row["tried_home_first"] = len(retried)
    row["last_tried_home_s"] = max(r.sent_s for r in retried) - start if retried and start is not None else None
    row["waited_timeout"] = sum(1 for r in ours_ok if (r.service_ttft_s or 0.0) >= first_token_timeout_s)
    cut = [r for r in results if start is not None and r.sent_s < start < r.done_s and not r.ok]
    row["cut_in_flight"] = len(cut)
    row["cut_kinds"] = describe_kinds(failure_kinds(cut))
    row.update(load_figures(window, outage.before, outage.after, home=home))
    return row


def load_figures(window: Sequence[Result], lo: Counters | None, hi: Counters | None, *,
                 home: str = HOME) -> dict[str, Any]:
    """The load the requests sent in a window put on each region: endpoints tried per request (route
    headers), the gateway's counters and what the healthy region's engines received, from ``lo`` to ``hi``."""
    deltas = counter_deltas(lo, hi)
    pools = deltas["attempts_by_pool"]
    home_pool = POOLS[home]
    healthy_pool = next(pool for region, pool in POOLS.items() if region != home)
    tried = sum(attempts_of(r) for r in window)
    received = deltas["healthy_received"]
    return {**deltas, "client_attempts": tried, "attempts_per_request": tried / len(window) if window else None,
            "home_attempts": _pool_attempts(pools, home_pool),
            "home_failed_attempts": _pool_attempts(pools, home_pool, failed=True),
            "healthy_attempts": _pool_attempts(pools, healthy_pool),
            "healthy_ratio": received / len(window) if received is not None and window else None}


def load_rows(results: Sequence[Result], line: Timeline) -> list[dict[str, Any]]:
    """Per phase: client requests sent, gateway attempts, and what the healthy region's engines received."""
    rows = []
    for phase, lo, hi, counters_lo, counters_hi in phase_windows(line):
        window = sent_between(results, lo, hi)
        rows.append({"phase": phase, "requests": len(window), **load_figures(window, counters_lo, counters_hi)})
    return rows


def failure_rows(results: Sequence[Result], line: Timeline, limit: int = FAILURES_LISTED) -> list[dict[str, Any]]:
    """The failed requests one by one (the first ``limit`` by send time): when, which phase, how they failed."""
    windows = phase_windows(line)
    rows = []
    for r in sorted((r for r in results if not r.ok), key=lambda r: r.sent_s)[:limit]:
        phase = next((name for name, lo, hi, _, _ in windows
                      if (lo is None or r.sent_s >= lo) and (hi is None or r.sent_s < hi)), "-")
        fields = r.route_fields
        rows.append({"sent_s": r.sent_s, "done_s": r.done_s, "phase": phase, "home": r.request_class,
                     "status": r.status, "error": r.error_type, "code": r.error_code, "chunks": r.chunks,
                     "attempts": attempts_of(r), "endpoint": fields.get("endpoint"),
                     "moved_on": fields.get("moved_on"), "message": (r.error_message or "")[:160]})
    return rows


def analyse(results: Sequence[Result], line: Timeline, *,
            first_token_timeout_s: float = FIRST_TOKEN_TIMEOUT_S) -> dict[str, Any]:
    """Every figure of the run: per outage, per phase, the load per phase, and overall success."""
    return {"outages": [analyse_outage(results, o, first_token_timeout_s=first_token_timeout_s)
                        for o in line.outages if o.start_s is not None],
            "phases": phase_rows(results, line), "load": load_rows(results, line),
            "success": sum(r.ok for r in results) / len(results) if results else None,
            "failures": sum(not r.ok for r in results), "requests": len(results),
            "failure_kinds": failure_kinds(results), "failed": failure_rows(results, line)}
