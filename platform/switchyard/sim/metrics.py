"""``/metrics``: the engine's state under vLLM's own metric names, labels and buckets.

Each engine has its own ``CollectorRegistry`` (many engines share a process) holding one
collector that reads the core's counters when scraped. Names, label names
(``model_name``, ``engine``) and histogram buckets are vLLM v1's
(``vllm/v1/metrics/loggers.py``), so scrapers and dashboards written for vLLM work as is.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from switchyard.sim.runtime import EngineRuntime
from switchyard.sim.stats import Histogram

_LABELS = ["model_name", "engine"]
_HISTOGRAMS = (
    ("ttft", "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."),
    ("itl", "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
    ("e2e", "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
    ("queue", "vllm:request_queue_time_seconds",
     "Histogram of time spent in WAITING phase for request."),
    ("prefill", "vllm:request_prefill_time_seconds",
     "Histogram of time spent in PREFILL phase for request."),
    ("decode", "vllm:request_decode_time_seconds",
     "Histogram of time spent in DECODE phase for request."),
    ("inference", "vllm:request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request."),
    ("iteration_tokens", "vllm:iteration_tokens_total",
     "Histogram of number of tokens per engine_step."),
    ("request_prompt_tokens", "vllm:request_prompt_tokens", "Number of prefill tokens processed."),
    ("request_generation_tokens", "vllm:request_generation_tokens",
     "Number of generation tokens processed."),
)


class EngineCollector(Collector):
    """Collects one engine's metrics at scrape time.

    Args:
        engine: The engine to report on.
    """

    def __init__(self, engine: EngineRuntime) -> None:
        self.engine = engine
        self.labels = [engine.config.served_model, "0"]

    def collect(self) -> Iterator[Metric]:
        """Yield every metric family (called by ``generate_latest``)."""
        core = self.engine.core
        stats = core.stats
        labels = self.labels
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             len(core.running)),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             core.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             core.kv.usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=_LABELS)
            gauge.add_metric(labels, float(value))
            yield gauge
        for name, doc, count in (
            ("vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.", stats.prefix_queries),
            ("vllm:prefix_cache_hits",
             "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_hits),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             stats.preemptions),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.",
             stats.generation_tokens),
        ):
            counter = CounterMetricFamily(name, doc, labels=_LABELS)
            counter.add_metric(labels, float(count))
            yield counter
        success = CounterMetricFamily("vllm:request_success",
                                      "Count of successfully processed requests.",
                                      labels=[*_LABELS, "finished_reason"])
        for reason, count in stats.finished.items():
            success.add_metric([*labels, reason], float(count))
        yield success
        for attr, name, doc in _HISTOGRAMS:
            yield _histogram(name, doc, labels, getattr(stats, attr))
        info = GaugeMetricFamily("vllm:cache_config_info",
                                 "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "enable_prefix_caching", "engine",
                                         "num_gpu_blocks"])
        info.add_metric([str(core.block_size), "True", "0", str(core.kv.num_blocks)], 1.0)
        yield info


def _histogram(name: str, doc: str, labels: list[str], hist: Histogram) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=_LABELS)
    family.add_metric(labels, buckets=hist.cumulative(), sum_value=hist.sum)
    return family


class EngineMetrics:
    """The per-engine registry and its text exposition.

    Args:
        engine: The engine to report on.
    """

    def __init__(self, engine: EngineRuntime) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(engine))

    def render(self) -> bytes:
        """Prometheus text format."""
        return generate_latest(self.registry)
