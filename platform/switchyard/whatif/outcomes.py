"""What a replayed request met, and one policy's replay: the figures the what-if report compares."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from switchyard.simtext.chat import render_chat
from switchyard.simtext.tokens import SPECIAL_TOKENS, tokenize

#: What the replay leaves out, each with what that means for its figures.
NOT_MODELLED: tuple[str, ...] = (
    "semantic cache rules (answers by meaning need the embedding model): only exact rules are replayed",
    "batch preemption (the gateway cancels its own batch requests for interactive ones): batch work "
    "holds its place in the engine",
    "engine failures, timeouts and retries: every engine stays healthy",
    "several gateway replicas: one gateway's queues and limits",
)
_BOS = SPECIAL_TOKENS["<|begin_of_text|>"]


@dataclass(slots=True)
class ReplayOutcome:
    """What one request would have met under one policy.

    Attributes:
        index: The request's position in the workload.
        arrival_s: Its arrival, in simulated seconds from the start.
        tier: The tier it was sent as.
        request_class: The priority class the tier has in this policy (``-`` for an unknown tier).
        requested: The ``model`` it asked for.
        status: 200 when served, else the status the gateway would answer with.
        code: The error code of a refusal.
        limit: The limit that refused it (429).
        resolved_model: The model its request resolved to (its route's choice), if it got that far.
        priority: The priority class it was served in (its tier's, or lower when it asked), if classed.
        plan: Its fallback plan's stages, in order.
        model: The model that served it (a fallback's when the plan moved on), if any.
        pool, region, endpoint: Where it ran, if it did.
        prompt_tokens: Prompt tokens the engine saw (chat template included).
        cached_tokens: Of those, tokens found in the engine's prefix cache.
        output_tokens: Tokens generated.
        ttft_s: Time to first token, from arrival.
        e2e_s: Time to the last token, from arrival.
        cost: Its price at the serving model's rates.
        queued_s: Time it waited in flow control's queue (None: it did not queue).
        downgraded_from: The model flow control downgraded it from, if it did.
        cache_hit: Answered from the response cache.
        canary: Its part in a replayed canary: ``canary`` (the candidate decided it), ``control`` (in the
            canary's scope; the active version decided it), None (outside the scope, or no canary).
    """

    index: int
    arrival_s: float
    tier: str
    request_class: str
    requested: str
    status: int = 200
    code: str | None = None
    limit: str | None = None
    resolved_model: str | None = None
    priority: str | None = None
    plan: tuple[str, ...] = ()
    model: str | None = None
    pool: str | None = None
    region: str | None = None
    endpoint: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    cost: float = 0.0
    queued_s: float | None = None
    downgraded_from: str | None = None
    cache_hit: bool = False
    canary: str | None = None

    @property
    def placement(self) -> str:
        """Where it went, as one comparable string: ``model @ pool (region)`` or the refusal."""
        if self.status != 200:
            return f"refused {self.status} ({self.code})"
        if self.cache_hit:
            return f"{self.model} @ response cache"
        return f"{self.model} @ {self.pool} ({self.region})"


@dataclass(slots=True)
class ArmResult:
    """One policy's replay.

    Attributes:
        name: ``active`` or ``candidate`` (or any label the caller gives).
        policy: The policy's label (``v7``, or a short hash for an unversioned document).
        sha256: The policy text's hash.
        outcomes: One per request, in workload order.
        simulated_s: Simulated seconds from the first arrival to the last token.
        wall_s: Wall-clock seconds the replay took.
        canary: The canary replayed, when the arm replayed one (its candidate, slice and scope): the candidate
            decided the outcomes whose ``canary`` is ``canary``, the active version the others.
    """

    name: str
    policy: str
    sha256: str
    outcomes: list[ReplayOutcome]
    simulated_s: float
    wall_s: float
    not_modelled: tuple[str, ...] = NOT_MODELLED
    canary: dict[str, Any] | None = None

    @property
    def speedup(self) -> float | None:
        """Simulated seconds per wall-clock second."""
        return self.simulated_s / self.wall_s if self.wall_s > 0 else None


def prompt_ids(body: Mapping[str, Any]) -> list[int]:
    """The token ids a simulated engine makes of a request body's prompt."""
    if "messages" in body:
        return render_chat(body["messages"], body.get("tools"), body.get("response_format"))
    return [_BOS, *tokenize(str(body["prompt"]))]
