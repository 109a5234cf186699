"""How a policy version goes live: a canary's slice, steps and guardrails (the ``rollout:`` stanza).

The same model is read from a document's ``rollout:`` stanza (in file mode a changed document that
carries one starts a canary instead of going live at once), from ``switchyard policy canary start``'s
flags and from the admin API's body.

- **Slice**: ``by`` names what a request is hashed by (``tenant``, the default, so that one tenant's
  experience is consistent; ``key``; ``session``; ``request``); a request is in the slice when its hash
  falls under the current step's percentage. ``only`` limits the canary to tiers, regions (the
  gateway's) or models (what the client asked for); requests outside it are neither slice nor control.
- **Steps**: percentages, strictly increasing, each held ``hold`` seconds (and until the guardrails have
  seen ``min_requests`` of the slice in it); passing the last step promotes the version. A last step of
  100 is the promotion itself. Without steps a canary stays at ``percent`` until promoted or aborted.
- **Guards**: compared between the slice and the rest of the canary's scope over the last ``window`` of the
  current step (the whole last ``window`` until the step has ``min_requests`` of its own; see
  :mod:`switchyard.decide.canary` for the tests). A breach rolls the canary back at once.
- **Shadow**: the candidate decides the requests of the slice alongside the active version without
  serving them; what differs is counted and sampled into the request log.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import Field, model_validator

from switchyard.policy.base import ModelName, Name, Strict
from switchyard.policy.units import Duration

#: What a request can be hashed by to fall in a canary's slice.
SLICE_BY = ("tenant", "key", "session", "request")
#: The guardrails a canary can declare: each with its kind of limit.
RATIO_GUARDS = ("ttft_p99", "cost_per_1k")
INCREASE_GUARDS = ("error_rate", "shed_rate", "rate_limited_rate")
GUARDS = RATIO_GUARDS + INCREASE_GUARDS
#: Declared when a canary names none: TTFT p99 at most 1.5x the rest's, error rate at most 1 point
#: above, shed and 429 rates at most 2 points above, cost per 1,000 requests at most 1.25x.
GuardName = Literal["ttft_p99", "cost_per_1k", "error_rate", "shed_rate", "rate_limited_rate"]
DEFAULT_GUARDS: dict[GuardName, float] = {"ttft_p99": 1.5, "error_rate": 0.01, "shed_rate": 0.02,
                                    "rate_limited_rate": 0.02, "cost_per_1k": 1.25}


class Step(Strict):
    """One step: serve ``percent`` of the scope's traffic for at least ``hold``."""

    percent: float = Field(gt=0, le=100)
    hold: Duration = Field(default=60.0, description="How long the step is held before the next (seconds or "
                           "'2m').")


class Scope(Strict):
    """Which requests a canary may take (empty: any)."""

    tiers: list[Name] = Field(default_factory=list)
    regions: list[Name] = Field(default_factory=list)
    models: list[ModelName] = Field(default_factory=list)


class Rollout(Strict):
    """A canary's slice, steps and guardrails (see the module doc)."""

    by: Literal["tenant", "key", "session", "request"] = "tenant"
    percent: float | None = Field(default=None, gt=0, le=100, description="Without steps: the share served "
                                  "(shadow: decided alongside), held until promoted or aborted.")
    steps: list[Step] = Field(default_factory=list, description="Strictly increasing percentages; passing the "
                              "last promotes.")
    only: Scope = Field(default_factory=Scope)
    guards: dict[GuardName, float] = Field(
        default_factory=lambda: dict(DEFAULT_GUARDS),
        description="ttft_p99 and cost_per_1k: the largest ratio canary/rest; error_rate, shed_rate, "
        "rate_limited_rate: the largest increase (0.01 is one point).")
    window: Duration = Field(default=120.0, description="The sliding window the guardrails compare over.")
    min_requests: int = Field(default=200, ge=20, description="Requests each side needs in the window before a "
                              "guard is tested (per class for a class's test), and the slice in a step before it "
                              "passes.")
    alpha: float = Field(default=0.001, gt=0, lt=0.5, description="The chance of a false breach allowed per "
                         "evaluation, shared among its tests (Bonferroni).")
    shadow: bool = Field(default=False, description="Decide the slice with the candidate without serving it.")

    @model_validator(mode="after")
    def _check(self) -> Rollout:
        percents = [s.percent for s in self.steps]
        if any(b <= a for a, b in itertools.pairwise(percents)):
            raise ValueError("steps' percentages must increase strictly")
        if 100 in percents[:-1]:
            raise ValueError("a step of 100% can only be the last (it is the promotion)")
        if not self.steps and self.percent is None:
            raise ValueError("give steps, or a percent to hold until promoted or aborted")
        if self.percent == 100 and not self.shadow:
            raise ValueError("a canary of 100% leaves nothing to compare it with: publish (or promote) instead")
        if self.steps and self.percent is not None:
            raise ValueError("give steps or a percent, not both (the first step is the starting percent)")
        for name, value in self.guards.items():
            if name in RATIO_GUARDS and value < 1:
                raise ValueError(f"guard {name} is a ratio canary/rest: it must be >= 1 (1.5 allows 50% more)")
            if name in INCREASE_GUARDS and not 0 <= value < 1:
                raise ValueError(f"guard {name} is an increase of a rate: 0 to 1 (0.01 is one point)")
        return self

    @property
    def stages(self) -> list[Step]:
        """The steps served before promotion (a last step of 100% is the promotion, not a stage)."""
        if not self.steps:
            assert self.percent is not None
            return [Step(percent=self.percent, hold=float("inf"))]
        return [s for s in self.steps if s.percent < 100]

    @property
    def automatic(self) -> bool:
        """Whether passing the steps promotes the version (a canary at a fixed percent waits for a person)."""
        return bool(self.steps)


_GUARD = re.compile(r"^\s*([a-z0-9_]+)\s*(?:<=|=|:|<)\s*([+]?)\s*(\d+(?:\.\d+)?)\s*(x|%)?\s*$")
_STEP = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%?\s*(?:[:@/]\s*(\S+))?\s*$")
#: Other names a guard is known by on the command line and in the console.
GUARD_ALIASES = {"ttft": "ttft_p99", "p99_ttft": "ttft_p99", "ttft_p99_ms": "ttft_p99", "cost": "cost_per_1k",
                 "cost_per_1000": "cost_per_1k", "errors": "error_rate", "error": "error_rate", "shed": "shed_rate",
                 "rate_limited": "rate_limited_rate", "limited_rate": "rate_limited_rate", "429": "rate_limited_rate",
                 "429_rate": "rate_limited_rate"}


def parse_guard(text: str) -> tuple[str, float]:
    """``ttft_p99=1.5x`` (or ``+50%``), ``cost_per_1k=1.25x``, ``error_rate=+1%`` (or ``0.01``),
    ``shed_rate=+0.02`` as (name, limit); ``<=`` or ``:`` may stand for ``=``.

    Raises:
        ValueError: not a guard, or its limit is written the other kind's way.
    """
    m = _GUARD.match(text)
    name = GUARD_ALIASES.get(m.group(1), m.group(1)) if m is not None else None
    if m is None or name not in GUARDS:
        raise ValueError(f"invalid guard {text!r}: use NAME=LIMIT with NAME one of {', '.join(GUARDS)} "
                         "(ttft_p99=1.5x, error_rate=+1%)")
    _, plus, number, unit = m.groups()
    value = float(number)
    if name in RATIO_GUARDS:
        if unit == "%":  # +50% (or 150%) of the rest's
            return name, 1 + value / 100 if plus else value / 100
        if plus:
            raise ValueError(f"guard {name} is a ratio: write it like {name}=1.5x or {name}=+50%")
        return name, value
    if unit == "x":
        raise ValueError(f"guard {name} is an increase of a rate: write it like {name}=+1% or {name}=+0.01")
    return name, value / 100 if unit == "%" else value


def parse_step(text: str) -> dict[str, float | str]:
    """``10`` or ``10:2m`` (percent, hold; ``10%@2m`` too) as a step's fields.

    Raises:
        ValueError: not a step.
    """
    m = _STEP.match(text)
    if m is None:
        raise ValueError(f"invalid step {text!r}: use PERCENT or PERCENT:HOLD (10:2m)")
    step: dict[str, float | str] = {"percent": float(m.group(1))}
    if m.group(2):
        step["hold"] = m.group(2)
    return step


def rollout_from_flags(*, percent: float | None = None, by: str = "tenant", steps: Sequence[str] = (),
                       guards: Sequence[str] = (), tiers: Sequence[str] = (), regions: Sequence[str] = (),
                       models: Sequence[str] = (), window: str | float | None = None, min_requests: int | None = None,
                       alpha: float | None = None, shadow: bool = False) -> Rollout:
    """A rollout from the command line's (and the console form's) words: ``steps`` as ``10:2m`` (or several in one,
    ``1:1m,10:2m``), ``guards`` as ``ttft_p99=1.5x`` (none given: the defaults); ``percent`` with steps is where the
    canary starts (a step before the first, held as long, unless it is the first).

    Raises:
        ValueError: a step or guard is not written right (pydantic's ValidationError, a ValueError, for the rest).
    """
    data: dict[str, Any] = {"by": by, "shadow": shadow,
                            "only": {"tiers": list(tiers), "regions": list(regions), "models": list(models)}}
    parsed = [parse_step(part) for text in steps for part in text.split(",") if part.strip()]
    if parsed and percent is not None:  # where it starts: the first step, or one before the steps
        first = float(parsed[0]["percent"])
        if percent > first:
            raise ValueError(f"the starting percent ({percent:g}) is above the first step's {first:g}%: the steps "
                             "rise from it")
        if percent < first:
            parsed.insert(0, {"percent": percent, **({"hold": parsed[0]["hold"]} if "hold" in parsed[0] else {})})
        percent = None
    if parsed:
        data["steps"] = parsed
    if percent is not None:
        data["percent"] = percent
    if shadow and not steps and percent is None:
        data["percent"] = 100.0  # the candidate decides alongside every request of the scope
    if guards:
        data["guards"] = dict(parse_guard(g) for g in guards)
    if window is not None:
        data["window"] = window
    if min_requests is not None:
        data["min_requests"] = min_requests
    if alpha is not None:
        data["alpha"] = alpha
    return Rollout.model_validate(data)


#: A rollout's fields as an API body names them (``mode``: ``canary`` or ``shadow``, another way to say shadow).
BODY_FIELDS = ("by", "percent", "steps", "only", "guards", "window", "min_requests", "alpha", "shadow", "mode")


def rollout_from_body(data: Mapping[str, Any]) -> Rollout:
    """A rollout from an API body's fields (:data:`BODY_FIELDS`): steps as objects or as ``10:2m`` words, guards'
    limits as numbers or as words (``1.5x``, ``+1%``), ``mode`` for ``shadow``.

    Raises:
        ValueError: a field is wrong (pydantic's ValidationError for the model's own checks).
    """
    fields = {k: v for k, v in data.items() if v is not None}
    mode = fields.pop("mode", None)
    if mode is not None:
        if mode not in ("canary", "shadow"):
            raise ValueError(f"mode must be canary or shadow, not {mode!r}")
        if "shadow" in fields and fields["shadow"] != (mode == "shadow"):
            raise ValueError("mode and shadow say different things")
        fields["shadow"] = mode == "shadow"
    steps = fields.get("steps")
    if isinstance(steps, list):
        fields["steps"] = [parse_step(s) if isinstance(s, str) else s for s in steps]
    guards = fields.get("guards")
    if isinstance(guards, Mapping):
        fields["guards"] = dict(parse_guard(f"{k}={v}") if isinstance(v, str) else (GUARD_ALIASES.get(k, k), v)
                                for k, v in guards.items())
    return Rollout.model_validate(fields)
