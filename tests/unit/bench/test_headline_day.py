"""The headline scenario's day: the Azure conversation trace's shape, scaled onto capacity, with the Mooncake
conversation trace's lengths and shared prefixes, one tenant per conversation."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest

from switchyard.bench.scenarios.headline.day import (
    DAY_TRACE,
    PEAK,
    TROUGH,
    Tenant,
    arrival_curve,
    day,
    day_arrivals,
    load_at,
    load_shape,
    tenant_of_groups,
)
from switchyard.bench.spec import WorkloadError

TENANTS = (Tenant("acme", "enterprise", 0.2), Tenant("shop", "pro", 0.5), Tenant("hobby", "free", 0.3))
CLASSES = {"enterprise": "critical", "pro": "standard", "free": "sheddable"}


def test_the_day_trace_ships_with_its_attribution() -> None:
    assert DAY_TRACE.is_file() and "shared" not in DAY_TRACE.parts
    notes = (DAY_TRACE.parent / "README.md").read_text()
    assert "azure2023_conv.csv" in notes and "Splitwise" in notes and "CC-BY 4.0" in notes


def test_the_curve_is_the_traces_hour_per_minute_with_its_midday_hump() -> None:
    curve = arrival_curve()
    # 19,366 requests over 58 min 21 s: 58 whole minutes (the last, cut short, is left out).
    assert len(curve) == 58
    assert 250 < sum(curve) / len(curve) < 400  # about 330 a minute
    busiest = int(np.argmax(curve))
    assert 20 <= busiest <= 40, curve  # the hump is in the middle of the hour
    assert max(curve) > 1.7 * min(curve)
    # Smoothing: no minute-to-minute jump of more than a fifth of the mean.
    assert max(abs(a - b) for a, b in itertools.pairwise(curve)) < 0.2 * sum(curve) / len(curve)


def test_the_curve_counts_whole_bins_and_averages_them(tmp_path: Path) -> None:
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    # 2 requests in the first minute, 4 in the second, 6 in the third, 1 at the start of a fourth (cut short).
    for minute, count in enumerate((2, 4, 6, 1)):
        rows += [f"2023-11-16 18:{minute:02d}:{10 + i:02d}.0000000,10,10" for i in range(count)]
    path = tmp_path / "t.csv"
    path.write_text("\n".join(rows) + "\n")
    assert arrival_curve(path, smooth_bins=1) == [2.0, 4.0, 6.0]
    assert arrival_curve(path, smooth_bins=3) == [3.0, 4.0, 5.0]
    with pytest.raises(WorkloadError):
        arrival_curve(path, smooth_bins=0)


def test_the_shape_runs_from_the_trough_to_the_peak() -> None:
    shape = load_shape([10.0, 30.0, 20.0])
    assert shape == [TROUGH, PEAK, pytest.approx((TROUGH + PEAK) / 2)]
    assert load_shape([5.0, 5.0], peak=1.2) == [1.2, 1.2]
    with pytest.raises(WorkloadError):
        load_shape([1.0, 2.0], peak=0.5, trough=1.0)
    # Stretched over a day of 100 s: bin centres at 25 s and 75 s, linear between, flat outside.
    assert load_at([1.0, 2.0], 25.0, 100.0) == 1.0
    assert load_at([1.0, 2.0], 50.0, 100.0) == pytest.approx(1.5)
    assert load_at([1.0, 2.0], 99.0, 100.0) == 2.0


def test_arrivals_follow_the_shape() -> None:
    shape = [0.3, 1.5, 0.3]
    times = day_arrivals(shape, 100.0, 30.0, np.random.default_rng(1))
    assert np.all(np.diff(times) >= 0) and times[0] >= 0 and times[-1] < 30.0
    expected = sum(100.0 * load_at(shape, t, 30.0) for t in np.arange(0.005, 30.0, 0.01)) * 0.01
    assert abs(len(times) - expected) < 4 * expected ** 0.5  # a Poisson count: within four deviations
    first, middle = np.sum(times < 2.0), np.sum((times >= 14.0) & (times < 16.0))
    assert middle > 3 * first  # 1.5x capacity in the middle, 0.3x at the start


def test_a_conversation_belongs_to_one_tenant_and_the_shares_hold() -> None:
    groups = [f"g{i % 2000}" for i in range(6000)] + [None, None]
    owners = tenant_of_groups(groups, TENANTS, np.random.default_rng(5))
    assert set(owners) == set(groups)
    counts = Counter(owners[f"g{i}"].name for i in range(2000))
    for tenant in TENANTS:
        assert abs(counts[tenant.name] / 2000 - tenant.share) < 0.05, counts
    with pytest.raises(WorkloadError):
        tenant_of_groups(groups, (), np.random.default_rng(5))


def test_the_day_is_the_mooncake_rows_on_the_days_arrivals() -> None:
    kwargs = {"tenants": TENANTS, "class_of_tier": CLASSES, "model": "auto", "token_scale": 0.05,
              "max_model_len": 4096}
    workload = day(8.0, 60.0, 3, **kwargs)
    again = day(8.0, 60.0, 3, **kwargs)
    assert [(s.arrival_s, s.prompt_tokens, s.max_tokens, s.tenant) for s in workload.specs] == \
        [(s.arrival_s, s.prompt_tokens, s.max_tokens, s.tenant) for s in again.specs]
    assert workload.duration_s == 60.0 and 200 < len(workload) < 800
    arrivals = [s.arrival_s for s in workload.specs]
    assert arrivals == sorted(arrivals) and [s.index for s in workload.specs] == list(range(len(workload)))
    by_group: dict[str | None, set[str]] = defaultdict(set)
    for spec in workload.specs:
        assert spec.model == "auto" and spec.stream and spec.labels.extra_body.get("ignore_eos") is True
        assert spec.request_class == CLASSES[next(t.tier for t in TENANTS if t.name == spec.tenant)]
        by_group[spec.prefix_group].add(spec.tenant)
        assert spec.prompt_tokens + spec.max_tokens <= 4096
    assert all(len(owners) == 1 for group, owners in by_group.items() if group is not None)
    assert any(count > 1 for count in Counter(s.prefix_group for s in workload.specs).values())  # shared prefixes
    # The scaled lengths of the trace (Mooncake: about 12,000 prompt and 340 answer tokens on average).
    mean_prompt = sum(s.prompt_tokens for s in workload.specs) / len(workload)
    assert 200 < mean_prompt < 1200, mean_prompt
    with pytest.raises(WorkloadError, match="rows"):
        day(300.0, 60.0, 3, **kwargs)  # about 16,000 requests: more than the trace's 12,031 rows
