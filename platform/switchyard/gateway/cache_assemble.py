"""Cached answers in: a streamed answer assembled into the complete answer the response cache stores.

The stored form, and the way back to a stream, are :mod:`switchyard.gateway.cache_replay`'s:
``assemble(kind, replay(kind, answer, include_usage=True)) == answer`` (as JSON) for every answer
``assemble`` builds and every answer vLLM returns unstreamed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from switchyard.gateway.cache_replay import CHUNK_OBJECT, TEXT_FIELDS, Kind

#: Finish reasons of an answer that ran its course; any other ("abort", "error", ...) is not cached.
FINISHED = frozenset({"stop", "length", "tool_calls", "function_call"})
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
        if (not isinstance(chunk, dict) or "error" in chunk or chunk.get("object") != CHUNK_OBJECT[kind]
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
        for key in TEXT_FIELDS:
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
