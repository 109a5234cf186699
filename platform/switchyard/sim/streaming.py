"""A generation request's answer as vLLM's server-sent events, written as its tokens become visible.

Everything that piled up while a slow consumer was busy goes out in a single ``send``. The role
chunks of a chat wait for the first token, as vLLM's do (they come with its first engine output).
An answer drawn by the fault rate ``abort_rate`` (``faults.py``) is broken off here, after
``abort_after_tokens`` content tokens: it stops for good (``abort_with: close``), or vLLM's mid-stream
error event takes the place of the next token (``abort_with: error``). Either way its requests are
aborted in the engine at that moment, before anything else runs: the engine computes a step ahead of
what a channel shows, so that is the last moment they are surely still there to abort (unless the
reader or the engine loop fell behind). Also the usage and log-probabilities of an answer, which the
complete answers share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from switchyard.sim.logprobs import chat_logprobs, completion_logprobs
from switchyard.sim.protocol import GenerationSpec
from switchyard.sim.request import SimRequest
from switchyard.sim.responses import DONE, STREAM_ERROR, ResponseShaper, Usage
from switchyard.sim.runtime import Channel, Waker
from switchyard.simtext.tokens import VOCAB_TEXT, detokenize

Send = Callable[[dict[str, Any]], Any]
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]


def usage_of(spec: GenerationSpec, channels: list[Channel], block_size: int, *, first: bool) -> Usage:
    """The response's usage, counted as vLLM counts it: each prompt once whatever ``n``, and
    the cache figures of one request (a stream's first, a full response's last prompt)."""
    lead = channels[0] if first else channels[-spec.n]
    cached = lead.request.num_cached_tokens
    created = max(0, len(lead.request.prompt) // block_size * block_size - cached)
    return Usage(prompt_tokens=sum(len(p) for p in spec.prompts),
                 completion_tokens=sum(len(c.request.output) for c in channels),
                 cached_tokens=cached, created_cache_tokens=created)


def logprobs_of(spec: GenerationSpec, req: SimRequest, start: int, ids: list[int],
                text_offset: int) -> dict[str, Any] | None:
    """Log-probabilities of the tokens ``ids`` of ``req`` (from its ``start``-th), if the request asked."""
    if spec.logprobs is None:
        return None
    if spec.chat:
        return chat_logprobs(req.seed, start, ids, spec.logprobs)
    return completion_logprobs(req.seed, start, ids, spec.logprobs, text_offset)


def last_text(req: SimRequest) -> str | None:
    """Text of the last token of an output a stop string cut short (None when none did)."""
    if req.text_len is None or not req.output:
        return None
    full = detokenize(req.output)
    before = len(full) - len(VOCAB_TEXT[req.output[-1]])
    return full[before:req.text_len] if req.text_len > before else ""


class _SlowChunks:
    """Chunks built one by one, for streams that carry per-token data (logprobs, usage)."""

    def __init__(self, spec: GenerationSpec, shaper: ResponseShaper, channels: list[Channel]) -> None:
        self.spec = spec
        self.shaper = shaper
        self.channels = channels
        self.text_offsets = [0] * len(channels)

    def prompt_len(self, index: int) -> int:
        return len(self.channels[index].request.prompt)

    def role(self, index: int) -> bytes:
        usage = (Usage(self.prompt_len(index), 0, 0, 0).running(chat=True)
                 if self.spec.continuous_usage else None)
        return self.shaper.role_chunk(index, usage)

    def tokens(self, index: int, start: int, ids: list[int], finish_reason: str | None) -> bytes:
        spec, req = self.spec, self.channels[index].request
        out: list[bytes] = []
        for k, token in enumerate(ids or [None]):
            piece = [] if token is None else [token]
            last = k == max(len(ids), 1) - 1
            logprobs = logprobs_of(spec, req, start + k, piece, self.text_offsets[index])
            self.text_offsets[index] += sum(len(VOCAB_TEXT[t]) for t in piece)
            usage = (Usage(self.prompt_len(index), start + k + len(piece), 0, 0).running(chat=spec.chat)
                     if spec.continuous_usage else None)
            final = finish_reason if last else None
            text = last_text(req) if final is not None else None
            out.append(self.shaper.chunk(index, piece, final, logprobs, usage, req.stop_reason if final else None,
                                         text))
        return b"".join(out)


async def stream_choices(send: Send, spec: GenerationSpec, shaper: ResponseShaper, channels: list[Channel],
                         waker: Waker, block_size: int, abort_after: int | None, fail: bool = False,
                         on_break: Callable[[], None] = lambda: None) -> None:
    """Stream the choices to their end.

    Args:
        send: The ASGI send callable (the response not started).
        spec: The request.
        shaper: Its response shapes.
        channels: One per choice, in choice order.
        waker: Wakes this writer when a channel shows more.
        block_size: The engine's KV block size (for the usage's cache figures).
        abort_after: Break the answer off after this many content tokens, all choices together (fewer
            if the choices end first); None: never.
        fail: How it is broken off: False, stop for good, leaving the answer incomplete (no usage,
            no ``[DONE]``, no end of the chunked body: the server drops the connection); True, send
            vLLM's mid-stream error event in place of the next token, then ``[DONE]``, and end the
            response. The answer then holds at most all but its last two tokens, so that the failure
            always shows and comes while the engine still runs the requests.
        on_break: Called when the answer is broken off, before its last write (it aborts the requests).
    """
    await send({"type": "http.response.start", "status": 200, "headers": _SSE})
    slow = _SlowChunks(spec, shaper, channels) if (
        spec.logprobs is not None or spec.continuous_usage) else None
    pending: list[bytes] = []
    if spec.chat:
        pending.extend(slow.role(i) if slow else shaper.role_chunk(i) for i in range(len(channels)))
    seen = [0] * len(channels)
    budget = abort_after  # content tokens still to send before breaking off (None: never)
    if fail and budget is not None:
        # One step ahead of the channels, the engine has computed the token after the last one shown: for
        # it not to be the answer's last (which finishes the request), stop two tokens before the end.
        budget = min(budget, max(0, sum(c.request.max_output for c in channels) - 2))
    while True:
        done = True
        for i, ch in enumerate(channels):
            if ch.aborted:
                return
            visible = ch.visible if budget is None else min(ch.visible, seen[i] + budget)
            if budget is not None:
                budget -= visible - seen[i]
            if visible > seen[i]:
                ids = ch.request.output[seen[i]:visible]
                final = ch.finished and visible == len(ch.request.output)
                reason = ch.request.finish_reason if final else None
                pending.append(slow.tokens(i, seen[i], ids, reason) if slow else shaper.token_chunks(
                    i, ids, reason, ch.request.stop_reason, last_text(ch.request) if final else None))
                seen[i] = visible
            if not (ch.finished and seen[i] == len(ch.request.output)):
                done = False
        if budget is not None and (budget == 0 or done):
            on_break()  # before the write below lets the engine loop run again
            if fail:
                # As vLLM's stream generators answer a GenerationError: the error event, [DONE], a proper end.
                await send({"type": "http.response.body", "body": b"".join([*pending, STREAM_ERROR, DONE]),
                            "more_body": False})
            elif pending:
                await send({"type": "http.response.body", "body": b"".join(pending), "more_body": True})
            return  # closing: no usage, no [DONE], no end of the chunked body: the server drops the connection
        if done:
            break
        if pending and any(seen):
            body = b"".join(pending)
            pending.clear()
            await send({"type": "http.response.body", "body": body, "more_body": True})
        else:
            await waker.wait()
    if spec.include_usage:
        pending.append(shaper.usage_chunk(usage_of(spec, channels, block_size, first=True)))
    pending.append(DONE)
    await send({"type": "http.response.body", "body": b"".join(pending), "more_body": False})
