"""What a request's tries become: policy refusals and engine failures as API errors, and the record of
one request's attempts along its fallback plan (:mod:`switchyard.gateway.proxy` uses both)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from switchyard.decide.pick import EndpointChoice
from switchyard.decide.resolve import Refused
from switchyard.engines.upstream import EngineError, UpstreamFailure
from switchyard.gateway.errors import (
    ApiError,
    BadGateway,
    BadRequest,
    Forbidden,
    GatewayTimeout,
    NotFound,
    Overloaded,
    PayloadTooLarge,
)


def refusal_error(refusal: Refused) -> ApiError:
    """The API error for a policy refusal."""
    cls = {400: BadRequest, 404: NotFound}.get(refusal.status, Forbidden)
    return cls(refusal.message, code=refusal.code, param=refusal.param)


def engine_error(err: EngineError, choice: EndpointChoice, headers: dict[str, str]) -> ApiError:
    """What an engine's non-2xx answer means for the client.

    The engine's 400s are the client's mistakes (context too long, bad parameter) and pass
    through; a 404 means the policy names a model the engine does not serve (a configuration
    error, so 502); 429/503 mean the engine is overloaded. A redirect is never followed (the gateway
    connects only to the policy's endpoints): the engine is misbehaving, so 502.
    """
    where = f"pool {choice.pool.name} ({choice.url})"
    code = str(err.code) if isinstance(err.code, str) else None
    if 300 <= err.status < 400:
        return BadGateway(f"The engine of {where} answered {err.status}, a redirect; the gateway never follows "
                          "one", code="upstream_invalid_response", headers=headers)
    if err.status in (400, 422):
        return BadRequest(err.message, code=code or "invalid_request", param=err.param, headers=headers)
    if err.status == 413:
        return PayloadTooLarge(err.message, headers=headers)
    if err.status == 404:
        return BadGateway(f"The engine of {where} does not serve '{choice.pool.served_model}': {err.message}",
                          code="upstream_model_missing", headers=headers)
    if err.status in (429, 503):
        return Overloaded(f"The engine of {where} is overloaded ({err.status}): {err.message}",
                          headers={**headers, "Retry-After": err.retry_after or "1"})
    return BadGateway(f"The engine of {where} answered {err.status}: {err.message}", headers=headers)


def failure_error(failure: UpstreamFailure, pool: str, headers: dict[str, str]) -> ApiError:
    """504 when the engine did not answer in time, 502 when it could not be reached, broke off or answered
    garbage (``upstream_invalid_response``)."""
    if failure.invalid:
        return BadGateway(f"Upstream failure in pool {pool}: {failure}", code="upstream_invalid_response",
                          headers=headers)
    cls = GatewayTimeout if failure.timeout else BadGateway
    return cls(f"Upstream failure in pool {pool}: {failure}", headers=headers)


#: Engine answers that say "try elsewhere": the engine is overloaded or broken, redirects (which are never
#: followed), or does not serve the model it should (a misconfigured replica). Other 4xx are the client's
#: mistakes and pass through.
RETRYABLE_STATUS = frozenset({*range(300, 400), 404, 429, 500, 502, 503, 504})
#: Of those, the answers that do not count against the engine's breaker: it is busy, not broken.
BUSY_STATUS = frozenset({429})


@dataclass(slots=True)
class Attempts:
    """One request's way through its fallback plan: what was tried, what was passed over, and why each
    try failed."""

    limit: int
    tried: set[str] = field(default_factory=set)
    #: Every step that moved the request on, in order: ``"<url or stage>: <reason>"``.
    failures: list[str] = field(default_factory=list)
    #: The same, short (``"<url> <kind>"``), for the ``x-switchyard-route`` header.
    moved_on: list[str] = field(default_factory=list)
    last_error: ApiError | None = None
    #: Set when a retry was not sent because the retry budget was spent.
    budget_spent: bool = False
    #: Seconds until an endpoint that is out may take requests again (for Retry-After), when known.
    retry_in: float | None = None

    @property
    def count(self) -> int:
        return len(self.tried)

    def failed(self, url: str, kind: str, reason: str, error: ApiError) -> None:
        """A try at ``url`` failed (``kind``: connect_error, timeout, first_token_timeout, broken, or a status)."""
        self.failures.append(f"{url}: {reason}")
        self.moved_on.append(f"{url} {kind}")
        self.last_error = error

    def passed_over(self, stage: str, reason: str) -> None:
        """A stage of the plan had no endpoint that could take the request."""
        self.failures.append(f"{stage}: {reason}")
        self.moved_on.append(f"{stage} unavailable")

    def final_error(self, headers: dict[str, str]) -> ApiError:
        """The error to answer with when every attempt failed (or none was possible)."""
        error = self.last_error
        if error is None:
            why = "; ".join(self.failures) or "no endpoint serves it"
            retry_after = str(max(1, math.ceil(self.retry_in))) if self.retry_in else "1"
            return Overloaded(f"No healthy endpoint can serve this request right now: {why}",
                              code="no_healthy_endpoint", headers={**headers, "Retry-After": retry_after})
        if self.budget_spent:
            error.message = (f"{error.message} (not retried: the gateway's retry budget is spent; "
                             f"tried: {'; '.join(self.failures)})")
        elif self.count > 1 or len(self.failures) > 1:
            error.message = f"All {self.count} attempts failed: " + "; ".join(self.failures)
        if self.count > 1:
            error.headers = {**(error.headers or {}), "x-switchyard-attempts": str(self.count)}
        return error
