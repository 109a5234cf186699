"""What the console shows of the recent activity: summaries over a window, sparkline series and points, the
status filter."""

from __future__ import annotations

from typing import Any

import pytest

from switchyard.admin import overview
from switchyard.gateway.activity import HORIZON_S, Activity
from tests.unit.gateway.helpers import T0, finish, rows


def test_rates_and_percentiles_over_the_window() -> None:
    activity = Activity(started=T0 - 10_000)
    for i in range(10):  # TTFTs of 10, 20, ... 100 ms, one second apart
        finish(activity, T0 + i, ttft=(i + 1) / 100, rid=f"ok{i}")
    finish(activity, T0 + 3, 502, moved_on=["http://a connect_error"])
    finish(activity, T0 + 3, 503, pool=None, shed=True)
    finish(activity, T0 + 4, 429, pool=None)
    finish(activity, T0 + 5, 200, pool="cache", cache="hit", ttft=0.001)
    finish(activity, T0 + 5, 200, ttft=0.2, cache="miss", moved_on=["http://a 503"])
    finish(activity, T0 + 6, 200, cache="error", ttft=0.3)

    summary = overview.summary(activity, window_s=60, now=T0 + 9.5)
    by_pool = rows(summary)
    assert set(by_pool) == {"small-us", "-", "cache"}
    small = by_pool["small-us"]
    assert (small["requests"], small["ok"], small["errors"], small["fallbacks"]) == (13, 12, 1, 2)
    assert small["requests_per_s"] == round(13 / 60, 3)
    assert small["error_rate"] == round(1 / 13, 4) and small["fallback_rate"] == round(2 / 13, 4)
    assert small["cache_hit_rate"] == 0.0 and small["cache_misses"] == 2  # an error lookup counts as a miss
    # 12 samples: 10..100 ms, 200, 300: nearest-rank p50 is the 6th, p99 the 12th.
    assert small["ttft_p50_ms"] == 60.0 and small["ttft_p99_ms"] == 300.0
    refused = by_pool["-"]
    assert (refused["shed"], refused["limited"], refused["shed_rate"], refused["limited_rate"]) == (1, 1, 0.5, 0.5)
    assert refused["ttft_p50_ms"] is None and refused["cache_hit_rate"] is None
    total = summary["total"]
    assert total["requests"] == 16 and total["cache_hits"] == 1 and total["cache_misses"] == 2
    assert total["cache_hit_rate"] == round(1 / 3, 4)
    assert total["shed_rate"] == round(1 / 16, 4) and total["errors"] == 1
    assert total["ttft_p50_ms"] == 60.0 and total["ttft_p99_ms"] == 300.0  # 13 samples with the 1 ms hit
    assert summary["window_s"] == 60 and summary["since"].endswith("Z")

    # A window that starts after the first requests leaves them out.
    later = rows(overview.summary(activity, window_s=3, now=T0 + 9))["small-us"]  # seconds 7, 8, 9
    assert later["requests"] == 3 and later["ttft_p50_ms"] == 90.0


def test_rate_of_a_young_process_counts_only_its_life() -> None:
    activity = Activity(started=T0)
    for i in range(20):
        finish(activity, T0 + i / 2)
    assert overview.summary(activity, window_s=300, now=T0 + 10)["total"]["requests_per_s"] == 2.0


def test_sparkline_series_aggregate_points() -> None:
    activity = Activity(started=T0 - 10_000)
    # Window of 30 s ending at second T0+29: points [T0, T0+9], [T0+10, T0+19], [T0+20, T0+29].
    for _ in range(20):
        finish(activity, T0 + 2, ttft=0.05)
    finish(activity, T0 + 25, ttft=0.5)
    finish(activity, T0 + 29, ttft=0.7)
    series = rows(overview.summary(activity, window_s=30, now=T0 + 29.2, point_s=10))["small-us"]["series"]
    assert series["requests_per_s"] == [2.0, 0.0, 0.2]
    assert series["ttft_p50_ms"] == [50.0, None, 500.0]
    # A window that is not a whole number of points: the oldest point is the short one.
    odd = rows(overview.summary(activity, window_s=25, now=T0 + 29.2, point_s=10))["small-us"]["series"]
    assert len(odd["requests_per_s"]) == 3 and odd["requests_per_s"][0] == 0.0  # seconds T0+5..T0+9
    assert odd["requests_per_s"][2] == 0.2


def test_buckets_roll_over_and_expire() -> None:
    activity = Activity(started=T0 - 10_000)
    finish(activity, T0, ttft=0.1)
    finish(activity, T0 + 5, ttft=0.2)
    assert overview.summary(activity, window_s=HORIZON_S, now=T0 + HORIZON_S - 1)["total"]["requests"] == 2
    assert overview.summary(activity, window_s=HORIZON_S, now=T0 + HORIZON_S)["total"]["requests"] == 1, \
        "a bucket a horizon old is out of every window"
    # The same slot as T0's, a horizon later: the old second's counts and samples are gone, not added to.
    finish(activity, T0 + HORIZON_S, ttft=0.9)
    row = overview.summary(activity, window_s=HORIZON_S, now=T0 + HORIZON_S)["total"]
    assert (row["requests"], row["ttft_p50_ms"], row["ttft_p99_ms"]) == (2, 200.0, 900.0)
    # Windows are capped at the horizon; a pool quiet for the whole horizon leaves the summary.
    assert overview.summary(activity, window_s=10 * HORIZON_S, now=T0 + HORIZON_S)["window_s"] == HORIZON_S
    assert overview.summary(activity, now=T0 + 3 * HORIZON_S)["pools"] == []
    assert "small-us" not in activity._series


def test_filters() -> None:
    activity = Activity()
    finish(activity, T0, 200, rid="a", tenant="acme", tenant_id=7, model="auto", resolved_model="small",
           served_model="small")
    finish(activity, T0, 429, rid="b", tenant="acme", tenant_id=7, model="large", resolved_model="large")
    finish(activity, T0, 503, rid="c", tenant="other", tenant_id=8, model="small", shed=True)
    finish(activity, T0, 502, rid="d", tenant="other", tenant_id=8, model="auto", resolved_model="medium",
           served_model="small")
    finish(activity, T0, 404, rid="e", model="nope")

    def ids(**kwargs: Any) -> list[str]:
        return [r.request_id for r in overview.recent_requests(activity, **kwargs)]

    assert ids(tenant="acme") == ["b", "a"] and ids(tenant="8") == ["d", "c"]
    assert ids(model="small") == ["d", "c", "a"], "asked, resolved or served"
    assert ids(model="auto", tenant="other") == ["d"]
    assert ids(status="429") == ["b"] and ids(status="5xx") == ["d", "c"] and ids(status="4XX") == ["e", "b"]
    assert ids(status="2xx") == ["a"] and ids(status="shed") == ["c"] and ids(status="error") == ["d"]
    assert ids(status="500") == []
    for bad in ("abc", "6xx", "42", "x29"):
        with pytest.raises(ValueError, match="status must be"):
            overview.recent_requests(activity, status=bad)


@pytest.mark.parametrize(("values", "width", "height", "points"), [
    ([], 100, 20, ""),
    ([None, None], 100, 20, ""),
    ([0.0, 5.0, 10.0], 100, 20, "0,20 50,10 100,0"),
    ([0.0, 0.0], 10, 4, "0,4 10,4"),
    ([2.0, None, 4.0, 1.0], 30, 10, "0,5 20,0 30,7.5"),
    ([7.0], 60, 10, "0,0"),
    ([1.0, 2.0, 3.0], 7, 3, "0,2 3.5,1 7,0"),
])
def test_sparkline_points(values: list[float | None], width: int, height: int, points: str) -> None:
    assert overview.sparkline_points(values, width, height) == points


def test_a_sparkline_has_a_scale_and_a_value_to_hover_at_each_point() -> None:
    from switchyard.admin.overview import _sparkline
    from switchyard.figures import per_second

    spark = _sparkline([1.0, None, 3.0, 2.0], "Requests per second", per_second)
    assert spark["scale"] == f"peak {per_second(3.0)}"
    assert [p["title"] for p in spark["hover"]] == [f"30 s ago: {per_second(1.0)}", f"10 s ago: {per_second(3.0)}",
                                                    f"now: {per_second(2.0)}"]
    assert [(p["x"], p["y"]) for p in spark["hover"]] == [tuple(p.split(",")) for p in spark["points"].split()]
    assert _sparkline([None, None], "x", per_second)["hover"] == []
