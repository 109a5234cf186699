"""Embedding classifiers against real simulated engines (`switchyard sim` processes on loopback).

Two engines serve the embedding model: one healthy, one that the tests slow down or make fail through
``/sim/faults``. Nothing listens on the dead ports.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp
import msgspec
import pytest

from switchyard.decide.features import RequestFeatures
from switchyard.engines.endpoints import EndpointRegistry
from switchyard.gateway.classifiers import ClassifierRunner
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.policy.snapshot import PolicySnapshot, compile_policy
from tests.helpers import free_port
from tests.integration.conftest import SWITCHYARD, stop, wait_http
from tests.unit.policy.base import base, to_yaml

MODEL = "sim-embed"
POSITIVE = ["How do I get a refund for my order?", "I want my money back, the product arrived broken",
            "Cancel my subscription and refund the charge"]
NEGATIVE = ["Write a poem about the sea", "Explain quicksort in Python", "What is the capital of France?"]


@dataclass
class EmbedEngines:
    """The embedding engines' base URLs, and two ports nobody listens on."""

    fast: str
    slow: str
    dead: str
    dead2: str


@pytest.fixture(scope="module")
def embed_engines() -> Iterator[EmbedEngines]:
    ports = [free_port(), free_port()]
    procs = [subprocess.Popen([SWITCHYARD, "sim", "--model", MODEL, "--port", str(p)]) for p in ports]
    try:
        for proc, port in zip(procs, ports, strict=True):
            wait_http(f"http://127.0.0.1:{port}/health", proc)
        fast, slow = (f"http://127.0.0.1:{p}" for p in ports)
        yield EmbedEngines(fast, slow, f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}")
    finally:
        for proc in procs:
            assert stop(proc), "the simulator must stop cleanly on SIGTERM"


def _snapshot(pools: dict[str, list[str]], timeout_ms: int = 2000) -> PolicySnapshot:
    """The base policy plus an embeddings pool and a classifier ``support-<pool>`` per entry of ``pools``."""
    doc: dict[str, Any] = base()
    doc["classifiers"] = {}
    for name, endpoints in pools.items():
        doc["pools"].append({"name": name, "region": "us-east", "served_model": MODEL, "endpoints": endpoints,
                             "kv_cache_tokens": 100000, "task": "embed"})
        doc["classifiers"][f"support-{name}"] = {
            "type": "embedding", "pool": name, "examples": {"positive": POSITIVE, "negative": NEGATIVE},
            "threshold": 0.5, "timeout_ms": timeout_ms}
    return compile_policy(to_yaml(doc), "embedding-test.yaml")


def _features(text: str) -> RequestFeatures:
    return RequestFeatures(model="auto", prompt_tokens=len(text) // 4, last_user_text=text)


@dataclass
class Calls:
    """The number of texts in each ``/v1/embeddings`` body sent."""

    inputs: list[int]


@pytest.fixture
async def http() -> AsyncIterator[tuple[aiohttp.ClientSession, Calls]]:
    calls = Calls([])

    async def on_chunk(_: aiohttp.ClientSession, __: SimpleNamespace, params: aiohttp.TraceRequestChunkSentParams
                       ) -> None:
        if params.url.path == "/v1/embeddings":
            calls.inputs.append(len(msgspec.json.decode(params.chunk)["input"]))

    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(on_chunk)
    async with aiohttp.ClientSession(trace_configs=[trace]) as session:
        yield session, calls


async def _set_faults(session: aiohttp.ClientSession, url: str, **faults: object) -> None:
    async with session.post(url + "/sim/faults", json=faults) as resp:
        assert resp.status == 200, await resp.text()


def _count(metrics: GatewayMetrics, classifier: str, outcome: str) -> float:
    value = metrics.registry.get_sample_value("switchyard_classifier_total",
                                              {"classifier": classifier, "outcome": outcome})
    return value or 0.0


async def test_scores_separate_the_examples(embed_engines: EmbedEngines,
                                            http: tuple[aiohttp.ClientSession, Calls]) -> None:
    snapshot = _snapshot({"embed": [embed_engines.fast]})
    metrics = GatewayMetrics()
    runner = ClassifierRunner(http[0], EndpointRegistry(), metrics)
    near_positive = await runner.score(snapshot, "support-embed", _features("Please refund my order, it is broken"))
    near_negative = await runner.score(snapshot, "support-embed", _features("Write a short poem about the ocean"))
    assert near_positive is not None and near_positive >= 0.5
    assert near_negative is not None and near_negative < 0.5
    assert _count(metrics, "support-embed", "yes") == 1
    assert _count(metrics, "support-embed", "no") == 1
    assert metrics.registry.get_sample_value("switchyard_classifier_seconds_count",
                                             {"classifier": "support-embed"}) == 2


async def test_examples_are_embedded_once(embed_engines: EmbedEngines,
                                          http: tuple[aiohttp.ClientSession, Calls]) -> None:
    session, calls = http
    snapshot = _snapshot({"embed": [embed_engines.fast]})
    runner = ClassifierRunner(session, EndpointRegistry())
    texts = [f"question number {i} about a refund" for i in range(5)]
    # Concurrent first requests share one fetch of the examples (the first one's query rides along) ...
    scores = await asyncio.gather(*(runner.score(snapshot, "support-embed", _features(t)) for t in texts))
    assert all(s is not None for s in scores)
    # ... and later ones send only their own text.
    for text in texts[:3]:
        assert await runner.score(snapshot, "support-embed", _features(text)) is not None
    examples = len(POSITIVE) + len(NEGATIVE)
    assert sorted(calls.inputs) == [1] * 7 + [examples + 1]
    # A new snapshot with the same model and examples (a reload) reuses the centroids.
    again = _snapshot({"embed": [embed_engines.fast]}, timeout_ms=1500)
    assert await runner.score(again, "support-embed", _features("refund please")) is not None
    assert calls.inputs[-1] == 1


async def test_unreachable_endpoint_gives_no_score_and_is_marked_down(
        embed_engines: EmbedEngines, http: tuple[aiohttp.ClientSession, Calls]) -> None:
    snapshot = _snapshot({"embed": [embed_engines.dead]}, timeout_ms=5000)
    endpoints, metrics = EndpointRegistry(), GatewayMetrics()
    runner = ClassifierRunner(http[0], endpoints, metrics)
    started = time.monotonic()
    assert await runner.score(snapshot, "support-embed", _features("refund my order")) is None
    assert time.monotonic() - started < 5.0  # answered by the refusal, not by the timeout
    state = endpoints.state(embed_engines.dead)
    assert not state.healthy(time.monotonic())
    assert state.failure is not None and "cannot connect" in state.failure
    assert _count(metrics, "support-embed", "error") == 1


async def test_a_refusing_replica_is_skipped(embed_engines: EmbedEngines,
                                             http: tuple[aiohttp.ClientSession, Calls]) -> None:
    snapshot = _snapshot({"embed": [embed_engines.dead2, embed_engines.fast]})
    endpoints = EndpointRegistry()
    runner = ClassifierRunner(http[0], endpoints)
    for text in ("refund my order", "a poem about rivers", "money back please"):
        assert await runner.score(snapshot, "support-embed", _features(text)) is not None
    assert not endpoints.state(embed_engines.dead2).healthy(time.monotonic())
    assert endpoints.state(embed_engines.fast).healthy(time.monotonic())


async def test_slow_or_failing_engine_gives_no_score(embed_engines: EmbedEngines,
                                                     http: tuple[aiohttp.ClientSession, Calls]) -> None:
    session = http[0]
    snapshot = _snapshot({"embed": [embed_engines.slow]}, timeout_ms=300)
    endpoints, metrics = EndpointRegistry(), GatewayMetrics()
    runner = ClassifierRunner(session, endpoints, metrics)
    try:
        # About 12 ms per call on the simulated 8B profile; a thousand times slower is far past 300 ms.
        await _set_faults(session, embed_engines.slow, mode="slow", slow_factor=1000)
        started = time.monotonic()
        assert await runner.score(snapshot, "support-embed", _features("refund my order")) is None
        assert time.monotonic() - started < 5.0  # the timeout, not the slow answer
        assert _count(metrics, "support-embed", "timeout") == 1
        assert endpoints.state(embed_engines.slow).healthy(time.monotonic())  # slow is not down

        await _set_faults(session, embed_engines.slow, mode="none", error_rate=1.0)
        assert await runner.score(snapshot, "support-embed", _features("refund my order")) is None
        assert _count(metrics, "support-embed", "error") == 1
    finally:
        await _set_faults(session, embed_engines.slow, mode="none", error_rate=0.0)
    # Failed fetches of the examples are not kept: once the engine recovers, scores come back.
    assert await runner.score(snapshot, "support-embed", _features("refund my order")) is not None
    assert _count(metrics, "support-embed", "yes") == 1
