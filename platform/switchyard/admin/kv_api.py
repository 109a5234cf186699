"""The admin API's view of the engines' prefix caches: which endpoint holds how much of a prompt, now."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from litestar import Request, post
from litestar.di import NamedDependency

from switchyard.admin import openapi_docs as docs
from switchyard.admin.common import json_body
from switchyard.api.errors import NotFound
from switchyard.api.openapi import admin_operation, ok
from switchyard.gateway.policy_state import PolicyHolder
from switchyard.state.kvindex import EngineCaches


class LookupRequest(msgspec.Struct):
    """A request body as a client would send it to ``/v1/chat/completions`` (``messages``) or
    ``/v1/completions`` (``prompt``), for one of the policy's models."""

    model: str
    messages: list[Any] | None = None
    prompt: Any = None
    tools: list[Any] | None = None


@post("/kv-cache/lookup", operation_id="adminKvCacheLookup", status_code=200,
      operation_class=admin_operation(ok("How much of the prompt each endpoint holds.", docs.KV_LOOKUP), 400, 404,
                                      413, body=docs.KV_LOOKUP_BODY))
async def lookup(request: Request[Any, Any, Any], policy: NamedDependency[PolicyHolder],
                 engine_caches: NamedDependency[EngineCaches]) -> dict[str, Any]:
    """The prompt's tokens as ``model``'s engines will see them, and for each endpoint of its pools the tokens of
    its longest prefix the engine's cache holds now, as its KV-cache events report (null: not known, the
    endpoint's state says why). What the ``kv-cache-precise`` scorer reads."""
    data = await json_body(request, LookupRequest)
    snapshot = policy.snapshot
    model = snapshot.models.get(data.model)
    if model is None:
        raise NotFound(f"the policy has no model {data.model!r} (give a model, not a route)")
    body = msgspec.to_builtins(data)
    render = policy.renderers.get(model.name)
    tokens = render(body) if render is not None else None
    now = time.monotonic()
    rows = []
    for pool in snapshot.model_pools[model.name]:
        for url in pool.endpoints:
            cache = engine_caches.get(url)
            held = engine_caches.held(url, tokens, now) if tokens else None
            rows.append({"url": url, "pool": pool.name,
                         "state": cache.state(now) if cache is not None else "no events",
                         "cached_tokens": held})
    return {"model": model.name, "prompt_tokens": len(tokens) if tokens is not None else None,
            "renders": render is not None, "endpoints": rows}


ROUTES = [lookup]
