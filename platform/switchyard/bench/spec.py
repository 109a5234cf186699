"""What a benchmark sends: one :class:`RequestSpec` per request, gathered in a :class:`Workload`.

A spec is a schedule entry (when, relative to the run's start), an OpenAI request in recipe
form (the prompt text is built only when the request is sent; see ``bench.prompts``) and the
labels the analysis groups by (tenant, class, model, prefix group). Specs are immutable and
cheap; a workload of 100,000 of them takes a few tens of megabytes.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from switchyard.bench.prompts import Kind, PromptText, SynthText, prompt_overhead_tokens

_ENCODE = msgspec.json.Encoder().encode


class WorkloadError(ValueError):
    """A workload cannot be built: a malformed trace row, an impossible parameter."""


@dataclass(frozen=True, slots=True)
class Labels:
    """Who sends a request and how: the parts of a request that are not its size.

    Attributes:
        tenant: The tenant label; the load generator's ``Target`` maps it to an API key.
        request_class: The class label the report groups by (e.g. a priority class).
        model: The ``model`` field sent.
        kind: ``chat`` (one user message) or ``completion`` (a prompt string).
        stream: Ask for server-sent events.
        extra_body: More fields for the request body (``temperature``, ``ignore_eos``, ...).
        headers: Request headers it carries (``x-switchyard-priority``, ``x-switchyard-region``, ...).
    """

    tenant: str = "default"
    request_class: str = "standard"
    model: str = "auto"
    kind: Kind = "chat"
    stream: bool = True
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One scheduled request.

    Attributes:
        index: Position in the workload (arrival order); results refer to it.
        arrival_s: When to send it, in seconds after the run's start.
        prompt: The prompt recipe: ``prompt.tokens`` is exact under the simulator's tokenizer.
        max_tokens: The output budget sent as ``max_tokens``.
        labels: Tenant, class, model, kind, streaming and extra body fields.
        prefix_group: Requests with the same group share a prompt prefix (for analysis only).
    """

    index: int
    arrival_s: float
    prompt: PromptText
    max_tokens: int
    labels: Labels
    prefix_group: str | None = None

    @property
    def kind(self) -> Kind:
        """``chat`` or ``completion``."""
        return self.labels.kind

    @property
    def stream(self) -> bool:
        """Whether the request asks for a stream."""
        return self.labels.stream

    @property
    def tenant(self) -> str:
        """The tenant label."""
        return self.labels.tenant

    @property
    def request_class(self) -> str:
        """The class label."""
        return self.labels.request_class

    @property
    def model(self) -> str:
        """The model name sent."""
        return self.labels.model

    @property
    def prompt_tokens(self) -> int:
        """Tokens of the prompt text (the engine adds ``prompt_overhead_tokens(kind)``)."""
        return self.prompt.tokens

    def body(self) -> dict[str, Any]:
        """The request body, prompt text included (built on each call)."""
        labels = self.labels
        body: dict[str, Any] = {"model": labels.model, "max_tokens": self.max_tokens}
        text = self.prompt.text()
        if labels.kind == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        if labels.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        if labels.extra_body:
            body.update(labels.extra_body)
        return body

    def encode(self) -> bytes:
        """The request body as JSON bytes (the one encoding a request gets)."""
        return _ENCODE(self.body())


@dataclass(frozen=True, slots=True)
class Workload:
    """A schedule of requests and where it came from.

    Attributes:
        specs: The requests in arrival order (``specs[i].index == i``).
        duration_s: The offered window. Synthetic sources: their duration. Replays: the duration
            cap, or the last arrival when the trace (or the limit) ends sooner. Rates and
            goodput are per second of this window.
        source: What made it and with which parameters (for the report).
        clipped: Requests whose lengths were cut to fit ``max_model_len``.
        phases: For bursty sources, ``(start_s, end_s, state)`` per phase of the arrival process.
    """

    specs: tuple[RequestSpec, ...]
    duration_s: float
    source: Mapping[str, Any]
    clipped: int = 0
    phases: tuple[tuple[float, float, str], ...] = ()

    def __len__(self) -> int:
        return len(self.specs)

    @property
    def offered_rate_per_s(self) -> float:
        """Requests per second of the offered window."""
        return len(self.specs) / self.duration_s if self.duration_s > 0 else 0.0

    def describe(self) -> dict[str, Any]:
        """The workload's parameters and size, as plain data for a report."""
        return {
            **self.source,
            "requests": len(self.specs),
            "duration_s": self.duration_s,
            "offered_rate_per_s": self.offered_rate_per_s,
            "prompt_tokens": sum(s.prompt.tokens for s in self.specs),
            "max_tokens": sum(s.max_tokens for s in self.specs),
            "clipped": self.clipped,
        }


def merge(workloads: Iterable[Workload], *, name: str = "merged") -> Workload:
    """Several workloads as one schedule (arrivals interleaved, indexes renumbered).

    The offered window is the longest of the parts; ``source`` lists the parts' sources.
    """
    parts = list(workloads)
    ordered = heapq.merge(*(w.specs for w in parts), key=lambda s: s.arrival_s)
    specs = tuple(replace(s, index=i) for i, s in enumerate(ordered))
    return Workload(specs, max((w.duration_s for w in parts), default=0.0),
                    {"source": name, "parts": [dict(w.source) for w in parts]},
                    sum(w.clipped for w in parts), tuple(p for w in parts for p in w.phases))


def fit_lengths(prompt_tokens: int, max_tokens: int, kind: Kind, max_model_len: int | None) -> tuple[int, int]:
    """Prompt and output lengths cut so that the engine's whole sequence fits ``max_model_len``.

    The output keeps its length when it can (it is cut only to leave one prompt token); the
    prompt loses its end, which keeps any shared prefix intact. The engine's template tokens
    (:func:`~switchyard.bench.prompts.prompt_overhead_tokens`) count against the limit.

    Raises:
        WorkloadError: ``max_model_len`` leaves no room for one prompt and one output token.
    """
    if max_model_len is None:
        return prompt_tokens, max_tokens
    room = max_model_len - prompt_overhead_tokens(kind)
    if room < 2:
        raise WorkloadError(f"max_model_len={max_model_len} leaves no room for a {kind} request")
    max_tokens = min(max_tokens, room - 1)
    return min(prompt_tokens, room - max_tokens), max_tokens


def weighted(choices: Labels | Sequence[tuple[Labels, float]]) -> tuple[list[Labels], list[float]]:
    """Labels and normalised weights from one ``Labels`` or ``(labels, weight)`` pairs."""
    if isinstance(choices, Labels):
        return [choices], [1.0]
    if not choices:
        raise WorkloadError("no labels given")
    total = sum(w for _, w in choices)
    if total <= 0 or any(w < 0 for _, w in choices):
        raise WorkloadError("label weights must be >= 0 and not all 0")
    return [lab for lab, _ in choices], [w / total for _, w in choices]


def cut_prompt(prompt: SynthText, tokens: int) -> SynthText:
    """``prompt`` cut to ``tokens`` tokens (unchanged when it is not longer)."""
    return prompt if prompt.tokens <= tokens else prompt.truncated(tokens)
