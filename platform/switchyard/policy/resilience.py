"""The ``resilience`` section of the policy: health probes, circuit breakers, retries, timeouts, and what
Switchyard does when one of its own dependencies (Redis, the database) is unreachable.

Every field has a default, so a document without the section gets sane behaviour; the README's
"Resilience" section explains each one.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveInt

from switchyard.policy.units import Duration

Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
#: What a request does when a dependency of the gateway cannot be reached.
FailureMode = Literal["fail_open", "fail_closed"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HealthSpec(_Strict):
    """Active probes of every endpoint's ``/health`` and what takes an endpoint out.

    An endpoint that refuses a connection (to a request, a probe or a metrics scrape) is out at once;
    one whose probes fail ``unhealthy_after`` times in a row is out too. Either way it comes back only
    after ``healthy_after`` probes in a row succeed.
    """

    probe_interval: Duration = Field(default=1.0, description="Seconds between two probes of one endpoint.")
    probe_timeout: Duration = Field(default=1.0, description="A probe not answered 200 within this fails.")
    unhealthy_after: PositiveInt = Field(default=2, description="Failed probes in a row that take an endpoint out.")
    healthy_after: PositiveInt = Field(default=2, description="Good probes in a row that bring it back.")
    max_ttfb: Duration | None = Field(
        default=None, description="Passive signal: a first byte later than this counts as a failure for the "
        "endpoint's breaker (the request itself is still served). Unset: only timeouts count.")


class BreakerSpec(_Strict):
    """A circuit breaker: closed → open on failures → half-open: a few trial requests → closed (or open again)."""

    consecutive_failures: PositiveInt = Field(default=5, description="Failures in a row that open the breaker.")
    error_rate: Fraction = Field(
        default=0.5, description="Share of failed requests within `window` that opens the breaker (once "
        "`min_requests` requests were seen in it).")
    min_requests: PositiveInt = Field(default=20, description="Requests within `window` before `error_rate` counts.")
    window: Duration = Field(default=10.0, description="The sliding window of the error rate, in seconds.")
    open_for: Duration = Field(
        default=5.0, description="How long the breaker stays open (no client request) before trial requests.")
    half_open_requests: PositiveInt = Field(
        default=2, description="Trial requests (one-token completions the gateway sends itself) that must all "
        "succeed to close the breaker; a failed one opens it again.")


def _pool_breaker() -> BreakerSpec:
    # A pool's breaker sees every replica's requests: it waits for more evidence than one replica's.
    return BreakerSpec(consecutive_failures=10, min_requests=40)


class Breakers(_Strict):
    """The breakers of each endpoint and of each pool (all its endpoints' requests together)."""

    endpoint: BreakerSpec = Field(default_factory=BreakerSpec)
    pool: BreakerSpec = Field(default_factory=_pool_breaker)


class RetrySpec(_Strict):
    """How many engines one request may try, and how many retries the gateway sends at most overall.

    Retries (every attempt after a request's first) draw on a budget refilled by first attempts:
    ``budget_ratio`` of the requests of the last ``budget_window`` seconds, plus ``min_retries_per_s``. A
    request whose retry finds the budget empty fails with its last error instead: a failing region
    cannot multiply the load on a healthy one.
    """

    max_attempts: int = Field(default=3, ge=1, le=10, description="Most engines one request is sent to.")
    budget_ratio: Fraction = Field(default=0.2, description="Retries allowed per first attempt, over the window.")
    budget_window: Duration = Field(default=10.0, description="The window the budget is counted over, in seconds.")
    min_retries_per_s: NonNegativeFloat = Field(
        default=3.0, description="Retries always allowed per second (so that light traffic can retry at all).")


class Dependencies(_Strict):
    """What happens when a dependency of Switchyard itself cannot be reached."""

    redis: FailureMode = Field(
        default="fail_open", description="`fail_open`: limits are enforced in each gateway process on its own "
        "(logged and counted) until Redis answers again; `fail_closed`: requests with limits are refused (503).")
    database: FailureMode = Field(
        default="fail_open", description="The policy snapshot keeps serving either way. `fail_open`: API keys "
        "seen before keep working from the gateway's cache while the database is unreachable (revocations wait "
        "for it); `fail_closed`: a key whose cache entry expired is refused (503) until it answers.")


class HangSpec(_Strict):
    """Hung engines: accepting work and making no progress, while their ``/health`` stays green.

    An engine is hung when, for ``after`` seconds, it reported requests running while none of its progress
    counters moved across its ``/metrics`` scrapes (generated and prompt tokens, engine steps), or none of the
    streams this gateway has running there got a byte. A hung engine is taken out at once (its breaker opens,
    and comes back through its trial requests), the tries at it that have produced nothing move on, and its
    streams are resumed elsewhere.
    """

    enabled: bool = Field(default=True, description="Detect hung engines.")
    after: Duration = Field(default=1.0, description="Seconds without progress that make an engine hung.")


class Resilience(_Strict):
    """Health, breakers, retries, the first-token timeout and dependency failure modes."""

    health: HealthSpec = Field(default_factory=HealthSpec)
    breakers: Breakers = Field(default_factory=Breakers)
    retries: RetrySpec = Field(default_factory=RetrySpec)
    first_token_timeout: Duration = Field(
        default=15.0, description="A streamed answer whose first byte has not come within this (seconds from "
        "the attempt) moves on to the next endpoint of the fallback plan; models may set their own, and a "
        "priority class's `first_token_deadline` (or `ttft_objective`) takes precedence.")
    hang_detection: HangSpec = Field(default_factory=HangSpec)
    dependencies: Dependencies = Field(default_factory=Dependencies)
