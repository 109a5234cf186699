"""Counters and histograms an engine keeps, cheap enough to update every step.

These are plain Python numbers updated by the engine core; ``metrics.py`` turns them into
Prometheus text only when ``/metrics`` is scraped, so a busy engine pays nothing for
exposition and a histogram update is one ``bisect``.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from switchyard.sim.request import SimRequest

# Bucket boundaries copied from vLLM (vllm/v1/metrics/loggers.py) so that dashboards and
# recording rules written for vLLM work unchanged against the simulator.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


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
    #: Prompt tokens of requests that produced their first token and were found in the cache.
    prompt_tokens_cached: int = 0
    #: Requests aborted because their client went away (``/sim/state`` only: vLLM exports none).
    aborted: int = 0
    finished: dict[str, int] = field(
        default_factory=lambda: {"stop": 0, "length": 0, "abort": 0, "error": 0, "repetition": 0})
    ttft: Histogram = field(default_factory=lambda: _h(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: _h(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: _h(REQUEST_LATENCY_BUCKETS))
    queue: Histogram = field(default_factory=lambda: _h(REQUEST_LATENCY_BUCKETS))
    prefill: Histogram = field(default_factory=lambda: _h(REQUEST_LATENCY_BUCKETS))
    decode: Histogram = field(default_factory=lambda: _h(REQUEST_LATENCY_BUCKETS))
    inference: Histogram = field(default_factory=lambda: _h(REQUEST_LATENCY_BUCKETS))
    iteration_tokens: Histogram = field(default_factory=lambda: _h(ITERATION_TOKEN_BUCKETS))
    time_per_output_token: Histogram = field(default_factory=lambda: _h(ITL_BUCKETS))
    params_n: Histogram = field(default_factory=lambda: _h(REQUEST_PARAMS_N_BUCKETS))
    num_preemptions: Histogram = field(default_factory=lambda: _h(REQUEST_NUM_PREEMPTIONS_BUCKETS))
    request_prompt_tokens: Histogram = field(init=False)
    request_generation_tokens: Histogram = field(init=False)
    max_num_generation_tokens: Histogram = field(init=False)
    params_max_tokens: Histogram = field(init=False)
    prefill_kv_computed: Histogram = field(init=False)

    def __post_init__(self) -> None:
        token_buckets = tuple(float(b) for b in buckets_1_2_5(self.max_model_len))
        self.request_prompt_tokens = Histogram(token_buckets)
        self.request_generation_tokens = Histogram(token_buckets)
        self.max_num_generation_tokens = Histogram(token_buckets)
        self.params_max_tokens = Histogram(token_buckets)
        self.prefill_kv_computed = Histogram(token_buckets)

    def record_finished(self, req: SimRequest, end: float) -> None:
        """Count a request that reached its end at time ``end`` (vLLM's finished-request stats)."""
        reason = req.final_reason
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.e2e.observe(end - req.arrival)
        scheduled_at = req.scheduled_at if req.scheduled_at is not None else end
        first = req.first_token_at if req.first_token_at is not None else end
        self.prefill.observe(first - scheduled_at)
        self.decode.observe(end - first)
        self.inference.observe(end - scheduled_at)
        self.request_prompt_tokens.observe(len(req.prompt))
        self.request_generation_tokens.observe(len(req.output))
        self.num_preemptions.observe(req.num_preemptions)
        self.prefill_kv_computed.observe(len(req.prompt) - req.num_cached_tokens)
        self.params_max_tokens.observe(req.budget or req.max_output)
        tpot = (end - first) / (len(req.output) - 1) if len(req.output) > 1 else 0.0
        self.time_per_output_token.observe(tpot)
        if req.n_param:  # once per client request, as vLLM counts its parent requests
            self.params_n.observe(req.n_param)
            self.max_num_generation_tokens.observe(len(req.output))
