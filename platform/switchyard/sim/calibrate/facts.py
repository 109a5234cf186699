"""What the engine says about itself: model, limits, block size, KV capacity, vocabulary.

``/v1/models`` (model, ``max_model_len``), ``/metrics`` (``vllm:cache_config_info``: block
size and KV blocks), ``/version``, and the vocabulary size by bisection on the smallest token
id the engine rejects (vLLM answers 400 "Token id N is out of vocabulary").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from switchyard.sim.calibrate.client import EngineClient, prometheus_samples

#: Largest token id probed when looking for the vocabulary's end.
VOCAB_PROBE_LIMIT = 1 << 20


@dataclass
class EngineFacts:
    """What the engine says about itself, and where each fact came from."""

    url: str
    model: str
    root: str
    version: str | None
    max_model_len: int
    block_size: int
    kv_cache_tokens: int | None
    vocab_size: int
    sources: dict[str, str] = field(default_factory=dict)


async def engine_facts(client: EngineClient, log: Callable[[str], None]) -> EngineFacts:
    """Discover the served model, its limits, block size, KV capacity and vocabulary size."""
    await client.discover()
    assert client.model is not None
    sources = {"max_model_len": "/v1/models max_model_len"}
    version = await client.version()
    block_size, kv_tokens = 16, None
    sources["block_size"] = "not reported (no vllm:cache_config_info); assumed vLLM's CUDA default"
    metrics = await client.text("/metrics")
    for name, labels, _ in prometheus_samples(metrics or ""):
        if name == "vllm:cache_config_info" and labels.get("block_size", "").isdigit():
            block_size = int(labels["block_size"])
            sources["block_size"] = "/metrics vllm:cache_config_info block_size"
            blocks = labels.get("num_gpu_blocks", "")
            if blocks.isdigit():
                kv_tokens = int(blocks) * block_size
                sources["kv_cache_tokens"] = ("/metrics vllm:cache_config_info num_gpu_blocks x "
                                              "block_size")
            break
    log(f"calibrate: {client.model} at {client.base_url}: max_model_len {client.max_model_len}, "
        f"block size {block_size}, KV {kv_tokens if kv_tokens is not None else 'unknown'} tokens")
    vocab = await _vocab_size(client)
    sources["vocab_size"] = ("measured: the smallest token id the engine rejects"
                             if vocab < VOCAB_PROBE_LIMIT else
                             f"no token id below {VOCAB_PROBE_LIMIT} was rejected")
    return EngineFacts(url=client.base_url, model=client.model, root=client.root, version=version,
                       max_model_len=client.max_model_len, block_size=block_size,
                       kv_cache_tokens=kv_tokens, vocab_size=vocab, sources=sources)


async def _vocab_size(client: EngineClient) -> int:
    if await client.accepts_token(VOCAB_PROBE_LIMIT):
        return VOCAB_PROBE_LIMIT
    lo, hi = 0, VOCAB_PROBE_LIMIT  # lo accepted (assumed), hi rejected
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if await client.accepts_token(mid):
            lo = mid
        else:
            hi = mid
    return hi
