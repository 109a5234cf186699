"""The policy documents the bench scenarios run, written for the ports each run chose.

Each is an ordinary ``schema: 1`` document (the gateway and ``switchyard sim --policy`` read it
as they would any other), kept minimal so that what a scenario measures is the feature under
test, not the demo policy's route rules.
"""

from __future__ import annotations

from collections.abc import Sequence

#: The built-in tokenizer a model may name for simulated engines (``switchyard.policy.fleet.SIM_TOKENIZER``;
#: the bench drives the gateway as a process and does not import the policy package).
SIM_TOKENIZER = "switchyard-sim"

#: The tenant and tier every scenario's requests use.
TENANT = "bench"
TIER = "bench"
PRIORITY = "interactive"


def _urls(ports: Sequence[int]) -> str:
    return "[" + ", ".join(f"http://127.0.0.1:{p}" for p in ports) + "]"


def _tail(models: str, priority_fields: str = "") -> str:
    return f"""\
{models}
priorities:
  {PRIORITY}: {{max_queue_ms: 2000{priority_fields}}}
tiers:
  - {{name: {TIER}, priority: {PRIORITY}, models: ["*"]}}
"""


#: What the overhead scenario's policy keeps on, as its report states it.
HOT_PATH_FEATURES = (
    "the key from the key cache; model `auto`, resolved by route rules (the `features` difficulty classifier, "
    "prompt length and turns) to `small` or `medium`, as in the demo policy; the tier's token and request limits "
    "(admission, in-process counters); flow control (the priority class's queue, the pool's saturation); the "
    "exact cache rule's lookup on every request (sent with temperature 0 and `x-switchyard-cache-control: "
    "no-store`, so the lookup runs and misses, and nothing is stored: a hit would not reach the engine); the `chat` "
    "endpoint "
    "profile's filters and scorers (prefix index, load, session affinity, KV room); prompts counted with the "
    "model's tokenizer; metrics and the request log (every request, SQLite)")


def overhead_policy(engine_port: int, served_model: str) -> str:
    """The demo policy's kind of request path in front of one instant engine (:data:`HOT_PATH_FEATURES`): clients
    call ``auto``, which resolves to ``small`` or ``medium``, both served by the engine's pool."""
    return f"""\
schema: 1
regions: [local]
pools:
  - {{name: instant, region: local, served_model: {served_model}, endpoints: {_urls([engine_port])},
      kv_cache_tokens: 100000}}
models:
  - {{name: small, pools: [instant], tokenizer: {SIM_TOKENIZER}, context_window: 8192, default_max_tokens: 256,
      price: {{input_per_mtok: 0.10, output_per_mtok: 0.20}}, endpoint_profile: chat}}
  - {{name: medium, pools: [instant], tokenizer: {SIM_TOKENIZER}, context_window: 16384, default_max_tokens: 512,
      price: {{input_per_mtok: 0.40, output_per_mtok: 1.20}}, fallback: [small], endpoint_profile: chat}}
routes:
  - name: auto
    rules:
      - {{name: hard-to-medium, when: {{classifier: hard}}, model: medium}}
      - {{name: short-and-simple, when: {{prompt_tokens_lt: 2000, messages_lt: 8}}, model: small}}
    default: medium
classifiers:
  hard: {{type: features, threshold: 0.5}}
endpoint_profiles:
  chat:
    filters: [{{type: healthy}}, {{type: serves-model}}, {{type: under-saturation}}]
    scorers:
      - {{type: kv-cache-precise, weight: 0.6}}
      - {{type: load, weight: 0.4}}
      - {{type: session-affinity, weight: 0.5}}
      - {{type: kv-cache, weight: 0.2}}
    picker: {{type: max-score}}
priorities:
  {PRIORITY}: {{max_queue_ms: 1500, ttft_objective: 3s}}
tiers:
  - {{name: {TIER}, priority: {PRIORITY}, models: [auto, small, medium],
      limits: {{tokens_per_minute: 1000000000, requests_per_minute: 100000000, tokens_per_day: 100000000000}}}}
cache:
  - {{name: deterministic, match: {{models: [small, medium]}}, mode: exact, ttl: 1h, scope: tenant}}
"""


#: The prefix scenario's precise profile: the engines' own report of their caches (KV-cache events), with load as
#: the tie-break within the herding margin, as the oracle places (0.6/0.4 gave 80.7-84.6% of the oracle's hits on
#: Mooncake, 0.9/0.1 88.2%, one run each).
PRECISE_SCORERS = ("[{type: kv-cache-precise, weight: 0.9, herd_margin: 4}, {type: load, weight: 0.1}]")


def replicas_policy(ports: Sequence[int], *, model: str, served_model: str, profile: str, kv_cache_tokens: int,
                    context_window: int, kv_events: tuple[int, int] | None = None) -> str:
    """One pool of simulated replicas (the prefix scenario).

    With ``kv_events`` (the events and replay ports' offsets from each endpoint's HTTP port), the pool
    declares where its engines publish their KV-cache events, the model counts and renders prompts with the
    simulator's own tokenizer, and the model's endpoints are picked by the ``precise`` profile
    (:data:`PRECISE_SCORERS`, max score).
    """
    events = precise = profiles = ""
    if kv_events is not None:
        events = f", kv_events: {{port_offset: {kv_events[0]}, replay_port_offset: {kv_events[1]}}}"
        precise = f", tokenizer: {SIM_TOKENIZER}, endpoint_profile: precise"
        profiles = f"endpoint_profiles:\n  precise: {{scorers: {PRECISE_SCORERS}}}\n"
    return f"""\
schema: 1
regions: [local]
pools:
  - {{name: replicas, region: local, served_model: {served_model}, endpoints: {_urls(ports)},
      kv_cache_tokens: {kv_cache_tokens}, sim_profile: {profile}{events}}}
""" + profiles + _tail(f"""\
models:
  - {{name: {model}, pools: [replicas], context_window: {context_window}{precise},
      price: {{input_per_mtok: 0, output_per_mtok: 0}}}}""")


def two_region_policy(us_ports: Sequence[int], eu_ports: Sequence[int], *, served_model: str, profile: str,
                      kv_cache_tokens: int, context_window: int, first_token_timeout: float | None = None,
                      ttft_objective: float | None = None, hedge_after: str | float | None = None) -> str:
    """Two regions; clients call ``chat-us`` or ``chat-eu`` (their home region), each falling back
    to ``chat`` (served in both regions) in the other region (the failover scenario).

    A fallback chain may not loop back (``chat-us → chat-eu → chat-us`` is refused), hence the
    third model: the region-neutral ``chat`` is only a fallback target.

    Args:
        us_ports: The us-east engines' ports.
        eu_ports: The eu-west engines' ports.
        served_model: The name the engines serve.
        profile: The engines' simulator profile.
        kv_cache_tokens: Each engine's KV-cache capacity.
        context_window: The models' context window.
        first_token_timeout: ``resilience.first_token_timeout`` in seconds (None: the gateway's default).
        ttft_objective: The tier's class's ``ttft_objective`` in seconds (its first-token deadline is then
            twice it; None: the class sets none).
        hedge_after: The class's ``hedge.after``: a quantile of the pool's observed TTFT (``p95``) or a delay
            in seconds (None: no hedging).
    """
    resilience = (f"resilience: {{first_token_timeout: {first_token_timeout:g}}}\n"
                  if first_token_timeout is not None else "")
    priority = ""
    if ttft_objective is not None:
        priority += f", ttft_objective: {ttft_objective:g}s"
    if hedge_after is not None:
        after = hedge_after if isinstance(hedge_after, str) else f"{hedge_after:g}s"
        priority += f", hedge: {{after: {after}}}"
    return f"""\
schema: 1
regions: [us-east, eu-west]
pools:
  - {{name: chat-us, region: us-east, served_model: {served_model}, endpoints: {_urls(us_ports)},
      kv_cache_tokens: {kv_cache_tokens}, sim_profile: {profile}}}
  - {{name: chat-eu, region: eu-west, served_model: {served_model}, endpoints: {_urls(eu_ports)},
      kv_cache_tokens: {kv_cache_tokens}, sim_profile: {profile}}}
""" + _tail(f"""\
models:
  - {{name: chat, pools: [chat-us, chat-eu], context_window: {context_window},
      price: {{input_per_mtok: 0, output_per_mtok: 0}}}}
  - {{name: chat-us, pools: [chat-us], context_window: {context_window}, fallback: ["chat@eu-west"],
      price: {{input_per_mtok: 0, output_per_mtok: 0}}}}
  - {{name: chat-eu, pools: [chat-eu], context_window: {context_window}, fallback: ["chat@us-east"],
      price: {{input_per_mtok: 0, output_per_mtok: 0}}}}""", priority) + resilience


def cache_policy(gen_ports: Sequence[int], embed_port: int, *, served_model: str, embed_model: str, profile: str,
                 kv_cache_tokens: int, context_window: int, min_similarity: float, ttl: str = "1h") -> str:
    """One pool of simulated replicas serving ``chat`` and ``faq``, an embeddings pool, and two response-cache
    rules (the cache scenario): ``exact`` for ``chat`` and ``faq`` (semantic, at ``min_similarity``, embedding the
    last user turn with the ``emb`` pool) for ``faq``."""
    return f"""\
schema: 1
regions: [local]
pools:
  - {{name: gen, region: local, served_model: {served_model}, endpoints: {_urls(gen_ports)},
      kv_cache_tokens: {kv_cache_tokens}, sim_profile: {profile}}}
  - {{name: emb, region: local, served_model: {embed_model}, task: embed, endpoints: {_urls([embed_port])},
      kv_cache_tokens: 100000}}
""" + _tail(f"""\
models:
  - {{name: chat, pools: [gen], context_window: {context_window},
      price: {{input_per_mtok: 0, output_per_mtok: 0}}}}
  - {{name: faq, pools: [gen], context_window: {context_window},
      price: {{input_per_mtok: 0, output_per_mtok: 0}}}}""") + f"""\
cache:
  - {{name: exact, match: {{models: [chat]}}, ttl: {ttl}}}
  - {{name: faq, match: {{models: [faq]}}, mode: semantic, min_similarity: {min_similarity:g}, embedding_pool: emb,
      ttl: {ttl}}}
"""
