"""``POST /v1/completions`` and ``POST /v1/chat/completions``, as raw ASGI handlers.

These are the hot path and need things a framework response object does not give: noticing
a client that disconnects while nothing is being written (to abort its request and free its
KV blocks, as vLLM does), and writing every token that piled up while a slow consumer was
busy in a single ``send``. The fault rates (``faults.py``) are applied here too, to the
generation and embeddings handlers alike: rejections before the request reaches the scheduler,
broken-off answers while they are written; and the garbage modes to generation requests
(``garbage.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from switchyard.sim.faults import GARBAGE_MODES
from switchyard.sim.garbage import send_garbage
from switchyard.sim.logprobs import chat_logprobs, completion_logprobs
from switchyard.sim.protocol import (
    ApiError,
    GenerationSpec,
    decode_body,
    find_stop,
    parse_generation,
    plan_output,
)
from switchyard.sim.request import SimRequest
from switchyard.sim.responses import DONE, ChoiceOutput, ResponseShaper, Usage
from switchyard.sim.runtime import Channel, EngineRuntime, Waker
from switchyard.simtext.tokens import VOCAB_TEXT, detokenize

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]

log = logging.getLogger("switchyard.sim")
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]
_METHOD_NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'
_RETRY = ((b"retry-after", b"1"),)
#: The answers of the rejecting fault outcomes: status, body, extra headers.
_REJECTIONS: dict[str, tuple[int, bytes, tuple[tuple[bytes, bytes], ...]]] = {
    "error": (500, ApiError(500, "Simulated engine failure (sim fault error_rate).").body(), ()),
    "throttle": (429, ApiError(429, "Too many requests (sim fault throttle_rate); retry after 1 second.").body(),
                 _RETRY),
    "overload": (503, ApiError(503, "The engine is overloaded (sim fault overload_rate); retry after 1 "
                                    "second.").body(), _RETRY),
}


async def send_json(send: Send, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Send a complete JSON response."""
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON, (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_cut(send: Send, body: bytes) -> None:
    """Start a 200 JSON answer of ``body`` and stop halfway through it (fault ``abort_rate``).

    The handler then returns with the answer incomplete, and the server closes the connection.
    """
    await send({"type": "http.response.start", "status": 200,
                "headers": [*_JSON, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body[:len(body) // 2], "more_body": True})


async def _read_body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


class Accepted(NamedTuple):
    """An inference request past ``read_post``."""

    #: The request body.
    body: bytes
    #: Whether fault ``abort_rate`` drew this request: its answer is to be broken off.
    abort: bool


async def read_post(engine: EngineRuntime, scope: Scope, receive: Receive, send: Send) -> Accepted | None:
    """The body of a ``POST`` to an inference route, or None when it was answered already: 405 for
    another method (FastAPI's answer, as vLLM gives it), a fault rate's rejection (500, 429, 503), or
    nothing when the client left before sending its body."""
    if scope.get("method") != "POST":
        await send_json(send, 405, _METHOD_NOT_ALLOWED)
        return None
    raw = await _read_body(receive)
    if raw is None:
        return None
    outcome = engine.faults.draw()
    if outcome is not None and outcome != "abort":
        status, body, headers = _REJECTIONS[outcome]
        await send_json(send, status, body, headers)
        return None
    return Accepted(raw, outcome == "abort")


class ClientWatch:
    """Watches the connection for a disconnect while the response is produced.

    Args:
        receive: The ASGI receive callable (the request body already consumed).
        on_disconnect: Called once if the client goes away.
    """

    def __init__(self, receive: Receive, on_disconnect: Callable[[], None]) -> None:
        self.gone = asyncio.Event()
        self._on_disconnect = on_disconnect
        self._task = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone.set()
        self._on_disconnect()

    def close(self) -> None:
        """Stop watching (the response is complete)."""
        self._task.cancel()


async def handle_generation(engine: EngineRuntime, chat: bool, scope: Scope, receive: Receive,
                            send: Send) -> None:
    """Serve one chat or text completion request end to end."""
    accepted = await read_post(engine, scope, receive, send)
    if accepted is None:
        return
    cfg = engine.config
    try:
        spec = parse_generation(decode_body(accepted.body), chat=chat, served_model=cfg.served_model,
                                vocab_size=cfg.profile.vocab_size, max_model_len=cfg.max_model_len)
    except ApiError as exc:
        await send_json(send, exc.status, exc.body())
        return

    requests: list[SimRequest] = []

    def abort_all() -> None:
        for r in requests:
            engine.abort(r)

    watch = ClientWatch(receive, abort_all)
    try:
        if engine.faults.mode == "hang" and not await _hang(engine, watch):
            return
        headers = dict(scope.get("headers") or [])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1") or None
        traceparent = headers.get(b"traceparent")
        if traceparent is not None:
            engine.trace_contexts.append({"request_id": request_id, "traceparent": traceparent.decode("latin-1")})
        shaper = ResponseShaper(chat=chat, model=cfg.served_model, request_id=request_id,
                                choices=len(spec.prompts) * spec.n, fingerprint=engine.fingerprint,
                                include_usage=spec.include_usage, role=spec.role)
        if engine.faults.mode in GARBAGE_MODES:
            await send_garbage(send, engine.faults.mode, shaper, spec.stream, watch.gone.is_set)
            return
        waker = Waker()
        # Choice p * n + j is the j-th sample of prompt p, as vLLM numbers them.
        channels = [_submit(engine, spec, shaper.id, p * spec.n + j, j, prompt, waker, requests)
                    for p, prompt in enumerate(spec.prompts) for j in range(spec.n)]
        abort_after = engine.faults.abort_after_tokens if accepted.abort else None
        if spec.stream:
            await _stream(send, spec, shaper, channels, waker, engine.core.block_size, abort_after)
        else:
            await _complete(send, spec, shaper, channels, waker, engine.core.block_size, accepted.abort)
    except Exception:  # a bug in the simulator, not a client mistake: log it and answer 500
        log.exception("sim: request failed")
        with contextlib.suppress(Exception):
            await send_json(send, 500, ApiError(500, "Internal server error").body())
    finally:
        watch.close()
        abort_all()  # a no-op for finished requests; frees KV if we stopped early


async def _hang(engine: EngineRuntime, watch: ClientWatch) -> bool:
    """Hold the request without a byte until the mode changes (True) or the client leaves."""
    while engine.faults.mode == "hang":
        change = asyncio.ensure_future(engine.faults.wait_changed())
        gone = asyncio.ensure_future(watch.gone.wait())
        try:
            await asyncio.wait({change, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            change.cancel()
            gone.cancel()
        if watch.gone.is_set():
            return False
    return True


def _submit(engine: EngineRuntime, spec: GenerationSpec, base_id: str, index: int, sample: int,
            prompt: list[int], waker: Waker, requests: list[SimRequest]) -> Channel:
    cfg = engine.config
    n, reason, seed = plan_output(spec, prompt, cfg.max_model_len, cfg.seed, sample)
    stop = find_stop(seed, n, spec.stop) if spec.stop else None
    if stop is not None:
        n, reason = stop[0], "stop"
    room = cfg.max_model_len - len(prompt)
    req = SimRequest(request_id=f"{base_id}-{index}", prompt=prompt, max_output=n,
                     final_reason=reason, priority=spec.priority, seed=seed,
                     cache_salt=spec.cache_salt,
                     budget=room if spec.max_tokens is None else min(spec.max_tokens, room),
                     n_param=spec.n if sample == 0 else 0,
                     stop_reason=stop[1] if stop else None, text_len=stop[2] if stop else None)
    channel = Channel(req, waker)
    requests.append(req)
    engine.submit(req, channel)
    return channel


def _usage(spec: GenerationSpec, channels: list[Channel], block_size: int, *, first: bool) -> Usage:
    """The response's usage, counted as vLLM counts it: each prompt once whatever ``n``, and
    the cache figures of one request (a stream's first, a full response's last prompt)."""
    lead = channels[0] if first else channels[-spec.n]
    cached = lead.request.num_cached_tokens
    created = max(0, len(lead.request.prompt) // block_size * block_size - cached)
    return Usage(prompt_tokens=sum(len(p) for p in spec.prompts),
                 completion_tokens=sum(len(c.request.output) for c in channels),
                 cached_tokens=cached, created_cache_tokens=created)


def _logprobs(spec: GenerationSpec, req: SimRequest, start: int, ids: list[int],
              text_offset: int) -> dict[str, Any] | None:
    if spec.logprobs is None:
        return None
    if spec.chat:
        return chat_logprobs(req.seed, start, ids, spec.logprobs)
    return completion_logprobs(req.seed, start, ids, spec.logprobs, text_offset)


async def _complete(send: Send, spec: GenerationSpec, shaper: ResponseShaper,
                    channels: list[Channel], waker: Waker, block_size: int, cut: bool) -> None:
    while not all(c.finished for c in channels):
        await waker.wait()
    if any(c.aborted for c in channels):
        return
    outputs = [ChoiceOutput(text=detokenize(c.request.output)[:c.request.text_len],
                            finish_reason=c.request.finish_reason or "length", stop_reason=c.request.stop_reason,
                            logprobs=_logprobs(spec, c.request, 0, c.request.output, 0)) for c in channels]
    body = shaper.full_body(outputs, _usage(spec, channels, block_size, first=False))
    await (send_cut(send, body) if cut else send_json(send, 200, body))


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
            logprobs = _logprobs(spec, req, start + k, piece, self.text_offsets[index])
            self.text_offsets[index] += sum(len(VOCAB_TEXT[t]) for t in piece)
            usage = (Usage(self.prompt_len(index), start + k + len(piece), 0, 0).running(chat=spec.chat)
                     if spec.continuous_usage else None)
            final = finish_reason if last else None
            text = _last_text(req) if final is not None else None
            out.append(self.shaper.chunk(index, piece, final, logprobs, usage, req.stop_reason if final else None,
                                         text))
        return b"".join(out)


def _last_text(req: SimRequest) -> str | None:
    """Text of the last token of an output a stop string cut short (None when none did)."""
    if req.text_len is None or not req.output:
        return None
    full = detokenize(req.output)
    before = len(full) - len(VOCAB_TEXT[req.output[-1]])
    return full[before:req.text_len] if req.text_len > before else ""


async def _stream(send: Send, spec: GenerationSpec, shaper: ResponseShaper, channels: list[Channel],
                  waker: Waker, block_size: int, abort_after: int | None) -> None:
    """Stream the choices; with ``abort_after``, stop for good after that many content tokens
    (fewer if the choices end first), leaving the answer incomplete (fault ``abort_rate``)."""
    await send({"type": "http.response.start", "status": 200, "headers": _SSE})
    slow = _SlowChunks(spec, shaper, channels) if (
        spec.logprobs is not None or spec.continuous_usage) else None
    pending: list[bytes] = []
    if spec.chat:
        pending.extend(slow.role(i) if slow else shaper.role_chunk(i) for i in range(len(channels)))
    seen = [0] * len(channels)
    budget = abort_after  # content tokens still to send before breaking off (None: never)
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
                    i, ids, reason, ch.request.stop_reason, _last_text(ch.request) if final else None))
                seen[i] = visible
            if not (ch.finished and seen[i] == len(ch.request.output)):
                done = False
        if budget is not None and (budget == 0 or done):
            if pending:
                await send({"type": "http.response.body", "body": b"".join(pending), "more_body": True})
            return  # no usage, no [DONE], no end of the chunked body: the server drops the connection
        if done:
            break
        if pending and any(seen):
            # Everything that piled up while the client was slow goes out in one write. (The role
            # chunks wait for the first token, as vLLM's do: they come with its first engine output.)
            body = b"".join(pending)
            pending.clear()
            await send({"type": "http.response.body", "body": body, "more_body": True})
        else:
            await waker.wait()
    if spec.include_usage:
        pending.append(shaper.usage_chunk(_usage(spec, channels, block_size, first=True)))
    pending.append(DONE)
    await send({"type": "http.response.body", "body": b"".join(pending), "more_body": False})
