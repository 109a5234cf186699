"""Parse and check OpenAI request bodies: only what the gateway relies on, with clear errors.

Everything else in the body is passed to the engine untouched, which answers for it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from switchyard.api.errors import BadRequest

#: Most choices one request may ask for (``n``), as OpenAI allows: each is a sequence of its own, and
#: admission reserves output for every one of them.
MAX_CHOICES = 128
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
#: Defaults of ``Settings.max_json_depth`` and ``Settings.max_messages``.
MAX_JSON_DEPTH = 64
MAX_MESSAGES = 2048
#: ``bytes.translate`` deletes every byte but these: what is left is one byte per array or object opened.
_NOT_OPENERS = bytes(b for b in range(256) if b not in b"[{")


def decode_json_object(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """The body as a JSON object nested at most ``max_depth`` deep, or a 400.

    The depth costs one pass in C over the raw bytes for an ordinary body (about half of what
    decoding it costs): a document cannot nest deeper than it has ``[`` and ``{`` (those inside
    strings counted too), so only a body with more of them than ``max_depth`` (a long
    conversation, many tool definitions) has its decoded containers walked (about twice what
    decoding costs; a sound bound from the raw bytes would have to tell strings apart, which
    costs more). msgspec itself gives up, with a ``RecursionError``, at about the interpreter's
    recursion limit; a body nested less deeply than that but deeper than ``max_depth`` is refused
    before anything recursive downstream (re-encoding it, the cache's digest) meets it.
    """
    if not raw:
        raise BadRequest("The request body is empty; send a JSON object.")
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"We could not parse the JSON body of your request: {exc}.") from None
    except RecursionError:
        raise _too_deep(max_depth) from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    if len(raw.translate(None, _NOT_OPENERS)) > max_depth and nested_deeper(body, max_depth):
        raise _too_deep(max_depth)
    return body


def nested_deeper(value: Any, limit: int) -> bool:
    """Whether arrays and objects in ``value`` nest more than ``limit`` deep (``value`` itself is depth 1).

    Level by level, not recursive: it is the guard against recursion.
    """
    level = [value]
    for _ in range(limit):
        below = []
        for container in level:
            for item in container.values() if type(container) is dict else container:
                kind = type(item)
                if kind is dict or kind is list:
                    below.append(item)
        if not below:
            return False
        level = below
    return True


def _too_deep(limit: int) -> BadRequest:
    return BadRequest(f"The JSON body of your request nests arrays and objects more than {limit} deep.",
                      code="json_too_deep")


def _positive_int(body: dict[str, Any], key: str) -> None:
    """``body[key]``, when given, is a positive integer (a whole JSON number such as ``5.0`` is taken as ``5``)."""
    value = body.get(key)
    if value is None:
        return
    if isinstance(value, float) and value.is_integer() and value >= 1:
        body[key] = value = int(value)
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
    n = body.get("n")
    if isinstance(n, int) and n > MAX_CHOICES:
        raise BadRequest(f"'n' must be at most {MAX_CHOICES}, got {n}.", param="n", code="invalid_value")
    # 'priority' (an integer in vLLM's sense, or a priority class's name) is checked where the
    # request's class is decided (decide.flow.classify).


def check_chat(body: dict[str, Any], max_messages: int = MAX_MESSAGES) -> None:
    """Check a ``/v1/chat/completions`` body in place (at most ``max_messages`` messages)."""
    _common(body)
    _positive_int(body, "max_completion_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array of messages.", param="messages")
    if len(messages) > max_messages:
        raise BadRequest(f"'messages' has {len(messages)} messages; at most {max_messages} are allowed.",
                         param="messages", code="too_many_messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{i}] must be an object.", param=f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:  # (an unhashable role cannot be looked up)
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


#: Most inputs one embeddings request may carry (OpenAI's limit).
MAX_EMBEDDING_INPUTS = 2048
_ENCODING_FORMATS = ("float", "base64")


def check_embedding(body: dict[str, Any]) -> None:
    """Check a ``/v1/embeddings`` body in place: ``input`` a string, strings, token ids or lists of token ids."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("You must provide a model parameter (a non-empty string).", param="model")
    value = body.get("input")
    ok = isinstance(value, str) or (
        isinstance(value, list) and value and (
            all(isinstance(v, str) for v in value)
            or all(_token_id(v) for v in value)
            or all(isinstance(v, list) and v and all(_token_id(t) for t in v) for v in value)
        )
    )
    if not ok:
        raise BadRequest("'input' must be a string, a non-empty array of strings, an array of token ids, or an "
                         "array of arrays of token ids.", param="input")
    if isinstance(value, list) and len(value) > MAX_EMBEDDING_INPUTS and not all(_token_id(v) for v in value):
        raise BadRequest(f"'input' has {len(value)} inputs; at most {MAX_EMBEDDING_INPUTS} are allowed.",
                         param="input", code="invalid_value")
    if value == "" or (isinstance(value, list) and any(isinstance(v, str) and not v for v in value)):
        raise BadRequest("'input' must not hold an empty string.", param="input")
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in _ENCODING_FORMATS:
        raise BadRequest(f"'encoding_format' must be one of {list(_ENCODING_FORMATS)}, got {fmt!r}.",
                         param="encoding_format")
    _positive_int(body, "dimensions")
    if body.get("stream"):
        raise BadRequest("Embeddings are not streamed: leave out 'stream'.", param="stream")


def _token_id(value: Any) -> bool:
    """A token id: a non-negative integer (a whole JSON number such as ``7.0`` too, as the engines take it)."""
    if isinstance(value, float):
        return value.is_integer() and value >= 0
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_responses(body: dict[str, Any], max_messages: int = MAX_MESSAGES) -> None:
    """Check a ``/v1/responses`` body in place: ``input`` a string or an array of input items."""
    _common(body)
    _positive_int(body, "max_output_tokens")
    value = body.get("input")
    if isinstance(value, list):
        if not value:
            raise BadRequest("'input' must be a string or a non-empty array of input items.", param="input")
        if len(value) > max_messages:
            raise BadRequest(f"'input' has {len(value)} items; at most {max_messages} are allowed.",
                             param="input", code="too_many_messages")
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                raise BadRequest(f"input[{i}] must be an object (a message or another input item).",
                                 param=f"input[{i}]")
            content = item.get("content")
            if content is not None and not isinstance(content, str | list):
                raise BadRequest(f"input[{i}].content must be a string or an array of parts.",
                                 param=f"input[{i}].content")
    elif not isinstance(value, str):
        raise BadRequest("'input' must be a string or a non-empty array of input items.", param="input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string.", param="instructions")
    if body.get("background"):
        raise BadRequest("'background' responses are not offered through the gateway: it keeps no responses "
                         "(send the request without it).", param="background", code="unsupported_parameter")


def check_tokenizer(kind: str, body: dict[str, Any], max_messages: int = MAX_MESSAGES) -> None:
    """Check a ``/tokenize`` (``prompt`` or chat ``messages``) or ``/detokenize`` (``tokens``) body in place."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("You must provide a model parameter (a non-empty string).", param="model")
    if kind == "detokenize":
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(_token_id(t) for t in tokens):
            raise BadRequest("'tokens' must be an array of token ids.", param="tokens")
        return
    if "messages" in body:
        check_chat(body, max_messages)
        return
    if not isinstance(body.get("prompt"), str):
        raise BadRequest("Give 'prompt' (a string) or 'messages' (a chat) to tokenize.", param="prompt")


def check_body(kind: str, body: dict[str, Any], max_messages: int = MAX_MESSAGES) -> None:
    """Check a body of ``kind`` (see :data:`switchyard.decide.cache.RequestKind`) in place."""
    if kind == "chat":
        check_chat(body, max_messages)
    elif kind == "completion":
        check_completion(body)
    elif kind == "embedding":
        check_embedding(body)
    elif kind == "responses":
        check_responses(body, max_messages)
    else:
        check_tokenizer(kind, body, max_messages)
