"""What the OpenAPI document (``/openapi``) says of routes whose handlers read their own bodies.

The ``/v1`` handlers take the raw body and check only what the gateway relies on (parsing it in
Litestar would cost requests per second: DESIGN.md), and the admin API decodes its bodies with
msgspec, so Litestar sees neither their request bodies nor what they answer or how they fail.
:func:`documented` makes a route's ``operation_class``: an :class:`Operation` that declares them
(request body, extra header parameters, every response with its schema, the security scheme), so
that clients and fuzzers (``tests/integration/test_fuzz.py``) can trust the document. Nothing here
runs on the request path: the document is built once, when it is first asked for.
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

from switchyard.gateway.body import MAX_CHOICES

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


# --- /v1/chat/completions, /v1/completions, /v1/models ----------------------------------------

_ROLES = ["system", "developer", "user", "assistant", "tool", "function"]
_POSITIVE = Schema(type=OpenAPIType.INTEGER, minimum=1)
_COMMON: dict[str, Schema] = {
    "model": Schema(type=OpenAPIType.STRING, min_length=1,
                    description="A model or route of the policy that the key's tier may use (GET /v1/models)."),
    "stream": BOOLEAN,
    "stream_options": Schema(type=OpenAPIType.OBJECT, additional_properties=True,
                             description="Only with stream: true."),
    "max_tokens": _POSITIVE,
    "n": Schema(type=OpenAPIType.INTEGER, minimum=1, maximum=MAX_CHOICES,
                description="Choices to generate; admission reserves output for each."),
    "priority": Schema(type=[OpenAPIType.INTEGER, OpenAPIType.STRING],
                       description="vLLM's priority, or the name of a priority class the tier may use."),
}
#: stream_options only with stream: true.
_STREAM_OPTIONS = {"stream_options": Schema(properties={"stream": Schema(const=True)}, required=["stream"])}
_EXTRA_FIELDS = ("Fields the gateway does not check pass to the engine untouched, which answers for them "
                 "(its 400s pass through).")

CHAT_REQUEST = obj({
    **_COMMON,
    "messages": array(obj({"role": Schema(type=OpenAPIType.STRING, enum=_ROLES),
                           "content": Schema(type=[OpenAPIType.STRING, OpenAPIType.ARRAY, OpenAPIType.NULL])},
                          ["role"]), min_items=1),
    "max_completion_tokens": _POSITIVE,
    "tools": Schema(type=OpenAPIType.ARRAY),
}, ["model", "messages"], description=_EXTRA_FIELDS, dependent=_STREAM_OPTIONS)

COMPLETION_REQUEST = obj({
    **_COMMON,
    "prompt": Schema(one_of=[
        STRING,
        array(STRING, min_items=1),
        array(INTEGER, min_items=1),
        array(array(INTEGER, min_items=1), min_items=1),
    ], description="Text, texts, token ids, or lists of token ids."),
}, ["model", "prompt"], description=_EXTRA_FIELDS, dependent=_STREAM_OPTIONS)

_USAGE = obj({"prompt_tokens": INTEGER, "completion_tokens": INTEGER, "total_tokens": INTEGER}, nullable_=True)
_CHOICES = array(obj({"index": INTEGER}, ["index"]))


def _completion(kind: str) -> Schema:
    return obj({"id": STRING, "object": Schema(type=OpenAPIType.STRING, const=kind), "created": INTEGER,
                "model": STRING, "choices": _CHOICES, "usage": _USAGE},
               ["id", "object", "created", "model", "choices"], description="The engine's answer, relayed.")


def _event(chunk: str) -> Schema:
    """One server-sent event of a stream: a chunk, the error that ends a stream an engine broke off, or
    ``[DONE]``."""
    payload = Schema(type=OpenAPIType.STRING, content_media_type="application/json",
                     content_schema=Schema(any_of=[_completion(chunk), OPENAI_ERROR]))
    return obj({"data": Schema(any_of=[Schema(const="[DONE]"), payload])}, ["data"])


def _answer(kind: str, chunk: str) -> OpenAPIResponse:
    return OpenAPIResponse(
        description="The answer (stream: true, a text/event-stream of chunks ending with data: [DONE]).",
        content={"application/json": OpenAPIMediaType(schema=_completion(kind)),
                 "text/event-stream": OpenAPIMediaType(schema=_event(chunk))},
        headers={"x-request-id": header("The request's id (the client's, when it sent a sane one)."),
                 "x-switchyard-route": header("What served the request: model, pool, endpoint, policy, ...")})


#: The headers the chat and completion routes read.
REQUEST_HEADERS = (
    header_parameter("x-switchyard-priority", "A priority class of the tier, instead of its default."),
    header_parameter("x-switchyard-region", "The region to serve the request in (one of the policy's)."),
    header_parameter("x-switchyard-cache-control", "no-cache, no-store or bypass: opt out of the response cache."),
    header_parameter("x-request-id", "The request's id, echoed in x-request-id (else the gateway makes one)."),
)

#: What a chat or completion request can be answered with, besides its answer.
GENERATION_ERRORS = v1_errors(400, 401, 403, 404, 413, 429, 500, 502, 503, 504)

CHAT_OPERATION = documented(
    body=json_request_body(CHAT_REQUEST), headers=REQUEST_HEADERS, security=API_KEY,
    responses={200: _answer("chat.completion", "chat.completion.chunk"), **GENERATION_ERRORS})
COMPLETION_OPERATION = documented(
    body=json_request_body(COMPLETION_REQUEST), headers=REQUEST_HEADERS, security=API_KEY,
    responses={200: _answer("text_completion", "text_completion"), **GENERATION_ERRORS})

MODEL_LIST = obj({
    "object": Schema(type=OpenAPIType.STRING, const="list"),
    "data": array(obj({"id": STRING, "object": Schema(type=OpenAPIType.STRING, const="model"), "created": INTEGER,
                       "owned_by": STRING, "max_model_len": INTEGER}, ["id", "object", "created", "owned_by"])),
}, ["object", "data"])
MODELS_OPERATION = documented(security=API_KEY, responses={
    200: json_response("The models and routes the key's tier may use.", MODEL_LIST),
    **v1_errors(401, 500, 503),
})

