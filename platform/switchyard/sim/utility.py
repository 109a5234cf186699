"""vLLM's small endpoints besides generation: ``/version``, ``/ping``, ``/load``, ``/tokenize``.

``/tokenize`` counts with the simulator's tokenizer, as generation does, so a client that sizes
its prompts with it gets the numbers the engine will use. ``/load`` reports the requests in
flight (vLLM reports them with ``--enable-server-load-tracking``, else 0).
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post
from litestar.datastructures import State
from litestar.handlers import asgi
from litestar.types import Receive, Scope, Send

from switchyard.sim.protocol import check_messages
from switchyard.sim.responses import VLLM_VERSION
from switchyard.sim.runtime import EngineRuntime
from switchyard.sim.validation import ApiError, Fields, bad, decode_body, strict_str
from switchyard.simtext.chat import ChatFormatError, render_chat
from switchyard.simtext.tokens import SPECIAL_TOKENS, tokenize

_BOS = SPECIAL_TOKENS["<|begin_of_text|>"]


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


def token_ids(body: dict[str, Any], served_model: str) -> list[int]:
    """The token ids a ``/tokenize`` body asks for (a ``prompt`` or chat ``messages``).

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
    model = f.get_str("model")
    if model is not None and model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {served_model}.", "model")
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
        ids = token_ids(decode_body(await request.body()), engine.config.served_model)
    except ApiError as exc:
        return Response(exc.body(), status_code=exc.status, media_type="application/json")
    return Response({"count": len(ids), "max_model_len": engine.config.max_model_len, "tokens": ids,
                     "token_strs": None})
