"""Whether a stream its engine broke off may be continued on another endpoint.

Continuing sends the original request with the text streamed so far as a final assistant message to be
continued (vLLM's ``continue_final_message``; for a completion, the prompt plus the text so far), with the
output budget reduced by what was produced. That is the same answer only where the text is all the state
there is. It is not, and the stream ends with its error event instead, when:

- the model does not allow it (``resume_streams: false``) or the request was resumed ``max_resumes`` times;
- more than one answer is being produced (``n`` > 1, several completion prompts, ``best_of``);
- the client asked for log-probabilities (a continuation's would not be the first answer's);
- a tool call or reasoning was being streamed (its deltas are not text to continue);
- the output is constrained (``response_format``, guided decoding: the constraint would restart), or the
  client set the chat template's own flags, asked for usage in every chunk, or sent a prompt that is not
  one piece of text (token ids, an echo of it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from switchyard.decide.cache import RequestKind
from switchyard.policy.fleet import Model

#: Body fields that constrain the output: a continuation would start the constraint again.
_CONSTRAINED = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs", "guided_decoding_backend")


@dataclass(slots=True)
class StreamSoFar:
    """What a broken stream had carried to its client.

    Attributes:
        tokens: Tokens produced so far (text events: engines send one token per event).
        why: Why the engine's stream ended (for the trace).
        kind: The same, short (``broken``, ``error_event``, ``stalled``, ``invalid``...).
        tool_calls: A tool call's deltas were streamed.
        reasoning: Reasoning deltas were streamed.
    """

    tokens: int
    why: str
    kind: str
    tool_calls: bool = False
    reasoning: bool = False


def _positive(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    return value is not None and value is not False and value != 0


def resume_refusal(model: Model, kind: RequestKind, body: Mapping[str, Any], so_far: StreamSoFar,
                   resumes: int) -> str | None:
    """Why the stream may not be continued elsewhere (see the module doc), or None when it may."""
    if kind not in ("chat", "completion"):
        return "only chat and text completion streams are continued (a Responses API stream's events name its " \
               "response, which another engine cannot go on with)"
    if not model.resume_streams:
        return f"resume_streams is off for model {model.name}"
    if resumes >= model.max_resumes:
        return f"it was resumed {resumes} times already (max_resumes {model.max_resumes})"
    n = body.get("n")
    if (isinstance(n, int) and n > 1) or (isinstance(body.get("best_of"), int) and body["best_of"] > 1):
        return "more than one answer was asked for (n > 1)"
    if _positive(body, "logprobs") or _positive(body, "top_logprobs") or _positive(body, "prompt_logprobs"):
        return "log-probabilities were asked for"
    if so_far.tool_calls:
        return "a tool call was being streamed"
    if so_far.reasoning:
        return "reasoning was being streamed"
    constrained = next((f for f in _CONSTRAINED if body.get(f) is not None), None)
    if constrained is not None:
        return f"the output is constrained ({constrained})"
    options = body.get("stream_options")
    if isinstance(options, Mapping) and options.get("continuous_usage_stats"):
        return "usage was asked for in every chunk (continuous_usage_stats)"
    if kind == "chat":
        if body.get("add_generation_prompt") is False and not body.get("continue_final_message"):
            return "the request sets add_generation_prompt itself"
        messages = body.get("messages")
        if body.get("continue_final_message") and not (
                isinstance(messages, list) and messages and isinstance(messages[-1], Mapping)
                and isinstance(messages[-1].get("content"), str)):
            return "the message it continues is not plain text"
        return None
    if not isinstance(body.get("prompt"), str):
        return "the prompt is not one piece of text"
    if body.get("echo"):
        return "the prompt is echoed (echo)"
    if body.get("suffix") is not None:
        return "a suffix was given"
    return None


def left_to_generate(body: Mapping[str, Any], produced: int) -> int | None:
    """The output budget a continuation gets: the client's ``max_tokens`` (or ``max_completion_tokens``) less
    what was produced (0: nothing is left); None when the client set none."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return max(0, value - produced)
    return None
