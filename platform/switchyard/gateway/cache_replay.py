"""Cached answers in and out: a streamed answer assembled whole, a whole answer replayed as a stream.

The response cache stores every answer as one complete, non-streamed OpenAI JSON answer (a
``chat.completion`` or ``text_completion`` object with its usage), key for key as vLLM 0.32
returns it (see ``switchyard.sim.responses``). ``assemble`` builds it from the raw SSE bytes of
a streamed answer (or refuses: None); ``replay`` turns it back into a well-formed SSE stream in
vLLM's streaming shape; ``for_client`` gives it to a non-streaming client.

``assemble(kind, replay(kind, answer, include_usage=True)) == answer`` (as JSON) for every answer
``assemble`` builds and every answer vLLM returns unstreamed.

Per-token data (``logprobs``, ``token_ids``) is split over the replayed content pieces: along
token boundaries when the tokens' texts make up the content exactly, otherwise in proportion to
the pieces; concatenated again, the lists are the answer's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

#: Which API an answer belongs to: chat completions or (text) completions.
Kind = Literal["chat", "completion"]

#: The event that ends every stream.
DONE = b"data: [DONE]\n\n"
#: Finish reasons of an answer that ran its course; any other ("abort", "error", ...) is not cached.
FINISHED = frozenset({"stop", "length", "tool_calls", "function_call"})

#: Text fields of a chat delta, concatenated per choice (and replayed in this order).
_TEXTS = ("reasoning", "reasoning_content", "refusal", "content")
_WORD = re.compile(r"\s*\S+")
_CHUNK_OBJECT = {"chat": "chat.completion.chunk", "completion": "text_completion"}
_ANSWER_OBJECT = {"chat": "chat.completion", "completion": "text_completion"}


class _Unusable(Exception):
    """The stream is not a complete, successful answer."""


@dataclass(slots=True)
class _Choice:
    """One choice's parts, merged across chunks."""

    role: str | None = None
    texts: dict[str, list[str]] = field(default_factory=dict)
    tools: dict[int, dict[str, Any]] = field(default_factory=dict)
    logprobs: dict[str, Any] | None = None
    token_ids: list[Any] | None = None
    prompt_token_ids: Any = None
    finish_reason: str | None = None
    stop_reason: Any = None

    def text(self, key: str) -> str | None:
        """The concatenated ``key`` texts, None if no chunk carried one."""
        parts = self.texts.get(key)
        return None if parts is None else "".join(parts)


# --- assemble -------------------------------------------------------------------------------


def assemble(kind: Kind, sse: bytes) -> bytes | None:
    """The complete non-streamed answer equivalent to a streamed one, or None if it is not cacheable.

    None when the stream does not end with ``data: [DONE]`` (or has events after it), when an
    event is an error (``{"error": ...}``, ``"object": "error"``, ``event: error``) or not a chunk
    of ``kind``, when an event's JSON does not parse, when a choice has no finish reason or one
    outside ``FINISHED`` (such as "abort"), when a choice continues after its finish reason, when
    there is no usage chunk (``choices`` empty, ``usage`` set), or when it carries prompt
    log-probabilities (not reproduced).

    Args:
        kind: "chat" for ``/v1/chat/completions``, "completion" for ``/v1/completions``.
        sse: The raw bytes of the whole event stream.

    Returns:
        The answer's JSON: id, created and model of the first chunk; choices by index; the usage
        with vLLM's null fields of a full answer added.
    """
    try:
        return _assemble(kind, sse)
    except (_Unusable, msgspec.DecodeError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _payloads(sse: bytes) -> list[bytes]:
    """The data of each complete SSE event, in order (comments and other fields skipped)."""
    out: list[bytes] = []
    data: list[bytes] = []
    for line in sse.splitlines():
        if not line:
            if data:
                out.append(b"\n".join(data))
                data = []
        elif line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
        elif line.startswith(b"event:") and line[6:].strip() == b"error":
            raise _Unusable
    return out  # an event not closed by a blank line is incomplete: dropped, as SSE readers do


def _assemble(kind: Kind, sse: bytes) -> bytes:
    payloads = _payloads(sse)
    if not payloads or payloads[-1] != b"[DONE]":
        raise _Unusable
    chat = kind == "chat"
    head: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    extra: dict[str, Any] = {"service_tier": None, "system_fingerprint": None}
    extra |= {"prompt_token_ids": None, "prompt_text": None} if chat else {}
    choices: dict[int, _Choice] = {}
    for raw in payloads[:-1]:
        chunk = msgspec.json.decode(raw)
        if (not isinstance(chunk, dict) or "error" in chunk or chunk.get("object") != _CHUNK_OBJECT[kind]
                or chunk.get("prompt_logprobs") is not None):
            raise _Unusable
        if head is None:
            head = {"id": chunk["id"], "object": _ANSWER_OBJECT[kind], "created": chunk["created"],
                    "model": chunk["model"]}
        for key in extra:
            if chunk.get(key) is not None:
                extra[key] = chunk[key]
        parts = chunk.get("choices")
        if not isinstance(parts, list):
            raise _Unusable
        if not parts and isinstance(chunk.get("usage"), dict):
            usage = chunk["usage"]
        for part in parts:
            index = part["index"]
            if not isinstance(index, int):
                raise _Unusable
            _merge(chat, choices.setdefault(index, _Choice()), part)
    if head is None or usage is None or not choices or any(c.finish_reason is None for c in choices.values()):
        raise _Unusable
    ordered = sorted(choices.items())
    body = {**head, "choices": [(_chat_choice if chat else _text_choice)(i, c) for i, c in ordered]}
    body |= {"service_tier": extra["service_tier"], "system_fingerprint": extra["system_fingerprint"],
             "usage": _full_usage(usage)}
    if chat:
        body |= {"prompt_logprobs": None, "prompt_token_ids": extra["prompt_token_ids"],
                 "prompt_text": extra["prompt_text"]}
    body |= {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
    return msgspec.json.encode(body)


def _merge(chat: bool, state: _Choice, part: dict[str, Any]) -> None:
    """Add one chunk's part of a choice to what the choice has so far."""
    if state.finish_reason is not None:
        raise _Unusable  # nothing follows a choice's last chunk
    if chat:
        delta = part.get("delta") or {}
        if delta.get("role") is not None:
            state.role = str(delta["role"])
        for key in _TEXTS:
            if delta.get(key) is not None:
                state.texts.setdefault(key, []).append(_string(delta[key]))
        for call in delta.get("tool_calls") or ():
            _merge_tool(state.tools, call)
    else:
        if part.get("text") is not None:
            state.texts.setdefault("text", []).append(_string(part["text"]))
        if part.get("prompt_logprobs") is not None:
            raise _Unusable
        if state.prompt_token_ids is None:
            state.prompt_token_ids = part.get("prompt_token_ids")
    if part.get("logprobs") is not None:
        state.logprobs = _merge_logprobs(state.logprobs, part["logprobs"])
    if part.get("token_ids") is not None:
        state.token_ids = [*(state.token_ids or ()), *part["token_ids"]]
    reason = part.get("finish_reason")
    if reason is not None:
        if reason not in FINISHED:
            raise _Unusable
        state.finish_reason = reason
        state.stop_reason = part.get("stop_reason")


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise _Unusable
    return value


def _merge_tool(tools: dict[int, dict[str, Any]], call: dict[str, Any]) -> None:
    """Merge a tool call delta: the first id and type, name and arguments concatenated."""
    index = call.get("index", 0)
    tool = tools.setdefault(index, {"id": None, "type": None, "name": "", "arguments": ""})
    for key in ("id", "type"):
        if tool[key] is None and call.get(key) is not None:
            tool[key] = call[key]
    function = call.get("function") or {}
    for key in ("name", "arguments"):
        if function.get(key) is not None:
            tool[key] += _string(function[key])


def _merge_logprobs(merged: dict[str, Any] | None, part: dict[str, Any]) -> dict[str, Any]:
    """Lists concatenated key by key; other values: the first that is not null."""
    out = dict(merged or {})
    for key, value in part.items():
        if isinstance(value, list):
            out[key] = [*(out.get(key) or ()), *value]
        elif out.get(key) is None:
            out[key] = value
    return out


def _chat_choice(index: int, c: _Choice) -> dict[str, Any]:
    content = c.text("content")
    if c.tools and not content:
        content = None  # as vLLM answers a pure tool call unstreamed
    message: dict[str, Any] = {"role": c.role or "assistant", "content": content, "refusal": c.text("refusal"),
                               "annotations": None, "audio": None, "function_call": None}
    if c.tools:
        message["tool_calls"] = [{"id": t["id"], "type": t["type"] or "function",
                                  "function": {"name": t["name"], "arguments": t["arguments"]}}
                                 for _, t in sorted(c.tools.items())]
    message["reasoning"] = c.text("reasoning")
    if "reasoning_content" in c.texts:
        message["reasoning_content"] = c.text("reasoning_content")
    return {"index": index, "message": message, "logprobs": c.logprobs, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason, "token_ids": c.token_ids, "routed_experts": None}


def _text_choice(index: int, c: _Choice) -> dict[str, Any]:
    return {"index": index, "text": c.text("text") or "", "logprobs": c.logprobs, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason, "token_ids": c.token_ids, "prompt_logprobs": None,
            "prompt_token_ids": c.prompt_token_ids, "routed_experts": None}


def _full_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A stream's usage (nulls left out) as a full answer has it (nulls in)."""
    out = dict(usage)
    details = out.get("prompt_tokens_details")
    if isinstance(details, dict):
        out["prompt_tokens_details"] = {"cached_tokens": None, "created_cache_tokens": None,
                                        "multimodal_tokens": None, **details}
    out.setdefault("prompt_tokens_details", None)
    out.setdefault("completion_tokens_details", None)
    return out


# --- replay ---------------------------------------------------------------------------------


def for_client(answer: bytes) -> bytes:
    """The answer as a non-streaming client gets it: the cached bytes, unchanged.

    The cache stores exactly the JSON body of a non-streamed answer, so nothing needs changing.
    """
    return answer


def replay(kind: Kind, answer: bytes, *, include_usage: bool, chunk_tokens: int = 16) -> bytes:
    """A complete SSE stream, in vLLM's streaming shape, equivalent to a complete answer.

    Chat: a role chunk per choice (``{"role": ..., "content": ""}``), then per choice its
    reasoning, refusal and content in pieces of about ``chunk_tokens`` words (or tokens, when
    the log-probabilities give them), then its tool calls (one delta naming each call, its
    arguments in pieces); the choice's last chunk carries ``finish_reason`` and ``stop_reason``.
    Choices are interleaved. Completions: the text in pieces likewise. When ``include_usage``,
    a chunk with no choices carries the usage (nulls left out, as vLLM sends it) and the
    ``system_fingerprint`` (no usage chunk if the answer has no usage); otherwise each choice's
    last chunk carries the fingerprint. Other chunks have no ``usage`` key, as vLLM's (OpenAI's
    have ``"usage": null``; clients read both alike). Then ``data: [DONE]``. Each event is
    ``data: <json>\\n\\n``.

    Args:
        kind: "chat" or "completion", the API the answer belongs to.
        answer: A complete answer (``assemble``'s, or an engine's unstreamed JSON body).
        include_usage: The client asked for ``stream_options.include_usage``.
        chunk_tokens: About how many words (or tokens) one content chunk carries.

    Raises:
        ValueError: ``answer`` is not a complete answer of ``kind``, or ``chunk_tokens`` < 1.
    """
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be at least 1")
    try:
        return _replay(kind, msgspec.json.decode(answer), include_usage, chunk_tokens)
    except (msgspec.DecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a complete {kind} answer: {exc!r}") from exc


def _replay(kind: Kind, body: Any, include_usage: bool, chunk_tokens: int) -> bytes:
    """``replay`` of a decoded answer (KeyError, TypeError, AttributeError when malformed)."""
    head = {"id": body["id"], "object": _CHUNK_OBJECT[kind], "created": body["created"], "model": body["model"]}
    choices = body["choices"]
    if not isinstance(choices, list):
        raise TypeError("choices is not a list")
    steps = [(_chat_steps if kind == "chat" else _text_steps)(c, chunk_tokens) for c in choices]
    fingerprint = body.get("system_fingerprint")
    out: list[bytes] = []
    if kind == "chat":
        extra = {"prompt_token_ids": body.get("prompt_token_ids"), "prompt_text": body.get("prompt_text")}
        for c in choices:
            role = {"index": c["index"], "delta": {"role": c["message"].get("role") or "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}
            out.append(_event({**head, "choices": [role], **extra}))
    for k in range(max(map(len, steps), default=0)):  # the choices interleaved
        for c, choice_steps in zip(choices, steps, strict=True):
            if k < len(choice_steps):
                last = k == len(choice_steps) - 1
                chunk = {**head, "choices": [_part(kind, c, choice_steps[k], k == 0, last)]}
                if last and not include_usage:
                    chunk["system_fingerprint"] = fingerprint
                out.append(_event(chunk))
    if include_usage and isinstance(body.get("usage"), dict):
        usage = _without_nulls(body["usage"])
        out.append(_event({**head, "choices": [], "usage": usage, "system_fingerprint": fingerprint}))
    out.append(DONE)
    return b"".join(out)


def _event(chunk: dict[str, Any]) -> bytes:
    """One SSE event."""
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


_Step = tuple[dict[str, Any], Any, Any]


def _part(kind: Kind, choice: dict[str, Any], step: _Step, first: bool, last: bool) -> dict[str, Any]:
    """The ``choices`` entry of one chunk: the step's fields, its per-token data, the finish."""
    fields, logprobs, token_ids = step
    finish = choice.get("finish_reason") if last else None
    stop = choice.get("stop_reason") if last else None
    if kind == "chat":  # vLLM names stop_reason in a chat choice's last chunk only
        part = {"index": choice["index"], "delta": fields, "logprobs": logprobs, "finish_reason": finish}
        return part | ({"stop_reason": stop, "token_ids": token_ids} if last else {"token_ids": token_ids})
    return {"index": choice["index"], **fields, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop,
            "prompt_token_ids": choice.get("prompt_token_ids") if first else None, "token_ids": token_ids}


def _chat_steps(choice: dict[str, Any], chunk_tokens: int) -> list[_Step]:
    """A chat choice's chunks after its role chunk: (delta, logprobs, token_ids) each."""
    message = choice["message"]
    steps: list[_Step] = []
    for key in _TEXTS[:-1]:
        steps += [({key: piece}, None, None) for piece in _pieces(message.get(key) or "", chunk_tokens)]
    logprobs, token_ids = choice.get("logprobs"), choice.get("token_ids")
    entries = (logprobs or {}).get("content")
    tokens = [e.get("token") for e in entries] if isinstance(entries, list) else None
    content = _with_tokens("content", message.get("content") or "", tokens, logprobs, token_ids, chunk_tokens)
    steps += content
    for i, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") or {}
        first: dict[str, Any] = {k: call[k] for k in ("id", "type") if call.get(k) is not None}
        first |= {"index": i, "function": {"name": function.get("name") or "", "arguments": ""}}
        steps.append(({"tool_calls": [first]}, None, None))
        steps += [({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}, None, None)
                  for piece in _pieces(function.get("arguments") or "", chunk_tokens)]
    if not content:  # no content to carry the per-token data: the last chunk does
        fields = steps.pop()[0] if steps else {"content": ""}
        steps.append((fields, logprobs, token_ids))
    return steps


def _text_steps(choice: dict[str, Any], chunk_tokens: int) -> list[_Step]:
    """A text completion choice's chunks: (fields, logprobs, token_ids) each."""
    logprobs, token_ids = choice.get("logprobs"), choice.get("token_ids")
    tokens = (logprobs or {}).get("tokens")
    steps = _with_tokens("text", choice.get("text") or "", tokens if isinstance(tokens, list) else None,
                         logprobs, token_ids, chunk_tokens)
    return steps or [({"text": ""}, logprobs, token_ids)]


def _with_tokens(key: str, text: str, tokens: list[Any] | None, logprobs: dict[str, Any] | None,
                 token_ids: list[Any] | None, chunk_tokens: int) -> list[_Step]:
    """``text`` in pieces, each with its share of the per-token data: along token boundaries
    when the tokens' texts make up ``text``, else in proportion."""
    if tokens and all(isinstance(t, str) for t in tokens) and "".join(tokens) == text:
        starts = range(0, len(tokens), chunk_tokens)
        pieces = ["".join(tokens[s:s + chunk_tokens]) for s in starts]
        bounds = [(s, min(s + chunk_tokens, len(tokens))) for s in starts]
    else:
        pieces = _pieces(text, chunk_tokens)
        bounds = []
    count = len(tokens) if tokens is not None else -1
    steps: list[_Step] = []
    for i, piece in enumerate(pieces):
        def share(items: list[Any], i: int = i) -> list[Any]:
            if bounds and len(items) == count:
                return items[bounds[i][0]:bounds[i][1]]
            return items[i * len(items) // len(pieces):(i + 1) * len(items) // len(pieces)]

        lp = ({k: share(v) if isinstance(v, list) else v for k, v in logprobs.items()}
              if isinstance(logprobs, dict) else logprobs)
        steps.append(({key: piece}, lp, None if token_ids is None else share(token_ids)))
    return steps


def _pieces(text: str, chunk_tokens: int) -> list[str]:
    """``text`` cut into pieces of about ``chunk_tokens`` words (long words cut too)."""
    if not text:
        return []
    words = _WORD.findall(text)
    rest = text[sum(map(len, words)):]
    if rest:
        words = [*words[:-1], words[-1] + rest] if words else [rest]
    cap = 8 * chunk_tokens
    cut = [w[s:s + cap] for w in words for s in range(0, len(w), cap)]
    return ["".join(cut[s:s + chunk_tokens]) for s in range(0, len(cut), chunk_tokens)]


def _without_nulls(value: Any) -> Any:
    """``value`` with null members of objects left out, as vLLM serialises a stream's usage."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value
