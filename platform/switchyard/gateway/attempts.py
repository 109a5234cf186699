"""What a request's refusals and tries become: the procedure's refusals and engine failures as API errors,
and a request's tries along its fallback plan in its record (:mod:`switchyard.gateway.proxy` uses both)."""

from __future__ import annotations

import math

from switchyard.api.errors import (
    ApiError,
    BadGateway,
    BadRequest,
    ClientLeft,
    Forbidden,
    GatewayTimeout,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
)
from switchyard.api.headers import ATTEMPTS_HEADER, LIMIT_HEADER, ROUTE_HEADER
from switchyard.decide.decision import Attempts
from switchyard.decide.pick import EndpointChoice
from switchyard.decide.refusals import Refusal
from switchyard.engines.upstream import EngineError, UpstreamFailure
from switchyard.gateway.activity import RequestRecord

#: The API error of each refusal status but 429 (a 499 is the client's own leaving: nobody reads it).
_REFUSALS: dict[int, type[ApiError]] = {400: BadRequest, 403: Forbidden, 404: NotFound, 499: ClientLeft,
                                        503: Overloaded}


def refusal_error(refusal: Refusal, headers: dict[str, str] | None = None) -> ApiError:
    """The API error for a refusal of the decision procedure, with ``headers`` (and ``Retry-After`` when the
    refusal says when to retry)."""
    headers = dict(headers or {})
    if refusal.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(refusal.retry_after_s)))
    if refusal.status == 429:
        assert refusal.limit is not None
        headers[LIMIT_HEADER] = refusal.limit
        return RateLimited(refusal.message, code=refusal.code, limit=refusal.limit, headers=headers)
    cls = _REFUSALS[refusal.status]
    return cls(refusal.message, code=refusal.code, param=refusal.param, headers=headers)


def engine_error(err: EngineError, choice: EndpointChoice, headers: dict[str, str]) -> ApiError:
    """What an engine's non-2xx answer means for the client.

    The engine's 400s are the client's mistakes (context too long, bad parameter) and pass
    through; a 404 means the policy names a model the engine does not serve (a configuration
    error, so 502), unless it says a stored response is missing (the client's 404); 429/503 mean
    the engine is overloaded. A redirect is never followed (the gateway connects only to the
    policy's endpoints): the engine is misbehaving, so 502.
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
    if stored_response_missing(err):  # a Responses API follow-up whose earlier response this engine does not keep
        return NotFound(err.message, code="response_not_found", param="previous_response_id", headers=headers)
    if err.status == 404:
        return BadGateway(f"The engine of {where} does not serve '{choice.pool.served_model}': {err.message}",
                          code="upstream_model_missing", headers=headers)
    if err.status in (429, 503):
        return Overloaded(f"The engine of {where} is overloaded ({err.status}): {err.message}",
                          headers={**headers, "Retry-After": err.retry_after or "1"})
    return BadGateway(f"The engine of {where} answered {err.status}: {err.message}", headers=headers)


def stored_response_missing(err: EngineError) -> bool:
    """Whether the engine's 404 says it does not have a stored response (vLLM's ``param: response_id``: a
    ``previous_response_id`` from another replica, or from a server that stores none). Another replica may have it:
    worth trying elsewhere, but no fault of the engine's; when none has it, the client gets the 404."""
    return err.status == 404 and err.param == "response_id"


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


def final_error(attempts: Attempts, headers: dict[str, str]) -> ApiError:
    """The error to answer with when every try failed: the last one's, saying what else was tried."""
    last = attempts.last
    assert last is not None
    assert isinstance(last.answer, ApiError)
    error: ApiError = last.answer
    if attempts.budget_spent:
        error.message = (f"{error.message} (not retried: the gateway's retry budget is spent; "
                         f"tried: {'; '.join(attempts.failures)})")
    elif attempts.count > 1 or len(attempts.failures) > 1:
        error.message = f"All {attempts.count} attempts failed: " + "; ".join(attempts.failures)
    if attempts.count > 1:
        error.headers = {**(error.headers or {}), ATTEMPTS_HEADER: str(attempts.count)}
    return error


def record_tries(record: RequestRecord, attempts: Attempts, headers: dict[str, str]) -> None:
    """Copy what the request's tries did into its record: tries, moves and why, the route it took."""
    record.attempts = attempts.count
    record.moved_on = attempts.moved_on
    record.trace.extend(attempts.failures)
    route = headers.get(ROUTE_HEADER)
    if route is not None:
        record.trace.append(f"route: {route}")
