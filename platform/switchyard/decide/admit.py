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

Before that, :func:`check_fits` refuses (400, in vLLM's words) a request the model cannot serve:
``max_tokens`` above the model's output cap, a prompt longer than its context window, or prompt
plus ``max_tokens`` beyond it. The caps are never applied silently to what a client asked for;
the reservation's own capping only matters where the prompt is estimated (see :func:`check_fits`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from switchyard.decide.refusals import Refusal
from switchyard.decide.tokens import TEMPLATE_TOKENS_PER_PROMPT
from switchyard.policy.fleet import Model
from switchyard.policy.snapshot import PolicySnapshot
from switchyard.policy.tiers import Limits

Unit = Literal["tokens", "requests", "spend"]

#: Each limit's period in seconds and what it counts.
LIMIT_PERIODS: dict[str, tuple[float, Unit]] = {
    "tokens_per_minute": (60.0, "tokens"),
    "requests_per_minute": (60.0, "requests"),
    "tokens_per_day": (86_400.0, "tokens"),
    "spend_per_month": (30 * 86_400.0, "spend"),
}


@dataclass(slots=True)
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


@dataclass(slots=True)
class Estimate:
    """What a request is expected to use."""

    prompt_tokens: int
    output_tokens: int
    spend: float

    @property
    def tokens(self) -> int:
        """Prompt plus output."""
        return self.prompt_tokens + self.output_tokens


class DoesNotFit(Exception):
    """A request its model cannot serve (:func:`check_fits`): the gateway answers 400 with ``code``."""

    def __init__(self, code: str, message: str, param: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


#: A prompt counted by the estimate (four characters a token: no tokenizer) is refused as too long only
#: when a quarter of its estimate is: its text would have to average sixteen characters a token to
#: fit, which no natural text does (English runs at about four, code at three, and CJK text at one
#: or two, where the estimate is low: a prompt it lets through is then the engine's 400). Refusing
#: on the plain estimate would refuse prompts the engine serves.
ESTIMATE_MARGIN = 4
#: A chat prompt counted with the model's tokenizer is exact but for the chat template, which is
#: estimated (Llama-3's; ChatML's is two tokens shorter, and a request without the generation prompt
#: five): a prompt is taken as certainly too long only when it is, with this much taken off.
CHAT_TEMPLATE_SLACK = TEMPLATE_TOKENS_PER_PROMPT


def check_fits(model: Model, kind: str, prompt_tokens: int, exact: bool, max_tokens: int | None,
               max_tokens_param: str = "max_tokens") -> None:
    """Refuse, before any engine sees it, a request ``model`` cannot serve; the messages read like vLLM's.

    Args:
        model: The model the request resolved to (a fallback never serves a request its own model
            refuses as a client error, so this is the model that decides).
        kind: ``chat``, ``completion``, ``embedding`` or ``responses``.
        prompt_tokens: Its (longest) prompt's tokens: each of a completion's prompts is a sequence of
            its own.
        exact: Whether ``prompt_tokens`` was counted (a tokenizer, token ids) rather than estimated.
        max_tokens: The output it asked for, if it did.
        max_tokens_param: The body field ``max_tokens`` came from.

    Raises:
        DoesNotFit: ``invalid_value`` when ``max_tokens`` is above the model's output cap
            (``max_output_tokens``, else its context window: certain, whatever the prompt);
            ``context_length_exceeded`` when the prompt alone, or the prompt plus
            ``max_tokens``, is certainly longer than the context window: counted exactly
            (less :data:`CHAT_TEMPLATE_SLACK` for a chat), or estimated and longer even at
            1/:data:`ESTIMATE_MARGIN` of the estimate. An estimated prompt that may fit goes on;
            its engine then has the last word (and the reservation counts only what the window
            leaves for output: :func:`expected_output`).
    """
    window = model.context_window
    if max_tokens is not None:
        if model.max_output_tokens is not None and max_tokens > model.max_output_tokens:
            raise DoesNotFit("invalid_value", f"{max_tokens_param}={max_tokens} cannot be greater than "
                             f"{model.max_output_tokens}, the most output tokens model {model.name} produces. "
                             "Please request fewer output tokens.", max_tokens_param)
        if max_tokens > window:
            raise DoesNotFit("invalid_value", f"{max_tokens_param}={max_tokens} cannot be greater than "
                             f"max_model_len={window}. Please request fewer output tokens.", max_tokens_param)
    if exact:
        least = prompt_tokens - CHAT_TEMPLATE_SLACK if kind in ("chat", "responses") else prompt_tokens
        stated, about = prompt_tokens, ""
    else:
        least = prompt_tokens // ESTIMATE_MARGIN
        stated, about = least, "at least "
    where = "messages" if kind == "chat" else "input" if kind in ("embedding", "responses") else "prompt"
    if least > window:
        count = f"{prompt_tokens}" if exact else f"an estimated {prompt_tokens} (at least {least})"
        raise DoesNotFit("context_length_exceeded", f"This model's maximum context length is {window} tokens. "
                         f"However, your prompt contains {count} input tokens, which exceeds this limit even "
                         "without any output tokens. Please reduce the length of the input prompt.", where)
    if max_tokens is not None and least + max_tokens > window:
        raise DoesNotFit("context_length_exceeded", f"This model's maximum context length is {window} tokens. "
                         f"However, you requested {about}{stated + max_tokens} tokens ({about}{stated} in the "
                         f"{where}, {max_tokens} in the completion). Please reduce the length of the {where} "
                         "or completion.", where)


def expected_output(model: Model, prompt_tokens: int, max_tokens: int | None) -> int:
    """The output a request may produce: its ``max_tokens`` or the model's default, within the model's caps.

    On the request path :func:`check_fits` has refused a ``max_tokens`` above the caps; what is
    capped here is what an estimated prompt leaves of the window (the engine cuts the output to
    that), and the default of a request that names no ``max_tokens``.
    """
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


def estimate(model: Model, prompt_tokens: int, max_tokens: int | None, choices: int = 1) -> Estimate:
    """The reservation's basis for one request (``choices``: its ``n``; each choice may generate the whole
    expected output, and the engine reports all of them in ``usage.completion_tokens``)."""
    output = expected_output(model, prompt_tokens, max_tokens) * choices
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


# --- the limit store's answer ------------------------------------------------------------------

@dataclass(slots=True)
class Reserve:
    """An effect: reserve every charge at once on the executor's limit store; answered with :class:`LimitAnswer`."""

    charges: tuple[LimitCharge, ...]


@dataclass(slots=True)
class LimitAnswer:
    """The limit store's answer to a :class:`Reserve`.

    Attributes:
        admitted: Every bucket had room.
        refused_by: The key of the charge that had no room (when not admitted).
        never: That bucket could never hold the charge (it is larger than the limit).
        retry_after_s: When it will have room, if it ever will.
        remaining: What that bucket has left now.
    """

    admitted: bool
    refused_by: str | None = None
    never: bool = False
    retry_after_s: float | None = None
    remaining: float = 0.0


def fresh_buckets(charges: Sequence[LimitCharge]) -> LimitAnswer:
    """What a limit store whose every bucket is full answers (the dry-run's limits)."""
    for charge in charges:
        if charge.amount > charge.capacity:
            return LimitAnswer(False, charge.key, never=True, remaining=charge.capacity)
    return LimitAnswer(True)


def duration(seconds: float) -> str:
    """A duration as OpenAI's ``x-ratelimit-reset-*`` headers write it: ``1s``, ``6m0s``, ``120ms``."""
    if not math.isfinite(seconds):
        return "never"
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def limit_refusal(charges: Sequence[LimitCharge], answer: LimitAnswer) -> Refusal:
    """The 429 for a reservation the limit store refused (``answer.admitted`` is False)."""
    charge = next(c for c in charges if c.key == answer.refused_by)
    what = f"{charge.limit} ({charge.scope})"
    amount = f"{charge.amount:.6g} {charge.unit}"
    if answer.never:
        return Refusal(429, refusal_code(charge.unit, True),
                       f"This request alone needs {amount}, more than the {what} limit of {charge.capacity:.6g}; "
                       "ask for fewer tokens (max_tokens) or a higher limit.", limit=charge.limit)
    wait = answer.retry_after_s
    return Refusal(429, refusal_code(charge.unit, False),
                   f"Rate limit reached for {what}: limit {charge.capacity:.6g}, remaining {answer.remaining:.6g}, "
                   f"requested {amount}. " + (f"Please try again in {duration(wait)}." if wait is not None else ""),
                   limit=charge.limit, retry_after_s=max(1, math.ceil(wait)) if wait is not None else 60.0)
