"""What the console and the admin API show of this gateway process's recent activity
(:mod:`switchyard.gateway.activity`): the traffic summary's rows (requests/s, TTFT p50 and p99 in ms,
outcome and cache rates, sparkline series), the Overview's traffic table and its sparklines, and the
status filter of the Requests page and ``/admin/api/requests``.

The gateway keeps the counts; everything here is computed from an :class:`~switchyard.gateway.activity.Activity`
when a page or the API asks, off the request path. Numbers are formatted by :mod:`switchyard.figures`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from switchyard.figures import DASH, millis, per_second, percent, percentile, to_ms, trimmed, utc_iso
from switchyard.gateway.activity import CACHE_POOL, NO_POOL, OUTCOMES, Activity, RequestRecord, Tally

#: The overview's traffic window and the width of one sparkline point, in seconds.
WINDOW_S = 300
#: The Requests page's lane filter: interactive requests, or batch jobs' lines.
LANES = ("interactive", "batch")
POINT_S = 10
#: A sparkline's box, in CSS pixels.
SPARK_WIDTH, SPARK_HEIGHT = 120, 24
#: What the special series keys stand for.
POOL_LABELS = {CACHE_POOL: "response cache", NO_POOL: "no pool (refused before placement)"}


# --- the summary (``/admin/api/activity`` and the Overview) -----------------------------------------------------

def summary(activity: Activity, window_s: float = 300, now: float | None = None, point_s: int = 10) -> dict[str, Any]:
    """Per pool and in total, over the last ``window_s`` seconds (at most ``HORIZON_S``).

    Returns:
        ``{"window_s", "point_s", "since", "now", "pools": [row, ...], "total": row}``, pools by
        name; a row is ``{"pool", "requests", "ok", "errors", "shed", "limited", "fallbacks",
        "cache_hits", "cache_misses", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "error_rate",
        "shed_rate", "limited_rate", "fallback_rate", "cache_hit_rate", "cache_lookups", "batch_lines",
        "batch_ok", "series"}``: interactive requests (batch lines are counted apart, in ``batch_lines``),
        TTFT over streamed requests only. Rates are fractions (None with no requests;
        ``cache_hit_rate`` None with no lookups, ``cache_lookups`` its base), TTFT None with no samples
        (nearest-rank percentiles: always a time that was observed). ``series``
        holds ``requests_per_s`` and ``ttft_p50_ms``, one value per ``point_s`` seconds, oldest
        first (the oldest point may be shorter); the newest includes the current second.
    """
    window = activity.window(window_s, now, point_s)
    rows: list[dict[str, Any]] = []
    total, total_points = Tally(), [Tally() for _ in window.lengths]
    for name, (tally, per_point) in window.pools.items():
        total.add(tally)
        for mine, theirs in zip(per_point, total_points, strict=True):
            theirs.add(mine)
        rows.append(_row(name, tally, per_point, window.lengths, window.span))
    return {"window_s": window.seconds, "point_s": window.point_s, "since": utc_iso(window.first),
            "now": utc_iso(window.now), "pools": rows,
            "total": _row("total", total, total_points, window.lengths, window.span)}


def _ttft_ms(samples: list[float], q: float, *, ordered: bool = False) -> float | None:
    return to_ms(percentile(samples, q, method="nearest", ordered=ordered))


def _row(name: str, tally: Tally, per_point: list[Tally], lengths: list[int], span: float) -> dict[str, Any]:
    n = tally.requests
    samples = sorted(tally.ttft)

    def rate(count: int, of: int = n) -> float | None:
        return round(count / of, 4) if of else None

    return {
        "pool": name, "requests": n, "ok": tally.ok, "errors": tally.errors, "shed": tally.shed,
        "limited": tally.limited, "fallbacks": tally.fallbacks, "cache_hits": tally.hits,
        "cache_misses": tally.misses,
        "requests_per_s": round(n / span, 3),
        "ttft_p50_ms": _ttft_ms(samples, 50, ordered=True), "ttft_p99_ms": _ttft_ms(samples, 99, ordered=True),
        "error_rate": rate(tally.errors), "shed_rate": rate(tally.shed), "limited_rate": rate(tally.limited),
        "fallback_rate": rate(tally.fallbacks), "cache_hit_rate": rate(tally.hits, tally.hits + tally.misses),
        "cache_lookups": tally.hits + tally.misses, "batch_lines": tally.batch, "batch_ok": tally.batch_ok,
        "series": {
            "requests_per_s": [round(p.requests / length, 3) for p, length in zip(per_point, lengths, strict=True)],
            "ttft_p50_ms": [_ttft_ms(p.ttft, 50) for p in per_point],
        },
    }


# --- the Overview's traffic table ------------------------------------------------------------------------------

def sparkline_points(values: list[float | None], width: int, height: int) -> str:
    """The ``points`` of an SVG ``<polyline>`` drawing ``values`` in a ``width`` x ``height`` box.

    The values spread evenly from x=0 (the first) to x=width (the last); y runs from the bottom
    (0, or the least value if negative) to the top (the greatest value); all zeros lie on the
    bottom edge. A None (no data) is left out, so the line joins its neighbours across the gap;
    no values at all give ``""``.
    """
    present = [(i, v) for i, v in enumerate(values) if v is not None]
    if not present:
        return ""
    low = min(0.0, *(v for _, v in present))
    high = max(v for _, v in present)
    spread = high - low
    step = width / (len(values) - 1) if len(values) > 1 else 0.0
    return " ".join(f"{trimmed(i * step)},{trimmed(height - ((v - low) / spread * height if spread else 0.0))}"
                    for i, v in present)


def _sparkline(values: list[float | None], what: str, fmt: Callable[[float | None], str]) -> dict[str, Any]:
    """An SVG polyline of ``values``, its newest point (marked with a dot) and a sentence that says what it
    shows."""
    present = [v for v in values if v is not None]
    window = f"over the last {WINDOW_S // 60} minutes, one point per {POINT_S} seconds"
    if present:
        label = f"{what} {window}: latest {fmt(present[-1])}, peak {fmt(max(present))}"
    else:
        label = f"{what} {window}: no data"
    points = sparkline_points(values, SPARK_WIDTH, SPARK_HEIGHT)
    last_x, _, last_y = points.rpartition(" ")[2].partition(",")
    # Hover values: each point with what it was and when (a title per point); the scale beside the line.
    present_at = [i for i, v in enumerate(values) if v is not None]
    hover = [{"x": x, "y": y, "title": f"{_ago((len(values) - 1 - i) * POINT_S)}: {fmt(values[i])}"}
             for i, (x, _, y) in zip(present_at, (p.partition(",") for p in points.split()), strict=True)]
    scale = f"peak {fmt(max(present))}" if present else ""
    return {"points": points, "label": label, "last_x": last_x, "last_y": last_y, "hover": hover, "scale": scale}


def _ago(seconds: int) -> str:
    """``now``, ``40 s ago``, ``2 min 10 s ago``."""
    if seconds <= 0:
        return "now"
    minutes, secs = divmod(seconds, 60)
    return (f"{minutes} min {secs} s ago" if secs else f"{minutes} min ago") if minutes else f"{secs} s ago"


def _stat_row(name: str, region: str | None, row: dict[str, Any] | None,
              endpoints: tuple[int, int] | None = None) -> dict[str, Any]:
    """One row of the traffic table (``row``: the summary's, None when the pool saw no requests)."""
    found = row or {}
    series = found.get("series") or {}
    return {
        "pool": name,
        "label": POOL_LABELS.get(name, name),
        "region": region,
        "endpoints": endpoints,
        "requests": found.get("requests", 0),
        "rps": per_second(found.get("requests_per_s"), missing=DASH) if row else DASH,
        "ttft_p50": millis(found.get("ttft_p50_ms"), missing=DASH),
        "ttft_p99": millis(found.get("ttft_p99_ms"), missing=DASH),
        "error_rate": percent(found.get("error_rate"), missing=DASH),
        "shed_rate": percent(found.get("shed_rate"), missing=DASH),
        "limited_rate": percent(found.get("limited_rate"), missing=DASH),
        "fallback_rate": percent(found.get("fallback_rate"), missing=DASH),
        "cache_hit_rate": percent(found.get("cache_hit_rate"), missing=DASH),
        "cache_lookups": found.get("cache_lookups", 0),
        "batch_lines": found.get("batch_lines", 0), "batch_ok": found.get("batch_ok", 0),
        "spark_rps": _sparkline(series.get("requests_per_s", []), "Requests per second", per_second),
        "spark_ttft": _sparkline(series.get("ttft_p50_ms", []), "Median time to first byte", millis),
    }


def live_stats(activity: Activity, regions: list[dict[str, Any]]) -> dict[str, Any]:
    """The traffic of the last :data:`WINDOW_S` seconds: totals, and a row per pool of the policy (in
    region order) then the response cache, refusals before placement and pools no longer in the policy."""
    found = summary(activity, window_s=WINDOW_S, point_s=POINT_S)
    by_pool = {row["pool"]: row for row in found["pools"]}
    rows = []
    for region in regions:
        for pool in region["pools"]:
            eps = pool["endpoints"]
            rows.append(_stat_row(pool["name"], region["name"], by_pool.pop(pool["name"], None),
                                  (sum(1 for e in eps if e["healthy"]), len(eps))))
    rows += [_stat_row(name, None, row) for name, row in by_pool.items()]
    total = found["total"]
    # The window's start, or this process's if it is younger than the window.
    since = max(time.time() - found["window_s"], activity.started)
    return {"window_s": found["window_s"], "point_s": found["point_s"], "since": utc_iso(since, "seconds"),
            "requests": total["requests"], "total": _stat_row("total", None, total), "pools": rows}


# --- the Requests page's filter -------------------------------------------------------------------------------

def status_filter(status: str) -> Callable[[RequestRecord], bool]:
    """A test of a record's ``status``: a code (``429``), a class (``4xx``) or an outcome (``shed``).

    Raises:
        ValueError: ``status`` is none of those.
    """
    text = status.strip().lower()
    if text in OUTCOMES:
        return lambda r: r.outcome == text
    if len(text) == 3 and text[0] in "12345" and text[1:] == "xx":
        family = int(text[0])
        return lambda r: r.status is not None and r.status // 100 == family
    if text.isdigit() and len(text) == 3:
        code = int(text)
        return lambda r: r.status == code
    raise ValueError(f"status must be a code (429), a class (4xx) or one of {', '.join(sorted(OUTCOMES))}; "
                     f"got {status!r}")


def recent_requests(activity: Activity, tenant: str | None = None, model: str | None = None,
                    status: str | None = None, limit: int = 100, lane: str | None = None) -> list[RequestRecord]:
    """The newest finished requests first, at most ``limit`` (:meth:`Activity.recent` with a status filter).

    Args:
        activity: This process's activity.
        tenant: A tenant's name or id.
        model: The model asked for, resolved to or served by.
        status: An exact status (``"429"``), a class (``"5xx"``) or an outcome (``"shed"``).
        limit: At most this many.
        lane: ``interactive`` or ``batch`` (batch jobs' lines) only; None: both.

    Raises:
        ValueError: ``status`` is none of those, or ``lane`` neither lane.
    """
    if lane not in (None, *LANES):
        raise ValueError(f"lane must be interactive or batch; got {lane!r}")
    return activity.recent(tenant, model, status_filter(status) if status else None, limit, lane=lane)
