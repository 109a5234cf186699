"""The ``failover`` scenario's setup: two regions (``HOME`` fails, ``HEALTHY`` carries its load), the phases
and the outages staged in them, the class's first-token objective and hedge, and the request mix (half the
clients at home in each region, half the requests streamed)."""

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
#: The outages staged, in order: ``down`` (the control server's mode down), ``kill`` (the region's simulator
#: process SIGKILLed, started again at the phase's end), ``hang`` (mode hang: the engines stall).
KINDS = ("down", "kill", "hang")
#: The phases in order: ``before``, then each outage followed by a healthy phase (``after`` the last one).
PHASES = ("before", "down", "between-1", "kill", "between-2", "hang", "after")
PHASE_S = dict.fromkeys(PHASES, 30.0)
#: --quick: a few seconds each; the phase after the kill leaves the restarted process time to start (2-7 s on two
#: busy cores), the gateway's probes time to take it back (two good probes a second apart) and the engines time
#: to carry traffic again before the hang (a fault waits for that if it must, and then lasts its whole phase).
QUICK_PHASE_S = {"before": 2.0, "down": 2.5, "between-1": 4.5, "kill": 2.5, "between-2": 8.0, "hang": 3.0,
                 "after": 3.0}
#: The class's time-to-first-token objective: its first-token deadline is twice it (the policy's default rule).
TTFT_OBJECTIVE_S = 1.0
DEADLINE_S = 2.0 * TTFT_OBJECTIVE_S
#: How much longer than its class's deadline a client may wait at most (the issue's goal).
WAIT_SLACK_S = 1.0
#: The class hedges late first tokens at the pool's observed TTFT p95.
HEDGE_AFTER = "p95"
TIME_SCALE = 1.0
KV_TOKENS = 100_000
CONTEXT = 8192
PROMPT_TOKENS = (200, 800)
#: Streams long enough that many are mid-answer at any moment (~6.5 ms a token on this profile: 0.4-1.7 s).
STREAM_OUTPUT = (64, 256)
#: Complete answers short enough that their wait is mostly their time to first token (0.1-0.4 s of decode).
COMPLETE_OUTPUT = (16, 64)
KIND_WORDS = {"down": "connection refused, open connections dropped",
              "kill": "simulator process SIGKILLed, restarted at the end",
              "hang": "engines stall: accept, never answer, /health green"}


def mix() -> list[RequestTemplate]:
    """The requests: chat, half with their home in each region (``chat-us``, ``chat-eu``), half streamed."""
    return [RequestTemplate(tenant=TENANT, request_class=region, model=f"chat-{region.split('-')[0]}",
                            prompt_tokens=PROMPT_TOKENS, output_tokens=STREAM_OUTPUT if stream else COMPLETE_OUTPUT,
                            stream=stream, name=f"{region}-{'stream' if stream else 'complete'}")
            for region in REGIONS for stream in (True, False)]
