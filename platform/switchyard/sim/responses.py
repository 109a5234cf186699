"""Response bodies and SSE chunks in vLLM 0.32's OpenAI-compatible shapes, key for key.

vLLM serialises a full response with every field (nulls included), a stream chunk with only
the fields it set (``exclude_unset``), and the final usage chunk without nulls as well; the
usage details differ between chat and text completions. The shapes here are those, as the
conformance suite (``tests/conformance``) checks against a real server; the sim answers as a
server started with ``--enable-prompt-tokens-details`` does.

Streaming is the hot path (one chunk per generated token, hundreds of streams per engine),
so each response precomputes the bytes before and after a token's text and a chunk is two
concatenations around the token's pre-encoded JSON string; nothing is JSON-encoded per token.
Requests that need per-chunk data (log-probabilities, continuous usage) take ``chunk()``,
which builds the same chunk as a dict.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from switchyard.simtext.tokens import VOCAB_JSON, detokenize

DONE = b"data: [DONE]\n\n"
#: The event vLLM 0.32 writes when a request fails mid-stream (the engine finished it with reason ``error``:
#: its stream generators catch the ``GenerationError``), byte for byte: ``json.dumps`` of its ``ErrorResponse``
#: (``create_streaming_error_response``, ``vllm/entrypoints/generate/base/serving.py``). ``DONE`` follows it.
STREAM_ERROR = (b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", '
                b'"param": null, "code": 500}}\n\n')
#: The vLLM release whose API the simulator reproduces (also in ``system_fingerprint``).
VLLM_VERSION = "0.32.0"


def system_fingerprint(*parts: object) -> str:
    """``vllm-<version>-<hash8>``, as vLLM's default fingerprint mode, from the engine's setup."""
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:8]
    return f"vllm-{VLLM_VERSION}-{digest}"


@dataclass(frozen=True)
class Usage:
    """Token counts of one response.

    Attributes:
        prompt_tokens: Prompt tokens (each prompt counted once, whatever ``n``).
        completion_tokens: Generated tokens, all choices together.
        cached_tokens: Prompt tokens found in the prefix cache.
        created_cache_tokens: Prompt tokens computed and newly cached (chat reports them).
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    created_cache_tokens: int

    def body(self, *, chat: bool, stream: bool) -> dict[str, Any]:
        """``usage`` of a full response (``stream`` False) or of the final usage chunk."""
        details: dict[str, Any]
        if stream:  # serialised without nulls
            details = {"cached_tokens": self.cached_tokens}
            if chat:
                details["created_cache_tokens"] = self.created_cache_tokens
        else:
            details = {"cached_tokens": self.cached_tokens,
                       "created_cache_tokens": self.created_cache_tokens if chat else None,
                       "multimodal_tokens": None}
        out = self.running(chat=chat, stream=False)
        out["prompt_tokens_details"] = details
        if not stream:
            out["completion_tokens_details"] = None
        return out

    def running(self, *, chat: bool, stream: bool = True) -> dict[str, Any]:
        """``usage`` of a chunk with ``continuous_usage_stats`` (counts so far)."""
        out: dict[str, Any] = {"prompt_tokens": self.prompt_tokens,
                               "total_tokens": self.prompt_tokens + self.completion_tokens,
                               "completion_tokens": self.completion_tokens}
        if chat and stream:
            out["completion_tokens_details"] = None
        return out


@dataclass(frozen=True)
class ChoiceOutput:
    """One finished choice of a full response.

    Attributes:
        text: The text a client sees (cut before a stop string).
        finish_reason: "length" or "stop".
        stop_reason: The stop string that ended it, if any.
        logprobs: Log-probabilities, if asked for.
    """

    text: str
    finish_reason: str
    stop_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ResponseShaper:
    """Builds one response's bodies and chunks.

    Args:
        chat: Chat completion (else text completion).
        model: Model name echoed in the response.
        request_id: Base id (a client's ``X-Request-Id`` or a fresh uuid).
        choices: Number of choices in the response.
        fingerprint: ``system_fingerprint``.
        include_usage: A usage chunk closes the stream (the last token chunk then carries no
            fingerprint: the usage chunk does).
        role: Role of a chat answer.
    """

    def __init__(self, *, chat: bool, model: str, request_id: str | None, choices: int,
                 fingerprint: str, include_usage: bool = False, role: str = "assistant") -> None:
        self.chat = chat
        self.model = model
        self.fingerprint = fingerprint
        self.include_usage = include_usage
        self.role = role
        self.id = ("chatcmpl-" if chat else "cmpl-") + (request_id or uuid.uuid4().hex)
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"
        head = msgspec.json.encode(self._head())
        self._head_bytes = b"data: " + head[:-1] + b',"choices":[{"index":'
        key = b'"delta":{"content":' if chat else b'"text":'
        self._open = [self._head_bytes + str(i).encode() + b"," + key for i in range(choices)]
        self._mid = (b'},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n' if chat else
                     b',"logprobs":null,"finish_reason":null,"stop_reason":null,'
                     b'"prompt_token_ids":null,"token_ids":null}]}\n\n')

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model}

    def _last(self, reason: str, stop_reason: str | None) -> bytes:
        close = b"}" if self.chat else b""
        tail = b"}]" if self.include_usage else b'}],"system_fingerprint":' + msgspec.json.encode(self.fingerprint)
        fields = (b',"logprobs":null,"finish_reason":' + msgspec.json.encode(reason)
                  + b',"stop_reason":' + msgspec.json.encode(stop_reason))
        fields += b',"token_ids":null' if self.chat else b',"prompt_token_ids":null,"token_ids":null'
        return close + fields + tail + b"}\n\n"

    def role_chunk(self, index: int, usage: dict[str, Any] | None = None) -> bytes:
        """Chat's first chunk of a choice: the role and empty content."""
        body = self._head()
        body["choices"] = [{"index": index, "delta": {"role": self.role, "content": ""},
                            "logprobs": None, "finish_reason": None}]
        if usage is not None:
            body["usage"] = usage
        body["prompt_token_ids"] = None
        body["prompt_text"] = None
        return b"data: " + msgspec.json.encode(body) + b"\n\n"

    def token_chunks(self, index: int, ids: Sequence[int], finish_reason: str | None,
                     stop_reason: str | None = None, last_text: str | None = None) -> bytes:
        """One SSE chunk per token; the last carries ``finish_reason`` if given (and its text
        is ``last_text`` when a stop string cut it short)."""
        opening, mid, vocab = self._open[index], self._mid, VOCAB_JSON
        if finish_reason is None:
            return b"".join([opening + vocab[t] + mid for t in ids])
        parts = [opening + vocab[t] + mid for t in ids[:-1]]
        last = vocab[ids[-1]] if ids else b'""'
        if last_text is not None:
            last = msgspec.json.encode(last_text)
        parts.append(opening + last + self._last(finish_reason, stop_reason))
        return b"".join(parts)

    def chunk(self, index: int, ids: Sequence[int], finish_reason: str | None,
              logprobs: dict[str, Any] | None = None, usage: dict[str, Any] | None = None,
              stop_reason: str | None = None, text: str | None = None) -> bytes:
        """One SSE chunk for ``ids`` built as a dict (log-probabilities, running usage)."""
        if text is None:
            text = detokenize(list(ids))
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        if finish_reason is not None or not self.chat:
            choice["stop_reason"] = stop_reason
        if not self.chat:
            choice["prompt_token_ids"] = None
        choice["token_ids"] = None
        body = self._head()
        body["choices"] = [choice]
        if usage is not None:
            body["usage"] = usage
        if finish_reason is not None and not self.include_usage:
            body["system_fingerprint"] = self.fingerprint
        return b"data: " + msgspec.json.encode(body) + b"\n\n"

    def usage_chunk(self, usage: Usage) -> bytes:
        """The ``include_usage`` chunk: no choices, the whole response's usage."""
        body = self._head()
        body.update(choices=[], usage=usage.body(chat=self.chat, stream=True),
                    system_fingerprint=self.fingerprint)
        return b"data: " + msgspec.json.encode(body) + b"\n\n"

    def full_body(self, outputs: Sequence[ChoiceOutput], usage: Usage) -> bytes:
        """A non-streaming response."""
        body: dict[str, Any] = {"id": self.id,
                                "object": "chat.completion" if self.chat else "text_completion",
                                "created": self.created, "model": self.model}
        if self.chat:
            body["choices"] = [{
                "index": i,
                "message": {"role": self.role, "content": out.text, "refusal": None,
                            "annotations": None, "audio": None, "function_call": None,
                            "reasoning": None},
                "logprobs": out.logprobs, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                "token_ids": None, "routed_experts": None,
            } for i, out in enumerate(outputs)]
        else:
            body["choices"] = [{
                "index": i, "text": out.text, "logprobs": out.logprobs, "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason, "token_ids": None, "prompt_logprobs": None,
                "prompt_token_ids": None, "routed_experts": None,
            } for i, out in enumerate(outputs)]
        body.update(service_tier=None, system_fingerprint=self.fingerprint,
                    usage=usage.body(chat=self.chat, stream=False))
        if self.chat:
            body.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
        body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
        return msgspec.json.encode(body)
