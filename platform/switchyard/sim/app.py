"""One simulated engine as a Litestar app: vLLM's HTTP surface plus ``/sim/*`` controls.

Routes: ``GET /v1/models``, ``GET /health``, ``GET /metrics``, ``POST /v1/completions``,
``POST /v1/chat/completions``, ``POST /v1/embeddings``, ``GET /version``, ``GET|POST /ping``,
``GET /load``, ``POST /tokenize``, ``POST /detokenize``, ``POST /v1/responses`` (``GET /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel`` find nothing: no response is stored) (as vLLM's OpenAI server; with runtime
LoRA updating also
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, see ``lora_routes.py``),
``POST /reset_prefix_cache`` (one of vLLM's development endpoints, served only with ``VLLM_SERVER_DEV_MODE=1``
there, always here), and ``GET/POST /sim/faults``, ``GET /sim/state`` (simulator only; fault modes and rates
are described in ``faults.py``). Unknown paths and methods get FastAPI's ``{"detail": …}`` answers, as from
vLLM. The app's lifespan starts and stops the engine loop.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.datastructures import State
from litestar.enums import ScopeType
from litestar.exceptions import HTTPException, MethodNotAllowedException, NotFoundException
from litestar.handlers import asgi
from litestar.params import FromQuery
from litestar.types import ASGIApp, Receive, Scope, Send
from prometheus_client import CONTENT_TYPE_LATEST

from switchyard.sim.config import EngineConfig, ResolvedConfig, resolve
from switchyard.sim.embeddings import handle_embeddings
from switchyard.sim.faults import FaultError
from switchyard.sim.generate import handle_generation, send_json
from switchyard.sim.lora_routes import adapter_cards, lora_route_handlers
from switchyard.sim.metrics import EngineMetrics
from switchyard.sim.protocol import ApiError
from switchyard.sim.responses_api import cancel_response, handle_responses, retrieve_response
from switchyard.sim.runtime import EngineRuntime
from switchyard.sim.utility import detokenize_endpoint, load, ping, tokenize_endpoint, version

_UNAVAILABLE = {mode: ApiError(503, f"Engine is unavailable (sim fault mode '{mode}').").body()
                for mode in ("unavailable", "down")}
_METHOD_NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'
# Litestar appends the charset to a text type itself.
_METRICS_TYPE = CONTENT_TYPE_LATEST.split("; charset=")[0]


def _engine(state: State) -> EngineRuntime:
    engine: EngineRuntime = state["engine"]
    return engine


def _scope_engine(scope: Scope) -> EngineRuntime:
    return _engine(Litestar.from_scope(scope).state)


@get("/v1/models", operation_id="listModels", sync_to_thread=False)
def list_models(state: State) -> dict[str, Any]:
    """vLLM's model list, with ``max_model_len``; then the LoRA adapters registered."""
    cfg = _engine(state).config
    created = int(time.time())
    card = {
        "id": cfg.served_model, "object": "model", "created": created, "owned_by": "vllm",
        "root": cfg.profile.model, "parent": None, "max_model_len": cfg.max_model_len,
        "permission": [{
            "id": f"modelperm-{cfg.served_model}", "object": "model_permission",
            "created": created, "allow_create_engine": False, "allow_sampling": True,
            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
            "allow_fine_tuning": False, "organization": "*", "group": None,
            "is_blocking": False}],
    }
    return {"object": "list", "data": [card, *adapter_cards(_engine(state), created)]}


async def send_empty_ok(scope: Scope, send: Send) -> None:
    """200 with an empty body and no content type (vLLM's ``/health`` and ``/ping``)."""
    if scope.get("method") not in ("GET", "HEAD"):
        await send_json(send, 405, _METHOD_NOT_ALLOWED)  # type: ignore[arg-type]
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@asgi("/health", copy_scope=False)
async def health(scope: Scope, receive: Receive, send: Send) -> None:
    """200 with an empty body while the engine is up."""
    await send_empty_ok(scope, send)


@get("/metrics", operation_id="metrics", sync_to_thread=False)
def metrics(state: State) -> Response[bytes]:
    """Prometheus text exposition."""
    body = state["metrics"].render()
    return Response(body, media_type=_METRICS_TYPE)


@asgi("/v1/completions", copy_scope=False)
async def completions(scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /v1/completions``."""
    await handle_generation(_scope_engine(scope), False, scope, receive, send)  # type: ignore[arg-type]


@asgi("/v1/chat/completions", copy_scope=False)
async def chat_completions(scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /v1/chat/completions``."""
    await handle_generation(_scope_engine(scope), True, scope, receive, send)  # type: ignore[arg-type]


@asgi("/v1/embeddings", copy_scope=False)
async def embeddings(scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /v1/embeddings`` (outside the engine's scheduler; see ``switchyard.sim.embeddings``)."""
    await handle_embeddings(_scope_engine(scope), scope, receive, send)  # type: ignore[arg-type]


@asgi("/v1/responses", copy_scope=False)
async def responses(scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /v1/responses`` (OpenAI's Responses API as vLLM serves it; see ``switchyard.sim.responses_api``)."""
    await handle_responses(_scope_engine(scope), scope, receive, send)  # type: ignore[arg-type]


@post("/reset_prefix_cache", operation_id="resetPrefixCache", status_code=200, sync_to_thread=False)
def reset_prefix_cache(state: State, reset_running_requests: FromQuery[bool] = False,
                       reset_external: FromQuery[bool] = False) -> dict[str, bool]:
    """Forget every cached prefix block: ``{"success": false}`` while requests hold blocks, unless
    ``reset_running_requests`` preempts them first (they recompute). ``reset_external`` is accepted
    and ignored (the sim has no KV connector). With KV events on, ``AllBlocksCleared`` goes out with
    the engine's next step, as from vLLM."""
    return {"success": _engine(state).reset_prefix_cache(reset_running_requests)}


@get("/sim/faults", operation_id="getFaults", sync_to_thread=False)
def get_faults(state: State) -> dict[str, Any]:
    """Current fault settings."""
    return _engine(state).faults.as_dict()


@post("/sim/faults", operation_id="setFaults", status_code=200)
async def set_faults(request: Request[Any, Any, Any], state: State) -> Response[bytes]:
    """Change the fault settings; answers all of them.

    Body: any of ``{"mode": "none"|"slow"|"drip"|"hang"|"down"|"unavailable"|a garbage mode,
    "slow_factor": float, "drip_interval_s": float, "error_rate": float, "throttle_rate": float,
    "overload_rate": float, "abort_rate": float, "abort_after_tokens": int, "abort_with":
    "close"|"error"}`` (settings left out keep their value; ``faults.py`` says what each does); 400
    naming the problem otherwise. ``down`` closes this very port once the answer is sent, so only
    the process's control server (``switchyard sim --control-port``) can bring the engine back.
    """
    engine = _engine(state)
    try:
        engine.faults.update(msgspec.json.decode(await request.body()))
    except (msgspec.DecodeError, FaultError) as exc:
        return Response(ApiError(400, str(exc)).body(), status_code=400,
                        media_type="application/json")
    return Response(msgspec.json.encode(engine.faults.as_dict()), media_type="application/json",
                    background=BackgroundTask(engine.sync_listener))


@get("/sim/state", operation_id="getState", sync_to_thread=False)
def get_state(state: State) -> dict[str, Any]:
    """Engine internals: queues, KV blocks, prefix cache, preemptions, clock."""
    return _engine(state).snapshot()


def _fastapi_error(_: Request[Any, Any, Any], exc: HTTPException) -> Response[dict[str, str]]:
    """Routing errors as vLLM (FastAPI) words them: ``{"detail": "Not Found"}``."""
    return Response({"detail": exc.detail}, status_code=exc.status_code)


def _unavailable_guard(app: ASGIApp) -> ASGIApp:
    """Answer 503 on everything but ``/sim/*`` in fault mode ``unavailable`` (and in ``down``, for a
    request that gets in before the socket closes, or in process where there is none)."""

    async def guard(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == ScopeType.HTTP and not scope["path"].startswith("/sim/"):
            answer = _UNAVAILABLE.get(_scope_engine(scope).faults.mode)
            if answer is not None:
                await send_json(send, 503, answer)  # type: ignore[arg-type]
                return
        await app(scope, receive, send)

    return guard


def build_app(config: ResolvedConfig) -> Litestar:
    """The app of an already resolved configuration (see ``create_engine_app``)."""
    engine = EngineRuntime(config)

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    return Litestar(
        route_handlers=[list_models, health, metrics, completions, chat_completions, embeddings,
                        responses, retrieve_response, cancel_response, detokenize_endpoint,
                        version, ping, load, tokenize_endpoint, reset_prefix_cache, get_faults, set_faults,
                        get_state, *lora_route_handlers(config)],
        state=State({"engine": engine, "metrics": EngineMetrics(engine)}),
        lifespan=[lifespan],
        middleware=[_unavailable_guard],
        exception_handlers={NotFoundException: _fastapi_error, MethodNotAllowedException: _fastapi_error},
        openapi_config=None,
        logging_config=None,
    )


def create_engine_app(config: EngineConfig) -> Litestar:
    """One engine's ASGI app; its lifespan starts and stops the engine loop.

    Raises:
        ValueError: The configuration is invalid (unknown profile, bad limits).
    """
    return build_app(resolve(config))
