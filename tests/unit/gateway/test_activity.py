"""The gateway's recent-activity recorder: per-second buckets, summaries, the recent-requests ring, sparklines."""

from __future__ import annotations

from typing import Any

import pytest

from switchyard.gateway.activity import (
    HORIZON_S,
    TTFT_SAMPLES,
    Activity,
    RequestRecord,
    outcome_of,
    percentile,
    sparkline_points,
)

T0 = 1_800_000_000.0  # a whole second, so bucket arithmetic in the tests is plain


def finish(activity: Activity, at: float, status: int = 200, *, pool: str | None = "small-us",
           ttft: float | None = None, rid: str = "r", **fields: Any) -> RequestRecord:
    record = activity.begin(rid, "chat", started=0.0, now=at)
    record.pool = pool
    record.ttft_s = ttft
    record.duration_s = 0.5
    for name, value in fields.items():
        setattr(record, name, value)
    activity.finish(record, status, now=at)
    return record


def rows(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["pool"]: row for row in summary["pools"]}


@pytest.mark.parametrize(("status", "shed", "broken", "outcome"), [
    (200, False, False, "ok"), (200, False, True, "error"), (503, True, False, "shed"), (503, False, False, "error"),
    (502, False, False, "error"), (429, False, False, "limited"), (400, False, False, "refused"),
    (404, False, False, "refused"), (499, False, False, "client_closed"),
])
def test_outcomes(status: int, shed: bool, broken: bool, outcome: str) -> None:
    assert outcome_of(status, shed=shed, broken=broken) == outcome


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

    summary = activity.summary(window_s=60, now=T0 + 9.5)
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
    later = rows(activity.summary(window_s=3, now=T0 + 9))["small-us"]  # seconds 7, 8, 9
    assert later["requests"] == 3 and later["ttft_p50_ms"] == 90.0


def test_rate_of_a_young_process_counts_only_its_life() -> None:
    activity = Activity(started=T0)
    for i in range(20):
        finish(activity, T0 + i / 2)
    assert activity.summary(window_s=300, now=T0 + 10)["total"]["requests_per_s"] == 2.0


def test_sparkline_series_aggregate_points() -> None:
    activity = Activity(started=T0 - 10_000)
    # Window of 30 s ending at second T0+29: points [T0, T0+9], [T0+10, T0+19], [T0+20, T0+29].
    for _ in range(20):
        finish(activity, T0 + 2, ttft=0.05)
    finish(activity, T0 + 25, ttft=0.5)
    finish(activity, T0 + 29, ttft=0.7)
    series = rows(activity.summary(window_s=30, now=T0 + 29.2, point_s=10))["small-us"]["series"]
    assert series["requests_per_s"] == [2.0, 0.0, 0.2]
    assert series["ttft_p50_ms"] == [50.0, None, 500.0]
    # A window that is not a whole number of points: the oldest point is the short one.
    odd = rows(activity.summary(window_s=25, now=T0 + 29.2, point_s=10))["small-us"]["series"]
    assert len(odd["requests_per_s"]) == 3 and odd["requests_per_s"][0] == 0.0  # seconds T0+5..T0+9
    assert odd["requests_per_s"][2] == 0.2


def test_buckets_roll_over_and_expire() -> None:
    activity = Activity(started=T0 - 10_000)
    finish(activity, T0, ttft=0.1)
    finish(activity, T0 + 5, ttft=0.2)
    assert activity.summary(window_s=HORIZON_S, now=T0 + HORIZON_S - 1)["total"]["requests"] == 2
    assert activity.summary(window_s=HORIZON_S, now=T0 + HORIZON_S)["total"]["requests"] == 1, \
        "a bucket a horizon old is out of every window"
    # The same slot as T0's, a horizon later: the old second's counts and samples are gone, not added to.
    finish(activity, T0 + HORIZON_S, ttft=0.9)
    row = activity.summary(window_s=HORIZON_S, now=T0 + HORIZON_S)["total"]
    assert (row["requests"], row["ttft_p50_ms"], row["ttft_p99_ms"]) == (2, 200.0, 900.0)
    # Windows are capped at the horizon; a pool quiet for the whole horizon leaves the summary.
    assert activity.summary(window_s=10 * HORIZON_S, now=T0 + HORIZON_S)["window_s"] == HORIZON_S
    assert activity.summary(now=T0 + 3 * HORIZON_S)["pools"] == []
    assert "small-us" not in activity._series


def test_ttft_samples_per_bucket_are_capped() -> None:
    activity = Activity(started=T0 - 10_000, seed=1)
    for i in range(TTFT_SAMPLES * 4):
        finish(activity, T0 + 0.5, ttft=i / 1000)
    series = activity._series["small-us"]
    bucket = series.bucket(int(T0))
    assert len(bucket.ttft) == TTFT_SAMPLES and bucket.ttft_seen == TTFT_SAMPLES * 4
    # A uniform sample: its median lies near the true one (255.5 ms), not among the first 128 values.
    p50 = rows(activity.summary(window_s=10, now=T0 + 1))["small-us"]["ttft_p50_ms"]
    assert 150 < p50 < 360


def test_percentile_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (50.0, 99.0, 100.0)


def test_the_ring_is_bounded_and_newest_first() -> None:
    activity = Activity(recent=5)
    for i in range(12):
        finish(activity, T0 + i, rid=f"r{i}")
    assert [r.request_id for r in activity.recent()] == ["r11", "r10", "r9", "r8", "r7"]
    assert activity.recent(limit=2)[-1].request_id == "r10"
    assert activity.get("r3") is None and activity.get("r9") is not None


def test_a_record_is_kept_once() -> None:
    activity = Activity()
    record = finish(activity, T0, 502)
    activity.finish(record, 500, now=T0)
    assert [r.status for r in activity.recent()] == [502]
    assert activity.summary(now=T0)["total"]["requests"] == 1


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
        return [r.request_id for r in activity.recent(**kwargs)]

    assert ids(tenant="acme") == ["b", "a"] and ids(tenant="8") == ["d", "c"]
    assert ids(model="small") == ["d", "c", "a"], "asked, resolved or served"
    assert ids(model="auto", tenant="other") == ["d"]
    assert ids(status="429") == ["b"] and ids(status="5xx") == ["d", "c"] and ids(status="4XX") == ["e", "b"]
    assert ids(status="2xx") == ["a"] and ids(status="shed") == ["c"] and ids(status="error") == ["d"]
    assert ids(status="500") == []
    for bad in ("abc", "6xx", "42", "x29"):
        with pytest.raises(ValueError, match="status must be"):
            activity.recent(status=bad)


def test_record_json_has_no_secrets_and_is_plain() -> None:
    activity = Activity()
    record = finish(activity, T0, 200, rid="req-1", tenant="acme", tenant_id=1, key_id=2, tier="free",
                    model="small", ttft=0.0123, prompt_tokens=5, completion_tokens=7, cached_tokens=0,
                    moved_on=["http://x 503"], trace=["model small requested directly"])
    data = record.as_dict()
    assert data["time"] == "2027-01-15T08:00:00.000Z"
    assert data["ttft_ms"] == 12.3 and data["duration_ms"] == 500.0 and data["outcome"] == "ok"
    assert data["status"] == 200 and data["cache"] == "none" and data["moved_on"] == ["http://x 503"]
    assert not {"started", "shed", "broken", "authorization", "api_key", "prompt", "messages"} & set(data)


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
    assert sparkline_points(values, width, height) == points
