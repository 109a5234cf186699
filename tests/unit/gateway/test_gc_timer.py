"""The garbage collector's pauses, timed into ``switchyard_gc_pause_seconds`` by generation."""

from __future__ import annotations

import gc

from switchyard.gateway.metrics import GatewayMetrics
from switchyard.gateway.runtime import gc_timer


def _count(metrics: GatewayMetrics, generation: int) -> float:
    value = metrics.registry.get_sample_value("switchyard_gc_pause_seconds_count", {"generation": str(generation)})
    return value or 0.0


def test_every_collection_is_timed_under_its_generation() -> None:
    metrics = GatewayMetrics()
    hook = gc_timer(metrics)
    gc.callbacks.append(hook)
    try:
        gc.collect(0)
        gc.collect(0)
        gc.collect(1)
        gc.collect(2)
    finally:
        gc.callbacks.remove(hook)
    assert [_count(metrics, g) for g in range(3)] == [2, 1, 1]
    total = metrics.registry.get_sample_value("switchyard_gc_pause_seconds_sum", {"generation": "2"})
    assert total is not None and 0 < total < 5  # a duration in seconds

