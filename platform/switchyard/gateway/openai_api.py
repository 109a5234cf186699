"""The OpenAI-compatible routes under ``/v1`` (and vLLM's ``/tokenize``, ``/detokenize``): thin handlers over
:class:`Proxy`."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response, get, post

from switchyard.gateway.openapi_docs import (
    CHAT_OPERATION,
    COMPLETION_OPERATION,
    DETOKENIZE_OPERATION,
    EMBEDDING_OPERATION,
    MODELS_OPERATION,
    RESPONSES_OPERATION,
    TOKENIZE_OPERATION,
)
from switchyard.gateway.proxy import Proxy
from switchyard.gateway.runtime import GatewayRuntime


def _proxy(request: Request[Any, Any, Any]) -> Proxy:
    proxy: Proxy = request.app.state.proxy
    return proxy


def _runtime(request: Request[Any, Any, Any]) -> GatewayRuntime:
    runtime: GatewayRuntime = request.app.state.runtime
    return runtime


@post("/v1/chat/completions", operation_id="createChatCompletion", status_code=200, operation_class=CHAT_OPERATION)
async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
    """Create a chat completion (streaming with ``stream: true``)."""
    return await _proxy(request).handle(request, "chat")


@post("/v1/completions", operation_id="createCompletion", status_code=200, operation_class=COMPLETION_OPERATION)
async def completions(request: Request[Any, Any, Any]) -> Response[Any]:
    """Create a text completion (streaming with ``stream: true``)."""
    return await _proxy(request).handle(request, "completion")


@post("/v1/embeddings", operation_id="createEmbedding", status_code=200, operation_class=EMBEDDING_OPERATION)
async def embeddings(request: Request[Any, Any, Any]) -> Response[Any]:
    """Create embeddings with a model of kind embedding."""
    return await _proxy(request).handle(request, "embedding")


@post("/v1/responses", operation_id="createResponse", status_code=200, operation_class=RESPONSES_OPERATION)
async def responses(request: Request[Any, Any, Any]) -> Response[Any]:
    """Create a response (the Responses API; streaming with ``stream: true``)."""
    return await _proxy(request).handle(request, "responses")


@post("/tokenize", operation_id="tokenize", status_code=200, operation_class=TOKENIZE_OPERATION)
async def tokenize(request: Request[Any, Any, Any]) -> Response[Any]:
    """A prompt's (or a chat's) token ids, from an engine of the model."""
    return await _proxy(request).handle(request, "tokenize")


@post("/detokenize", operation_id="detokenize", status_code=200, operation_class=DETOKENIZE_OPERATION)
async def detokenize(request: Request[Any, Any, Any]) -> Response[Any]:
    """The text of token ids, from an engine of the model."""
    return await _proxy(request).handle(request, "detokenize")


@get("/v1/models", operation_id="listModels", operation_class=MODELS_OPERATION)
async def list_models(request: Request[Any, Any, Any]) -> Response[bytes]:
    """The models and routes the caller's tier may use."""
    runtime = _runtime(request)
    snapshot = runtime.policy.snapshot
    identity = await runtime.auth.authenticate(request.headers.get("authorization"),
                                               snapshot.document.resilience.dependencies.database)
    tier = snapshot.tiers.get(identity.tier)
    created = int(runtime.started_at)
    data: list[dict[str, Any]] = []
    if tier is not None:
        for model in snapshot.models.values():
            if snapshot.allowed(tier, model.name):
                data.append({"id": model.name, "object": "model", "created": created,
                             "owned_by": "switchyard", "max_model_len": model.context_window})
        for route in snapshot.routes.values():
            if snapshot.allowed(tier, route.name):
                data.append({"id": route.name, "object": "model", "created": created,
                             "owned_by": "switchyard"})
    return Response(msgspec.json.encode({"object": "list", "data": data}), media_type="application/json")


ROUTES = [chat_completions, completions, embeddings, responses, tokenize, detokenize, list_models]
