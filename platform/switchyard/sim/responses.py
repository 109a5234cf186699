"""Response bodies and SSE chunks in vLLM's OpenAI-compatible shapes.

Streaming is the hot path (one chunk per generated token, hundreds of streams per engine),
so each response precomputes the bytes before and after a token's text and a chunk is two
concatenations around the token's pre-encoded JSON string; nothing is JSON-encoded per token.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec

from switchyard.sim.tokens import VOCAB_JSON, detokenize

DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """vLLM's ``UsageInfo`` with ``prompt_tokens_details.cached_tokens``."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class ResponseShaper:
    """Builds one response's bodies and chunks.

    Args:
        chat: Chat completion (else text completion).
        model: Model name echoed in the response.
        request_id: Base id (a client's ``X-Request-Id`` or a fresh uuid).
        choices: Number of choices (prompts) in the response.
    """

    def __init__(self, *, chat: bool, model: str, request_id: str | None, choices: int) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + (request_id or uuid.uuid4().hex)
        self.created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = msgspec.json.encode({"id": self.id, "object": obj, "created": self.created,
                                    "model": model})
        self._head = b"data: " + head[:-1] + b',"choices":[{"index":'
        key = b'"delta":{"content":' if chat else b'"text":'
        self._open = [self._head + str(i).encode() + b"," + key for i in range(choices)]
        close = b"}" if chat else b""
        self._mid = close + b',"logprobs":null,"finish_reason":null' + (
            b"}]}\n\n" if chat else b',"stop_reason":null}]}\n\n')

    def _last(self, reason: str) -> bytes:
        close = b"}" if self.chat else b""
        return close + b',"logprobs":null,"finish_reason":"' + reason.encode() + \
            b'","stop_reason":null}]}\n\n'

    def role_chunk(self, index: int) -> bytes:
        """Chat's first chunk of a choice: the assistant role and empty content."""
        return (self._head + str(index).encode()
                + b',"delta":{"role":"assistant","content":""},"logprobs":null,'
                b'"finish_reason":null}]}\n\n')

    def token_chunks(self, index: int, ids: Sequence[int], finish_reason: str | None) -> bytes:
        """One SSE chunk per token; the last carries ``finish_reason`` if given."""
        opening, mid, vocab = self._open[index], self._mid, VOCAB_JSON
        if finish_reason is None:
            return b"".join([opening + vocab[t] + mid for t in ids])
        parts = [opening + vocab[t] + mid for t in ids[:-1]]
        last = vocab[ids[-1]] if ids else b'""'
        parts.append(opening + last + self._last(finish_reason))
        return b"".join(parts)

    def usage_chunk(self, info: dict[str, Any]) -> bytes:
        """The ``include_usage`` chunk: no choices, just usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return b"data: " + msgspec.json.encode({
            "id": self.id, "object": obj, "created": self.created, "model": self.model,
            "choices": [], "usage": info}) + b"\n\n"

    def full_body(self, outputs: Sequence[tuple[list[int], str]], info: dict[str, Any]) -> bytes:
        """A non-streaming response: ``outputs`` is (token ids, finish reason) per choice."""
        choices: list[dict[str, Any]]
        if self.chat:
            choices = [{
                "index": i,
                "message": {"role": "assistant", "content": detokenize(ids), "refusal": None,
                            "annotations": None, "audio": None, "function_call": None,
                            "tool_calls": [], "reasoning_content": None},
                "logprobs": None, "finish_reason": reason, "stop_reason": None,
            } for i, (ids, reason) in enumerate(outputs)]
            body: dict[str, Any] = {
                "id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": choices, "service_tier": None,
                "system_fingerprint": None, "usage": info, "prompt_logprobs": None,
                "kv_transfer_params": None}
        else:
            choices = [{"index": i, "text": detokenize(ids), "logprobs": None,
                        "finish_reason": reason, "stop_reason": None, "prompt_logprobs": None}
                       for i, (ids, reason) in enumerate(outputs)]
            body = {"id": self.id, "object": "text_completion", "created": self.created,
                    "model": self.model, "choices": choices, "service_tier": None,
                    "system_fingerprint": None, "usage": info, "kv_transfer_params": None}
        return msgspec.json.encode(body)
