"""The ``soak`` scenario's mix of request kinds (each with the statuses it may get) and its policy: one pool,
an exact cache rule, a tier with a small limit; two documents the run writes in turn."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from switchyard.bench.policies import PRIORITY, TIER

PROFILE = "h100-8b"
SERVED = "sim-8b"
#: Distinct prompts the cache-repeat kind cycles through (each is a miss once, then hits until its TTL).
CACHED_PROMPTS = 40
LIMITED_TENANT = "soak-limited"
LIMITED_TIER = "limited"


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind of request in the soak's mix.

    Attributes:
        name: Its label in the report.
        weight: Relative frequency.
        expected: The statuses it may get; anything else is an unexpected error.
    """

    name: str
    weight: float
    expected: frozenset[int]


MIX = (
    Kind("chat", 28, frozenset({200})),
    Kind("stream", 22, frozenset({200})),
    Kind("abandoned stream", 10, frozenset({200})),
    Kind("cache repeat", 15, frozenset({200})),
    Kind("completion", 5, frozenset({200})),
    Kind("over limit", 8, frozenset({200, 429})),
    Kind("bad JSON", 4, frozenset({400})),
    Kind("unknown model", 4, frozenset({404})),
    Kind("no key", 4, frozenset({401})),
)


def soak_policy(ports: Sequence[int], *, queue_ms: int) -> str:
    """One pool of simulated engines, an exact cache rule for ``chat``, and a tier with a small limit.

    ``queue_ms`` tells the two documents the scenario alternates apart (each write is a new version).
    """
    urls = ", ".join(f"http://127.0.0.1:{p}" for p in ports)
    return f"""\
schema: 1
regions: [local]
pools:
  - {{name: soak, region: local, served_model: {SERVED}, endpoints: [{urls}],
      kv_cache_tokens: 100000, sim_profile: {PROFILE}}}
models:
  - {{name: chat, pools: [soak], context_window: 8192, price: {{input_per_mtok: 0, output_per_mtok: 0}}}}
priorities:
  {PRIORITY}: {{max_queue_ms: {queue_ms}}}
tiers:
  - {{name: {TIER}, priority: {PRIORITY}, models: ["*"]}}
  - {{name: {LIMITED_TIER}, priority: {PRIORITY}, models: ["*"], limits: {{tokens_per_minute: 3000}}}}
cache:
  - {{name: exact, match: {{models: [chat]}}, ttl: 2m}}
"""
