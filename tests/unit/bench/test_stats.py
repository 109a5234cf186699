"""Statistics on known inputs."""

from __future__ import annotations

import pytest

from switchyard.bench.results import Outcome, parse_route
from switchyard.bench.stats import (
    Slo,
    compare,
    goodput,
    group_by,
    percentiles,
    ratio,
    slo_attainment,
    summarize,
    summarize_groups,
    time_series,
)
from switchyard.figures import percentile
from tests.unit.bench.helpers import result


def test_percentiles_interpolate_linearly() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)  # rank 0.9 * 3 = 2.7
    assert percentile([5], 99) == 5
    assert percentile([], 50) is None
    assert percentiles([10, 20, 30, 40, 50], (0, 25, 100)) == {"p0": 10, "p25": 20, "p100": 50}
    assert percentiles([], (50, 99.9)) == {"p50": None, "p99.9": None}


def test_outcomes() -> None:
    assert result(status=200).outcome is Outcome.OK
    assert result(status=200, error_type="stream_truncated").outcome is Outcome.ERROR
    assert result(status=429).outcome is Outcome.LIMITED
    assert result(status=503).outcome is Outcome.SHED
    assert result(status=502).outcome is Outcome.ERROR
    assert result(status=0, error_type="connection_error").outcome is Outcome.ERROR
    assert result(status=0, timed_out=True).outcome is Outcome.TIMEOUT


def test_slo_attainment_counts_failures_as_misses() -> None:
    results = [result(0, ttft=0.1), result(1, ttft=0.3), result(2, status=503), result(3, status=0, timed_out=True)]
    assert slo_attainment(results, Slo(ttft_s=0.2)) == 0.25
    assert slo_attainment(results, None) == 0.5  # no threshold: success alone
    assert slo_attainment([], Slo(ttft_s=1)) is None


def test_slo_per_class_and_other_thresholds() -> None:
    results = [result(0, cls="critical", ttft=0.3), result(1, cls="batch", ttft=5.0),
               result(2, cls="standard", ttft=0.3, e2e=2.0)]
    slo = {"critical": Slo(ttft_s=0.5), "*": Slo(ttft_s=1.0)}
    assert slo_attainment(results, slo) == pytest.approx(2 / 3)  # batch falls under "*" and misses
    assert not Slo(e2e_s=1.0).met(results[2])
    # tpot: (e2e - ttft) / (tokens - 1) = (0.5 - 0.1) / 9
    assert Slo(tpot_s=0.05).met(result(tokens=10))
    assert not Slo(tpot_s=0.04).met(result(tokens=10))


def test_goodput_in_requests_and_tokens() -> None:
    results = [result(0, ttft=0.1, tokens=10), result(1, ttft=0.1, tokens=30), result(2, ttft=0.9, tokens=50),
               result(3, status=503)]
    rps, tps = goodput(results, Slo(ttft_s=0.5), window_s=4.0)
    assert rps == 0.5 and tps == 10.0
    assert goodput(results, Slo(ttft_s=0.5), window_s=0) == (0.0, 0.0)


def test_summary_rates_percentiles_and_tokens() -> None:
    results = [
        result(0, ttft=0.1, e2e=1.0, itl=(0.01, 0.03), late=0.001, prompt_tokens=100, cached_tokens=50),
        result(1, ttft=0.2, e2e=2.0, itl=(0.02,), late=0.003, prompt_tokens=100, cached_tokens=0,
               route="model=small; fallback_from=large; pool=p2"),
        result(2, ttft=0.3, e2e=3.0, route="model=m; pool=p1"),
        result(3, status=503, e2e=0.01),
        result(4, status=429, e2e=0.01),
        result(5, status=0, timed_out=True, e2e=10.0),
    ]
    s = summarize(results, slo=Slo(ttft_s=0.25), window_s=10.0)
    assert (s.count, s.ok, s.shed, s.limited, s.timeouts, s.errors) == (6, 3, 1, 1, 1, 0)
    assert s.ok_rate == 0.5 and s.shed_rate == pytest.approx(1 / 6)
    assert s.ttft_p50_s == pytest.approx(0.2) and s.ttft_mean_s == pytest.approx(0.2)
    assert s.e2e_p50_s == pytest.approx(2.0)
    assert s.itl_p50_s == pytest.approx(0.02)  # pooled gaps 0.01, 0.02, 0.03
    assert s.lateness_max_s == pytest.approx(0.003)
    assert s.slo_attainment == pytest.approx(2 / 6)
    assert s.goodput_rps == pytest.approx(0.2) and s.goodput_tps == pytest.approx(2.0)
    assert s.throughput_rps == pytest.approx(0.3) and s.output_tps == pytest.approx(3.0)
    assert s.offered_rps == pytest.approx(0.6)
    assert s.fallback_rate == pytest.approx(1 / 6)
    assert (s.prompt_tokens, s.cached_tokens, s.cached_fraction) == (200, 50, 0.25)
    empty = summarize([])
    assert empty.count == 0 and empty.ttft_p99_s is None and empty.ok_rate is None


def test_route_header_and_groups() -> None:
    assert parse_route("model=small; route=auto; fallback_from=large; pool=p; attempt=2") == {
        "model": "small", "route": "auto", "fallback_from": "large", "pool": "p", "attempt": "2"}
    results = [result(0, arm="x", cls="a", route="model=s; pool=p1"), result(1, arm="x", cls="b"),
               result(2, arm="y", cls="a", route="model=s; pool=p1; attempt=2")]
    assert list(group_by(results, "arm", "class")) == [("x", "a"), ("x", "b"), ("y", "a")]
    assert {k: len(v) for k, v in group_by(results, "pool").items()} == {("-",): 1, ("p1",): 2}
    assert results[2].fell_back and not results[0].fell_back
    summaries = summarize_groups(results, "arm", window_s=1.0)
    assert summaries[("x",)].count == 2 and summaries[("y",)].fallback_rate == 1.0
    with pytest.raises(KeyError):
        group_by(results, "nope")


def test_ratios() -> None:
    assert ratio(2.0, 4.0) == 0.5
    assert ratio(1.0, 0.0) is None and ratio(None, 1.0) is None and ratio(1.0, None) is None
    fast = summarize([result(0, ttft=0.1), result(1, ttft=0.1)], window_s=1.0)
    slow = summarize([result(0, ttft=0.4), result(1, status=503)], window_s=1.0)
    r = compare(fast, slow, ["ttft_p50_s", "ok_rate", "shed_rate", "count"])
    assert r == {"ttft_p50_s": pytest.approx(0.25), "ok_rate": 2.0, "shed_rate": 0.0, "count": 1.0}
    assert compare(slow, fast, ["shed_rate"]) == {"shed_rate": None}  # nothing to divide by


def test_time_series_bins() -> None:
    results = [
        # sent 0.5, done 2.5; 15 tokens spread over [1.0, 2.5]
        result(0, scheduled=0.5, ttft=0.5, e2e=2.0, tokens=15),
        result(1, scheduled=1.2, status=503, e2e=0.1),
        result(2, scheduled=2.2, ttft=0.3, e2e=0.3, route="model=m; fallback_from=x; pool=p", tokens=4),
        result(3, scheduled=2.6, status=0, timed_out=True, e2e=0.2),
    ]
    ts = time_series(results, bin_s=1.0)
    assert ts.t_s == [0.0, 1.0, 2.0]
    assert ts.sent == [1, 1, 2]
    assert ts.in_flight == pytest.approx([0.5, 1.1, 1.0])  # time-averaged per bin
    assert ts.throughput_rps == [0, 0, 2]
    assert ts.output_tps == pytest.approx([0.0, 10.0, 5.0 + 4.0])
    assert ts.shed == [0, 1, 0]
    assert ts.fallback == [0, 0, 1]
    assert ts.failed_by_status == {"503": [0, 1, 0], "timeout": [0, 0, 1]}
    assert sum(ts.output_tps) == pytest.approx(19.0)
    half = time_series(results, bin_s=0.5)
    assert len(half.t_s) == 6 and sum(half.sent) == 4
    with pytest.raises(ValueError, match="bin_s"):
        time_series(results, bin_s=0)
