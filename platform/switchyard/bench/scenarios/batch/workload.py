"""The ``batch`` scenario's setup: one pool serving an interactive and a batch model name, an interactive
class and a batch-lane class, the interactive request mix and the batch's input lines."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from switchyard.bench.synthetic import RequestTemplate, poisson

ARMS = ("without-batch", "with-batch")
BASELINE = "without-batch"
WITH = "with-batch"
REPLICAS = 2
#: Sequence slots per replica, and the profile: a 32B model's step takes about twice an 8B model's, so
#: 16 slots a replica turn over at the rate 8 slots of ``h100-8b`` would (what two cores can drive), and
#: half the capacity (16 of 32 slots on average) seldom fills every slot in a Poisson burst: the
#: baseline's p99 is then not a few requests queued for a slot (as with 8 slots of ``h100-8b``: 1-2%
#: of them, and the p99 moved 34-96 ms from run to run) but the engines' and the gateway's latency.
MAX_NUM_SEQS = 16
PROFILE = "h100-32b"
#: Sequence slots of the pool the batch lane leaves free (the schema's default ``batch_reserve_slots``;
#: a test checks they agree).
DEFAULT_BATCH_RESERVE = 1
MODEL = "chat"
BATCH_MODEL = "chat-batch"
SERVED = "sim-32b"
KV_TOKENS = 100_000
CONTEXT = 8192
PROMPT_TOKENS = (100, 400)
OUTPUT_TOKENS = (32, 96)
TIER = "standard"
INTERACTIVE_CLASS = "interactive"
BATCH_CLASS = "batch"
INTERACTIVE_TENANT = "interactive"
BATCH_TENANT = "batch"
MAX_QUEUE_MS = 5000
#: The batch lane's utilisation ceiling: the policy here sets no ``max_utilisation``, so it is the
#: schema's default ``BATCH_MAX_UTILISATION`` (bench code imports no policy code; a test checks they agree).
DEFAULT_BATCH_CEILING = 0.95
#: The interactive load, as a share of the measured capacity.
LOAD = 0.5
#: The batch has enough lines to keep the whole pool busy this much longer than the window.
BATCH_MARGIN_S = 10.0


def batch_policy(ports: Sequence[int]) -> str:
    """The policy document: one pool, ``chat`` and ``chat-batch`` on it, an interactive and a batch-lane class."""
    urls = "[" + ", ".join(f"http://127.0.0.1:{p}" for p in ports) + "]"
    price = "{input_per_mtok: 3, output_per_mtok: 15}"
    return f"""\
schema: 1
regions: [local]
pools:
  - {{name: main, region: local, served_model: {SERVED}, endpoints: {urls},
      kv_cache_tokens: {KV_TOKENS}, sim_profile: {PROFILE}, max_num_seqs: {MAX_NUM_SEQS},
      priority_scheduling: true}}
models:
  - {{name: {MODEL}, pools: [main], context_window: {CONTEXT}, price: {price}}}
  - {{name: {BATCH_MODEL}, pools: [main], context_window: {CONTEXT}, price: {price}}}
priorities:
  {INTERACTIVE_CLASS}: {{max_queue_ms: {MAX_QUEUE_MS}}}
  {BATCH_CLASS}: {{lane: batch}}
tiers:
  - {{name: {TIER}, priority: {INTERACTIVE_CLASS}, models: ["*"]}}
"""


def interactive_mix(model: str = MODEL) -> list[RequestTemplate]:
    """The interactive requests: one tenant, streaming."""
    return [RequestTemplate(tenant=INTERACTIVE_TENANT, request_class=INTERACTIVE_CLASS, model=model,
                            prompt_tokens=PROMPT_TOKENS, output_tokens=OUTPUT_TOKENS, stream=True,
                            name=INTERACTIVE_TENANT)]


def batch_lines(count: int, seed: int) -> bytes:
    """The batch's input file: ``count`` chat lines (about: a Poisson draw) of the interactive lengths."""
    template = RequestTemplate(tenant=BATCH_TENANT, request_class=BATCH_CLASS, model=BATCH_MODEL,
                               prompt_tokens=PROMPT_TOKENS, output_tokens=OUTPUT_TOKENS, stream=False,
                               name=BATCH_TENANT)
    specs = poisson(count / 10.0, 10.0, [template], seed, max_model_len=CONTEXT).specs
    encode = msgspec.json.Encoder().encode
    return b"".join(encode({"custom_id": f"line-{s.index}", "method": "POST", "url": "/v1/chat/completions",
                            "body": s.body()}) + b"\n" for s in specs)
