"""What the OpenAPI document (``/openapi``) says of the gateway's own OpenAI-compatible routes: chat completions,
completions, embeddings, responses, models, and vLLM's ``/tokenize`` and ``/detokenize``.

Their handlers take the raw body and check only what the gateway relies on (DESIGN.md), so Litestar sees
neither the request bodies nor the answers: the operation classes here declare them, built from the
shared pieces of :mod:`switchyard.api.openapi` (the bound on ``n`` is the gateway's own, from
:mod:`switchyard.gateway.body`).
"""

from __future__ import annotations

from litestar.openapi.spec import OpenAPIMediaType, OpenAPIResponse, OpenAPIType, Schema

from switchyard.api.headers import CACHE_CONTROL_HEADER, PRIORITY_HEADER, REGION_HEADER, ROUTE_HEADER
from switchyard.api.openapi import (
    API_KEY,
    BOOLEAN,
    INTEGER,
    OPENAI_ERROR,
    STRING,
    array,
    documented,
    header,
    header_parameter,
    json_request_body,
    json_response,
    obj,
    v1_errors,
)
from switchyard.gateway.body import MAX_CHOICES

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
                 ROUTE_HEADER: header("What served the request: model, pool, endpoint, policy, ...")})


#: The headers the chat and completion routes read.
REQUEST_HEADERS = (
    header_parameter(PRIORITY_HEADER, "A priority class of the tier, instead of its default."),
    header_parameter(REGION_HEADER, "The region to serve the request in (one of the policy's)."),
    header_parameter(CACHE_CONTROL_HEADER, "no-cache, no-store or bypass: opt out of the response cache."),
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


# --- /v1/embeddings, /v1/responses, /tokenize, /detokenize ----------------------------------------

_MODEL = _COMMON["model"]
_TOKEN_ID = Schema(type=OpenAPIType.INTEGER, minimum=0)

EMBEDDING_REQUEST = obj({
    "model": Schema(type=OpenAPIType.STRING, min_length=1,
                    description="An embedding model (kind: embedding) the key's tier may use."),
    "input": Schema(one_of=[
        Schema(type=OpenAPIType.STRING, min_length=1),
        array(Schema(type=OpenAPIType.STRING, min_length=1), min_items=1),
        array(_TOKEN_ID, min_items=1),
        array(array(_TOKEN_ID, min_items=1), min_items=1),
    ], description="Text, texts, token ids, or lists of token ids."),
    "encoding_format": Schema(type=OpenAPIType.STRING, enum=["float", "base64"]),
    "dimensions": _POSITIVE,
    "user": STRING,
    "priority": _COMMON["priority"],
}, ["model", "input"], description=_EXTRA_FIELDS)

EMBEDDING_LIST = obj({
    "object": Schema(type=OpenAPIType.STRING, const="list"),
    "data": array(obj({"object": Schema(type=OpenAPIType.STRING, const="embedding"), "index": INTEGER,
                       "embedding": Schema(one_of=[array(Schema(type=OpenAPIType.NUMBER)), STRING])},
                      ["object", "index", "embedding"])),
    "model": STRING,
    "usage": obj({"prompt_tokens": INTEGER, "total_tokens": INTEGER}),
}, ["object", "data", "model"], description="The engine's answer, relayed (or the response cache's).")

EMBEDDING_OPERATION = documented(
    body=json_request_body(EMBEDDING_REQUEST), headers=REQUEST_HEADERS, security=API_KEY,
    responses={200: json_response("The embeddings.", EMBEDDING_LIST,
                                  {"x-request-id": header("The request's id."),
                                   ROUTE_HEADER: header("What served the request: model, pool, endpoint, ...")}),
               **GENERATION_ERRORS})

RESPONSES_REQUEST = obj({
    "model": _MODEL,
    "input": Schema(one_of=[STRING, array(Schema(type=OpenAPIType.OBJECT, additional_properties=True),
                                          min_items=1)],
                    description="Text, or input items (messages with a role and content, and other items)."),
    "instructions": STRING,
    "max_output_tokens": _POSITIVE,
    "stream": BOOLEAN,
    "store": BOOLEAN,
    "previous_response_id": STRING,
    "priority": _COMMON["priority"],
}, ["model", "input"], description=_EXTRA_FIELDS + " The gateway keeps no responses (see the README).")

_RESPONSE = obj({"id": STRING, "object": Schema(type=OpenAPIType.STRING, const="response"), "created_at": INTEGER,
                 "model": STRING, "status": STRING, "output": Schema(type=OpenAPIType.ARRAY),
                 "usage": obj({"input_tokens": INTEGER, "output_tokens": INTEGER, "total_tokens": INTEGER},
                              nullable_=True)},
                ["id", "object", "model", "output"], description="The engine's answer, relayed.")
_RESPONSE_EVENT = obj({"event": STRING, "data": Schema(
    type=OpenAPIType.STRING, content_media_type="application/json",
    content_schema=obj({"type": STRING, "sequence_number": INTEGER}, ["type"]))}, ["event", "data"])

RESPONSES_OPERATION = documented(
    body=json_request_body(RESPONSES_REQUEST), headers=REQUEST_HEADERS, security=API_KEY,
    responses={200: OpenAPIResponse(
        description="The response (stream: true, a text/event-stream of named events ending with "
                    "response.completed).",
        content={"application/json": OpenAPIMediaType(schema=_RESPONSE),
                 "text/event-stream": OpenAPIMediaType(schema=_RESPONSE_EVENT)},
        headers={"x-request-id": header("The request's id."),
                 ROUTE_HEADER: header("What served the request: model, pool, endpoint, policy, ...")}),
        **GENERATION_ERRORS})

TOKENIZE_REQUEST = obj({
    "model": _MODEL,
    "prompt": STRING,
    "messages": array(obj({"role": Schema(type=OpenAPIType.STRING, enum=_ROLES),
                           "content": Schema(type=[OpenAPIType.STRING, OpenAPIType.ARRAY, OpenAPIType.NULL])},
                          ["role"]), min_items=1),
    "add_special_tokens": BOOLEAN,
}, ["model"], description="Give prompt (a text) or messages (a chat, rendered with the model's template). "
                          + _EXTRA_FIELDS)
TOKENIZE_REQUEST.any_of = [Schema(required=["prompt"]), Schema(required=["messages"])]
TOKENIZE_OPERATION = documented(
    body=json_request_body(TOKENIZE_REQUEST), headers=REQUEST_HEADERS, security=API_KEY,
    responses={200: json_response("The prompt's tokens, from an engine of the model.", obj(
        {"count": INTEGER, "max_model_len": INTEGER, "tokens": array(INTEGER)}, ["count", "tokens"])),
        **v1_errors(400, 401, 403, 404, 413, 500, 502, 503, 504)})

DETOKENIZE_REQUEST = obj({"model": _MODEL, "tokens": array(_TOKEN_ID)}, ["model", "tokens"],
                         description=_EXTRA_FIELDS)
DETOKENIZE_OPERATION = documented(
    body=json_request_body(DETOKENIZE_REQUEST), headers=REQUEST_HEADERS, security=API_KEY,
    responses={200: json_response("The tokens' text, from an engine of the model.", obj({"prompt": STRING},
                                                                                         ["prompt"])),
               **v1_errors(400, 401, 403, 404, 413, 500, 502, 503, 504)})
