"""vLLM 0.32's OpenAI Responses API (``POST /v1/responses``) for a plain chat model, on the simulated engine.

A request is validated and rendered as a chat (``responses_request.py``) and then runs as a chat completion
does: through the fault rates and garbage modes, the scheduler, the KV cache and the metrics
(``generate.py``). Only the answer's shape differs. In full, vLLM's response object with every key; as a
stream, its server-sent events, each ``event: <type>`` and ``data: <json>`` with a ``sequence_number``
counting from 0: ``response.created`` and ``response.in_progress`` at once, then with the first token
``response.output_item.added`` and ``response.content_part.added``, one ``response.output_text.delta`` per
token, and at the end ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done`` and ``response.completed`` with the whole response and its usage (also when
``max_output_tokens`` cut it short: its status is then ``incomplete``). No ``data: [DONE]``.

vLLM keeps no responses unless started with ``VLLM_ENABLE_RESPONSES_API_STORE``; nor does the simulator:
``store`` is ignored, ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` always answer 404.

A stream drawn by the fault rate ``abort_rate`` is broken off after ``abort_after_tokens`` tokens whatever
``abort_with`` says: where a chat stream gets vLLM's error event, vLLM 0.32's Responses stream fails
(its error event does not validate as a Responses event) and the server drops the connection.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from litestar import Response, get, post
from litestar.params import FromPath

from switchyard.sim.faults import GARBAGE_MODES
from switchyard.sim.garbage import send_garbage
from switchyard.sim.generate import ClientWatch, Receive, Scope, Send, _submit, log, read_post, send_cut, send_json
from switchyard.sim.logprobs import top_logprobs
from switchyard.sim.request import SimRequest
from switchyard.sim.responses import ResponseShaper
from switchyard.sim.responses_request import ResponsesRequest, not_found, parse_responses
from switchyard.sim.runtime import Channel, EngineRuntime, Waker
from switchyard.sim.streaming import last_text, usage_of
from switchyard.sim.utility import json_body
from switchyard.sim.validation import ApiError
from switchyard.simtext.tokens import VOCAB_JSON, VOCAB_TEXT, detokenize

_SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]


def _usage(spec_usage: Any) -> dict[str, Any]:
    prompt, output = spec_usage.prompt_tokens, spec_usage.completion_tokens
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": spec_usage.cached_tokens,
                                     "cache_write_tokens": spec_usage.created_cache_tokens,
                                     "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
                                      "tool_output_tokens_per_turn": []},
            "total_tokens": prompt + output}


def _logprob(text: str, logprob: float, top: list[tuple[str, float]], *, full: bool) -> dict[str, Any]:
    """One token's log-probability: an output text part's (``full``, with bytes) or a delta event's."""
    if full:
        return {"token": text, "bytes": list(text.encode()), "logprob": logprob,
                "top_logprobs": [{"token": t, "bytes": list(t.encode()), "logprob": lp} for t, lp in top]}
    return {"token": text, "logprob": logprob, "top_logprobs": [{"token": t, "logprob": lp} for t, lp in top]}


class ResponseWriter:
    """Builds one response's object and events.

    Args:
        req: The validated request.
        model: The model name the response reports.
    """

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.req = req
        self.model = model
        self.created = int(time.time())
        self.item_id = f"msg_{uuid.uuid4().hex[:16]}"
        self.sequence = 0
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self._item_id_json = msgspec.json.encode(self.item_id)

    def body(self, output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        """The response object, key for key as vLLM writes it."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        echo = self.req.echo
        out: dict[str, Any] = {"id": self.req.response_id, "created_at": self.created,
                               "incomplete_details": incomplete, "instructions": echo["instructions"],
                               "metadata": echo["metadata"], "model": self.model, "object": "response",
                               "output": output}
        for key in ("parallel_tool_calls", "temperature", "tool_choice", "tools", "top_p", "background",
                    "max_output_tokens", "max_tool_calls", "previous_response_id", "prompt", "reasoning",
                    "service_tier"):
            out[key] = echo[key]
        out["status"] = status
        for key in ("text", "top_logprobs", "truncation"):
            out[key] = echo[key]
        out.update(usage=usage, user=echo["user"], presence_penalty=echo["presence_penalty"],
                   frequency_penalty=echo["frequency_penalty"], kv_transfer_params=None, ec_transfer_params=None,
                   input_messages=None, output_messages=None)
        return out

    def message(self, text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
        """The output message item (no content part when there is no text, as vLLM)."""
        part = {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}
        return {"id": self.item_id, "content": [part] if text else [], "role": "assistant", "status": "completed",
                "type": "message", "phase": None}

    def event(self, kind: str, fields: dict[str, Any]) -> bytes:
        """One event, numbered (openai's event models, and so vLLM's, write their keys in alphabetical order)."""
        data = dict(sorted({**fields, "sequence_number": self.sequence, "type": kind}.items()))
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"

    def opening(self) -> bytes:
        """``response.created`` and ``response.in_progress``."""
        initial = self.body([], "in_progress", None)
        return (self.event("response.created", {"response": initial})
                + self.event("response.in_progress", {"response": initial}))

    def deltas(self, req: SimRequest, start: int, ids: list[int], final: bool) -> bytes:
        """The delta events of tokens ``start…`` of ``req`` (the item's opening events before the first)."""
        out: list[bytes] = []
        k = self.req.top_logprobs
        for offset, token in enumerate(ids):
            last = final and offset == len(ids) - 1 and req.text_len is not None
            text = (last_text(req) or "") if last else VOCAB_TEXT[token]
            if not text:  # vLLM skips an empty delta (a stop string took all of the token's text)
                continue
            if not self.text:
                out.append(self._open_item())
            self.text.append(text)
            logprobs = b"[]"
            if self.req.spec.logprobs is not None:
                top = top_logprobs(req.seed, start + offset, token, k)
                logprob = top[0][1]
                self.logprobs.append(_logprob(top[0][0], logprob, top[:k], full=True))
                logprobs = msgspec.json.encode([_logprob(top[0][0], logprob, top[:k], full=False)])
            delta = msgspec.json.encode(text) if last else VOCAB_JSON[token]
            out.append(b'event: response.output_text.delta\ndata: {"content_index":0,"delta":' + delta
                       + b',"item_id":' + self._item_id_json + b',"logprobs":' + logprobs
                       + b',"output_index":0,"sequence_number":' + str(self.sequence).encode()
                       + b',"type":"response.output_text.delta"}\n\n')
            self.sequence += 1
        return b"".join(out)

    def _open_item(self) -> bytes:
        item: dict[str, Any] = {"id": self.item_id, "content": [], "role": "assistant", "status": "in_progress",
                                "type": "message", "phase": None}
        part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
        return (self.event("response.output_item.added", {"item": item, "output_index": 0})
                + self.event("response.content_part.added", {"content_index": 0, "item_id": self.item_id,
                                                             "output_index": 0, "part": part}))

    def closing(self, status: str, usage: dict[str, Any]) -> bytes:
        """The done events of the item (if any text came) and ``response.completed``."""
        out: list[bytes] = []
        output: list[dict[str, Any]] = []
        if self.text:
            text = "".join(self.text)
            item = self.message(text, self.logprobs or None)
            out.append(self.event("response.output_text.done", {
                "content_index": 0, "item_id": self.item_id, "logprobs": [], "output_index": 0, "text": text}))
            out.append(self.event("response.content_part.done", {
                "content_index": 0, "item_id": self.item_id, "output_index": 0, "part": item["content"][0]}))
            out.append(self.event("response.output_item.done", {"item": item, "output_index": 0}))
            output.append(item)
        out.append(self.event("response.completed", {"response": self.body(output, status, usage)}))
        return b"".join(out)


def _status(req: SimRequest) -> str:
    return "incomplete" if (req.finish_reason or "length") == "length" else "completed"


async def handle_responses(engine: EngineRuntime, scope: Scope, receive: Receive, send: Send) -> None:
    """Serve one ``POST /v1/responses`` end to end."""
    accepted = await read_post(engine, scope, receive, send)
    if accepted is None:
        return
    cfg = engine.config
    adapter = None
    try:
        content_type = dict(scope.get("headers") or []).get(b"content-type", b"").decode("latin-1")
        body = json_body(content_type, accepted.body)
        # As for chat: a ``model`` naming a LoRA adapter runs on the base model with it, under its name.
        adapter = engine.adapter(body.get("model"))
        req = parse_responses(body, served_model=engine.served_name(adapter),
                              max_model_len=cfg.max_model_len)
    except ApiError as exc:
        if exc.status == 404 and exc.param == "model":
            engine.unknown_model()
        await send_json(send, exc.status, exc.body())
        return
    model = engine.served_name(adapter)

    requests: list[SimRequest] = []

    def abort_all() -> None:
        for r in requests:
            engine.abort(r)

    watch = ClientWatch(receive, abort_all)
    try:
        engine.note_trace(dict(scope.get("headers") or []), req.response_id)
        spec = req.spec
        if engine.faults.mode in GARBAGE_MODES:
            shaper = ResponseShaper(chat=True, model=model, request_id=req.response_id, choices=1,
                                    fingerprint=engine.fingerprint)
            await send_garbage(send, engine.faults.mode, shaper, spec.stream, watch.gone.is_set)
            return
        waker = Waker()
        channel = _submit(engine, spec, req.response_id, 0, 0, spec.prompts[0], waker, requests, adapter)
        writer = ResponseWriter(req, model)
        block_size = engine.core.block_size
        if spec.stream:
            abort_after = engine.faults.abort_after_tokens if accepted.abort else None
            await _stream(send, writer, channel, waker, block_size, abort_after,
                          engine.faults.abort_with == "error", abort_all)
            return
        while not channel.finished:
            await waker.wait()
        if channel.aborted:
            return
        out = channel.request
        logprobs = None
        if spec.logprobs is not None:
            k = req.top_logprobs
            tops = [top_logprobs(out.seed, i, t, k) for i, t in enumerate(out.output)]
            logprobs = [_logprob(top[0][0], top[0][1], top[:k], full=True) for top in tops]
        text = detokenize(out.output)[:out.text_len]
        usage = _usage(usage_of(spec, [channel], block_size, first=False))
        answer = msgspec.json.encode(writer.body([writer.message(text, logprobs)], _status(out), usage))
        await (send_cut(send, answer) if accepted.abort else send_json(send, 200, answer))
    except Exception:  # a bug in the simulator, not a client mistake: log it and answer 500
        log.exception("sim: responses request failed")
        with contextlib.suppress(Exception):
            await send_json(send, 500, ApiError(500, "Internal server error").body())
    finally:
        watch.close()
        abort_all()


async def _stream(send: Send, writer: ResponseWriter, channel: Channel, waker: Waker, block_size: int,
                  abort_after: int | None, fail: bool, on_break: Callable[[], None]) -> None:
    """Write the events as the tokens become visible; break off after ``abort_after`` tokens (None: never),
    two before the end at the latest when ``fail`` (so that the engine still runs the request)."""
    await send({"type": "http.response.start", "status": 200, "headers": _SSE})
    await send({"type": "http.response.body", "body": writer.opening(), "more_body": True})
    req = channel.request
    budget = abort_after
    if fail and budget is not None:
        budget = min(budget, max(0, req.max_output - 2))
    seen = 0
    pending: list[bytes] = []
    while True:
        if channel.aborted:
            return
        visible = channel.visible if budget is None else min(channel.visible, seen + budget)
        if budget is not None:
            budget -= visible - seen
        if visible > seen:
            final = channel.finished and visible == len(req.output)
            pending.append(writer.deltas(req, seen, req.output[seen:visible], final))
            seen = visible
        done = channel.finished and seen == len(req.output)
        if budget is not None and (budget == 0 or done):
            on_break()  # before the write below lets the engine loop run again
            if pending:
                await send({"type": "http.response.body", "body": b"".join(pending), "more_body": True})
            return  # no closing events, no end of the chunked body: the server drops the connection
        if done:
            break
        if pending:
            body = b"".join(pending)
            pending.clear()
            await send({"type": "http.response.body", "body": body, "more_body": True})
        else:
            await waker.wait()
    usage = _usage(usage_of(writer.req.spec, [channel], block_size, first=False))
    pending.append(writer.closing(_status(req), usage))
    await send({"type": "http.response.body", "body": b"".join(pending), "more_body": False})


@get("/v1/responses/{response_id:str}", operation_id="retrieveResponse", sync_to_thread=False)
def retrieve_response(response_id: FromPath[str]) -> Response[bytes]:
    """A stored response: none is stored (vLLM without ``VLLM_ENABLE_RESPONSES_API_STORE``), so 404."""
    error = not_found(response_id)
    return Response(error.body(), status_code=error.status, media_type="application/json")


@post("/v1/responses/{response_id:str}/cancel", operation_id="cancelResponse", sync_to_thread=False)
def cancel_response(response_id: FromPath[str]) -> Response[bytes]:
    """Cancel a background response: there are none (see ``retrieve_response``), so 404."""
    error = not_found(response_id)
    return Response(error.body(), status_code=error.status, media_type="application/json")
