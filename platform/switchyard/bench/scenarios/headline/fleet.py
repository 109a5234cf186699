"""The ``headline`` scenario's fleet, tenants and policies: two regions of four simulated replicas (two of a
small and two of a large model), three tiers mapped to three priority classes with their TTFT objectives, a
batch tenant, and the policy document of each arm."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from switchyard.bench.scenarios.headline.day import Tenant

#: The arms, in the order they run (the first one's capacity sets the day's load).
ROUND_ROBIN, LEAST_LOADED, SWITCHYARD, NO_BACKLOG = "round-robin", "least-loaded", "switchyard", "switchyard-no-backlog"
ARMS = (ROUND_ROBIN, LEAST_LOADED, SWITCHYARD, NO_BACKLOG)
BASELINES = (ROUND_ROBIN, LEAST_LOADED)
#: The endpoint picker of each arm's gateway (``SWITCHYARD_PICKER``).
PICKER = {ROUND_ROBIN: "round-robin", LEAST_LOADED: "least-loaded", SWITCHYARD: "prefix-aware",
          NO_BACKLOG: "prefix-aware"}
#: The arms given the batch backlog (the baselines send its lines as ordinary requests).
WITH_BACKLOG = (ROUND_ROBIN, LEAST_LOADED, SWITCHYARD)

REGIONS = ("us-east", "eu-west")
#: The region taken down in the middle of the day, and when (shares of the day).
OUTAGE_REGION = "eu-west"
OUTAGE = (0.45, 0.6)
SMALL, LARGE = "small", "large"
MODELS = (SMALL, LARGE)
SERVED = {SMALL: "sim-8b", LARGE: "sim-32b"}
PROFILE = {SMALL: "h100-8b", LARGE: "h100-32b"}
#: Replicas of each model in each region.
REPLICAS = 2
MAX_NUM_SEQS = 4
KV_TOKENS = 60_000
CONTEXT = 8192
#: Mooncake's lengths times this (the conversation trace's prompts of some 12,000 tokens on average become
#: about 1,200, its answers of some 340 tokens about 35).
TOKEN_SCALE = 0.1
PRICE = {SMALL: (0.10, 0.20), LARGE: (0.40, 1.20)}  # dollars per million input, output tokens
#: ``auto`` sends prompts shorter than this to the small model, the rest to the large one.
AUTO_SMALL_BELOW = 1000

TIERS = {"enterprise": "critical", "pro": "standard", "free": "sheddable"}
CLASSES = ("critical", "standard", "sheddable")
#: Each class's TTFT objective (seconds from the scheduled time).
SLO_TTFT_S = {"critical": 1.0, "standard": 3.0, "sheddable": 10.0}
MAX_QUEUE_MS = {"critical": 5000, "standard": 3000, "sheddable": 8000}
SHED_ABOVE = 0.9
TENANTS = (Tenant("bank", "enterprise", 0.08), Tenant("clinic", "enterprise", 0.07),
           Tenant("shop", "pro", 0.25), Tenant("studio", "pro", 0.2),
           Tenant("hobby", "free", 0.25), Tenant("students", "free", 0.15))
#: The free tier's per-tenant limit (tokens per minute) in the Switchyard arms: about a quarter of what the
#: fleet turns over in a minute (some 60 requests/s of some 1,200 tokens), so that no free tenant can take more.
FREE_TOKENS_PER_MINUTE = 1_000_000
#: The large model's standard and sheddable requests go to the small one once its pools are this full: the rest
#: of the large pools is kept for critical requests (``on_saturation.at_utilisation``).
DOWNGRADE_AT = 0.75
BATCH_TENANT, BATCH_TIER = "analytics", "pro"
BATCH_CLASS = "batch"


#: The Switchyard arms' response cache: an exact answer repeated answers at once (per tenant, ten minutes).
CACHE_RULES = """\
cache:
  - {name: repeated-questions, match: {routes: [auto]}, mode: exact, ttl: 10m, scope: tenant}
"""


def ports_of(ports: Sequence[int]) -> dict[tuple[str, str], list[int]]:
    """``ports`` dealt out to (region, model), ``REPLICAS`` each, in the order of ``REGIONS`` and ``MODELS``."""
    out: dict[tuple[str, str], list[int]] = {}
    it = iter(ports)
    for region in REGIONS:
        for model in MODELS:
            out[(region, model)] = [next(it) for _ in range(REPLICAS)]
    return out


def pool_name(region: str, model: str) -> str:
    return f"{model}-{region}"


def policy(arm: str, ports: Mapping[tuple[str, str], Sequence[int]]) -> str:
    """The policy document of ``arm``: the same fleet, models, ``auto`` route and fallbacks for every arm; the
    Switchyard arms add priority scheduling, TTFT objectives, queue deadlines and shedding, the free tier's
    limit, the large model's downgrades, the response cache and the batch lane."""
    full = arm not in BASELINES
    pools = []
    for (region, model), endpoints in ports.items():
        urls = ", ".join(f"http://127.0.0.1:{p}" for p in endpoints)
        pools.append(f"  - {{name: {pool_name(region, model)}, region: {region}, served_model: {SERVED[model]}, "
                     f"endpoints: [{urls}], kv_cache_tokens: {KV_TOKENS}, sim_profile: {PROFILE[model]}, "
                     f"max_num_seqs: {MAX_NUM_SEQS}, priority_scheduling: {'true' if full else 'false'}}}")
    models = []
    for model in MODELS:
        inp, out = PRICE[model]
        fallback = [SMALL] if model == LARGE else []
        extra = (f", on_saturation: [{{downgrade_to: small, classes: [standard, sheddable], "
                 f"at_utilisation: {DOWNGRADE_AT:g}}}, {{downgrade_to: small, classes: [critical], "
                 "wait_for_either: true}]" if full and model == LARGE else "")
        models.append(f"  - {{name: {model}, pools: [{', '.join(pool_name(r, model) for r in REGIONS)}], "
                      f"tokenizer: switchyard-sim, context_window: {CONTEXT}, "
                      f"price: {{input_per_mtok: {inp}, output_per_mtok: {out}}}, fallback: [{', '.join(fallback)}]"
                      f"{extra}}}")
    # (The baselines' gateways run without flow control: their queue deadlines are never used.)
    classes = [f"  {c}: {{max_queue_ms: {MAX_QUEUE_MS[c]}"
               + (f", ttft_objective: {SLO_TTFT_S[c]:g}" if full else "")
               + (f", shed_above_utilisation: {SHED_ABOVE:g}" if full and c == "sheddable" else "") + "}"
               for c in CLASSES]
    if full:
        classes.append(f"  {BATCH_CLASS}: {{lane: batch}}")
    tiers = []
    for tier, cls in TIERS.items():
        limit = f", limits: {{tokens_per_minute: {FREE_TOKENS_PER_MINUTE}}}" if full and tier == "free" else ""
        tiers.append(f"  - {{name: {tier}, priority: {cls}, models: [\"*\"]{limit}}}")
    newline = "\n"
    return f"""\
schema: 1
regions: [{', '.join(REGIONS)}]
pools:
{newline.join(pools)}
models:
{newline.join(models)}
routes:
  - name: auto
    rules:
      - {{name: short-to-small, when: {{prompt_tokens_lt: {AUTO_SMALL_BELOW}}}, model: small}}
    default: large
priorities:
{newline.join(classes)}
tiers:
{newline.join(tiers)}
""" + (CACHE_RULES if full else "")
