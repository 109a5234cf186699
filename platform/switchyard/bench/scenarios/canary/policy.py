"""The ``canary`` scenario's fleet, tenants and policy documents: the one that runs first, the harmless change
(the good candidate) and the costly one (the bad candidate)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: The pools: two replicas of an 8B model (``small``) and one of a 70B model (``large``).
SMALL_PROFILE, SMALL_SERVED, SMALL_ENGINES = "h100-8b", "sim-8b", 2
LARGE_PROFILE, LARGE_SERVED, LARGE_ENGINES = "h100-70b", "sim-70b", 1
ENGINES = SMALL_ENGINES + LARGE_ENGINES
#: What clients ask for: a route sending long prompts to ``large`` and the rest to ``small``.
ROUTE = "chat"
LONG_PROMPT_TOKENS = 1000
#: Prices per million tokens (input, output): ``large`` costs 9x (input) to 13.5x (output) ``small``.
SMALL_PRICE = (0.10, 0.20)
LARGE_PRICE = (0.90, 2.70)


@dataclass(frozen=True, slots=True)
class Tier:
    """A tier of the policy and the share of the tenants in it."""

    name: str
    priority: str
    tokens_per_minute: int
    share: float


#: Three tiers, each in its own priority class (the canary's figures are compared per class and over all).
TIERS = (Tier("enterprise", "critical", 2_000_000, 0.1), Tier("pro", "standard", 400_000, 0.3),
         Tier("free", "sheddable", 100_000, 0.6))


def tenants(count: int) -> list[tuple[str, str]]:
    """``count`` tenants ``(name, tier)``, spread over :data:`TIERS` by their shares (round robin, so any prefix of
    the list has about the same mix)."""
    out: list[tuple[str, str]] = []
    credit = dict.fromkeys((t.name for t in TIERS), 0.0)
    for i in range(count):
        for t in TIERS:
            credit[t.name] += t.share
        tier = max(TIERS, key=lambda t: credit[t.name]).name
        credit[tier] -= 1.0
        out.append((f"tenant-{i:03d}", tier))
    return out


def base_policy(small_ports: Sequence[int], large_ports: Sequence[int]) -> str:
    """The policy active when the run begins (it becomes version 1)."""
    def urls(ports: Sequence[int]) -> str:
        return "[" + ", ".join(f"http://127.0.0.1:{p}" for p in ports) + "]"

    tiers = "\n".join(f"  - {{name: {t.name}, priority: {t.priority}, models: [\"*\"], "
                      f"limits: {{tokens_per_minute: {t.tokens_per_minute}}}}}" for t in TIERS)
    return f"""\
schema: 1
regions: [local]
pools:
  - {{name: small, region: local, served_model: {SMALL_SERVED}, endpoints: {urls(small_ports)},
      kv_cache_tokens: 200000, sim_profile: {SMALL_PROFILE}}}
  - {{name: large, region: local, served_model: {LARGE_SERVED}, endpoints: {urls(large_ports)},
      kv_cache_tokens: 200000, sim_profile: {LARGE_PROFILE}}}
models:
  - {{name: small, pools: [small], context_window: 8192,
      price: {{input_per_mtok: {SMALL_PRICE[0]}, output_per_mtok: {SMALL_PRICE[1]}}}}}
  - {{name: large, pools: [large], context_window: 8192,
      price: {{input_per_mtok: {LARGE_PRICE[0]}, output_per_mtok: {LARGE_PRICE[1]}}}}}
routes:
  - name: {ROUTE}
    rules:
      - {{name: long-to-large, when: {{prompt_tokens_gte: {LONG_PROMPT_TOKENS}}}, model: large}}
    default: small
priorities:
  critical: {{max_queue_ms: 3000}}
  standard: {{max_queue_ms: 2000}}
  sheddable: {{max_queue_ms: 1000}}
tiers:
{tiers}
cache:
  - {{name: exact, match: {{models: [small]}}, mode: exact, ttl: 10m, scope: tenant}}
"""


#: What the good candidate changes: the exact cache rule's lifetime (the workload repeats no request, so nothing
#: the clients see changes).
GOOD_CHANGE = "the exact cache rule's ttl from 10m to 20m"


def good_candidate(base: str) -> str:
    """A harmless change of ``base``: :data:`GOOD_CHANGE`."""
    changed = base.replace("mode: exact, ttl: 10m", "mode: exact, ttl: 20m")
    if changed == base:
        raise ValueError("the base policy has no exact cache rule of 10m to change")
    return changed


#: What the bad candidate changes: the route's default, so that every request goes to the large model.
BAD_CHANGE = "the chat route's default from small to large (every request on the 70B model, priced 9x to 13.5x " \
             "small: a slower first token, and about twice the cost per request of this mix)"


def bad_candidate(base: str) -> str:
    """A costly change of ``base``: :data:`BAD_CHANGE`."""
    changed = base.replace("    default: small\n", "    default: large\n")
    if changed == base:
        raise ValueError("the base policy's route has no default of small to change")
    return changed
