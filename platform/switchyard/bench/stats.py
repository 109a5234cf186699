"""Numbers from results: percentiles, SLO attainment, goodput, per-group summaries, time series.

All functions are pure over lists of :class:`~switchyard.bench.results.Result`.

Conventions:

- Percentiles are :func:`switchyard.figures.percentile`'s ``linear`` method, numpy's default
  (Hyndman & Fan type 7: the value at rank ``q/100 * (n - 1)``, interpolated between neighbours).
  An empty sample has no percentile (``None``, never ``NaN``, so reports stay valid JSON).
- Latency percentiles (TTFT, ITL, end-to-end) are over *successful* requests; failures are
  counted by the outcome rates and, as misses, by SLO attainment. TTFT and end-to-end time count
  from the scheduled time (see ``bench.results``). ITL percentiles pool every gap of every
  successful stream (a long answer weighs more than a short one).
- A request meets its SLO when it succeeded and met every threshold its class has; a class
  without thresholds needs success only. Goodput is the requests (or output tokens) meeting the
  SLO per second of the window; throughput the same for all successful requests.
- The window is the offered duration (``Workload.duration_s``) when the caller passes it, else
  the run's makespan (the last completion).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from switchyard.bench.results import Outcome, Result
from switchyard.figures import percentile

FloatArray = np.ndarray[Any, np.dtype[np.float64]]


def percentiles(values: Sequence[float] | FloatArray, qs: Iterable[float] = (50, 90, 99)) -> dict[str, float | None]:
    """Several percentiles at once, keyed ``p50``, ``p90``, ... (``p99.9`` for fractions).

    :func:`switchyard.figures.percentile`'s linear method over one numpy sort (a long run's pooled
    inter-token gaps number in the millions).
    """
    ordered = np.sort(np.asarray(values, dtype=np.float64))
    return {f"p{q:g}": percentile(ordered, q, ordered=True) for q in qs}


def ratio(candidate: float | None, baseline: float | None) -> float | None:
    """``candidate / baseline``; None when either is missing or the baseline is 0."""
    if candidate is None or baseline is None or baseline == 0:
        return None
    return candidate / baseline


@dataclass(frozen=True, slots=True)
class Slo:
    """Thresholds a successful request must meet (None: no threshold).

    Attributes:
        ttft_s: Time to first token, from the scheduled time.
        e2e_s: End-to-end time, from the scheduled time.
        tpot_s: Mean time per output token after the first (``(e2e - ttft) / (tokens - 1)``).
    """

    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None

    def met(self, result: Result) -> bool:
        """Whether ``result`` succeeded and met every threshold."""
        if not result.ok:
            return False
        ttft = result.ttft_s
        if self.ttft_s is not None and (ttft is None or ttft > self.ttft_s):
            return False
        if self.e2e_s is not None and result.e2e_s > self.e2e_s:
            return False
        if self.tpot_s is not None and ttft is not None and result.output_tokens > 1:
            return (result.e2e_s - ttft) / (result.output_tokens - 1) <= self.tpot_s
        return True


#: An SLO for every request, or one per class (key ``*``: classes not listed).
SloSpec = Slo | Mapping[str, Slo] | None


def slo_for(spec: SloSpec, request_class: str) -> Slo:
    """The SLO a request of ``request_class`` is held to (no thresholds when none applies)."""
    if spec is None:
        return Slo()
    if isinstance(spec, Slo):
        return spec
    return spec.get(request_class) or spec.get("*") or Slo()


def meets_slo(results: Sequence[Result], spec: SloSpec) -> list[bool]:
    """Per request: did it meet its class's SLO? (Failures never do.)"""
    return [slo_for(spec, r.request_class).met(r) for r in results]


def slo_attainment(results: Sequence[Result], spec: SloSpec) -> float | None:
    """Fraction of all requests, failures included, that met their SLO; None when empty."""
    if not results:
        return None
    return sum(meets_slo(results, spec)) / len(results)


def makespan(results: Sequence[Result]) -> float:
    """Seconds from the run's start to the last completion."""
    return max((r.done_s for r in results), default=0.0)


def goodput(results: Sequence[Result], spec: SloSpec, window_s: float | None = None) -> tuple[float, float]:
    """Requests and output tokens per second that met their SLO, over ``window_s``."""
    window = window_s if window_s is not None else makespan(results)
    if window <= 0:
        return 0.0, 0.0
    good = [r for r, met in zip(results, meets_slo(results, spec), strict=True) if met]
    return len(good) / window, sum(r.output_tokens for r in good) / window


@dataclass(frozen=True, slots=True)
class Summary:
    """The headline numbers of a set of results (times in seconds; rates of all requests)."""

    count: int
    ok: int
    limited: int
    shed: int
    errors: int
    timeouts: int
    ok_rate: float | None
    limited_rate: float | None
    shed_rate: float | None
    error_rate: float | None
    timeout_rate: float | None
    fallback_rate: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    ttft_mean_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    lateness_p50_s: float | None
    lateness_p99_s: float | None
    lateness_max_s: float | None
    slo_attainment: float | None
    goodput_rps: float
    goodput_tps: float
    throughput_rps: float
    output_tps: float
    offered_rps: float
    prompt_tokens: int
    cached_tokens: int
    cached_fraction: float | None
    window_s: float

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (JSON-ready)."""
        return asdict(self)


def summarize(results: Sequence[Result], *, slo: SloSpec = None, window_s: float | None = None) -> Summary:
    """The :class:`Summary` of ``results`` (see the module docstring for the conventions)."""
    n = len(results)
    outcomes = [r.outcome for r in results]
    tally = {o: outcomes.count(o) for o in Outcome}
    ok = [r for r, o in zip(results, outcomes, strict=True) if o is Outcome.OK]
    window = window_s if window_s is not None else makespan(results)

    def rate(count: int) -> float | None:
        return count / n if n else None

    def per_s(amount: float) -> float:
        return amount / window if window > 0 else 0.0

    ttft = np.array([r.ttft_s for r in ok if r.ttft_s is not None], dtype=np.float64)
    itl = np.concatenate([np.frombuffer(r.itl_s, dtype=np.float64) for r in ok]) if ok else np.zeros(0)
    e2e = np.array([r.e2e_s for r in ok], dtype=np.float64)
    lateness = np.array([r.lateness_s for r in results], dtype=np.float64)
    t, i, e, late = percentiles(ttft), percentiles(itl, (50, 99)), percentiles(e2e, (50, 99)), \
        percentiles(lateness, (50, 99))
    good_rps, good_tps = goodput(results, slo, window)
    prompt = sum(r.prompt_tokens for r in ok if r.prompt_tokens is not None)
    cached = sum(r.cached_tokens for r in ok if r.cached_tokens is not None)
    return Summary(
        count=n, ok=tally[Outcome.OK], limited=tally[Outcome.LIMITED], shed=tally[Outcome.SHED],
        errors=tally[Outcome.ERROR], timeouts=tally[Outcome.TIMEOUT], ok_rate=rate(tally[Outcome.OK]),
        limited_rate=rate(tally[Outcome.LIMITED]), shed_rate=rate(tally[Outcome.SHED]),
        error_rate=rate(tally[Outcome.ERROR]), timeout_rate=rate(tally[Outcome.TIMEOUT]),
        fallback_rate=rate(sum(r.fell_back for r in results)),
        ttft_p50_s=t["p50"], ttft_p90_s=t["p90"], ttft_p99_s=t["p99"],
        ttft_mean_s=float(ttft.mean()) if len(ttft) else None,
        itl_p50_s=i["p50"], itl_p99_s=i["p99"], e2e_p50_s=e["p50"], e2e_p99_s=e["p99"],
        lateness_p50_s=late["p50"], lateness_p99_s=late["p99"],
        lateness_max_s=float(lateness.max()) if n else None,
        slo_attainment=slo_attainment(results, slo), goodput_rps=good_rps, goodput_tps=good_tps,
        throughput_rps=per_s(len(ok)), output_tps=per_s(sum(r.output_tokens for r in ok)), offered_rps=per_s(n),
        prompt_tokens=prompt, cached_tokens=cached, cached_fraction=cached / prompt if prompt else None,
        window_s=window,
    )


#: Labels results can be grouped by.
GROUP_KEYS: dict[str, Callable[[Result], str]] = {
    "arm": lambda r: r.arm,
    "class": lambda r: r.request_class,
    "tenant": lambda r: r.tenant,
    "model": lambda r: r.model,
    "served_model": lambda r: r.served_model,
    "pool": lambda r: r.pool,
    "kind": lambda r: r.kind,
    "outcome": lambda r: r.outcome.value,
    "prefix_group": lambda r: r.prefix_group or "-",
}


def group_by(results: Iterable[Result], *keys: str) -> dict[tuple[str, ...], list[Result]]:
    """Results grouped by the labels named in ``keys`` (see ``GROUP_KEYS``), groups sorted.

    Raises:
        KeyError: An unknown key.
    """
    getters = [GROUP_KEYS[k] for k in keys]
    groups: dict[tuple[str, ...], list[Result]] = defaultdict(list)
    for r in results:
        groups[tuple(g(r) for g in getters)].append(r)
    return dict(sorted(groups.items()))


def summarize_groups(results: Iterable[Result], *keys: str, slo: SloSpec = None,
                     window_s: float | None = None) -> dict[tuple[str, ...], Summary]:
    """A :class:`Summary` per group (all groups over the same window)."""
    return {k: summarize(v, slo=slo, window_s=window_s) for k, v in group_by(results, *keys).items()}


def compare(candidate: Summary, baseline: Summary, metrics: Iterable[str] | None = None) -> dict[str, float | None]:
    """``candidate / baseline`` for each numeric metric (default: all of them)."""
    cand, base = candidate.as_dict(), baseline.as_dict()
    return {m: ratio(cand[m], base[m]) for m in (metrics if metrics is not None else cand)}


# --- time series -------------------------------------------------------------------------


def _covered(starts: FloatArray, ends: FloatArray, weights: FloatArray, edges: FloatArray) -> FloatArray:
    """For each edge e: sum of ``weight * |[start, end] ∩ [-inf, e]|`` (sorted prefix sums)."""

    def ramp(points: FloatArray) -> FloatArray:
        order = np.argsort(points)
        p, w = points[order], weights[order]
        cum_w = np.concatenate(([0.0], np.cumsum(w)))
        cum_wp = np.concatenate(([0.0], np.cumsum(w * p)))
        k = np.searchsorted(p, edges, side="right")
        out: FloatArray = edges * cum_w[k] - cum_wp[k]
        return out

    return ramp(starts) - ramp(ends)


@dataclass(frozen=True, slots=True)
class TimeSeries:
    """Per-bin series of a run (bins of ``bin_s`` from the run's start).

    Attributes:
        bin_s: Bin width.
        t_s: Start of each bin.
        sent: Requests sent in the bin.
        throughput_rps: Successful completions per second (by completion time).
        output_tps: Output tokens per second of successful requests, each spread evenly from its
            first token to its end.
        in_flight: Requests in flight, time-averaged over the bin.
        shed: Requests answered 429 or 503 in the bin (by completion time).
        fallback: Requests served by a fallback in the bin (by completion time).
        failed_by_status: Failed requests per bin, keyed by status (or ``timeout``,
            ``connection_error``, ... when no status came).
        extra: Series sampled elsewhere (a gateway's queue depth), same bins, added by callers.
    """

    bin_s: float
    t_s: list[float]
    sent: list[int]
    throughput_rps: list[float]
    output_tps: list[float]
    in_flight: list[float]
    shed: list[int]
    fallback: list[int]
    failed_by_status: dict[str, list[int]]
    extra: dict[str, list[float]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The series as a plain dict (JSON-ready)."""
        return asdict(self)


def failure_label(result: Result) -> str:
    """The status of a failed request as text: the HTTP status, else the client's error type."""
    if result.timed_out:
        return "timeout"
    return str(result.status) if result.status else (result.error_type or "error")


def time_series(results: Sequence[Result], *, bin_s: float = 1.0, end_s: float | None = None) -> TimeSeries:
    """Bin a run's results in time (see :class:`TimeSeries`); ``end_s`` defaults to the makespan."""
    if bin_s <= 0:
        raise ValueError("bin_s must be > 0")
    end = end_s if end_s is not None else makespan(results)
    bins = max(1, math.ceil(end / bin_s - 1e-9))
    edges = np.arange(bins + 1, dtype=np.float64) * bin_s

    def binned(times: Iterable[float], weights: FloatArray | None = None) -> FloatArray:
        idx = np.clip((np.fromiter(times, dtype=np.float64) // bin_s).astype(np.int64), 0, bins - 1)
        out: FloatArray = np.bincount(idx, weights=weights, minlength=bins).astype(np.float64)
        return out

    def count(times: Iterable[float]) -> list[int]:
        return [int(x) for x in binned(times)]

    ok = [r for r in results if r.ok]
    sent = np.array([r.sent_s for r in results], dtype=np.float64)
    done = np.array([r.done_s for r in results], dtype=np.float64)
    in_flight = np.diff(_covered(sent, done, np.ones(len(results)), edges)) / bin_s
    first = np.array([r.first_token_s if r.first_token_s is not None else r.done_s for r in ok], dtype=np.float64)
    last = np.array([r.done_s for r in ok], dtype=np.float64)
    tokens = np.array([r.output_tokens for r in ok], dtype=np.float64)
    spread = last > first
    per_s = np.zeros(len(ok))
    np.divide(tokens, last - first, out=per_s, where=spread)
    output = np.diff(_covered(first[spread], last[spread], per_s[spread], edges))
    output += binned(last[~spread].tolist(), tokens[~spread])  # whole answers at once: a point mass
    failed: dict[str, list[int]] = {}
    for label in sorted({failure_label(r) for r in results if not r.ok}):
        failed[label] = count(r.done_s for r in results if not r.ok and failure_label(r) == label)
    return TimeSeries(
        bin_s=bin_s,
        t_s=edges[:-1].tolist(),
        sent=count(sent.tolist()),
        throughput_rps=[c / bin_s for c in count(last.tolist())],
        output_tps=(output / bin_s).tolist(),
        in_flight=in_flight.tolist(),
        shed=count(r.done_s for r in results if r.outcome in (Outcome.SHED, Outcome.LIMITED)),
        fallback=count(r.done_s for r in results if r.fell_back),
        failed_by_status=failed,
    )
