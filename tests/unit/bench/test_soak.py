"""The soak's trend and its reading of the gateway's cache hits."""

from __future__ import annotations

import random

from switchyard.bench.scenarios.soak.figures import GROWTH_FLOOR_MIB, Sample, cache_hits, trend


def _samples(rss: list[float], every_s: float = 10.0) -> list[Sample]:
    return [Sample(i * every_s, r, 8, 30, 100.0, i, 0) for i, r in enumerate(rss)]


def test_a_flat_noisy_series_has_no_growing_trend() -> None:
    rng = random.Random(1)
    report = trend(_samples([150 + rng.uniform(-2, 2) for _ in range(180)]), warmup_s=300)
    assert report["met"] is True and abs(report["rise_mib"]) < GROWTH_FLOOR_MIB
    assert report["samples"] == 150 and report["steady_from_s"] == 300


def test_a_slow_leak_is_a_growing_trend() -> None:
    rng = random.Random(2)  # 150 MiB growing 10 MiB over half an hour, under the same noise
    report = trend(_samples([150 + i * 10 / 180 + rng.uniform(-2, 2) for i in range(180)]), warmup_s=0)
    assert report["met"] is False and 8 < report["rise_mib"] < 12
    assert 16 < report["slope_mib_per_h"] < 24


def test_the_warm_up_is_left_out() -> None:
    # filling caches to their bound in the first five minutes, flat after
    rss = [100 + min(i, 30) for i in range(180)]
    assert trend(_samples(rss), warmup_s=0)["met"] is False
    assert trend(_samples(rss), warmup_s=360)["met"] is True


def test_too_few_samples_give_no_verdict() -> None:
    assert trend(_samples([100, 101]), warmup_s=0)["met"] is None


def test_cache_hits_sum_the_hit_lookups_of_every_rule() -> None:
    exposition = """\
# HELP switchyard_cache_lookups_total Response-cache lookups.
# TYPE switchyard_cache_lookups_total counter
switchyard_cache_lookups_total{mode="exact",result="hit",rule="exact"} 21.0
switchyard_cache_lookups_total{mode="exact",result="miss",rule="exact"} 27.0
switchyard_cache_lookups_total{mode="semantic",result="hit",rule="faq"} 2.0
"""
    assert cache_hits(exposition) == 23.0
