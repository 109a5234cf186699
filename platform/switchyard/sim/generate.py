"""``POST /v1/completions`` and ``POST /v1/chat/completions``, as raw ASGI handlers.

These are the hot path and need things a framework response object does not give: noticing
a client that disconnects while nothing is being written (to abort its request and free its
KV blocks, as vLLM does), and writing every token that piled up while a slow consumer was
busy in a single ``send``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from switchyard.sim.protocol import (
    ApiError,
    GenerationSpec,
    check_context,
    decode_body,
    parse_generation,
    plan_output,
)
from switchyard.sim.request import SimRequest
from switchyard.sim.responses import DONE, ResponseShaper, usage
from switchyard.sim.runtime import Channel, EngineRuntime, Waker

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]

log = logging.getLogger("switchyard.sim")
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


async def send_json(send: Send, status: int, body: bytes) -> None:
    """Send a complete JSON response."""
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _read_body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


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
    if scope.get("method") != "POST":
        await send_json(send, 405, ApiError(405, "Method Not Allowed").body())
        return
    raw = await _read_body(receive)
    if raw is None:
        return
    cfg = engine.config
    try:
        if engine.faults.should_fail():
            raise ApiError(500, "Simulated engine failure (sim fault mode 'error').")
        spec = parse_generation(decode_body(raw), chat=chat, served_model=cfg.served_model,
                                vocab_size=cfg.profile.vocab_size)
        for prompt in spec.prompts:
            check_context(len(prompt), spec.max_tokens, cfg.max_model_len)
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
        shaper = ResponseShaper(chat=chat, model=cfg.served_model, request_id=request_id,
                                choices=len(spec.prompts))
        waker = Waker()
        channels = [_submit(engine, spec, shaper.id, i, prompt, waker, requests)
                    for i, prompt in enumerate(spec.prompts)]
        if spec.stream:
            await _stream(send, spec, shaper, channels, waker)
        else:
            await _complete(send, shaper, channels, waker)
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


def _submit(engine: EngineRuntime, spec: GenerationSpec, base_id: str, index: int,
            prompt: list[int], waker: Waker, requests: list[SimRequest]) -> Channel:
    cfg = engine.config
    n, reason, seed = plan_output(spec, prompt, cfg.max_model_len, cfg.seed)
    req = SimRequest(request_id=f"{base_id}-{index}", prompt=prompt, max_output=n,
                     final_reason=reason, priority=spec.priority, seed=seed,
                     cache_salt=spec.cache_salt)
    channel = Channel(req, waker)
    requests.append(req)
    engine.submit(req, channel)
    return channel


def _usage(channels: list[Channel]) -> dict[str, Any]:
    return usage(sum(len(c.request.prompt) for c in channels),
                 sum(len(c.request.output) for c in channels),
                 sum(c.request.num_cached_tokens for c in channels))


async def _complete(send: Send, shaper: ResponseShaper, channels: list[Channel],
                    waker: Waker) -> None:
    while not all(c.finished for c in channels):
        await waker.wait()
    if any(c.aborted for c in channels):
        return
    outputs = [(c.request.output, c.request.finish_reason or "length") for c in channels]
    await send_json(send, 200, shaper.full_body(outputs, _usage(channels)))


async def _stream(send: Send, spec: GenerationSpec, shaper: ResponseShaper,
                  channels: list[Channel], waker: Waker) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": _SSE})
    pending: list[bytes] = []
    if spec.chat:
        pending.extend(shaper.role_chunk(i) for i in range(len(channels)))
    seen = [0] * len(channels)
    while True:
        done = True
        for i, ch in enumerate(channels):
            if ch.aborted:
                return
            visible = ch.visible
            if visible > seen[i]:
                ids = ch.request.output[seen[i]:visible]
                final = ch.finished and visible == len(ch.request.output)
                pending.append(shaper.token_chunks(
                    i, ids, ch.request.finish_reason if final else None))
                seen[i] = visible
            if not (ch.finished and seen[i] == len(ch.request.output)):
                done = False
        if done:
            break
        if pending:
            # Everything that piled up while the client was slow goes out in one write.
            body = b"".join(pending)
            pending.clear()
            await send({"type": "http.response.body", "body": body, "more_body": True})
        else:
            await waker.wait()
    if spec.include_usage:
        pending.append(shaper.usage_chunk(_usage(channels)))
    pending.append(DONE)
    await send({"type": "http.response.body", "body": b"".join(pending), "more_body": False})
