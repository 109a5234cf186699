"""Which limits a request is charged against, and for how much (a pure function of the policy).

A tenant's limits come from its tier (``tiers[].limits``), replaced field by field by the
tenant's own override; a key's override adds limits of its own on top; a tier's
``model_limits`` apply per tenant to the model the request resolved to. Each limit is one token
bucket (see ``store.limits``): capacity = the limit, refilled evenly over its period (a minute, a
day, 30 days), so there is no boundary at which twice the limit can pass.

The amount reserved before a request runs is an estimate: its prompt tokens plus the output it
may produce (``max_tokens``, else the model's ``default_max_tokens``, capped by the model's output
cap and what the context window leaves), and for spend, that estimate at the model's prices.
When the request ends the gateway reconciles with what the engine reports it used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from switchyard.policy.schema import Limits, Model
from switchyard.policy.snapshot import PolicySnapshot

Unit = Literal["tokens", "requests", "spend"]

#: Each limit's period in seconds and what it counts.
LIMIT_PERIODS: dict[str, tuple[float, Unit]] = {
    "tokens_per_minute": (60.0, "tokens"),
    "requests_per_minute": (60.0, "requests"),
    "tokens_per_day": (86_400.0, "tokens"),
    "spend_per_month": (30 * 86_400.0, "spend"),
}


@dataclass(frozen=True, slots=True)
class LimitCharge:
    """One limit a request is charged against.

    Attributes:
        key: Where its bucket lives: the subject and the limit (``t:42:tokens_per_minute``).
        limit: The limit's name in the policy.
        unit: ``tokens``, ``requests`` or ``spend``.
        capacity: The limit's value.
        period_s: Over how long it refills.
        amount: What this request reserves.
        scope: Whose limit it is, for messages (``tier free``, ``tenant override``, ``key override``,
            ``tier free, model large``).
    """

    key: str
    limit: str
    unit: Unit
    capacity: float
    period_s: float
    amount: float
    scope: str


@dataclass(frozen=True, slots=True)
class Estimate:
    """What a request is expected to use."""

    prompt_tokens: int
    output_tokens: int
    spend: float

    @property
    def tokens(self) -> int:
        """Prompt plus output."""
        return self.prompt_tokens + self.output_tokens


def expected_output(model: Model, prompt_tokens: int, max_tokens: int | None) -> int:
    """The output a request may produce: its ``max_tokens`` or the model's default, within the model's caps."""
    cap = model.max_output_tokens or model.context_window
    wanted = max_tokens if max_tokens is not None else model.default_max_tokens
    return max(0, min(wanted, cap, model.context_window - prompt_tokens))


def spend_of(model: Model, prompt_tokens: int, output_tokens: int, cached_tokens: int = 0,
             batch: bool = False) -> float:
    """A request's price at ``model``'s rates (cached prompt tokens at the cached rate, when there is one;
    a batch job's line at the batch rates)."""
    price = model.price
    cached_rate = price.cached_input_per_mtok if price.cached_input_per_mtok is not None else price.input_per_mtok
    input_rate, output_rate = price.input_per_mtok, price.output_per_mtok
    if batch:
        input_rate, output_rate = price.batch_rates()
        cached_rate = min(cached_rate, input_rate)
    uncached = max(0, prompt_tokens - cached_tokens)
    return (uncached * input_rate + cached_tokens * cached_rate + output_tokens * output_rate) / 1e6


def estimate(model: Model, prompt_tokens: int, max_tokens: int | None) -> Estimate:
    """The reservation's basis for one request."""
    output = expected_output(model, prompt_tokens, max_tokens)
    return Estimate(prompt_tokens, output, spend_of(model, prompt_tokens, output))


def _amount(unit: Unit, est: Estimate) -> float:
    return float(est.tokens) if unit == "tokens" else 1.0 if unit == "requests" else est.spend


def _charges(limits: Limits, subject: str, scope: str, est: Estimate,
             fields: set[str] | None = None) -> list[LimitCharge]:
    out = []
    for name, (period, unit) in LIMIT_PERIODS.items():
        value = getattr(limits, name)
        if value is None or (fields is not None and name not in fields):
            continue
        out.append(LimitCharge(f"{subject}:{name}", name, unit, float(value), period, _amount(unit, est), scope))
    return out


def limit_charges(snapshot: PolicySnapshot, tier_name: str, model: Model, est: Estimate, *, tenant: str,
                  key: str, tenant_limits: Limits | None = None, key_limits: Limits | None = None) -> list[LimitCharge]:
    """Every limit the request is charged against (empty: unlimited).

    Args:
        snapshot: The policy the request runs under.
        tier_name: The tenant's tier.
        model: The model the request resolved to.
        est: What the request is expected to use.
        tenant: A stable id of the tenant (bucket keys are built from it).
        key: A stable id of the API key.
        tenant_limits: The tenant's override: each limit it sets replaces the tier's.
        key_limits: The key's own limits, charged in addition.
    """
    tier = snapshot.tiers[tier_name]
    own = tenant_limits.model_fields_set if tenant_limits is not None else set()
    charges = _charges(tier.limits, f"t:{tenant}", f"tier {tier.name}", est,
                       {n for n in LIMIT_PERIODS if n not in own})
    if tenant_limits is not None:
        charges += _charges(tenant_limits, f"t:{tenant}", "tenant override", est)
    model_limits = tier.model_limits.get(model.name)
    if model_limits is not None:
        charges += _charges(model_limits, f"t:{tenant}:m:{model.name}", f"tier {tier.name}, model {model.name}", est)
    if key_limits is not None:
        charges += _charges(key_limits, f"k:{key}", "key override", est)
    return charges


def refusal_code(unit: Unit, never: bool) -> str:
    """The OpenAI error code of a 429 from a limit of ``unit``: the request alone is larger than
    the limit, a spend budget is used up, or a rate limit has no room right now."""
    if never:
        return "request_too_large"
    return "insufficient_quota" if unit == "spend" else "rate_limit_exceeded"


def actual_amounts(charges: list[LimitCharge], tokens: int, spend: float) -> dict[str, float]:
    """What a finished request really used, per bucket key (requests count one each)."""
    return {c.key: float(tokens) if c.unit == "tokens" else 1.0 if c.unit == "requests" else spend for c in charges}
