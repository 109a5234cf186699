"""``/metrics``: the engine's state under vLLM 0.32's metric names, types, labels and buckets.

Each engine has its own ``CollectorRegistry`` (many engines share a process) holding one
collector that reads the core's counters when scraped. Every ``vllm:*`` family a vLLM 0.32
server exports by default is here, with its label names and enumerated label values, its
histogram buckets (``vllm/v1/metrics/buckets.py``) and a ``_created`` sample per counter and
histogram, so scrapers, recording rules and dashboards written for vLLM work as is; the
conformance suite compares the two. Families for features the simulator does not model (KV
transfer, multimodal caches, admission limits, FLOP estimates, sleep mode) are exported with
the values an engine that does not use them reports.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from switchyard.sim.runtime import EngineRuntime
from switchyard.sim.stats import Histogram

_LABELS = ["model_name", "engine"]
_HISTOGRAMS = (
    ("request_prompt_tokens", "vllm:request_prompt_tokens", "Number of prefill tokens processed."),
    ("request_generation_tokens", "vllm:request_generation_tokens",
     "Number of generation tokens processed."),
    ("iteration_tokens", "vllm:iteration_tokens_total",
     "Histogram of number of tokens per engine_step."),
    ("max_num_generation_tokens", "vllm:request_max_num_generation_tokens",
     "Histogram of maximum number of requested generation tokens."),
    ("params_n", "vllm:request_params_n", "Histogram of the n request parameter."),
    ("params_max_tokens", "vllm:request_params_max_tokens",
     "Histogram of the max_tokens request parameter."),
    ("ttft", "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."),
    ("itl", "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
    ("time_per_output_token", "vllm:request_time_per_output_token_seconds",
     "Histogram of time_per_output_token_seconds per request."),
    ("e2e", "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
    ("queue", "vllm:request_queue_time_seconds",
     "Histogram of time spent in WAITING phase for request."),
    ("inference", "vllm:request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request."),
    ("prefill", "vllm:request_prefill_time_seconds",
     "Histogram of time spent in PREFILL phase for request."),
    ("decode", "vllm:request_decode_time_seconds",
     "Histogram of time spent in DECODE phase for request."),
    ("num_preemptions", "vllm:request_num_preemptions",
     "Histogram of number of preemptions per finished request."),
    ("prefill_kv_computed", "vllm:request_prefill_kv_computed_tokens",
     "Histogram of new KV tokens computed during prefill (excluding cached tokens)."),
)
_ZERO_COUNTERS = (
    ("vllm:estimated_flops_per_gpu",
     "Estimated number of floating point operations per GPU (for Model Flops Utilization "
     "calculations)."),
    ("vllm:estimated_read_bytes_per_gpu",
     "Estimated number of bytes read from memory per GPU (for Model Flops Utilization "
     "calculations)."),
    ("vllm:estimated_write_bytes_per_gpu",
     "Estimated number of bytes written to memory per GPU (for Model Flops Utilization "
     "calculations)."),
)
_CACHE_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
_ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")


class EngineCollector(Collector):
    """Collects one engine's metrics at scrape time.

    Args:
        engine: The engine to report on.
    """

    def __init__(self, engine: EngineRuntime) -> None:
        self.engine = engine
        self.model = engine.config.served_model
        self.labels = [self.model, "0"]
        self.created = time.time()

    def reported(self) -> tuple[object, ...]:
        """Every value :meth:`collect` reads that can change: equal tuples, equal expositions (a histogram's
        buckets and sum change only with its count; the rest of the text is fixed per engine)."""
        core = self.engine.core
        stats = core.stats
        lora = core.lora
        return (len(core.running), core.num_waiting, core.kv.usage, core.kv.num_blocks, stats.prompt_tokens,
                stats.prompt_tokens_cached, stats.generation_tokens, stats.preemptions, stats.prefix_queries,
                stats.prefix_hits, tuple(stats.finished.items()),
                tuple(getattr(stats, attr).count for attr, _, _ in _HISTOGRAMS),
                None if lora is None else (lora.max_loras, len(lora.deferred), tuple(lora.info.items())))

    def _counter(self, name: str, doc: str, values: dict[tuple[str, ...], float],
                 extra: tuple[str, ...] = (), labels: list[str] | None = None) -> Metric:
        family = CounterMetricFamily(name, doc, labels=[*(labels or _LABELS), *extra])
        for suffix, value in values.items():
            family.add_metric([*(self.labels if labels is None else [self.model]), *suffix], value,
                              created=self.created)
        return family

    def collect(self) -> Iterator[Metric]:
        """Yield every metric family (called by ``generate_latest``)."""
        core = self.engine.core
        stats = core.stats
        labels = self.labels
        for name, doc in _ZERO_COUNTERS:
            yield self._counter(name, doc, {(): 0.0})
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          len(core.running))
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                          core.num_waiting)
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
            "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
            "status). Sum of all reasons equals vllm:num_requests_waiting.", labels=[*_LABELS, "reason"])
        deferred = 0 if core.lora is None else len(core.lora.deferred)
        by_reason.add_metric([*labels, "capacity"], float(core.num_waiting - deferred))
        by_reason.add_metric([*labels, "deferred"], float(deferred))
        yield by_reason
        sleep = GaugeMetricFamily(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            labels=[*_LABELS, "sleep_state"])
        for state, value in (("awake", 1.0), ("weights_offloaded", 0.0), ("discard_all", 0.0)):
            sleep.add_metric([*labels, state], value)
        yield sleep
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                          core.kv.usage)
        for name, doc, count in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             stats.prefix_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             stats.prefix_hits),
            ("vllm:external_prefix_cache_queries",
             "External prefix cache queries from KV connector cross-instance cache sharing, in terms "
             "of number of queried tokens.", 0),
            ("vllm:external_prefix_cache_hits",
             "External prefix cache hits from KV connector cross-instance cache sharing, in terms of "
             "number of cached tokens.", 0),
            ("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.", 0),
            ("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.", 0),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", stats.preemptions),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens),
        ):
            yield self._counter(name, doc, {(): float(count)})
        cached = stats.prompt_tokens_cached
        yield self._counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", {
            ("local_compute",): float(stats.prompt_tokens - cached),
            ("local_cache_hit",): float(cached),
            ("external_kv_transfer",): 0.0}, ("source",))
        yield self._counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                            {(): float(cached)})
        yield self._counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host "
            "(offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. "
            "Counted at admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
            {(source,): float(stats.prefix_hits if source == "device" else 0) for source in _CACHE_SOURCES},
            ("source",))
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.",
                            {(): float(stats.generation_tokens)})
        yield self._counter("vllm:request_success", "Count of successfully processed requests.",
                            {(reason,): float(count) for reason, count in stats.finished.items()},
                            ("finished_reason",))
        yield self._counter(
            "vllm:admission_rejections", "Number of admission attempts rejected by a queue limit, by reason.",
            {(reason,): 0.0 for reason in _ADMISSION_REASONS}, ("reason",), labels=["model_name"])
        for attr, name, doc in _HISTOGRAMS:
            yield self._histogram(name, doc, getattr(stats, attr))
        if core.lora is not None:
            yield self._lora_requests_info()
        yield self._cache_config_info()

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        gauge = GaugeMetricFamily(name, doc, labels=_LABELS)
        gauge.add_metric(self.labels, float(value))
        return gauge

    def _histogram(self, name: str, doc: str, hist: Histogram) -> Metric:
        family = HistogramMetricFamily(name, doc, labels=_LABELS)
        family.add_metric(self.labels, buckets=hist.cumulative(), sum_value=hist.sum)
        family.samples.append(Sample(f"{name}_created", dict(zip(_LABELS, self.labels, strict=True)),
                                     self.created))
        return family

    def _lora_requests_info(self) -> Metric:
        """``vllm:lora_requests_info``, as vLLM 0.32's Prometheus logger keeps it.

        vLLM sets this gauge to the current Unix time after every engine step, labelled with ``max_lora`` and
        the comma-separated names of the adapters that have requests in flight (in the order the API server
        first saw their output). It fills both ``running_lora_adapters`` and ``waiting_lora_adapters`` from
        one per-adapter table, so the two lists always name the same adapters. A label set once written stays
        in the exposition with the time it was last set, so there is one sample per list of adapters the
        engine ever ran (an empty list included). No ``model_name``/``engine`` labels.
        """
        lora = self.engine.core.lora
        assert lora is not None
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        max_lora = str(lora.max_loras)
        for names, t in lora.info.items():
            family.add_metric([max_lora, names, names], self.engine.sim_to_epoch(t))
        return family

    def _cache_config_info(self) -> Metric:
        """``vllm:cache_config_info``: vLLM's CacheConfig labels, with the simulator's values."""
        core, cfg = self.engine.core, self.engine.config
        bs = str(core.block_size)
        kv_bytes = getattr(cfg.profile, "kv_bytes_per_token", None)
        info = {
            "_block_size_resolved": "True", "block_size": bs, "cache_dtype": "auto",
            "cache_hit_alignment_tokens": "None", "effective_attention_block_size": bs,
            "enable_mamba_shared_prefix_checkpoint": "False", "enable_prefix_caching": "True", "engine": "0",
            "gpu_memory_utilization": "0.9", "hash_block_size": "None", "is_attention_free": "False",
            "kv_cache_dtype_skip_layers": "[]", "kv_cache_layout": "None",
            "kv_cache_max_concurrency": str(cfg.kv_cache_tokens / cfg.max_model_len),
            "kv_cache_memory_bytes": str(kv_bytes * cfg.kv_cache_tokens) if kv_bytes else "None",
            "kv_cache_size_tokens": str(cfg.kv_cache_tokens), "kv_offloading_backend": "native",
            "kv_offloading_size": "None", "kv_sharing_fast_prefill": "False", "mamba_block_size": "None",
            "mamba_cache_dtype": "auto",
            "mamba_cache_mode": "none", "mamba_page_size_padded": "None", "mamba_ssm_cache_dtype": "auto",
            "num_cpu_blocks": "None", "num_gpu_blocks": str(core.kv.num_blocks),
            "num_gpu_blocks_override": "None", "prefix_cache_retention_interval": "0",
            "prefix_caching_hash_algo": "sha256", "prefix_match_unit": "None", "replayssm_buffer_len": "16",
            "skip_page_size_padded": "None", "sliding_window": "None", "swa_bounded_replay": "True",
            "use_kda_recoverssm": "False", "use_replayssm": "False", "user_specified_block_size": "False",
        }
        family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                   labels=list(info))
        family.add_metric(list(info.values()), 1.0)
        return family


class EngineMetrics:
    """The per-engine registry and its text exposition.

    The text is made again only when something it reports has changed since the last scrape
    (:meth:`EngineCollector.reported`): an idle engine's scrapes cost next to nothing, as a gateway
    reads every engine's ``/metrics`` once a second.

    Args:
        engine: The engine to report on.
    """

    def __init__(self, engine: EngineRuntime) -> None:
        self.collector = EngineCollector(engine)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self._reported: tuple[object, ...] | None = None
        self._text = b""

    def render(self) -> bytes:
        """Prometheus text format."""
        reported = self.collector.reported()
        if reported != self._reported:
            self._text = generate_latest(self.registry)
            self._reported = reported
        return self._text
