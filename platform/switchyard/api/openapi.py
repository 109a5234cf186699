"""The OpenAPI document's (``/openapi``) shared pieces: schema building blocks, the error objects, the
security schemes and the operation classes of the routes whose handlers read their own bodies.

The ``/v1`` handlers take the raw body and check only what the gateway relies on (parsing it in
Litestar would cost requests per second: DESIGN.md), and the admin API decodes its bodies with
msgspec, so Litestar sees neither their request bodies nor what they answer or how they fail.
:func:`documented` makes a route's ``operation_class``: an :class:`Operation` that declares them
(request body, extra header parameters, every response with its schema, the security scheme), so
that clients and fuzzers (``tests/integration/test_fuzz.py``) can trust the document. Nothing here
runs on the request path: the document is built once, when it is first asked for.

Each surface describes its own routes with these pieces: ``/v1`` chat, completions and models in
:mod:`switchyard.gateway.openapi_docs`, ``/v1/files`` and ``/v1/batches`` in :mod:`switchyard.batch.api`,
``/admin/api`` in :mod:`switchyard.admin.openapi_docs`. The admin API's error shape is the gateway's error
object; a policy document that was not accepted (422) adds ``"issues"``, every reason with its YAML path
and line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import (
    Components,
    OpenAPIFormat,
    OpenAPIHeader,
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Operation,
    Parameter,
    RequestBody,
    Schema,
    SecurityScheme,
)

#: The security schemes: an API key for ``/v1``, the admin token for ``/admin/api``.
API_KEY, ADMIN_TOKEN = "apiKey", "adminToken"

# --- schema building blocks ------------------------------------------------------------------

STRING = Schema(type=OpenAPIType.STRING)
INTEGER = Schema(type=OpenAPIType.INTEGER)
NUMBER = Schema(type=OpenAPIType.NUMBER)
BOOLEAN = Schema(type=OpenAPIType.BOOLEAN)
ANY_OBJECT = Schema(type=OpenAPIType.OBJECT, additional_properties=True)
DATE_TIME = Schema(type=OpenAPIType.STRING, format=OpenAPIFormat.DATE_TIME)


def nullable(*types: OpenAPIType) -> Schema:
    """A value of one of ``types``, or null."""
    return Schema(type=[*types, OpenAPIType.NULL])


def obj(properties: Mapping[str, Schema], required: Sequence[str] = (), *, extra: bool = True,
        description: str | None = None, nullable_: bool = False,
        dependent: Mapping[str, Schema] | None = None) -> Schema:
    """An object with ``properties`` (``required`` ones always there); ``extra``: others may come too;
    ``dependent``: what the object must be when it has a property."""
    return Schema(type=[OpenAPIType.OBJECT, OpenAPIType.NULL] if nullable_ else OpenAPIType.OBJECT,
                  properties=dict(properties), required=list(required) or None, additional_properties=extra,
                  description=description, dependent_schemas=dict(dependent) if dependent else None)


def array(items: Schema, *, min_items: int | None = None, description: str | None = None) -> Schema:
    """An array of ``items``."""
    return Schema(type=OpenAPIType.ARRAY, items=items, min_items=min_items, description=description)


def json_request_body(schema: Schema, description: str | None = None) -> RequestBody:
    """A required JSON request body."""
    return RequestBody(content={"application/json": OpenAPIMediaType(schema=schema)}, description=description,
                       required=True)


def json_response(description: str, schema: Schema,
                  headers: Mapping[str, OpenAPIHeader] | None = None) -> OpenAPIResponse:
    """A JSON response."""
    return OpenAPIResponse(description=description, content={"application/json": OpenAPIMediaType(schema=schema)},
                           headers=dict(headers) if headers else None)


def header(description: str) -> OpenAPIHeader:
    """A response header (a string)."""
    return OpenAPIHeader(schema=STRING, description=description)


def header_parameter(name: str, description: str, schema: Schema = STRING) -> Parameter:
    """An optional request header the handler reads."""
    return Parameter(name=name, param_in="header", schema=schema, description=description, required=False)


# --- errors ----------------------------------------------------------------------------------

#: The object inside every error answer (OpenAI's).
ERROR_DETAIL = obj({
    "message": STRING,
    "type": Schema(type=OpenAPIType.STRING, description="invalid_request_error, authentication_error, "
                   "permission_error, tokens, requests, insufficient_quota, overloaded_error, upstream_error, "
                   "internal_error"),
    "param": Schema(type=[OpenAPIType.STRING, OpenAPIType.NULL], description="The parameter at fault, if one is."),
    "code": Schema(type=[OpenAPIType.STRING, OpenAPIType.NULL], description="A machine-readable reason."),
}, ["message", "type", "param", "code"], extra=False)

#: OpenAI's error object: every error ``/v1`` answers.
OPENAI_ERROR = obj({"error": ERROR_DETAIL}, ["error"], extra=False,
                   description='OpenAI\'s error object: {"error": {"message", "type", "param", "code"}}.')

_RETRY_AFTER = header("Seconds to wait before trying again.")

#: What each error status of ``/v1`` means (a route declares those it can answer).
V1_ERRORS: dict[int, OpenAPIResponse] = {
    400: json_response("Malformed or invalid request (body, parameter or header), or an engine's client error "
                       "(e.g. the context is too long).", OPENAI_ERROR),
    401: json_response("No API key, a malformed Authorization header, or an unknown or revoked key.", OPENAI_ERROR),
    403: json_response("The model or region is not allowed for the key's tier.", OPENAI_ERROR),
    404: json_response("Unknown model, or an id the caller's tenant does not own.", OPENAI_ERROR),
    413: json_response("The request body is larger than the gateway (or the engine) takes.", OPENAI_ERROR),
    429: json_response("A token budget or rate limit has no room (Retry-After; x-ratelimit-* headers, in tokens).",
                       OPENAI_ERROR, {"Retry-After": _RETRY_AFTER}),
    500: json_response("A bug in the gateway (logged with its traceback).", OPENAI_ERROR),
    502: json_response("The engine could not be reached, broke off, or failed.", OPENAI_ERROR),
    503: json_response("Shed by flow control, no healthy endpoint, an engine overloaded, or a dependency the "
                       "policy fails closed on is down.", OPENAI_ERROR, {"Retry-After": _RETRY_AFTER}),
    504: json_response("The engine did not answer in time.", OPENAI_ERROR),
}


def v1_errors(*statuses: int) -> dict[int, OpenAPIResponse]:
    """The ``/v1`` error responses of ``statuses``."""
    return {status: V1_ERRORS[status] for status in statuses}


# --- the operation class ---------------------------------------------------------------------

def documented(*, responses: Mapping[int, OpenAPIResponse], body: RequestBody | None = None,
               headers: Sequence[Parameter] = (), security: str | None = None) -> type[Operation]:
    """An ``operation_class`` that declares what Litestar cannot see of a route.

    Args:
        responses: Every status the route answers (success and errors), replacing Litestar's guesses
            (it takes a ``bytes`` response for a JSON string, and knows nothing of the error shape).
        body: The request body the handler reads itself.
        headers: Request headers the handler reads itself, beside the parameters Litestar knows.
        security: The security scheme the route wants (:data:`API_KEY`, :data:`ADMIN_TOKEN`).
    """
    declared = {str(status): response for status, response in sorted(responses.items())}

    @dataclass
    class Documented(Operation):
        def __post_init__(self) -> None:
            self.responses = dict(declared)
            if body is not None:
                self.request_body = body
            if headers:
                self.parameters = [*(self.parameters or []), *headers]
            if security is not None:
                self.security = [{security: []}]

    return Documented


def openapi_config(title: str, version: str, path: str) -> OpenAPIConfig:
    """The app's OpenAPI configuration, with the two bearer schemes routes refer to."""
    schemes: dict[str, SecurityScheme] = {
        API_KEY: SecurityScheme(type="http", scheme="bearer",
                                description="An API key (switchyard keys create): Authorization: Bearer sk-sy-..."),
        ADMIN_TOKEN: SecurityScheme(type="http", scheme="bearer",
                                    description="The admin token (SWITCHYARD_ADMIN_TOKEN)."),
    }
    return OpenAPIConfig(title=title, version=version, path=path,
                         components=Components(security_schemes=dict(schemes)))


# --- the admin API's errors and operations ----------------------------------------------------

#: One reason a policy document was refused.
ISSUE = obj({"path": STRING, "message": STRING, "line": nullable(OpenAPIType.INTEGER), "source": STRING},
            ["path", "message", "line", "source"])

#: The admin API's error object.
ADMIN_ERROR = obj({"error": ERROR_DETAIL, "issues": array(ISSUE)}, ["error"], extra=False,
                  description='{"error": {"message", "type", "param", "code"}}, and "issues" when a policy '
                              "document was refused (422).")

#: What each error status of ``/admin/api`` means (a route declares those it can answer).
ADMIN_ERRORS: dict[int, OpenAPIResponse] = {
    400: json_response("A malformed body or parameter.", ADMIN_ERROR),
    401: json_response("No admin token, or a wrong one (Authorization: Bearer <SWITCHYARD_ADMIN_TOKEN>).",
                       ADMIN_ERROR, {"WWW-Authenticate": header("Bearer")}),
    403: json_response("The admin API is disabled: SWITCHYARD_ADMIN_TOKEN is not set.", ADMIN_ERROR),
    404: json_response("No such version, tenant, key or request.", ADMIN_ERROR),
    409: json_response("The policy file is the truth (policy_source=file): the policy changes only through it.",
                       ADMIN_ERROR),
    413: json_response("The request body is too large.", ADMIN_ERROR),
    422: json_response("The policy document was refused (every issue, with its path and line); nothing was "
                       "written.", obj({"error": ERROR_DETAIL, "issues": array(ISSUE)}, ["error", "issues"],
                                       extra=False)),
    500: json_response("A bug in the gateway (logged with its traceback).", ADMIN_ERROR),
}


def admin_operation(ok: Mapping[int, OpenAPIResponse], *errors: int,
                    body: RequestBody | None = None) -> type[Operation]:
    """The ``operation_class`` of an admin API route: ``ok`` and ``errors`` besides those of the token guard."""
    statuses = sorted({401, 403, 500, *errors})
    return documented(security=ADMIN_TOKEN, body=body,
                      responses={**ok, **{status: ADMIN_ERRORS[status] for status in statuses}})


def ok(description: str, schema: Schema) -> dict[int, OpenAPIResponse]:
    """A 200 answer."""
    return {200: json_response(description, schema)}
