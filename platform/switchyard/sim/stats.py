"""Counters and histograms an engine keeps, cheap enough to update every step.

These are plain Python numbers updated by the engine core; ``metrics.py`` turns them into
Prometheus text only when ``/metrics`` is scraped, so a busy engine pays nothing for
exposition and a histogram update is one ``bisect``.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

# Bucket boundaries copied from vLLM (vllm/v1/metrics/loggers.py) so that dashboards and
# recording rules written for vLLM work unchanged against the simulator.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 series up to ``max_value`` (used for token-count histograms)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Histogram:
    """A fixed-bucket histogram: per-bucket counts, a sum and a count.

    Args:
        bounds: Upper bounds of the finite buckets, ascending.
    """

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        """Record ``n`` observations of ``value``."""
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, cumulative count)`` pairs, ending with ``+Inf``."""
        out: list[tuple[str, float]] = []
        total = 0
        for bound, c in zip(self.bounds, self.counts, strict=False):
            total += c
            out.append((repr(float(bound)), float(total)))
        out.append(("+Inf", float(self.count)))
        return out


def _h(bounds: tuple[float, ...]) -> Histogram:
    return Histogram(bounds)


@dataclass
class EngineStats:
    """Everything ``/metrics`` reports besides the live gauges.

    Args:
        max_model_len: Upper end of the token-count histograms' 1-2-5 buckets.
    """

    max_model_len: int
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    finished: dict[str, int] = field(
        default_factory=lambda: {"stop": 0, "length": 0, "abort": 0, "error": 0})
    ttft: Histogram = field(default_factory=lambda: _h(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: _h(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: _h(REQUEST_LATENCY_BUCKETS))
    queue: Histogram = field(default_factory=lambda: _h(REQUEST_LATENCY_BUCKETS))
    prefill: Histogram = field(default_factory=lambda: _h(REQUEST_LATENCY_BUCKETS))
    decode: Histogram = field(default_factory=lambda: _h(REQUEST_LATENCY_BUCKETS))
    inference: Histogram = field(default_factory=lambda: _h(REQUEST_LATENCY_BUCKETS))
    iteration_tokens: Histogram = field(default_factory=lambda: _h(ITERATION_TOKEN_BUCKETS))
    request_prompt_tokens: Histogram = field(init=False)
    request_generation_tokens: Histogram = field(init=False)

    def __post_init__(self) -> None:
        token_buckets = tuple(float(b) for b in buckets_1_2_5(self.max_model_len))
        self.request_prompt_tokens = Histogram(token_buckets)
        self.request_generation_tokens = Histogram(token_buckets)
