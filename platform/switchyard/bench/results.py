"""What the load generator measured for one request, and how to read it.

Times are seconds on the run's monotonic clock, measured from the run's start (the moment the
first request was due). Latencies count from the *scheduled* time, not the send time: if the
load generator falls behind, its lateness shows up in the latencies instead of hiding (the
coordinated-omission trap), and ``lateness_s`` says how much of it was the generator's own.
"""

from __future__ import annotations

import functools
from array import array
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Outcome(StrEnum):
    """How a request ended."""

    OK = "ok"  #: 2xx and a complete answer
    LIMITED = "limited"  #: 429: a budget or rate limit (Retry-After)
    SHED = "shed"  #: 503: shed under overload or no endpoint (Retry-After)
    ERROR = "error"  #: any other status, a connection failure or a broken stream
    TIMEOUT = "timeout"  #: the client gave up waiting


@functools.lru_cache(maxsize=4096)
def parse_route(header: str) -> dict[str, str]:
    """The fields of an ``x-switchyard-route`` header (``model=m; pool=p; ...``) as a dict."""
    out: dict[str, str] = {}
    for part in header.split(";"):
        name, eq, value = part.strip().partition("=")
        if eq:
            out[name] = value
    return out


@dataclass(slots=True)
class Result:
    """One request as the client saw it.

    Attributes:
        index: The spec's index in the workload.
        arm: The target's name (which system served it).
        tenant: Tenant label of the spec.
        request_class: Class label of the spec.
        model: Model requested.
        kind: ``chat`` or ``completion``.
        stream: Whether a stream was asked for.
        prompt_tokens_sent: Prompt tokens of the text sent (before the engine's template).
        max_tokens: The output budget sent.
        prefix_group: The spec's prefix group, if any.
        scheduled_s: When it was due.
        sent_s: When the client began sending it (after ``scheduled_s`` by ``lateness_s``).
        first_token_s: When the first chunk with content arrived (the whole body, if not streamed).
        done_s: When the response ended (or the client gave up).
        status: HTTP status; 0 when no response came (connection failure, timeout).
        error_type: OpenAI error ``type`` (from the body or an in-stream error), or a client-side
            label (``connection_error``, ``timeout``, ``stream_truncated``, ``bad_response``).
        error_code: OpenAI error ``code``, as text.
        error_message: The error message, shortened.
        timed_out: The client gave up (its timeout passed).
        chunks: Content-bearing chunks received (1 for a whole non-streamed answer).
        itl_s: Gaps between consecutive content-bearing chunks.
        prompt_tokens: ``usage.prompt_tokens``, if reported.
        completion_tokens: ``usage.completion_tokens``, if reported.
        cached_tokens: ``usage.prompt_tokens_details.cached_tokens``, if reported.
        finish_reason: The first choice's ``finish_reason``.
        route: The ``x-switchyard-route`` header.
        retry_after: The ``retry-after`` header.
        attempts: The ``x-switchyard-attempts`` header, as a number.
    """

    index: int
    arm: str
    tenant: str
    request_class: str
    model: str
    kind: str
    stream: bool
    prompt_tokens_sent: int
    max_tokens: int
    prefix_group: str | None
    scheduled_s: float
    sent_s: float = 0.0
    first_token_s: float | None = None
    done_s: float = 0.0
    status: int = 0
    error_type: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    timed_out: bool = False
    chunks: int = 0
    itl_s: array[float] = field(default_factory=lambda: array("d"))
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    route: str | None = None
    retry_after: str | None = None
    attempts: int | None = None

    @property
    def outcome(self) -> Outcome:
        """How the request ended."""
        if self.timed_out:
            return Outcome.TIMEOUT
        if 200 <= self.status < 300 and self.error_type is None:
            return Outcome.OK
        if self.status == 429:
            return Outcome.LIMITED
        if self.status == 503:
            return Outcome.SHED
        return Outcome.ERROR

    @property
    def ok(self) -> bool:
        """2xx with a complete answer."""
        return self.outcome is Outcome.OK

    @property
    def lateness_s(self) -> float:
        """How late the client sent it: the load generator's own delay."""
        return self.sent_s - self.scheduled_s

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, from the scheduled time; None when no content came."""
        return None if self.first_token_s is None else self.first_token_s - self.scheduled_s

    @property
    def service_ttft_s(self) -> float | None:
        """Time to first token from the moment it was sent (excludes the generator's lateness)."""
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float:
        """End-to-end time, from the scheduled time to the end of the response."""
        return self.done_s - self.scheduled_s

    @property
    def output_tokens(self) -> int:
        """Output tokens: ``usage.completion_tokens`` when reported, else the chunks counted."""
        return self.completion_tokens if self.completion_tokens is not None else self.chunks

    @property
    def route_fields(self) -> dict[str, str]:
        """The route header's fields (empty without one)."""
        return parse_route(self.route) if self.route else {}

    @property
    def pool(self) -> str:
        """The pool that served it (from the route header), ``-`` when unknown."""
        return self.route_fields.get("pool", "-")

    @property
    def served_model(self) -> str:
        """The model that served it (from the route header), else the model requested."""
        return self.route_fields.get("model", self.model)

    @property
    def fell_back(self) -> bool:
        """Served by a fallback (another model) or after more than one attempt."""
        fields = self.route_fields
        return "fallback_from" in fields or "attempt" in fields or (self.attempts or 1) > 1

    def row(self) -> dict[str, Any]:
        """A flat, JSON-ready record (ITL gaps summarised as their count, mean and max)."""
        itl = self.itl_s
        return {
            "index": self.index, "arm": self.arm, "tenant": self.tenant, "class": self.request_class,
            "model": self.model, "kind": self.kind, "stream": self.stream, "prefix_group": self.prefix_group,
            "prompt_tokens_sent": self.prompt_tokens_sent, "max_tokens": self.max_tokens,
            "scheduled_s": self.scheduled_s, "lateness_s": self.lateness_s, "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s, "status": self.status, "outcome": self.outcome.value,
            "error_type": self.error_type, "error_code": self.error_code, "timed_out": self.timed_out,
            "chunks": self.chunks, "itl_mean_s": sum(itl) / len(itl) if itl else None,
            "itl_max_s": max(itl) if itl else None, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason, "pool": self.pool, "served_model": self.served_model,
            "fell_back": self.fell_back, "retry_after": self.retry_after, "attempts": self.attempts,
        }
