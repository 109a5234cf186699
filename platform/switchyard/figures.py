"""Numbers for people: percentiles and formatting helpers shared by the console, the CLI, the replay report and
the bench.

One rule per kind of figure, so that a latency, a rate or a percentile reads the same wherever it is shown:

- :func:`percentile`: linear interpolation between the two nearest ranks (numpy's default, Hyndman & Fan
  type 7, computed as numpy computes it, so the bench's numpy helpers agree to the last bit) or the
  nearest rank (the console's: always a value that was observed). An empty sample has none (``None``,
  never ``NaN``, so reports stay valid JSON).
- :func:`fixed`: a value scaled (1000 for seconds shown as ms, 100 for a fraction shown as a percentage),
  with a fixed number of decimals, an optional unit and thousands separators, and a mark for no value
  (:data:`NO_VALUE` unless the caller names its own: the console shows :data:`DASH`).
  :func:`percent`, :func:`ratio`, :func:`millis`, :func:`per_second`, :func:`significant_ms`,
  :func:`duration` and :func:`trimmed` are the named rules built on the same idea.
- :func:`to_ms` and :func:`utc_iso`: seconds as milliseconds and epoch seconds as ISO 8601 text in the
  JSON the console and the admin API show.

Must not touch: anything of switchyard, or anything beyond the standard library. Every package may import
this module (the simulator too), so it stays a leaf.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Literal, Protocol, SupportsFloat

#: The console's mark for "no value" (an en dash).
DASH = "\u2013"
#: The bench reports' and the CLI's mark for "no value" (plain ASCII, for Markdown and terminals).
NO_VALUE = "-"

Method = Literal["linear", "nearest"]


class Sample(Protocol):
    """What :func:`percentile` reads: a list or tuple of numbers, or a one-dimensional numpy array."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int, /) -> SupportsFloat: ...
    def __iter__(self) -> Iterator[SupportsFloat]: ...


def percentile(values: Sample, q: float, *, method: Method = "linear", ordered: bool = False) -> float | None:
    """The ``q``-th percentile (0-100) of ``values``; None when there are none.

    Args:
        values: The sample.
        q: The percentile, 0 to 100.
        method: ``linear`` interpolates between the two nearest ranks at rank ``q/100 * (n - 1)`` (numpy's
            default, with numpy's arithmetic); ``nearest`` is the nearest-rank value, the
            ``ceil(q/100 * n)``-th smallest (always one of the values).
        ordered: ``values`` is already sorted ascending (skips a sort; the caller vouches for it).
    """
    n = len(values)
    if n == 0:
        return None
    ranked: Sample = values if ordered else sorted(map(float, values))
    if method == "nearest":
        rank = math.ceil(q / 100 * n)
        return float(ranked[min(max(rank, 1), n) - 1])
    # numpy's linear method: the virtual index, its floor, and its lerp (two forms, by the side of 0.5).
    index = (n - 1) * (q / 100)
    if index >= n - 1:
        return float(ranked[n - 1])
    if index < 0:
        return float(ranked[0])
    below = math.floor(index)
    gamma = index - below
    a, b = float(ranked[below]), float(ranked[below + 1])
    diff = b - a
    return b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma


def fixed(value: float | None, *, scale: float = 1.0, decimals: int = 1, unit: str = "", grouped: bool = False,
          missing: str = NO_VALUE) -> str:
    """``value`` times ``scale`` with ``decimals`` decimals, then ``unit``; ``missing`` for None.

    ``grouped`` puts thousands separators in (``12,345.6``).
    """
    if value is None:
        return missing
    return f"{value * scale:{',' if grouped else ''}.{decimals}f}{unit}"


def percent(fraction: float | None, *, decimals: int = 1, missing: str = NO_VALUE) -> str:
    """A fraction as a percentage (``0.1234`` -> ``12.3%``)."""
    return fixed(fraction, scale=100.0, decimals=decimals, unit="%", missing=missing)


def ratio(value: float | None, *, missing: str = NO_VALUE) -> str:
    """A ratio as ``1.23x`` (``0.0032x`` below 0.01, so that a small ratio does not read 0)."""
    if value is None:
        return missing
    if 0 < abs(value) < 0.01:
        return f"{value:.2g}x"
    return f"{value:.2f}x"


def millis(value_ms: float | None, *, missing: str = NO_VALUE) -> str:
    """A latency already in milliseconds: whole ms from 10 ms up, one decimal below."""
    if value_ms is None:
        return missing
    return f"{value_ms:.0f} ms" if value_ms >= 10 else f"{value_ms:.1f} ms"


def significant_ms(seconds: float) -> str:
    """Seconds as milliseconds with three significant figures (``n/a`` for a NaN or an infinity)."""
    if not math.isfinite(seconds):
        return "n/a"
    v = seconds * 1000
    if abs(v) >= 1000:
        return f"{v:,.0f} ms"
    return f"{v:.3g} ms" if abs(v) >= 0.01 or v == 0 else f"{v:.2e} ms"


def per_second(value: float | None, *, missing: str = NO_VALUE) -> str:
    """A rate per second with as many decimals as a small rate needs."""
    if value is None:
        return missing
    if value == 0:
        return "0"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}" if value >= 0.01 else f"{value:.3f}"


def duration(seconds: float | None, *, missing: str = NO_VALUE) -> str:
    """Seconds as the policy document would say them: ``10m``, ``1h``, ``90s``, ``250ms``."""
    if seconds is None:
        return missing
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds * 1000:g}ms" if seconds < 1 else f"{seconds:g}s"


def trimmed(value: float, decimals: int = 1) -> str:
    """``value`` with at most ``decimals`` decimals and no trailing zeros (``2.50`` -> ``2.5``, ``-0.0`` -> ``0``)."""
    text = f"{value:.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def to_ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds rounded to a tenth, for JSON shown to people (None stays None)."""
    return None if seconds is None else round(seconds * 1000, 1)


def utc_iso(epoch: float, timespec: str = "milliseconds") -> str:
    """Epoch seconds as UTC ISO 8601 text ending in ``Z`` (``2027-01-15T08:00:00.000Z``)."""
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec=timespec).replace("+00:00", "Z")


#: How people read a limit's name, everywhere the console and the command line show one.
LIMIT_LABELS = {"tokens_per_minute": "tokens per minute", "requests_per_minute": "requests per minute",
                "tokens_per_day": "tokens per day", "spend_per_month": "spend per month"}


def limit_label(name: str) -> str:
    """``tokens_per_minute`` as people read it (``tokens per minute``); other names with spaces for underscores."""
    return LIMIT_LABELS.get(name, name.replace("_", " "))


def limit_amount(name: str, value: float | None, *, missing: str = "—") -> str:
    """A limit's value for people: ``5,000,000 tokens``, ``400 requests``, ``$12.50``."""
    if value is None:
        return missing
    if name.startswith("spend"):
        return f"${value:,.2f}" if value >= 1 else f"${value:.4g}"
    unit = "requests" if name.startswith("requests") else "tokens"
    return f"{value:,.0f} {unit}"
