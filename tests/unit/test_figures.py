"""The shared figures: one percentile (numpy's linear method, to the bit, and the nearest rank) and the formatters."""

from __future__ import annotations

import random

import numpy as np
import pytest

from switchyard import figures
from switchyard.figures import (
    DASH,
    duration,
    fixed,
    millis,
    per_second,
    percent,
    percentile,
    ratio,
    significant_ms,
    to_ms,
    trimmed,
    utc_iso,
)


def test_linear_percentile_is_numpys_to_the_bit() -> None:
    rng = random.Random(7)
    for n in (1, 2, 3, 7, 10, 101, 1000):
        values = [rng.lognormvariate(0, 2) for _ in range(n)]
        shuffled = rng.sample(values, n)
        ordered = np.sort(np.asarray(values))
        for q in (0, 0.1, 1, 25, 50, 66.6, 90, 99, 99.9, 100):
            expected = float(np.percentile(np.asarray(values), q))
            assert percentile(shuffled, q) == expected, (n, q)
            assert percentile(ordered, q, ordered=True) == expected, (n, q)


def test_linear_percentile_on_known_inputs() -> None:
    assert percentile([4, 1, 3, 2], 50) == 2.5  # unsorted input is sorted first
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile((5,), 99) == 5.0
    assert percentile([], 50) is None


def test_nearest_rank_percentile() -> None:
    assert percentile([], 50, method="nearest") is None
    assert percentile([3.0], 99, method="nearest") == 3.0
    values = [float(v) for v in range(1, 101)]
    assert [percentile(values, q, method="nearest", ordered=True) for q in (50, 99, 100)] == [50.0, 99.0, 100.0]
    assert percentile([0.3, 0.1, 0.2], 50, method="nearest") == 0.2


def test_fixed_point_figures() -> None:
    assert fixed(None) == "-" and fixed(None, missing="unlimited") == "unlimited"
    assert fixed(0.01234, scale=1000, decimals=1, unit=" ms") == "12.3 ms"
    assert fixed(12345.678, decimals=2, grouped=True) == "12,345.68"
    assert fixed(3, decimals=0) == "3"
    assert percent(0.1234) == "12.3%" and percent(None) == "-" and percent(None, missing=DASH) == DASH
    assert percent(0.5, decimals=0) == "50%"


def test_named_rules() -> None:
    assert (ratio(None), ratio(1.234), ratio(0.0032), ratio(0.0)) == ("-", "1.23x", "0.0032x", "0.00x")
    assert (millis(None, missing=DASH), millis(12.34), millis(1.234)) == (DASH, "12 ms", "1.2 ms")
    assert [per_second(v) for v in (None, 0.0, 123.4, 12.34, 1.234, 0.001234)] == \
        ["-", "0", "123", "12.3", "1.23", "0.001"]
    assert [significant_ms(v) for v in (float("nan"), 1.5, 0.0123, 0.0, 1e-6)] == \
        ["n/a", "1,500 ms", "12.3 ms", "0 ms", "1.00e-03 ms"]
    assert [duration(v) for v in (None, 600, 3600, 90, 0.25, 1.5, 86400)] == \
        ["-", "10m", "1h", "90s", "250ms", "1.5s", "1d"]
    assert [trimmed(v) for v in (0.0, 2.5, 2.0, 100.0, -0.01, 3.14159)] == ["0", "2.5", "2", "100", "0", "3.1"]
    assert (to_ms(None), to_ms(0.0123), to_ms(0.5)) == (None, 12.3, 500.0)
    assert utc_iso(1_800_000_000.0) == "2027-01-15T08:00:00.000Z"
    assert utc_iso(1_800_000_000.4, "seconds") == "2027-01-15T08:00:00Z"


def test_figures_is_a_leaf() -> None:
    """Every package (the simulator too) may import it: it imports nothing of switchyard, and only the
    standard library."""
    source = figures.__file__
    assert source is not None
    with open(source, encoding="utf-8") as f:
        imports = [line for line in f if line.startswith(("import ", "from "))]
    assert imports and all(line.split()[1].split(".")[0] in {"__future__", "math", "collections", "datetime",
                                                               "typing"} for line in imports), imports
