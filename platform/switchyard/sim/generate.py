"""``POST /v1/completions`` and ``POST /v1/chat/completions``, as raw ASGI handlers.

These are the hot path and need things a framework response object does not give: noticing
a client that disconnects while nothing is being written (to abort its request and free its
KV blocks, as vLLM does), and writing every token that piled up while a slow consumer was
busy in a single ``send`` (``streaming.py``). The fault rates (``faults.py``) are applied here too,
to the generation and embeddings handlers alike: rejections before the request reaches the
scheduler, broken-off answers while they are written; and the garbage modes to generation requests
(``garbage.py``). The stalling modes (``hang``, ``drip``) are the engine loop's (``runtime.py``): a
request is accepted and submitted as usual, and waits for the steps that do not come.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from switchyard.sim.faults import GARBAGE_MODES
from switchyard.sim.garbage import send_garbage
from switchyard.sim.lora import LoraAdapter
from switchyard.sim.protocol import (
    ApiError,
    GenerationSpec,
    decode_body,
    find_stop,
    parse_generation,
    plan_output,
)
from switchyard.sim.request import SimRequest
from switchyard.sim.responses import ChoiceOutput, ResponseShaper
from switchyard.sim.runtime import Channel, EngineRuntime, Waker
from switchyard.sim.streaming import logprobs_of, stream_choices, usage_of
from switchyard.simtext.tokens import detokenize

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]

log = logging.getLogger("switchyard.sim")
_JSON = [(b"content-type", b"application/json")]
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
        body = decode_body(accepted.body)
        # A ``model`` naming a LoRA adapter runs on the base model with it, and answers under its name.
        adapter = engine.adapter(body.get("model"))
        spec = parse_generation(body, chat=chat, served_model=engine.served_name(adapter),
                                vocab_size=cfg.profile.vocab_size, max_model_len=cfg.max_model_len)
    except ApiError as exc:
        if exc.status == 404:
            engine.unknown_model()
        await send_json(send, exc.status, exc.body())
        return

    requests: list[SimRequest] = []

    def abort_all() -> None:
        for r in requests:
            engine.abort(r)

    watch = ClientWatch(receive, abort_all)
    try:
        headers = dict(scope.get("headers") or [])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1") or None
        engine.note_trace(headers, request_id)
        shaper = ResponseShaper(chat=chat, model=engine.served_name(adapter),
                                request_id=request_id,
                                choices=len(spec.prompts) * spec.n, fingerprint=engine.fingerprint,
                                include_usage=spec.include_usage, role=spec.role)
        if engine.faults.mode in GARBAGE_MODES:
            await send_garbage(send, engine.faults.mode, shaper, spec.stream, watch.gone.is_set)
            return
        waker = Waker()
        # Choice p * n + j is the j-th sample of prompt p, as vLLM numbers them.
        channels = [_submit(engine, spec, shaper.id, p * spec.n + j, j, prompt, waker, requests, adapter)
                    for p, prompt in enumerate(spec.prompts) for j in range(spec.n)]
        abort_after = engine.faults.abort_after_tokens if accepted.abort else None
        if spec.stream:
            await stream_choices(send, spec, shaper, channels, waker, engine.core.block_size, abort_after,
                                 fail=engine.faults.abort_with == "error", on_break=abort_all)
        else:
            await _complete(send, spec, shaper, channels, waker, engine.core.block_size, accepted.abort)
    except Exception:  # a bug in the simulator, not a client mistake: log it and answer 500
        log.exception("sim: request failed")
        with contextlib.suppress(Exception):
            await send_json(send, 500, ApiError(500, "Internal server error").body())
    finally:
        watch.close()
        abort_all()  # a no-op for finished requests; frees KV if we stopped early


def _submit(engine: EngineRuntime, spec: GenerationSpec, base_id: str, index: int, sample: int,
            prompt: list[int], waker: Waker, requests: list[SimRequest], adapter: LoraAdapter | None = None) -> Channel:
    cfg = engine.config
    n, reason, seed = plan_output(spec, prompt, cfg.max_model_len, cfg.seed, sample)
    start = 1 if spec.continues else 0  # a continued message goes on mid-sentence
    stop = find_stop(seed, n, spec.stop, start) if spec.stop else None
    if stop is not None:
        n, reason = stop[0], "stop"
    room = cfg.max_model_len - len(prompt)
    req = SimRequest(request_id=f"{base_id}-{index}", prompt=prompt, max_output=n,
                     final_reason=reason, priority=spec.priority, seed=seed,
                     cache_salt=spec.cache_salt,
                     budget=room if spec.max_tokens is None else min(spec.max_tokens, room),
                     n_param=spec.n if sample == 0 else 0,
                     stop_reason=stop[1] if stop else None, text_len=stop[2] if stop else None,
                     text_start=start, lora=adapter)
    channel = Channel(req, waker)
    requests.append(req)
    engine.submit(req, channel)
    return channel


async def _complete(send: Send, spec: GenerationSpec, shaper: ResponseShaper,
                    channels: list[Channel], waker: Waker, block_size: int, cut: bool) -> None:
    while not all(c.finished for c in channels):
        await waker.wait()
    if any(c.aborted for c in channels):
        return
    outputs = [ChoiceOutput(text=detokenize(c.request.output)[:c.request.text_len],
                            finish_reason=c.request.finish_reason or "length", stop_reason=c.request.stop_reason,
                            logprobs=logprobs_of(spec, c.request, 0, c.request.output, 0)) for c in channels]
    body = shaper.full_body(outputs, usage_of(spec, channels, block_size, first=False))
    await (send_cut(send, body) if cut else send_json(send, 200, body))
