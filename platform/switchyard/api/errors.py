"""One exception tree for the API; one handler turns it into OpenAI's error object.

The gateway's ``/v1`` routes, the Batch API and the admin API raise these; the composition root
(``switchyard.app``) installs the handlers for the whole app.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException

# (The gateway's logger, as before the tree moved here: log filters and dashboards select on its name.)
log = logging.getLogger("switchyard.gateway")


class ApiError(Exception):
    """An error answered to the client as ``{"error": {"message", "type", "param", "code"}}``."""

    status_code = 500
    type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None,
                 headers: Mapping[str, str] | None = None, status_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = dict(headers or {})
        if code is not None:
            self.code = code
        if status_code is not None:
            self.status_code = status_code


class BadRequest(ApiError):
    """400: a malformed or invalid request."""

    status_code = 400
    type = "invalid_request_error"
    code = "invalid_request"


class Unauthorized(ApiError):
    """401: no credentials, or wrong ones."""

    status_code = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(ApiError):
    """403: the caller may not do this."""

    status_code = 403
    type = "permission_error"
    code = "forbidden"


class NotFound(ApiError):
    """404: no such thing (or none the caller owns)."""

    status_code = 404
    type = "invalid_request_error"
    code = "not_found"


class PayloadTooLarge(ApiError):
    """413: the body is larger than allowed."""

    status_code = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RateLimited(ApiError):
    """429: a token budget or rate limit has no room (``type`` says which unit, as OpenAI's do)."""

    status_code = 429
    type = "tokens"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, limit: str, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message, code=code, headers=headers)
        self.limit = limit
        self.type = "requests" if limit.startswith("requests") else "insufficient_quota" if limit.startswith(
            "spend") else "tokens"


class Overloaded(ApiError):
    """503: shed under overload, or nothing healthy to serve it."""

    status_code = 503
    type = "overloaded_error"
    code = "upstream_overloaded"


class ClientLeft(ApiError):
    """The client disconnected while its request waited (nobody reads this answer)."""

    status_code = 499
    type = "client_closed_request"
    code = "client_closed_request"


class BadGateway(ApiError):
    """502: the engine could not be reached, broke off, or failed."""

    status_code = 502
    type = "upstream_error"
    code = "bad_gateway"


class GatewayTimeout(ApiError):
    """504: the engine did not answer in time."""

    status_code = 504
    type = "upstream_error"
    code = "upstream_timeout"


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
    """OpenAI's error object, encoded."""
    return msgspec.json.encode({"error": {"message": message, "type": type_, "param": param, "code": code}})


def _response(status: int, body: bytes, headers: Mapping[str, str] | None = None) -> Response[bytes]:
    return Response(content=body, status_code=status, media_type="application/json",
                    headers=dict(headers or {}))


def api_error_handler(request: Request[Any, Any, Any], exc: ApiError) -> Response[bytes]:
    """Answer an :class:`ApiError`."""
    body = error_body(exc.message, exc.type, exc.code, exc.param)
    return _response(exc.status_code, body, exc.headers)


_HTTP_TYPES = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", "forbidden"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}


def http_error(status: int, detail: str, method: str, path: str,
               headers: Mapping[str, str] | None = None) -> tuple[bytes, dict[str, str]]:
    """The body and headers answering an HTTP error of the server itself (an unknown path, a wrong method, a body
    too large or a bad ``content-length``) with OpenAI's error object."""
    type_, code = _HTTP_TYPES.get(status, ("invalid_request_error" if status < 500 else "internal_error",
                                           None))
    message = detail
    if status == 404:
        message = f"Unknown path: {method} {path}"
    elif status == 405:
        message = f"Method {method} is not allowed on {path}"
    elif status == 413:
        message = "Request body too large."
    return error_body(message, type_, code), {k: v for k, v in (headers or {}).items() if k.lower() == "allow"}


def http_exception_handler(request: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    """Answer the framework's own HTTP errors (unknown path, wrong method, body too large)."""
    body, headers = http_error(exc.status_code, exc.detail, request.method, request.url.path, exc.headers)
    return _response(exc.status_code, body, headers)


#: The body of a 500 (a bug: nothing of it is told).
INTERNAL_ERROR_BODY = error_body("Internal error in the gateway.", "internal_error", "internal_error")


def internal_error_handler(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """A bug: log it with its traceback, answer 500 without leaking internals."""
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _response(500, INTERNAL_ERROR_BODY)
