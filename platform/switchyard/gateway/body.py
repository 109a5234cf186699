"""Parse and check OpenAI request bodies: only what the gateway relies on, with clear errors.

Everything else in the body is passed to the engine untouched, which answers for it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from switchyard.gateway.errors import BadRequest

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400."""
    if not raw:
        raise BadRequest("The request body is empty; send a JSON object.")
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"We could not parse the JSON body of your request: {exc}.") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    return body


def _positive_int(body: dict[str, Any], key: str) -> None:
    value = body.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"'{key}' must be a positive integer, got {value!r}.", param=key)


def _common(body: dict[str, Any]) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("You must provide a model parameter (a non-empty string).", param="model")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false.", param="stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise BadRequest("'stream_options' must be an object.", param="stream_options")
        if not stream:
            raise BadRequest("'stream_options' is only allowed when 'stream' is true.",
                             param="stream_options")
    for key in ("max_tokens", "n"):
        _positive_int(body, key)
    # 'priority' (an integer in vLLM's sense, or a priority class's name) is checked where the
    # request's class is decided (decide.flow.classify).


def check_chat(body: dict[str, Any]) -> None:
    """Check a ``/v1/chat/completions`` body in place."""
    _common(body)
    _positive_int(body, "max_completion_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array of messages.", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{i}] must be an object.", param=f"messages[{i}]")
        role = message.get("role")
        if role not in _ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}.",
                             param=f"messages[{i}].role")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(f"messages[{i}].content must be a string or an array of parts.",
                             param=f"messages[{i}].content")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("'tools' must be an array.", param="tools")


def check_completion(body: dict[str, Any]) -> None:
    """Check a ``/v1/completions`` body in place."""
    _common(body)
    prompt = body.get("prompt")
    ok = isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and (
            all(isinstance(p, str) for p in prompt)
            or all(isinstance(p, int) and not isinstance(p, bool) for p in prompt)
            or all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt)
        )
    )
    if not ok:
        raise BadRequest("'prompt' must be a string, an array of strings, or token ids.", param="prompt")
