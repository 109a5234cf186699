"""The tenants' side of the policy document: priority classes, and tiers with their limits."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PositiveFloat, PositiveInt, StringConstraints, model_validator

from switchyard.policy.base import ModelName, Name, Strict

#: How long a batch-lane request may wait when its class sets no max_queue_ms.
BATCH_MAX_QUEUE_MS = 600_000
#: The utilisation under which batch-lane work is dispatched when its class sets no max_utilisation.
BATCH_MAX_UTILISATION = 0.95
#: Interactive requests (someone waits) and batch work (nobody waits) share engines, never a queue.
Lane = Literal["interactive", "batch"]


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
        return self

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
