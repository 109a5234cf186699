"""OpenTelemetry traces of requests (the optional ``otel`` extra), exported over OTLP/HTTP.

With ``SWITCHYARD_OTLP_TRACES_ENDPOINT`` set (e.g. ``http://otel-collector:4318/v1/traces``), each
chat or completion request is one span (``chat`` or ``completion``), the child of the client's
W3C ``traceparent`` when it sent one, with a child span per stage: ``admit`` (limits), ``queue``
(flow control), ``pick`` (each endpoint choice) and ``upstream`` (each try at an engine, so a
fallback shows as several, each with its endpoint and outcome). The ``upstream`` span's context goes
to the engine as ``traceparent``, so vLLM's own spans (``--otlp-traces-endpoint``) join the trace.
Spans are batched and exported in the background; without the setting every call here is a no-op
that costs a method call.

Attributes carry ids, names, statuses and timings only: never a key, a prompt or an answer.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, MutableMapping
from typing import Any

#: Spans and their attributes use these names (``switchyard.*`` for ours).
SPAN_NAMES = ("chat", "completion", "embedding", "responses", "tokenize", "detokenize", "admit", "queue", "pick",
              "upstream")


class RequestTrace:
    """The spans of one request (this base class: tracing is off, nothing is recorded)."""

    __slots__ = ()

    enabled = False

    def child(self, name: str, attributes: Mapping[str, Any] | None = None) -> Any:
        """Start a child span of the request's span (None when off); end it with :func:`end`."""
        return None

    def inject(self, span: Any, headers: MutableMapping[str, str]) -> None:
        """Put ``span``'s context into ``headers`` as W3C ``traceparent`` (nothing when off)."""

    def finish(self, attributes: Mapping[str, Any], error: bool) -> None:
        """End the request's span with ``attributes`` (an error status when ``error``)."""

    def record(self, name: str, started: float, attributes: Mapping[str, Any], error: str | None = None) -> None:
        """A child span that began at ``started`` (monotonic seconds) and ends now (nothing when off)."""


OFF = RequestTrace()


def end(span: Any, attributes: Mapping[str, Any] | None = None, error: str | None = None) -> None:
    """End a span from :meth:`RequestTrace.child` (None: nothing), with more attributes and an error."""
    if span is None:
        return
    if attributes:
        span.set_attributes(dict(attributes))
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


class _Spans(RequestTrace):
    __slots__ = ("_context", "_root", "_tracer")

    enabled = True

    def __init__(self, tracer: Any, name: str, headers: Mapping[str, str], attributes: Mapping[str, Any]) -> None:
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(
            {k: v for k in ("traceparent", "tracestate") if (v := headers.get(k)) is not None})
        self._tracer = tracer
        self._root = tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=dict(attributes))
        self._context = set_span_in_context(self._root)

    def child(self, name: str, attributes: Mapping[str, Any] | None = None) -> Any:
        from opentelemetry.trace import SpanKind

        kind = SpanKind.CLIENT if name == "upstream" else SpanKind.INTERNAL
        return self._tracer.start_span(name, context=self._context, kind=kind, attributes=dict(attributes or {}))

    def inject(self, span: Any, headers: MutableMapping[str, str]) -> None:
        from opentelemetry.trace import set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if span is not None:
            TraceContextTextMapPropagator().inject(headers, context=set_span_in_context(span))

    def finish(self, attributes: Mapping[str, Any], error: bool) -> None:
        end(self._root, {k: v for k, v in attributes.items() if v is not None},
            "failed" if error else None)

    def record(self, name: str, started: float, attributes: Mapping[str, Any], error: str | None = None) -> None:
        from opentelemetry.trace import SpanKind

        began = time.time_ns() - int((time.monotonic() - started) * 1e9)
        span = self._tracer.start_span(name, context=self._context, kind=SpanKind.INTERNAL, start_time=began)
        end(span, attributes, error)


class Tracing:
    """Where request spans go: an OTLP/HTTP exporter, or nowhere (``endpoint`` None)."""

    def __init__(self, endpoint: str | None, service: str, region: str | None = None) -> None:
        self.endpoint = endpoint
        self._provider: Any = None
        self._tracer: Any = None
        if endpoint is None:
            return
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise RuntimeError("SWITCHYARD_OTLP_TRACES_ENDPOINT is set but OpenTelemetry is not installed: "
                               "pip install 'switchyard[otel]'") from exc
        attributes = {"service.name": service}
        if region:
            attributes["cloud.region"] = region
        self._provider = TracerProvider(resource=Resource.create(attributes))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("switchyard.gateway")

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def request(self, name: str, headers: Mapping[str, str], attributes: Mapping[str, Any]) -> RequestTrace:
        """The spans of a request that just arrived (:data:`OFF` when tracing is off)."""
        if self._tracer is None:
            return OFF
        return _Spans(self._tracer, name, headers, attributes)

    def shutdown(self) -> None:
        """Export what is left and stop (a blocking call: the exporter's last batch goes out)."""
        if self._provider is not None:
            self._provider.shutdown()
