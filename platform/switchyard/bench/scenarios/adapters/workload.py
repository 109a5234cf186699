"""The ``adapters`` scenario's setup: the pool, its LoRA adapters and their Zipf popularity, the request mix, and
the policy document of both arms."""

from __future__ import annotations

from collections.abc import Sequence

from switchyard.bench.policies import PRIORITY, TENANT, TIER
from switchyard.bench.scenarios.cache.workload import zipf_weights
from switchyard.bench.synthetic import RequestTemplate

#: The arms, in the order they run: the baseline first.
LEAST_LOADED, ADAPTER_AWARE = "least-loaded", "adapter-aware"
ARMS = (LEAST_LOADED, ADAPTER_AWARE)
BASELINE = LEAST_LOADED
#: The gateway's endpoint picking per arm (``SWITCHYARD_PICKER``): the baseline profile, or each model's own
#: (the built-in default profile, with its ``lora-affinity`` scorer).
PICKER = {LEAST_LOADED: "least-loaded", ADAPTER_AWARE: "prefix-aware"}

REPLICAS = 4
PROFILE = "h100-8b"
POOL = "lora"
SERVED = "sim-8b"
#: Adapters served on the pool's base model, and vLLM's ``--max-loras`` of every replica (the GPU slots; the
#: CPU cache, ``--max-cpu-loras``, is vLLM's default: as many).
ADAPTERS = 32
MAX_LORAS = 4
#: Popularity of the adapter of rank ``r``: proportional to ``1 / r ** ZIPF_S``.
ZIPF_S = 1.0
KV_TOKENS = 100_000
CONTEXT = 8192
PROMPT_TOKENS = (100, 400)
OUTPUT_TOKENS = (32, 96)
#: Popularity bands (ranks, 1-based, inclusive) the report breaks the figures down by: the request's class.
BANDS = (("hot", 1, 4), ("warm", 5, 12), ("cold", 13, ADAPTERS))


def adapter_name(rank: int) -> str:
    """The model name (and the adapter's name on the engines) of the adapter of popularity ``rank`` (1-based)."""
    return f"lora-{rank:02d}"


def band_of(rank: int) -> str:
    """The popularity band of ``rank``."""
    return next(name for name, low, high in BANDS if low <= rank <= high)


def popularity() -> list[float]:
    """Each adapter's share of the requests, by rank."""
    return [float(w) for w in zipf_weights(ADAPTERS, ZIPF_S)]


def band_shares() -> dict[str, float]:
    """Each band's share of the requests."""
    shares = popularity()
    return {name: sum(shares[low - 1:high]) for name, low, high in BANDS}


def mix() -> list[RequestTemplate]:
    """The request mix: one streamed template per adapter, weighted by its popularity; the class is its band."""
    return [RequestTemplate(tenant=TENANT, request_class=band_of(rank), model=adapter_name(rank), weight=share,
                            prompt_tokens=PROMPT_TOKENS, output_tokens=OUTPUT_TOKENS, stream=True,
                            name=adapter_name(rank))
            for rank, share in enumerate(popularity(), start=1)]


def adapters_policy(ports: Sequence[int]) -> str:
    """One pool of replicas of the base model with ``MAX_LORAS`` adapter slots each, and every adapter a model of
    its own (``adapter_of``), registered on every replica at start-up (no runtime loading)."""
    urls = ", ".join(f"http://127.0.0.1:{p}" for p in ports)
    models = "\n".join(
        f"  - {{name: {adapter_name(rank)}, adapter_of: {POOL}, adapter_path: /adapters/{adapter_name(rank)}, "
        f"context_window: {CONTEXT}, price: {{input_per_mtok: 0, output_per_mtok: 0}}}}"
        for rank in range(1, ADAPTERS + 1))
    return f"""\
schema: 1
regions: [local]
pools:
  - {{name: {POOL}, region: local, served_model: {SERVED}, endpoints: [{urls}], kv_cache_tokens: {KV_TOKENS},
      sim_profile: {PROFILE}, max_loras: {MAX_LORAS}, runtime_lora_loading: false}}
models:
{models}
priorities:
  {PRIORITY}: {{max_queue_ms: 2000}}
tiers:
  - {{name: {TIER}, priority: {PRIORITY}, models: ["*"]}}
"""
