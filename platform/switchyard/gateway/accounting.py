"""What a served request used: its reservation settled, the usage ledger and the token and spend counters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from switchyard.decide.admit import spend_of
from switchyard.engines.upstream import usage_counts
from switchyard.gateway.activity import RequestRecord
from switchyard.gateway.request import PendingRequest
from switchyard.policy.fleet import Model

if TYPE_CHECKING:
    from switchyard.gateway.runtime import GatewayRuntime


async def account(runtime: GatewayRuntime, req: PendingRequest, model: Model, usage: dict[str, Any] | None,
                  text_events: int, record: RequestRecord) -> None:
    """Settle ``req``'s reservation with what it used at ``model`` and add it to the usage ledger.

    The engine's ``usage`` when it sent one; else (a stream without ``include_usage``, or one its
    client left) the prompt as counted at admission and one token per text event.
    """
    prompt, completion, cached = req.decision.prompt_tokens, text_events, 0
    if usage is not None:
        prompt, completion, cached = usage_counts(usage, prompt, completion)
    record.prompt_tokens, record.completion_tokens, record.cached_tokens = prompt, completion, cached
    spend = spend_of(model, prompt, completion, cached, batch=req.batch)
    identity = req.identity
    runtime.usage.record(identity.tenant_id, identity.key_id, model.name, prompt, completion, cached, spend)
    prompt_total, completion_total, cached_total, spend_total = runtime.metrics.usage_counters(model.name)
    prompt_total.inc(prompt)
    completion_total.inc(completion)
    if cached:
        cached_total.inc(cached)
    spend_total.inc(spend)
    if req.lease.reservation is not None:
        await req.lease.settle(prompt + completion, spend)
