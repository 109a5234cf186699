"""The tenants' side of the policy document: priority classes, and tiers with their limits."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PositiveFloat, PositiveInt, StringConstraints, model_validator

from switchyard.policy.base import ModelName, Name, Strict
from switchyard.policy.units import Duration

#: How long a batch-lane request may wait when its class sets no max_queue_ms.
BATCH_MAX_QUEUE_MS = 600_000
#: The utilisation under which batch-lane work is dispatched when its class sets no max_utilisation.
BATCH_MAX_UTILISATION = 0.95
#: Interactive requests (someone waits) and batch work (nobody waits) share engines, never a queue.
Lane = Literal["interactive", "batch"]
#: A class's first-token deadline, when it declares a TTFT objective but no deadline, is this many times it.
DEADLINE_PER_OBJECTIVE = 2.0
#: The observed quantiles of a pool's time to first token a hedge may wait for.
HedgeQuantile = Literal["p50", "p90", "p95", "p99"]


class HedgeSpec(Strict):
    """Hedged first tokens: a streamed request whose first token is late is also sent to a second endpoint;
    whichever answers first serves it and the other is aborted at once.

    A hedge is a retry as far as the retry budget is concerned (it needs the budget's consent), and none is
    sent while the stage's pools are at or above ``max_utilisation`` (a saturated fleet gains nothing from
    doubled work). Only streamed requests are hedged: a complete answer shows no first token to wait for.
    """

    after: HedgeQuantile | Duration = Field(
        default="p95", description="When to hedge: a quantile of the pool's observed time to first token (`p95`: "
        "the slowest 5% are hedged), or a fixed delay in seconds. With a quantile and no observations yet, no "
        "hedge is sent.")
    min_delay: Duration = Field(
        default=0.05, description="Never hedge sooner than this after the first try was sent (seconds).")
    max_utilisation: float = Field(
        default=0.8, gt=0, le=1, description="No hedge while every pool of the stage is at least this full.")


class PriorityClass(Strict):
    """A priority class: how long its requests may queue and when they are shed.

    Interactive classes are served best first; within a class tenants share by start-time fair
    queuing in tokens. Batch-lane classes wait in a queue of their own that is served only while
    the pool's interactive queue is empty and its utilisation is under ``max_utilisation``.
    """

    lane: Lane = "interactive"
    max_queue_ms: PositiveInt | None = Field(
        default=None, description="How long a request may wait in the gateway's queue (required for the "
        f"interactive lane; batch lane default {BATCH_MAX_QUEUE_MS}).")
    shed_above_utilisation: float | None = Field(
        default=None, gt=0, le=1,
        description="Refuse (503) requests of this class at once while their pools' utilisation is above this.")
    max_utilisation: float | None = Field(
        default=None, gt=0, le=1,
        description=f"Batch lane only: dispatch while the pool's utilisation is below this "
        f"(default {BATCH_MAX_UTILISATION}).")
    ttft_objective: Duration | None = Field(
        default=None, description="The class's time-to-first-token objective (its SLO), in seconds: what its "
        "first-token deadline is derived from when none is set, and what `switchyard bench` measures attainment "
        "against.")
    first_token_deadline: Duration | None = Field(
        default=None, description="How long one try of a request of this class may go without producing before "
        "it moves on to the next endpoint of its fallback plan: a stream's first byte, or for a complete answer "
        "any sign of progress from its engine; and the longest silence mid-stream before the stream is resumed "
        f"elsewhere. Default: {DEADLINE_PER_OBJECTIVE:g}x `ttft_objective` when set, else the model's "
        "`first_token_timeout` (or `resilience.first_token_timeout`).")
    hedge: HedgeSpec | None = Field(
        default=None, description="Hedge late first tokens of this class's streamed requests (interactive "
        "classes only). Unset: never.")
    engine_priority: int | None = Field(
        default=None, ge=-1_000_000, le=1_000_000,
        description="vLLM request `priority` for this class (lower is served first). Default: the class's "
        "position in `priorities` times 10 (0 for the first class, 10 for the second, ...), plus 1000 for a "
        "batch-lane class, so that the engine preempts batch work first.",
    )

    @model_validator(mode="after")
    def _deadline(self) -> PriorityClass:
        if self.lane == "interactive" and self.max_queue_ms is None:
            raise ValueError("an interactive class needs max_queue_ms (its queue deadline)")
        if self.lane == "interactive" and self.max_utilisation is not None:
            raise ValueError("max_utilisation applies to the batch lane only (an interactive class uses "
                             "shed_above_utilisation)")
        if self.lane == "batch" and self.hedge is not None:
            raise ValueError("hedge applies to interactive classes only (nobody waits for a batch line's first "
                             "token)")
        if self.lane == "batch" and self.ttft_objective is not None:
            raise ValueError("ttft_objective applies to interactive classes only (set first_token_deadline for "
                             "the batch lane)")
        return self

    def deadline(self, fallback_s: float) -> float:
        """The class's first-token deadline in seconds (``fallback_s``: the model's or the policy's first-token
        timeout, for a class that sets neither a deadline nor an objective)."""
        if self.first_token_deadline is not None:
            return self.first_token_deadline
        if self.ttft_objective is not None:
            return DEADLINE_PER_OBJECTIVE * self.ttft_objective
        return fallback_s

    @property
    def queue_deadline_s(self) -> float:
        """How long a request of the class may wait in the gateway's queue, in seconds."""
        ms = self.max_queue_ms if self.max_queue_ms is not None else BATCH_MAX_QUEUE_MS
        return ms / 1000.0

    @property
    def dispatch_ceiling(self) -> float:
        """The utilisation under which the class's requests are dispatched."""
        if self.lane == "batch":
            return self.max_utilisation if self.max_utilisation is not None else BATCH_MAX_UTILISATION
        return 1.0


class Limits(Strict):
    """Token-denominated limits; absent means unlimited."""

    tokens_per_minute: PositiveInt | None = None
    requests_per_minute: PositiveInt | None = None
    tokens_per_day: PositiveInt | None = None
    spend_per_month: PositiveFloat | None = None

    @model_validator(mode="after")
    def _ordered(self) -> Limits:
        tpm, tpd = self.tokens_per_minute, self.tokens_per_day
        if tpm is not None and tpd is not None and tpm > tpd:
            raise ValueError(f"tokens_per_minute ({tpm}) exceeds tokens_per_day ({tpd})")
        return self


class Tier(Strict):
    """A class of tenants: its priority, the models it may use, and its limits."""

    name: Name
    priority: Name
    models: list[Annotated[str, StringConstraints(min_length=1)]] = Field(
        min_length=1, description="Models and routes this tier may call; '*' for all."
    )
    limits: Limits = Field(default_factory=Limits)
    model_limits: dict[ModelName, Limits] = Field(default_factory=dict)
    regions: list[Name] | None = Field(
        default=None, min_length=1, description="Regions this tier's requests may be served in (data residency; "
        "default: all). Endpoints elsewhere are filtered out, fallbacks included.")
