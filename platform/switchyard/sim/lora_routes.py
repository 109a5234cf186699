"""vLLM's LoRA routes: ``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter`` and the adapters'
``/v1/models`` cards.

The two routes exist only with runtime updating (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); otherwise their
paths are unknown (FastAPI's 404). They answer as vLLM's FastAPI handlers do: FastAPI's JSON parsing
first, then vLLM's ``validate_json_request`` (an ``application/json`` content type), then the pydantic
body (``lora_name``, ``lora_path``, ``load_inplace``, ``is_3d_lora_weight``; ``lora_name``,
``lora_int_id``), then the registry's checks (``lora.py``), then the engine's: a ``lora_path`` on this
machine must hold an adapter (vLLM's 404 "No adapter found for <path>" otherwise), while a made-up path in
no existing directory (``/adapters/support-v1``) loads a simulated adapter (``lora.check_adapter_path``).
Success is a 200 whose body is vLLM's sentence as plain text, with no content type; a load answers once
the engine has the adapter loaded (its load time, in simulated time). Error messages pass through vLLM's
``sanitize_message``, which hides file paths.

Must not touch: the engine's state (``EngineRuntime`` does the work).
"""

from __future__ import annotations

import email.message
from collections.abc import Callable
from typing import Any

from litestar import Litestar
from litestar.handlers import ASGIRouteHandler, asgi
from litestar.types import Receive, Scope, Send

from switchyard.sim.config import ResolvedConfig
from switchyard.sim.generate import send_json
from switchyard.sim.lora import LoraRequestError, sanitize_message
from switchyard.sim.runtime import EngineRuntime
from switchyard.sim.validation import ApiError, decode_body, input_repr, read_bool

_METHOD_NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'
_UNSUPPORTED = "Unsupported Media Type: Only 'application/json' is allowed"


def adapter_cards(engine: EngineRuntime, created: int) -> list[dict[str, Any]]:
    """The ``/v1/models`` cards of the registered adapters, after the base model's, as vLLM lists them:
    ``root`` the adapter's path, ``parent`` the base model, no ``max_model_len``."""
    registry = engine.loras
    if registry is None:
        return []
    return [{
        "id": a.name, "object": "model", "created": created, "owned_by": "vllm", "root": a.path,
        "parent": a.parent, "max_model_len": None,
        "permission": [{
            "id": f"modelperm-{a.name}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False}],
    } for a in registry.adapters.values()]


def _error(status: int, message: str, err_type: str, param: str | None = None) -> ApiError:
    return ApiError(status, sanitize_message(message), param, err_type)


def _validation(errors: list[dict[str, Any]] | list[str]) -> ApiError:
    """FastAPI's ``RequestValidationError`` as vLLM's handler answers it (a 400 of type "Bad Request")."""
    count = len(errors)
    lines = "\n".join(f"  {e}" if isinstance(e, str) else f"  {e!r}" for e in errors)
    first = errors[0]
    param = first["loc"] if isinstance(first, dict) else None
    return ApiError(400, sanitize_message(f"{count} validation {'error' if count == 1 else 'errors'}:\n{lines}"), param,
                    "Bad Request")


def _field_error(kind: str, loc: str, msg: str, value: object) -> dict[str, Any]:
    return {"type": kind, "loc": loc, "msg": msg, "input": input_repr(value)}


def _string(body: dict[str, Any], key: str, errors: list[dict[str, Any]]) -> str:
    if key not in body:
        errors.append(_field_error("missing", f"body.{key}", "Field required", body))
        return ""
    value = body[key]
    if not isinstance(value, str):
        errors.append(_field_error("string_type", f"body.{key}", "Input should be a valid string", value))
        return ""
    return value


def _boolean(body: dict[str, Any], key: str, errors: list[dict[str, Any]]) -> bool:
    if key not in body:
        return False
    read = read_bool(body[key])
    if isinstance(read, bool):
        return read
    errors.append(_field_error(read[0], f"body.{key}", read[1], body[key]))
    return False


def _optional_int(body: dict[str, Any], key: str, errors: list[dict[str, Any]]) -> None:
    value = body.get(key)
    loc = f"body.{key}"
    if value is None or isinstance(value, int):
        return
    if isinstance(value, float):
        if not value.is_integer():
            errors.append(_field_error("int_from_float", loc,
                                       "Input should be a valid integer, got a number with a fractional part", value))
    elif isinstance(value, str):
        try:
            int(value.strip())
        except ValueError:
            errors.append(_field_error("int_parsing", loc,
                                       "Input should be a valid integer, unable to parse string as an integer", value))
    else:
        errors.append(_field_error("int_type", loc, "Input should be a valid integer", value))


def _is_json(content_type: str) -> bool:
    """Whether FastAPI parses a body of this content type as JSON (``application/json`` or ``…+json``)."""
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


async def _read_body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body = message.get("body", b"")
        chunks.append(body if isinstance(body, bytes) else b"")
        if not message.get("more_body", False):
            return b"".join(chunks)


def _request_body(scope: Scope, raw: bytes) -> dict[str, Any]:
    """The JSON object of a LoRA request, checked in FastAPI's order (JSON, content type, body).

    Raises:
        ApiError: The 400 FastAPI and vLLM answer.
    """
    headers = dict(scope.get("headers") or [])
    content_type = headers.get(b"content-type", b"").decode("latin-1")
    if raw and (not content_type or _is_json(content_type)):
        try:
            decode_body(raw)
        except ApiError as exc:
            if exc.param is not None and exc.param.startswith("body.") and "JSON decode error" in exc.message:
                raise
    if content_type.lower().split(";", 1)[0] != "application/json":
        raise _validation([_UNSUPPORTED])
    return decode_body(raw)


async def _text_ok(send: Send, text: str) -> None:
    """A 200 with a plain string body and no content type (FastAPI's ``Response(content=...)``)."""
    body = text.encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _serve(scope: Scope, receive: Receive, send: Send,
                 act: Callable[[EngineRuntime, dict[str, Any]], Any]) -> None:
    if scope.get("method") != "POST":
        await send_json(send, 405, _METHOD_NOT_ALLOWED)  # type: ignore[arg-type]
        return
    raw = await _read_body(receive)
    if raw is None:
        return
    engine: EngineRuntime = Litestar.from_scope(scope).state["engine"]
    try:
        text = await act(engine, _request_body(scope, raw))
    except ApiError as exc:
        await send_json(send, exc.status, exc.body())  # type: ignore[arg-type]
        return
    except LoraRequestError as exc:
        error = _error(exc.status, exc.message, exc.err_type)
        await send_json(send, error.status, error.body())  # type: ignore[arg-type]
        return
    await _text_ok(send, text)


async def _load(engine: EngineRuntime, body: dict[str, Any]) -> str:
    errors: list[dict[str, Any]] = []
    name = _string(body, "lora_name", errors)
    path = _string(body, "lora_path", errors)
    inplace = _boolean(body, "load_inplace", errors)
    _boolean(body, "is_3d_lora_weight", errors)
    if errors:
        raise _validation(errors)
    done = engine.load_adapter(name, path, load_inplace=inplace)
    await engine.sleep_until(done)
    return engine.loras.added_message(name) if engine.loras else ""


async def _unload(engine: EngineRuntime, body: dict[str, Any]) -> str:
    errors: list[dict[str, Any]] = []
    name = _string(body, "lora_name", errors)
    _optional_int(body, "lora_int_id", errors)
    if errors:
        raise _validation(errors)
    engine.unload_adapter(name)
    return engine.loras.removed_message(name) if engine.loras else ""


@asgi("/v1/load_lora_adapter", copy_scope=False)
async def load_lora_adapter(scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace"?}``."""
    await _serve(scope, receive, send, _load)


@asgi("/v1/unload_lora_adapter", copy_scope=False)
async def unload_lora_adapter(scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /v1/unload_lora_adapter`` ``{"lora_name"}``."""
    await _serve(scope, receive, send, _unload)


def lora_route_handlers(config: ResolvedConfig) -> list[ASGIRouteHandler]:
    """The LoRA routes an engine serves: both with runtime updating, none without (as vLLM)."""
    return [load_lora_adapter, unload_lora_adapter] if config.allow_runtime_lora else []
