"""The ``failover`` scenario's setup: two regions (``HOME`` fails, ``HEALTHY`` carries its load), the phases
and the outages staged in them, and the request mix (half the clients at home in each region)."""

from __future__ import annotations

from switchyard.bench.policies import TENANT
from switchyard.bench.synthetic import RequestTemplate

REGIONS = ("us-east", "eu-west")
#: The region that fails, and the one that must carry its load.
HOME, HEALTHY = REGIONS
POOLS = {"us-east": "chat-us", "eu-west": "chat-eu"}
REPLICAS = 2
PROFILE = "h100-8b"
SERVED = "sim-8b"
RATE = 20.0
#: The phases in order (``before``, then each outage followed by a healthy phase) and their seconds.
PHASES = ("before", "down", "between", "hang", "after")
PHASE_S = dict.fromkeys(PHASES, 30.0)
#: --quick: a few seconds each; the hang gets more, as it is found only after first-token timeouts.
QUICK_PHASE_S = {"before": 1.5, "down": 2.5, "between": 2.5, "hang": 4.5, "after": 4.0}
#: The outages staged, in order.
KINDS = PHASES[1:-1:2]
#: The gateway's first-token timeout for this workload (prompts of 200-800 tokens: TTFT of tens of ms).
FIRST_TOKEN_TIMEOUT_S = 2.0
TIME_SCALE = 1.0
KV_TOKENS = 100_000
CONTEXT = 8192
KIND_WORDS = {"down": "connection refused", "hang": "accepts, never answers"}


def mix() -> list[RequestTemplate]:
    """The requests: streamed chat, half with their home in each region (``chat-us``, ``chat-eu``)."""
    return [RequestTemplate(tenant=TENANT, request_class=region, model=f"chat-{region.split('-')[0]}",
                            prompt_tokens=(200, 800), output_tokens=(16, 48), stream=True, name=region)
            for region in REGIONS]
