"""Streams that survive their engine: a broken stream continued on another endpoint, in the client's stream.

When an engine breaks a stream off after its first byte (the connection lost, an error event, a stall the
watchdog cut), the relay (:class:`~switchyard.engines.streams.StreamRelay`) calls the request's
:class:`Resumer`. It reads what the client has received (:class:`~switchyard.engines.splice.Transcript`) and:

- when the answer was complete (its ``finish_reason`` came) or its output budget is spent, ends the stream
  itself: the final chunk, the usage the client asked for, ``[DONE]``;
- else runs the decision procedure's :func:`~switchyard.decide.procedure.resume` (whether it is safe, and where:
  the next endpoint of the fallback plan, each try a retry for the budget). The try sends the original request
  with the text so far as a final assistant message to continue (``continue_final_message: true``,
  ``add_generation_prompt: false``; a completion's prompt plus the text so far), ``max_tokens`` less what was
  produced, and always the usage chunk; its stream is spliced in (:class:`~switchyard.engines.splice.Splice`):
  the same id, no second role delta, one usage object that adds up every engine's work;
- else (not safe, nowhere to go) the stream ends with its error event, as a stream that is not resumed does.

Every resume is in the request's decision trace and record (``resumes``) and in
``switchyard_stream_resumes_total``; the ledger charges each engine's part at its own model's prices.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from switchyard.decide.decision import Decision, Tried
from switchyard.decide.procedure import Steps, resume
from switchyard.decide.resume import StreamSoFar, left_to_generate
from switchyard.engines.splice import SoFar, Splice, closing_events, stream_kind
from switchyard.engines.streams import Break, Leg, Resumed
from switchyard.gateway.activity import RequestRecord
from switchyard.gateway.request import PendingRequest

if TYPE_CHECKING:
    from switchyard.gateway.runtime import GatewayRuntime


class Driver(Protocol):
    """Runs a piece of the decision procedure live (the request's own executor: ``gateway.proxy``)."""

    async def drive(self, steps: Steps | Any) -> Any:
        """Answer ``steps``' effects until it returns; its value."""
        ...


def continuation_body(kind: str, body: Mapping[str, Any], text: str, produced: int, left: int | None) -> dict[str, Any]:
    """The request that continues an answer whose text so far is ``text`` (``produced`` tokens) with ``left``
    tokens of output budget (None: the client set none). With no text yet the request is sent again as it was."""
    out = dict(body)
    options = body.get("stream_options")
    out["stream"] = True
    out["stream_options"] = {**(options if isinstance(options, Mapping) else {}), "include_usage": True}
    if left is not None:
        name = "max_completion_tokens" if isinstance(body.get("max_completion_tokens"), int) else "max_tokens"
        out[name] = left
        if name == "max_completion_tokens":
            out.pop("max_tokens", None)
    if not text:
        return out
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > 0:
        out["min_tokens"] = max(0, min_tokens - produced)
    if kind == "chat":
        messages = list(body.get("messages") or [])
        if body.get("continue_final_message") and messages:
            last = dict(messages[-1])
            last["content"] = str(last.get("content") or "") + text
            messages[-1] = last
        else:
            messages.append({"role": "assistant", "content": text})
        out["messages"] = messages
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
    else:
        out["prompt"] = str(body.get("prompt") or "") + text
    return out


def _asked_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, Mapping) and options.get("include_usage") is True


class Resumer:
    """Continues one request's stream after its engine broke it off (see the module doc)."""

    def __init__(self, runtime: GatewayRuntime, driver: Driver, req: PendingRequest, record: RequestRecord) -> None:
        self.runtime = runtime
        self.driver = driver
        self.req = req
        self.record = record

    @property
    def decision(self) -> Decision:
        return self.req.decision

    def usage(self, last: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The usage object the client gets: every engine's work (the legs that ended, and ``last``, the usage
        the current continuation reports)."""
        prompt = sum(leg.prompt_tokens for leg in self.req.legs)
        completion = sum(leg.completion_tokens for leg in self.req.legs)
        cached = sum(leg.cached_tokens for leg in self.req.legs)
        if last is not None:
            prompt += int(last.get("prompt_tokens") or 0)
            completion += int(last.get("completion_tokens") or 0)
            details = last.get("prompt_tokens_details")
            if isinstance(details, Mapping):
                cached += int(details.get("cached_tokens") or 0)
        out: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                               "completion_tokens": completion}
        if cached:
            out["prompt_tokens_details"] = {"cached_tokens": cached}
        return out

    async def __call__(self, broke: Break) -> Resumed:
        req, d, metrics = self.req, self.decision, self.runtime.metrics
        so_far = broke.transcript.read() if broke.transcript is not None else SoFar()
        model = d.stage.model.name if d.stage is not None else "-"
        keep_usage = _asked_usage(req.body)
        left = left_to_generate(req.body, so_far.tokens)
        if so_far.finished is not None or left == 0:
            # The answer is all there (or may not grow): the stream only lacks its end.
            d.trace.append(f"stream: the engine {broke.why} after the answer's "
                           f"{'end' if so_far.finished else 'output budget'}; the gateway ended the stream")
            metrics.stream_resumes.labels(model, "closed").inc()
            return closing_events(stream_kind(req.kind), so_far.head, None if so_far.finished else "length",
                                  self.usage() if keep_usage else None)
        req.continuation = continuation_body(req.kind, req.body, so_far.text, so_far.tokens, left)
        req.continued_tokens = so_far.tokens
        point = StreamSoFar(so_far.tokens, broke.why, broke.kind, so_far.tool_calls, so_far.reasoning)
        resumes = d.resumes
        tried: Tried | None = await self.driver.drive(resume(d, self.runtime.view, point))
        if tried is None or tried.outcome != "ok":
            if tried is not None:  # the engine refused the continuation itself (a 4xx)
                d.trace.append(f"stream: not resumed: the continuation was refused ({tried.kind}: {tried.reason})")
            metrics.stream_resumes.labels(model, "refused" if d.resumes == resumes else "failed").inc()
            return None
        leg, continuing = tried.answer
        assert isinstance(leg, Leg)
        leg.splice = Splice(stream_kind(req.kind), so_far.head, self.usage, keep_usage)
        continuing.watch(broke.relay, leg)
        self.record.trace.append(f"stream: resumed at {continuing.url} after {so_far.tokens} tokens "
                                 f"({'continue_final_message' if req.kind == 'chat' else 'prompt + text so far'}"
                                 + (f", max_tokens {left}" if left is not None else "") + ")")
        metrics.stream_resumes.labels(model, "resumed").inc()
        return leg

