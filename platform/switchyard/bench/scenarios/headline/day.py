"""The ``headline`` scenario's day of traffic: when requests arrive, how long they are, who sends them.

- **When**: the shape of the Azure conversation trace's arrivals (its requests per minute over its hour,
  smoothed by a centred moving average), stretched over the run and mapped onto the fleet's measured capacity
  so that the quietest minute offers ``trough`` times it and the busiest ``peak`` times it; arrivals are a
  Poisson process of that varying rate (drawn by thinning).
- **How long, and what they share**: the Mooncake conversation trace's rows in their own order (prompt and
  answer lengths, and the prompt blocks that turns of one conversation share), their lengths scaled by
  ``token_scale``; row *i* of the trace is the day's request *i*.
- **Who**: each conversation (the Mooncake prefix group) belongs to one tenant, drawn by the tenants' shares;
  a tenant's tier gives the request's class, and the class its TTFT objective.

Every draw comes from ``numpy.random.default_rng(seed)``: a seed gives the same day on every machine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from switchyard.bench.scenarios.prefix.workloads import SHIPPED_TRACES, default_trace
from switchyard.bench.spec import Labels, Workload, WorkloadError
from switchyard.bench.traces import azure, mooncake

#: The trace whose arrivals give the day its shape (shipped, with its attribution, in ``bench/data``).
DAY_TRACE = SHIPPED_TRACES / "azure2023_conv.csv"
#: The trace whose rows give the requests their lengths and shared prefixes.
LENGTHS_TRACE = default_trace()
#: The busiest and the quietest minute of the day, as multiples of the fleet's measured capacity.
PEAK = 1.5
TROUGH = 0.3
#: The trace's arrivals are counted per minute, and the counts averaged over this many minutes (centred): the
#: day's shape, not the trace's minute-to-minute noise.
CURVE_BIN_S = 60.0
CURVE_SMOOTH_BINS = 5


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant of the day: its name (the tenant label and database tenant), tier, and share of the
    conversations."""

    name: str
    tier: str
    share: float


def arrival_curve(path: str | Path = DAY_TRACE, *, bin_s: float = CURVE_BIN_S,
                  smooth_bins: int = CURVE_SMOOTH_BINS) -> list[float]:
    """Requests per bin of ``bin_s`` seconds over the trace (the last bin, cut short by the trace's end, left
    out), each the centred mean of ``smooth_bins`` bins (fewer at the edges)."""
    if bin_s <= 0 or smooth_bins < 1:
        raise WorkloadError("bin_s must be > 0 and smooth_bins >= 1")
    times = np.fromiter((s.arrival_s for s in azure(path, exact_output=False).specs), dtype=np.float64)
    if len(times) == 0:
        raise WorkloadError(f"{path}: no arrivals")
    full = int(times[-1] // bin_s)  # bins that the trace covers whole
    if full < 1:
        raise WorkloadError(f"{path}: shorter than one {bin_s:g} s bin")
    counts = np.bincount((times // bin_s).astype(np.int64), minlength=full + 1)[:full].astype(np.float64)
    half = smooth_bins // 2
    return [float(counts[max(0, i - half):i + half + 1].mean()) for i in range(full)]


def load_shape(curve: Sequence[float], *, peak: float = PEAK, trough: float = TROUGH) -> list[float]:
    """``curve`` mapped linearly onto ``[trough, peak]`` (its lowest bin to ``trough``, its highest to
    ``peak``): the offered load of each bin as a multiple of the fleet's capacity."""
    if not curve:
        raise WorkloadError("an empty arrival curve")
    if not 0 < trough <= peak:
        raise WorkloadError(f"need 0 < trough <= peak, got {trough} and {peak}")
    low, high = min(curve), max(curve)
    if high == low:
        return [peak for _ in curve]
    return [trough + (peak - trough) * (c - low) / (high - low) for c in curve]


def load_at(shape: Sequence[float], t_s: float, duration_s: float) -> float:
    """The load (a multiple of capacity) at ``t_s`` of a day of ``duration_s`` seconds: ``shape``'s bins
    stretched over the day, linear between their centres (flat before the first and after the last)."""
    bins = len(shape)
    position = t_s / duration_s * bins - 0.5
    return float(np.interp(position, np.arange(bins), shape))


def day_arrivals(shape: Sequence[float], capacity_rps: float, duration_s: float,
                 rng: np.random.Generator) -> np.ndarray[Any, np.dtype[np.float64]]:
    """Arrival times (sorted, seconds) of a Poisson process whose rate at ``t`` is ``capacity_rps`` times
    :func:`load_at`: candidates at the highest rate, each kept with the rate's share of it (thinning)."""
    if capacity_rps <= 0 or duration_s <= 0:
        raise WorkloadError(f"need capacity_rps > 0 and duration_s > 0, got {capacity_rps} and {duration_s}")
    top = capacity_rps * max(shape)
    candidates = np.sort(rng.uniform(0.0, duration_s, rng.poisson(top * duration_s)))
    bins = len(shape)
    rates = capacity_rps * np.interp(candidates / duration_s * bins - 0.5, np.arange(bins), shape)
    keep = rng.uniform(0.0, top, len(candidates)) < rates
    return candidates[keep]


def tenant_of_groups(groups: Sequence[str | None], tenants: Sequence[Tenant],
                     rng: np.random.Generator) -> dict[str | None, Tenant]:
    """One tenant per prefix group (a conversation), drawn by the tenants' shares in the order the groups
    first appear; requests without a group (``None``) get one draw together."""
    if not tenants:
        raise WorkloadError("no tenants")
    weights = np.array([t.share for t in tenants], dtype=np.float64)
    if (weights < 0).any() or weights.sum() <= 0:
        raise WorkloadError("tenant shares must be >= 0 and not all 0")
    order = list(dict.fromkeys(groups))
    picks = rng.choice(len(tenants), size=len(order), p=weights / weights.sum())
    return {group: tenants[pick] for group, pick in zip(order, picks.tolist(), strict=True)}


def day(capacity_rps: float, duration_s: float, seed: int, *, tenants: Sequence[Tenant],
        class_of_tier: Mapping[str, str], model: str, token_scale: float, max_model_len: int,
        peak: float = PEAK, trough: float = TROUGH, day_trace: str | Path = DAY_TRACE,
        lengths_trace: str | Path = LENGTHS_TRACE) -> Workload:
    """The day's requests (see the module doc), every one streamed and calling ``model``.

    Raises:
        WorkloadError: The day needs more requests than the lengths trace has rows, or a parameter is
            impossible.
    """
    rng = np.random.default_rng(seed)
    shape = load_shape(arrival_curve(day_trace), peak=peak, trough=trough)
    times = day_arrivals(shape, capacity_rps, duration_s, rng)
    rows = mooncake(lengths_trace, limit=len(times), seed=seed, token_scale=token_scale,
                    max_model_len=max_model_len, labels=Labels(model=model), exact_output=True)
    if len(rows) < len(times):
        raise WorkloadError(f"the day needs {len(times)} requests and {lengths_trace} has {len(rows)} rows: lower "
                            "the capacity or the duration")
    owners = tenant_of_groups([s.prefix_group for s in rows.specs], tenants, rng)
    specs = []
    for spec, at in zip(rows.specs, times.tolist(), strict=True):
        tenant = owners[spec.prefix_group]
        labels = replace(spec.labels, tenant=tenant.name, request_class=class_of_tier[tenant.tier])
        specs.append(replace(spec, arrival_s=at, labels=labels))
    source = {"source": "headline day", "day_trace": str(day_trace), "lengths_trace": str(lengths_trace),
              "capacity_rps": capacity_rps, "peak": peak, "trough": trough, "curve_bin_s": CURVE_BIN_S,
              "curve_smooth_bins": CURVE_SMOOTH_BINS, "token_scale": token_scale, "max_model_len": max_model_len,
              "seed": seed, "tenants": {t.name: {"tier": t.tier, "share": t.share} for t in tenants}}
    return Workload(tuple(specs), duration_s, source, rows.clipped)
