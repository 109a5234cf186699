"""Cached answers out: a whole answer replayed as a stream, or given to a non-streaming client.

The response cache stores every answer as one complete, non-streamed OpenAI JSON answer (a
``chat.completion`` or ``text_completion`` object with its usage), key for key as vLLM 0.32
returns it (see ``switchyard.sim.responses``). :func:`~switchyard.gateway.cache_assemble.assemble`
builds it from the raw SSE bytes of a streamed answer (or refuses: None); ``replay`` turns it back
into a well-formed SSE stream in vLLM's streaming shape; ``for_client`` gives it to a
non-streaming client.

``assemble(kind, replay(kind, answer, include_usage=True)) == answer`` (as JSON) for every answer
``assemble`` builds and every answer vLLM returns unstreamed.

Per-token data (``logprobs``, ``token_ids``) is split over the replayed content pieces: along
token boundaries when the tokens' texts make up the content exactly, otherwise in proportion to
the pieces; concatenated again, the lists are the answer's.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

#: Which API an answer belongs to: chat completions or (text) completions.
Kind = Literal["chat", "completion"]

#: The event that ends every stream.
DONE = b"data: [DONE]\n\n"

#: Text fields of a chat delta, concatenated per choice (and replayed in this order).
TEXT_FIELDS = ("reasoning", "reasoning_content", "refusal", "content")
#: The ``object`` of a streamed chunk of each kind.
CHUNK_OBJECT = {"chat": "chat.completion.chunk", "completion": "text_completion"}
_WORD = re.compile(r"\s*\S+")


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
    head = {"id": body["id"], "object": CHUNK_OBJECT[kind], "created": body["created"], "model": body["model"]}
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
    for key in TEXT_FIELDS[:-1]:
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
