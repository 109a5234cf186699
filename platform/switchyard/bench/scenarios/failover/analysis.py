"""The ``failover`` scenario's figures: per outage (its requests answered completely, resumed and hedged, time
to detect, traffic moved, time to recover, the longest client wait), over the whole run (engine requests per
client request), the gateway's request log per outage, and every failed request."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from switchyard.bench.results import Result
from switchyard.bench.scenarios.failover.phases import (
    complete,
    describe_kinds,
    failure_kinds,
    in_phase,
    load_figures,
    load_rows,
    longest_gap_s,
    phase_of,
    phase_rows,
    phase_windows,
    sent_between,
    served_at,
    served_region,
    tried_first,
    wait_s,
)
from switchyard.bench.scenarios.failover.timeline import EndpointChange, Outage, Timeline, counter_deltas, run_received
from switchyard.bench.scenarios.failover.watch import record_at
from switchyard.bench.scenarios.failover.workload import HEALTHY, HOME, REGIONS

#: Failed requests listed one by one in the report, at most (the client's, and the gateway's records).
FAILURES_LISTED = 30
#: The longest waits listed one by one.
SLOWEST_LISTED = 10


def _in_service_at(changes: Sequence[EndpointChange], url: str, at: float) -> bool | None:
    """Whether the gateway had ``url`` in service at ``at`` (its last change seen before; None: none seen)."""
    state = None
    for change in changes:
        if change.url == url and change.at_s <= at:
            state = change.in_service
    return state


def detection(changes: Sequence[EndpointChange], urls: Collection[str], start: float,
              end: float | None) -> dict[str, Any]:
    """When the gateway took the failing endpoints out after the fault at ``start`` (the first one, and all of
    them: seconds from the fault, 0 for one already out), why, and when it had them all back after ``end``."""
    out_at: dict[str, float] = {}
    reasons: list[str] = []
    for url in urls:
        if _in_service_at(changes, url, start) is False:
            out_at[url] = start
            continue
        gone = next((c for c in changes if c.url == url and c.at_s >= start and not c.in_service
                     and (end is None or c.at_s < end)), None)
        if gone is not None:
            out_at[url] = gone.at_s
            if gone.reason:
                reasons.append(gone.reason)
    row: dict[str, Any] = {"out_first_s": min(out_at.values()) - start if out_at else None,
                           "out_all_s": max(out_at.values()) - start if len(out_at) == len(urls) and urls else None,
                           "out_reasons": "; ".join(dict.fromkeys(reasons)), "back_s": None}
    if end is not None:
        back = []
        for url in urls:
            seen = next((c.at_s for c in changes if c.url == url and c.at_s >= end and c.in_service), None)
            if seen is None:
                return row
            back.append(seen)
        row["back_s"] = max(back) - end
    return row


def records_in(line: Timeline, lo: float, hi: float | None) -> list[dict[str, Any]]:
    """The gateway's request log records of a phase: arrived in ``[lo, hi)``, or before ``lo`` and still
    running at ``lo``."""
    if line.wall_start is None:
        return []
    out = []
    for record in line.records.values():
        at = record_at(record, line.wall_start)
        if at is None:
            continue
        ended = at + (record.get("duration_ms") or 0.0) / 1000.0
        if (at >= lo and (hi is None or at < hi)) or at < lo < ended:
            out.append(record)
    return out


def analyse_outage(results: Sequence[Result], outage: Outage, line: Timeline,
                   home_urls: Collection[str]) -> dict[str, Any]:
    """One outage's figures (its requests: sent while it lasted, or running when it began)."""
    start, end = outage.start_s, outage.end_s
    assert start is not None
    row: dict[str, Any] = {"outage": outage.kind, "start_s": start, "end_s": end,
                           "duration_s": end - start if end is not None else None}
    rs = in_phase(results, start, end)
    sent = sent_between(results, start, end)
    running = [r for r in rs if r.sent_s < start]
    done = [r for r in rs if complete(r)]
    row.update(requests=len(rs), sent=len(sent), in_flight=len(running), streams=sum(r.stream for r in rs),
               complete=len(done), complete_rate=len(done) / len(rs) if rs else None,
               failures=describe_kinds(failure_kinds(rs)),
               in_flight_failed=sum(not complete(r) for r in running),
               short=sum(1 for r in done if r.completion_tokens is not None and r.completion_tokens < r.max_tokens))
    deltas = counter_deltas(outage.before, outage.after)
    row.update({k: deltas[k] for k in ("resumes", "resumes_by_outcome", "broken", "hedges", "hedges_by_outcome",
                                       "hangs", "fallbacks", "budget_exhausted")})
    records = records_in(line, start, end)
    row.update(records=len(records), resumed_requests=sum(1 for r in records if (r.get("resumes") or 0) > 0),
               hedged_requests=sum(1 for r in records if (r.get("hedges") or 0) > 0),
               failed_records=sum(1 for r in records if r.get("outcome") != "ok"))
    row.update(detection(line.changes, home_urls, start, end))
    ours = [r for r in sent if r.request_class == HOME]
    away = [served_at(r) - start for r in ours if complete(r) and served_region(r) == HEALTHY]
    row["first_away_s"] = min(away) if away else None
    tried = [r for r in ours if tried_first(r, home_urls)]
    row["tried_home"] = len(tried)
    row["last_tried_home_s"] = max(r.sent_s for r in tried) - start if tried else None
    row["moved_s"] = row["last_tried_home_s"] if tried else (0.0 if ours else None)
    back = [served_at(r) for r in results if r.request_class == HOME and complete(r) and end is not None
            and r.sent_s >= end and served_region(r) == HOME]
    row["recover_s"] = min(back) - end if back and end is not None else None
    row.update(wait_figures(rs))
    return row


def wait_figures(rs: Sequence[Result]) -> dict[str, Any]:
    """The longest waits of some requests: for a first token (streams), for the whole answer (complete
    answers: an upper bound of their wait), the generator's own lateness, and the longest gap inside a stream."""
    streams = [wait_s(r) for r in rs if r.stream]
    whole = [wait_s(r) for r in rs if not r.stream]
    gaps = [g for r in rs if r.stream and (g := longest_gap_s(r)) is not None]
    return {"wait_max_s": max(streams + whole, default=None), "stream_wait_max_s": max(streams, default=None),
            "complete_wait_max_s": max(whole, default=None),
            "lateness_max_s": max((r.lateness_s for r in rs), default=None), "gap_max_s": max(gaps, default=None)}


def run_figures(results: Sequence[Result], line: Timeline) -> dict[str, Any]:
    """The whole run: requests answered completely, the longest wait, what both regions' engines received per
    client request, and the gateway's attempts, hedges and resumes."""
    received = run_received(line)
    known = bool(received) and all(received.get(r) is not None for r in REGIONS)
    engines = sum(v for v in received.values() if v is not None) if known else None
    load = load_figures(len(results), line.first, line.last)
    done = sum(complete(r) for r in results)
    slowest = max(results, key=wait_s, default=None)
    return {"requests": len(results), "complete": done, "complete_rate": done / len(results) if results else None,
            "failures": len(results) - done, "failure_kinds": failure_kinds(results),
            **wait_figures(results), "wait_max_phase": phase_of(slowest, phase_windows(line)) if slowest else None,
            "received": received, "engine_requests": engines,
            "engine_ratio": engines / len(results) if engines is not None and results else None,
            **{k: load[k] for k in ("attempts", "hedges", "hedges_by_outcome", "resumes", "resumes_by_outcome",
                                    "broken", "hangs", "fallbacks", "budget_exhausted")}}


def failure_rows(results: Sequence[Result], line: Timeline, limit: int = FAILURES_LISTED) -> list[dict[str, Any]]:
    """The requests not answered completely, one by one (the first ``limit`` by send time)."""
    windows = phase_windows(line)
    rows = []
    for r in sorted((r for r in results if not complete(r)), key=lambda r: r.sent_s)[:limit]:
        fields = r.route_fields
        rows.append({"sent_s": r.sent_s, "done_s": r.done_s, "phase": phase_of(r, windows), "home": r.request_class,
                     "stream": r.stream, "status": r.status, "error": r.error_type or "no finish_reason",
                     "code": r.error_code, "chunks": r.chunks, "max_tokens": r.max_tokens,
                     "endpoint": fields.get("endpoint"), "moved_on": fields.get("moved_on"),
                     "message": (r.error_message or "")[:160]})
    return rows


def slowest_rows(results: Sequence[Result], line: Timeline, limit: int = SLOWEST_LISTED) -> list[dict[str, Any]]:
    """The requests whose clients waited longest (:func:`wait_s`), longest first: when, where they were served
    and what the gateway tried before (their route header)."""
    windows = phase_windows(line)
    rows = []
    for r in sorted(results, key=wait_s, reverse=True)[:limit]:
        fields = r.route_fields
        rows.append({"sent_s": r.sent_s, "phase": phase_of(r, windows), "home": r.request_class, "stream": r.stream,
                     "wait_s": wait_s(r), "lateness_s": r.lateness_s, "complete": complete(r),
                     "region": fields.get("region"), "attempt": fields.get("attempt"),
                     "moved_on": fields.get("moved_on"), "hedged": fields.get("hedged")})
    return rows


def record_rows(line: Timeline, limit: int = FAILURES_LISTED) -> list[dict[str, Any]]:
    """The gateway's records of the requests that did not end ``ok`` (the first ``limit`` by arrival): what it
    tried, resumed and why it gave up (the last lines of the decision trace)."""
    windows = phase_windows(line)
    failed = [(record_at(r, line.wall_start), r) for r in line.records.values() if r.get("outcome") != "ok"] \
        if line.wall_start is not None else []
    rows = []
    for at, r in sorted(((a, r) for a, r in failed if a is not None), key=lambda ar: ar[0])[:limit]:
        phase = next((name for name, lo, hi, _, _ in windows if (lo is None or at >= lo) and (hi is None or at < hi)),
                     "-")
        trace = [str(t) for t in (r.get("trace") or [])]
        rows.append({"at_s": at, "phase": phase, "stream": r.get("stream"), "status": r.get("status"),
                     "outcome": r.get("outcome"), "code": r.get("error_code"), "endpoint": r.get("endpoint"),
                     "attempts": r.get("attempts"), "resumes": r.get("resumes"), "hedges": r.get("hedges"),
                     "moved_on": ", ".join(r.get("moved_on") or []), "trace": " | ".join(trace[-3:])[:300]})
    return rows


def analyse(results: Sequence[Result], line: Timeline, home_urls: Collection[str] = ()) -> dict[str, Any]:
    """Every figure of the run: per outage, over the run, per phase, the load per phase, the failures."""
    return {"outages": [analyse_outage(results, o, line, home_urls) for o in line.outages if o.start_s is not None],
            "run": run_figures(results, line), "phases": phase_rows(results, line), "load": load_rows(results, line),
            "failed": failure_rows(results, line), "slowest": slowest_rows(results, line),
            "records": record_rows(line)}
