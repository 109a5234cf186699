"""What a served request used: its reservation settled, the usage ledger and the token and spend counters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from switchyard.decide.admit import spend_of
from switchyard.gateway.activity import RequestRecord
from switchyard.gateway.request import LegUsage, PendingRequest

if TYPE_CHECKING:
    from switchyard.gateway.runtime import GatewayRuntime


async def account(runtime: GatewayRuntime, req: PendingRequest, legs: Sequence[LegUsage],
                  record: RequestRecord) -> None:
    """Settle ``req``'s reservation with what its engines used (``legs``: one per engine that produced part of
    the answer, each at its own model's prices) and add it to the usage ledger.

    Each leg's usage is the engine's ``usage`` when it sent one; else (a stream without ``include_usage``, one
    its client left, or one its engine broke off) its prompt as counted at admission and one token per text
    event.
    """
    identity = req.identity
    prompt_sum = completion_sum = cached_sum = 0
    spend_sum = 0.0
    for i, leg in enumerate(legs):
        model = leg.model
        prompt, completion, cached = leg.prompt_tokens, leg.completion_tokens, leg.cached_tokens
        spend = spend_of(model, prompt, completion, cached, batch=req.batch)
        # (One request, whatever the engines that served parts of it: the ledger counts it once.)
        runtime.usage.record(identity.tenant_id, identity.key_id, model.name, prompt, completion, cached, spend,
                             requests=0 if i else 1)
        prompt_total, completion_total, cached_total, spend_total = runtime.metrics.usage_counters(model.name)
        prompt_total.inc(prompt)
        completion_total.inc(completion)
        if cached:
            cached_total.inc(cached)
        spend_total.inc(spend)
        prompt_sum, completion_sum, cached_sum = prompt_sum + prompt, completion_sum + completion, cached_sum + cached
        spend_sum += spend
    record.prompt_tokens, record.completion_tokens, record.cached_tokens = prompt_sum, completion_sum, cached_sum
    record.spend = spend_sum
    if record.canary is not None:
        runtime.canary.spent(record, spend_sum)
    if req.lease.reservation is not None:
        await req.lease.settle(prompt_sum + completion_sum, spend_sum)
