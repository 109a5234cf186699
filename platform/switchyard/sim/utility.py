"""vLLM's small endpoints besides generation: ``/version``, ``/ping``, ``/load``, ``/tokenize``, ``/detokenize``.

``/tokenize`` counts with the simulator's tokenizer, as generation does, so a client that sizes
its prompts with it gets the numbers the engine will use. ``/detokenize`` turns ids back into text:
special tokens by name (vLLM keeps them), generated words, and any text this process has tokenized (the
simulator's ids are hashes of text, so an id it never produced decodes to nothing, as an id a real
tokenizer does not know does). ``/load`` reports the requests in flight (vLLM reports them with
``--enable-server-load-tracking``, else 0).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.datastructures import State
from litestar.handlers import asgi
from litestar.types import Receive, Scope, Send

from switchyard.sim.protocol import check_messages
from switchyard.sim.responses import VLLM_VERSION
from switchyard.sim.runtime import EngineRuntime
from switchyard.sim.validation import ApiError, Fields, bad, decode_body, input_repr, invalid, lax_int, strict_str
from switchyard.simtext.chat import ChatFormatError, render_chat
from switchyard.simtext.tokens import SPECIAL_TOKENS, token_text, tokenize

_BOS = SPECIAL_TOKENS["<|begin_of_text|>"]
_INT64 = 2**63 - 1
_UNSUPPORTED_MEDIA = ApiError(400, "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                              None, "Bad Request")


def _engine(state: State) -> EngineRuntime:
    engine: EngineRuntime = state["engine"]
    return engine


@get("/version", operation_id="version", sync_to_thread=False)
def version() -> dict[str, str]:
    """The vLLM version whose API is simulated."""
    return {"version": VLLM_VERSION}


@asgi("/ping", copy_scope=False)
async def ping(scope: Scope, receive: Receive, send: Send) -> None:
    """SageMaker's health check (GET or POST): 200 with an empty body, like ``/health``."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@get("/load", operation_id="load", sync_to_thread=False)
def load(state: State) -> dict[str, int]:
    """Requests in flight."""
    return {"server_load": _engine(state).in_flight}


def _check_model(model: str | None, served_model: str, adapters: Collection[str]) -> None:
    """vLLM's ``_check_model``: the base model's name, a registered adapter's, or none at all.

    Raises:
        ApiError: The 404 naming the base model's aliases (not the adapters).
    """
    if model is not None and model != served_model and model not in adapters:
        raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {served_model}.", "model")


def _adapter_names(engine: EngineRuntime) -> Collection[str]:
    return () if engine.loras is None else engine.loras.adapters.keys()


def token_ids(body: dict[str, Any], served_model: str, adapters: Collection[str] = ()) -> list[int]:
    """The token ids a ``/tokenize`` body asks for (a ``prompt`` or chat ``messages``); ``model`` may
    name the base model or one of ``adapters`` (the registered LoRA adapters: they tokenize alike).

    Raises:
        ApiError: A malformed body or an unknown model.
    """
    f = Fields(body)
    if "messages" in body:
        # vLLM's TokenizeChatRequest has the chat completion's "before" validator of the two flags.
        if body.get("continue_final_message") and body.get("add_generation_prompt"):
            raise bad("Cannot set both `continue_final_message` and `add_generation_prompt` to True.", None)
        messages = check_messages(body["messages"])
        add_gen = f.get_bool("add_generation_prompt", True)
        continue_final = f.get_bool("continue_final_message")
    else:
        if "prompt" not in body:
            raise ApiError(400, "1 validation error:\n  {'type': 'missing', 'loc': 'body.prompt', "
                                "'msg': 'Field required', 'input': " + repr(f"<dict of {len(body)} items>") + "}",
                           "body.prompt", "Bad Request")
        prompt = strict_str(body["prompt"], "body.prompt")
        special = f.get_bool("add_special_tokens", True)
    _check_model(f.get_str("model"), served_model, adapters)
    if "messages" not in body:
        return [_BOS, *tokenize(prompt)] if special else tokenize(prompt)
    try:
        return render_chat(messages, body.get("tools"), None, add_gen, continue_final)
    except ChatFormatError as exc:
        raise bad(str(exc), None) from None


@post("/tokenize", operation_id="tokenize", status_code=200)
async def tokenize_endpoint(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """``{count, max_model_len, tokens, token_strs}`` of a prompt or a chat."""
    engine = _engine(state)
    try:
        ids = token_ids(decode_body(await request.body()), engine.config.served_model, _adapter_names(engine))
    except ApiError as exc:
        if exc.status == 404:
            engine.unknown_model()
        return Response(exc.body(), status_code=exc.status, media_type="application/json")
    return Response({"count": len(ids), "max_model_len": engine.config.max_model_len, "tokens": ids,
                     "token_strs": None})


def json_body(content_type: str, raw: bytes) -> dict[str, Any]:
    """The JSON object of a request to a route that wants ``application/json``, checked in FastAPI's order.

    FastAPI parses a body sent as JSON (or with no content type) first, so its syntax errors come first;
    then vLLM's ``validate_json_request`` refuses any content type but ``application/json``; then the body
    is validated.

    Raises:
        ApiError: 400 for a syntax error, another content type, or a body that is no JSON object.
    """
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json":
        json_like = not media or (media.startswith("application/") and media.endswith("+json"))
        if json_like and raw.strip():
            try:
                msgspec.json.decode(raw)
            except msgspec.DecodeError:
                decode_body(raw)  # raises FastAPI's error for the syntax error
        raise _UNSUPPORTED_MEDIA
    return decode_body(raw)


def _token_error(value: object, loc: str) -> dict[str, Any] | None:
    """pydantic's error for one item of ``list[Annotated[int, Field(ge=0, le=2**63 - 1)]]`` (lax mode)."""
    number: int | None = None
    kind, msg = "int_type", "Input should be a valid integer"
    if isinstance(value, bool | int):
        number = int(value)
    elif isinstance(value, float):
        if value.is_integer():
            number = int(value)
        else:
            kind, msg = "int_from_float", "Input should be a valid integer, got a number with a fractional part"
    elif isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            kind, msg = "int_parsing", "Input should be a valid integer, unable to parse string as an integer"
    if number is None:
        return {"type": kind, "loc": loc, "msg": msg, "input": input_repr(value)}
    if number < 0:
        return {"type": "greater_than_equal", "loc": loc, "msg": "Input should be greater than or equal to 0",
                "input": input_repr(value), "ctx": {"ge": 0}}
    if number > _INT64:
        return {"type": "less_than_equal", "loc": loc, "msg": f"Input should be less than or equal to {_INT64}",
                "input": input_repr(value), "ctx": {"le": _INT64}}
    return None


def detokenize_ids(body: dict[str, Any], served_model: str, adapters: Collection[str] = ()) -> str:
    """The text of a ``/detokenize`` body's ``tokens``; ``model`` may name the base model or one of
    ``adapters``.

    Raises:
        ApiError: A malformed body or an unknown model.
    """
    model = Fields(body).get_str("model")
    if "tokens" not in body:
        raise invalid("missing", "body.tokens", "Field required", body)
    tokens = body["tokens"]
    if not isinstance(tokens, list):
        raise invalid("list_type", "body.tokens", "Input should be a valid list", tokens)
    errors = [e for i, t in enumerate(tokens) if (e := _token_error(t, f"body.tokens.{i}")) is not None]
    if errors:
        label = "error" if len(errors) == 1 else "errors"
        lines = "".join(f"\n  {e!r}" for e in errors[:10])
        more = f"\n  ...and {len(errors) - 10} more {label}" if len(errors) > 10 else ""
        raise ApiError(400, f"{len(errors)} validation {label}:{lines}{more}", errors[0]["loc"], "Bad Request")
    _check_model(model, served_model, adapters)
    return "".join(token_text(lax_int(t, "")) or "" for t in tokens)


@post("/detokenize", operation_id="detokenize", status_code=200)
async def detokenize_endpoint(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """``{"prompt": text}`` of a list of token ids."""
    engine = _engine(state)
    try:
        body = json_body(request.headers.get("content-type", ""), await request.body())
        text = detokenize_ids(body, engine.config.served_model, _adapter_names(engine))
    except ApiError as exc:
        if exc.status == 404:
            engine.unknown_model()
        return Response(exc.body(), status_code=exc.status, media_type="application/json")
    return Response({"prompt": text})
