"""OpenTelemetry traces from a real gateway to a loopback OTLP/HTTP receiver, and on to the engine."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.integration.conftest import Engines, Gateway, client, eventually, http_json, start_gateway, stop

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Receiver:
    """An OTLP/HTTP trace receiver on loopback: every span it was sent, by name."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server calls it by this name
                body = self.rfile.read(int(self.headers["content-length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with receiver.lock:
                    for resource in request.resource_spans:
                        for scope in resource.scope_spans:
                            receiver.spans.extend(scope.spans)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str) -> list[Any]:
        with self.lock:
            return [s for s in self.spans if s.trace_id.hex() == trace_id]


def attrs(span: Any) -> dict[str, Any]:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


@pytest.fixture(scope="module")
def traced(engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Receiver]]:
    receiver = Receiver()
    data_dir = tmp_path_factory.mktemp("gw-tracing")
    gateway = start_gateway(engines, f"sqlite:///{data_dir / 'switchyard.db'}", data_dir, "sqlite",
                            extra_env={"SWITCHYARD_OTLP_TRACES_ENDPOINT": receiver.url,
                                       "SWITCHYARD_OTEL_SERVICE_NAME": "switchyard-test",
                                       "OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        gateway.keys = {"pro": gateway.new_key("tracing-co", "pro")}
        yield gateway, receiver
    finally:
        assert stop(gateway.proc)
        receiver.server.shutdown()


def test_a_request_is_one_span_with_a_child_per_stage_under_the_clients_trace(
        traced: tuple[Gateway, Receiver]) -> None:
    gw, receiver = traced
    raw = client(gw, "pro").chat.completions.with_raw_response.create(
        model="small", messages=[{"role": "user", "content": "trace me"}], max_tokens=3,
        extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    rid = raw.headers["x-request-id"]

    def complete() -> list[Any] | None:
        spans = receiver.trace(TRACE_ID)
        names = sorted(s.name for s in spans)
        return spans if names == ["admit", "chat", "pick", "queue", "upstream"] else None

    spans = eventually(complete)
    assert spans, f"spans received: {sorted(s.name for s in receiver.trace(TRACE_ID))}"
    by = {s.name: s for s in spans}
    root = by["chat"]
    assert root.parent_span_id.hex() == PARENT_ID  # the client's trace continues
    root_attrs = attrs(root)
    assert root_attrs["switchyard.request_id"] == rid and root_attrs["http.response.status_code"] == 200
    assert root_attrs["switchyard.served_model"] == "small" and root_attrs["switchyard.tier"] == "pro"
    for name in ("admit", "queue", "pick", "upstream"):
        assert by[name].parent_span_id == root.span_id, name
        assert root.start_time_unix_nano <= by[name].start_time_unix_nano <= by[name].end_time_unix_nano
        assert by[name].end_time_unix_nano <= root.end_time_unix_nano
    upstream = attrs(by["upstream"])
    assert upstream["switchyard.outcome"] == "ok" and upstream["switchyard.attempt"] == 1
    assert attrs(by["pick"])["switchyard.endpoint"] == upstream["switchyard.endpoint"]
    # The engine got the upstream span's context as W3C traceparent.
    status, _, state = http_json("GET", upstream["switchyard.endpoint"] + "/sim/state")
    assert status == 200
    sent = f"00-{TRACE_ID}-{by['upstream'].span_id.hex()}-01"
    assert sent in [c["traceparent"] for c in state["trace_contexts"]]
    # Nothing of the prompt or the key is in any attribute.
    text = repr([attrs(s) for s in spans])
    assert "trace me" not in text and gw.keys["pro"] not in text


def test_a_failed_request_has_an_error_span_and_a_new_trace_without_a_parent(
        traced: tuple[Gateway, Receiver]) -> None:
    gw, receiver = traced
    with pytest.raises(openai.APIStatusError) as failed:
        client(gw, "pro").chat.completions.create(model="dead", messages=[{"role": "user", "content": "x"}],
                                                  max_tokens=3)
    rid = failed.value.response.headers["x-request-id"]

    def root() -> Any:
        with receiver.lock:
            found = [s for s in receiver.spans if s.name == "chat" and attrs(s).get("switchyard.request_id") == rid]
        return found[0] if found else None

    span = eventually(root)
    assert span is not None, "no span for the failed request"
    assert span.parent_span_id == b""  # no traceparent sent: a trace of its own
    assert span.status.code == 2  # STATUS_CODE_ERROR
    assert attrs(span)["http.response.status_code"] == failed.value.status_code >= 500
    # Its one pool's endpoint refuses connections: either a try failed, or the probes had already taken
    # the endpoint out and the pick found none.
    stages = [s for s in receiver.trace(span.trace_id.hex()) if s.name in ("pick", "upstream")]
    tries = [s for s in stages if s.name == "upstream"]
    assert all(attrs(t)["switchyard.outcome"] != "ok" and t.status.code == 2 for t in tries)
    assert tries or any(attrs(s)["switchyard.endpoint"] == "none" for s in stages), [attrs(s) for s in stages]
