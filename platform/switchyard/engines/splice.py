"""One answer out of several engines' streams: what a broken stream had carried, and a continuation spliced in.

When an engine breaks off a stream, the gateway may continue the answer on another engine
(:mod:`switchyard.gateway.resume`). This module does the stream side of it, with no policy in it:

- :class:`Transcript` keeps the events the client has received (their bytes, parsed only if the stream
  breaks: a stream that ends well is never parsed) and reads them back as :class:`SoFar`: the answer's text,
  its head (``id``, ``created``, ``model``, ``system_fingerprint``), the tokens produced, and whether a tool
  call or reasoning was being streamed. Past :data:`KEEP_BYTES` the bytes kept are folded into what they say,
  so a long answer costs no more memory than that.
- :class:`Splice` rewrites a continuation's events into the first engine's stream: the same ``id``,
  ``created``, ``model`` and ``system_fingerprint``, no second ``role`` delta, and the usage chunk replaced by
  one that adds up every engine's work (or left out when the client did not ask for usage).
- :func:`closing_events` ends a stream whose answer was complete (or whose output budget was spent) when its
  engine broke off: the final chunk, the usage the client asked for, ``[DONE]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

StreamKind = Literal["chat", "completion"]


def stream_kind(kind: str) -> StreamKind:
    """``kind`` as a kind of stream that can be spliced and replayed (chat or completion), or a ValueError."""
    if kind == "chat":
        return "chat"
    if kind == "completion":
        return "completion"
    raise ValueError(f"{kind} streams are neither spliced nor replayed")
#: Bytes of events kept as they are before they are folded into what they say.
KEEP_BYTES = 1 << 20
_DONE = b"[DONE]"


@dataclass(slots=True)
class SoFar:
    """What the client of a stream has received.

    Attributes:
        text: The answer's text (choice 0).
        tokens: Text events (engines send one token per event).
        head: The first chunk's ``id``, ``object``, ``created``, ``model`` and ``system_fingerprint``.
        tool_calls: A tool call's deltas came.
        reasoning: Reasoning deltas came.
        finished: A choice's ``finish_reason`` came (the answer itself is complete).
    """

    text: str = ""
    tokens: int = 0
    head: dict[str, Any] = field(default_factory=dict)
    tool_calls: bool = False
    reasoning: bool = False
    finished: str | None = None


_HEAD = ("id", "object", "created", "model", "system_fingerprint")


def _events(data: bytes) -> list[bytes]:
    """The ``data:`` payloads of whole SSE events (comments and other fields left out)."""
    out = []
    for event in data.replace(b"\r\n", b"\n").split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                out.append(line[5:].strip())
    return out


def _fold(so_far: SoFar, kind: StreamKind, data: bytes) -> None:
    """Add what the events in ``data`` say to ``so_far``."""
    parts = [so_far.text]
    for payload in _events(data):
        if not payload or payload == _DONE:
            continue
        try:
            chunk = msgspec.json.decode(payload)
        except msgspec.DecodeError:
            continue
        if not isinstance(chunk, dict):
            continue
        if not so_far.head:
            so_far.head = {k: chunk[k] for k in _HEAD if k in chunk}
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            if kind == "chat":
                delta = choice.get("delta") or {}
                piece = delta.get("content") if isinstance(delta, dict) else None
                if isinstance(delta, dict):
                    so_far.tool_calls = so_far.tool_calls or bool(delta.get("tool_calls"))
                    so_far.reasoning = so_far.reasoning or bool(delta.get("reasoning_content")
                                                                or delta.get("reasoning"))
            else:
                piece = choice.get("text")
            if isinstance(piece, str) and piece:
                parts.append(piece)
                so_far.tokens += 1
            if choice.get("finish_reason") is not None:
                so_far.finished = str(choice["finish_reason"])
    so_far.text = "".join(parts)


class Transcript:
    """The events a stream's client has received, kept to be read back if the stream breaks (see the module doc)."""

    __slots__ = ("_folded", "_kept", "kind")

    def __init__(self, kind: StreamKind) -> None:
        self.kind = kind
        self._kept = bytearray()
        self._folded = SoFar()

    def feed(self, events: bytes) -> None:
        """Whole events that went to the client."""
        self._kept += events
        if len(self._kept) > KEEP_BYTES:
            _fold(self._folded, self.kind, bytes(self._kept))
            self._kept.clear()

    def read(self) -> SoFar:
        """What the client has received so far."""
        so_far = SoFar(self._folded.text, self._folded.tokens, dict(self._folded.head), self._folded.tool_calls,
                       self._folded.reasoning, self._folded.finished)
        _fold(so_far, self.kind, bytes(self._kept))
        return so_far


def _encode(chunk: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


class Splice:
    """Rewrites one continuation's events into the client's stream (see the module doc).

    Args:
        kind: Chat or text completion.
        head: The first engine's chunk head (:attr:`SoFar.head`).
        usage: Given the continuation's own ``usage`` object, the one the client gets (every engine's work).
        keep_usage: The client asked for the usage chunk.
    """

    __slots__ = ("_head", "_keep_usage", "_kind", "_role_seen", "_usage")

    def __init__(self, kind: StreamKind, head: dict[str, Any], usage: Callable[[dict[str, Any]], dict[str, Any]],
                 keep_usage: bool) -> None:
        self._kind = kind
        self._head = {k: v for k, v in head.items() if k != "object"}
        self._usage = usage
        self._keep_usage = keep_usage
        self._role_seen = False

    def events(self, whole: bytes) -> bytes:
        """The client's bytes for whole events of the continuation."""
        out: list[bytes] = []
        for payload in _events(whole):
            if payload == _DONE:
                out.append(b"data: [DONE]\n\n")
                continue
            try:
                chunk = msgspec.json.decode(payload)
            except msgspec.DecodeError:
                out.append(b"data: " + payload + b"\n\n")  # not ours to judge here: the relay checked the first
                continue
            if not isinstance(chunk, dict):
                out.append(b"data: " + payload + b"\n\n")
                continue
            choices = chunk.get("choices")
            if isinstance(chunk.get("usage"), dict) and not choices:
                if self._keep_usage:
                    chunk["usage"] = self._usage(chunk["usage"])
                    out.append(_encode({**chunk, **self._head}))
                continue
            if self._kind == "chat" and isinstance(choices, list):
                choices = [c for c in (self._without_role(c) for c in choices) if c is not None]
                if not choices:
                    continue
                chunk["choices"] = choices
            if "usage" in chunk and chunk["usage"] is None:
                chunk.pop("usage")
            out.append(_encode({**chunk, **self._head}))
        return b"".join(out)

    def _without_role(self, choice: object) -> object:
        """A chat choice without the continuation's ``role`` (None: a role-only delta, dropped)."""
        if not isinstance(choice, dict):
            return choice
        delta = choice.get("delta")
        if not isinstance(delta, dict) or "role" not in delta:
            return choice
        rest = {k: v for k, v in delta.items() if k != "role"}
        if (not rest or rest == {"content": ""}) and choice.get("finish_reason") is None:
            return None
        return {**choice, "delta": rest}


def closing_events(kind: StreamKind, head: dict[str, Any], finish_reason: str | None,
                   usage: dict[str, Any] | None) -> bytes:
    """The end of a stream whose answer needs no more text: a final chunk with ``finish_reason`` (None: it was
    sent already), the ``usage`` chunk (None: not asked for), ``[DONE]``."""
    out = b""
    base = dict(head)
    base.setdefault("object", "chat.completion.chunk" if kind == "chat" else "text_completion")
    if finish_reason is not None:
        choice: dict[str, Any] = ({"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}
                                  if kind == "chat" else
                                  {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason})
        out += _encode({**base, "choices": [choice]})
    if usage is not None:
        out += _encode({**base, "choices": [], "usage": usage})
    return out + b"data: [DONE]\n\n"
