"""The targeted /metrics parser agrees with prometheus_client's full parser."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client.parser import text_string_to_metric_families

from switchyard.engines.endpoints import EndpointRegistry, EngineSignals
from switchyard.engines.scrape import (
    KV_USAGE,
    PREFIX_HITS,
    PREFIX_QUERIES,
    RUNNING,
    WAITING,
    MetricsFormatError,
    parse_engine_metrics,
)

# The shape of a vLLM 0.x V1 exposition (two engines behind one server, data parallel).
VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
# HELP vllm:num_requests_running_total_fake A longer name that must not be read as running.
# TYPE vllm:num_requests_running_total_fake gauge
vllm:num_requests_running_total_fake{engine="0"} 100.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1024.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.7e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 256.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 5.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 5.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 0.5
"""


def reference(text: str) -> EngineSignals:
    """The same signals computed with prometheus_client's parser."""
    sums: dict[str, float] = {}
    kv: list[float] = []
    models: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == RUNNING and "model_name" in sample.labels:
                models.add(sample.labels["model_name"])
            if sample.name in KV_USAGE:
                kv.append(sample.value)
            elif sample.name in (RUNNING, WAITING, PREFIX_QUERIES, PREFIX_HITS):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return EngineSignals(sums.get(RUNNING, 0.0), sums.get(WAITING, 0.0), max(kv, default=0.0),
                         sums.get(PREFIX_QUERIES, 0.0), sums.get(PREFIX_HITS, 0.0), frozenset(models))


def test_vllm_exposition_agrees_with_prometheus_client() -> None:
    signals = parse_engine_metrics(VLLM_TEXT)
    assert signals == reference(VLLM_TEXT)
    assert signals == EngineSignals(running=5, waiting=4, kv_usage=0.5, prefix_queries=1024, prefix_hits=256,
                                    models=frozenset({"tiny"}))


def test_unlabelled_series_older_names_and_odd_values() -> None:
    text = ("vllm:num_requests_running 1\nvllm:num_requests_waiting NaN\n"
            "vllm:gpu_cache_usage_perc{model_name=\"x\"} 0.75 1700000000000\n"
            "vllm:num_requests_waiting{broken 7\n")
    assert parse_engine_metrics(text) == EngineSignals(1, 0, 0.75, 0, 0)


def test_text_without_load_series_is_rejected() -> None:
    with pytest.raises(MetricsFormatError):
        parse_engine_metrics("# nothing here\nprocess_cpu_seconds_total 3\n")


def test_load_estimate_combines_scrape_and_own_dispatches() -> None:
    registry = EndpointRegistry(signal_max_age=3)
    url = "http://127.0.0.1:1"
    registry.acquire(url)
    registry.record_scrape(url, EngineSignals(running=4, waiting=2, kv_usage=0.1, prefix_queries=0, prefix_hits=0),
                           now=100)
    state = registry.state(url)
    assert state.load(100, 3) == 6  # the engine's view already includes our one request
    registry.acquire(url)
    registry.acquire(url)
    assert state.load(101, 3) == 8  # two more sent since the scrape
    assert state.queued(101, 3) == 2
    assert state.load(104, 3) == 3  # a stale scrape: only our own count
    for _ in range(3):
        registry.release(url)
    registry.release(url)
    assert registry.outstanding(url) == 0
    assert registry.mark_down(url, "refused", now=200) is True
    assert not state.healthy(200) and not state.healthy(10_000)  # out until probes bring it back


def test_lora_adapters_are_read_from_the_latest_lora_requests_info_series() -> None:
    # vLLM keeps one series per label set it has seen, each set to the time it was last current.
    text = (
        'vllm:num_requests_running{engine="0",model_name="base"} 2.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="base"} 1.0\n'
        '# HELP vllm:lora_requests_info Running stats on lora requests.\n'
        '# TYPE vllm:lora_requests_info gauge\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",waiting_lora_adapters=""} 1.7645e+09\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="b,c",waiting_lora_adapters="d"} 1.7646e+09\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7644e+09\n'
    )
    signals = parse_engine_metrics(text)
    assert signals.adapters == frozenset({"b", "c", "d"}) and signals.max_loras == 2
    idle = parse_engine_metrics(text.replace("1.7644e+09", "1.7647e+09"))
    assert idle.adapters == frozenset() and idle.max_loras == 2
    plain = parse_engine_metrics('vllm:num_requests_running{model_name="base"} 0.0\n')
    assert plain.adapters is None and plain.max_loras is None


def test_requests_deferred_for_an_adapter_slot_are_no_queue_for_capacity() -> None:
    text = (
        'vllm:num_requests_running{engine="0",model_name="base"} 4.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="base"} 3.0\n'
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="base",reason="capacity"} 0.0\n'
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="base",reason="deferred"} 3.0\n'
    )
    signals = parse_engine_metrics(text)
    assert (signals.waiting, signals.deferred) == (3.0, 3.0)
    registry = EndpointRegistry()
    registry.record_scrape("http://a", signals, now=10.0)
    state = registry.state("http://a")
    # Deferred requests wait for their adapter, not for room: the engine is not saturated by them.
    assert state.utilisation(10.0, 3.0, 100_000, None) < 1.0
    assert state.load(10.0, 3.0) == 7.0  # (they are still requests at the engine)
    queued = parse_engine_metrics(text.replace('reason="capacity"} 0.0', 'reason="capacity"} 2.0')
                                  .replace('waiting{engine="0",model_name="base"} 3.0',
                                           'waiting{engine="0",model_name="base"} 5.0'))
    registry.record_scrape("http://b", queued, now=10.0)
    assert registry.state("http://b").utilisation(10.0, 3.0, 100_000, None) == 1.0 + 2.0 / 4.0


def test_a_simulated_engines_whole_exposition_agrees_with_prometheus_client() -> None:
    # The whole text an engine serves (every vLLM family, histograms, _created samples), after some traffic.
    from litestar.testing import TestClient

    from switchyard.sim import EngineConfig, create_engine_app

    with TestClient(app=create_engine_app(EngineConfig(served_model="m", port=1, time_scale=1000, seed=1))) as c:
        for i in range(3):
            assert c.post("/v1/completions", json={"prompt": f"hi {i}", "max_tokens": 4}).status_code == 200
        text = c.get("/metrics").text
    signals = parse_engine_metrics(text)
    assert dataclasses.replace(signals, progress=None) == reference(text)  # (the reference reads no progress)
    assert signals.progress is not None and signals.progress > 0 and signals.models == frozenset({"m"})
    # The same text with Windows line ends and without its final newline reads the same.
    assert parse_engine_metrics(text.replace("\n", "\r\n").rstrip()) == signals
