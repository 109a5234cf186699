"""Upstream trust through a real gateway: it connects only to the endpoints its policy names, whatever a
client sends (a trap listener on loopback, in no policy, must never see a connection), never follows an
engine's redirect, and turns an engine's garbage (not JSON, cut short, the wrong content type, too large)
into a clean 502 or a clean end of stream that counts against that engine.

Engines: one ``switchyard sim`` process (fault control server) serving ``main-us`` (``a``), ``backup-us``
(``b``) and ``solo-us`` (``s``); and a hostile engine in this process (``h``, pool ``redirect-us``) that
answers every inference request, and ``/metrics``, with a redirect to the trap. Model ``main`` falls
back to ``backup``, as does ``redirected`` (served by the hostile engine); ``solo`` and ``redirect-only``
have no fallback. Breakers never open here, so each test sees the failures it causes counted and nothing
else; one gateway serves the module.
"""

from __future__ import annotations

import json
import socket
import socketserver
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import free_port
from tests.integration.conftest import (
    SWITCHYARD,
    Engines,
    Gateway,
    client,
    endpoints,
    gateway_counter,
    http_json,
    route,
    start_gateway,
    stop,
    wait_http,
)

SIM_POOLS = {"a": "main-us", "b": "backup-us", "s": "solo-us"}
#: The gateway's limits here: a complete answer of at most 1 MiB, a stream event of at most 256 KiB.
MAX_RESPONSE = 1024 * 1024
MAX_EVENT = 256 * 1024
CLEAR = {"mode": "none"}


class Trap:
    """A TCP listener on loopback that no policy names: it counts every connection it is given."""

    def __init__(self) -> None:
        self.connections = 0
        trap = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                trap.connections += 1

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Redirector:
    """An engine that answers ``/health`` and nothing else: inference requests and ``/metrics`` are
    redirected (307) to the trap."""

    def __init__(self, trap: Trap) -> None:
        self.posts = 0
        self.metrics = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self, status: int, location: str | None = None) -> None:
                self.send_response(status)
                if location is not None:
                    self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    owner.metrics += 1
                    self._answer(307, trap.url + "/metrics")
                else:
                    self._answer(200 if self.path == "/health" else 404)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                owner.posts += 1
                self._answer(307, trap.url + self.path)

            def log_message(self, *args: Any) -> None:
                pass

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _policy(ports: dict[str, int], hostile: str) -> str:
    def url(name: str) -> str:
        return f"http://127.0.0.1:{ports[name]}"

    price = "{input_per_mtok: 1, output_per_mtok: 1}"
    return f"""\
schema: 1
regions: [us-east]
pools:
  - {{name: main-us, region: us-east, served_model: sim-m, endpoints: [{url("a")}], kv_cache_tokens: 100000}}
  - {{name: backup-us, region: us-east, served_model: sim-m, endpoints: [{url("b")}], kv_cache_tokens: 100000}}
  - {{name: solo-us, region: us-east, served_model: sim-m, endpoints: [{url("s")}], kv_cache_tokens: 100000}}
  - {{name: redirect-us, region: us-east, served_model: sim-m, endpoints: [{hostile}], kv_cache_tokens: 100000}}
models:
  - {{name: main, pools: [main-us], context_window: 4096, price: {price}, fallback: [backup]}}
  - {{name: backup, pools: [backup-us], context_window: 4096, price: {price}}}
  - {{name: solo, pools: [solo-us], context_window: 4096, price: {price}}}
  - {{name: redirected, pools: [redirect-us], context_window: 4096, price: {price}, fallback: [backup]}}
  - {{name: redirect-only, pools: [redirect-us], context_window: 4096, price: {price}}}
priorities:
  critical: {{max_queue_ms: 10000}}
tiers:
  - {{name: gold, priority: critical, models: ["*"]}}
resilience:
  health: {{probe_interval: 60}}
  breakers:
    endpoint: {{consecutive_failures: 100000, error_rate: 1, min_requests: 1000000, window: 600}}
    pool: {{consecutive_failures: 100000, error_rate: 1, min_requests: 1000000}}
  retries: {{max_attempts: 3, min_retries_per_s: 100}}
  first_token_timeout: 10
"""


@dataclass
class World:
    gw: Gateway
    trap: Trap
    hostile: Redirector
    ports: dict[str, int]
    control: str

    def url(self, name: str) -> str:
        return self.hostile.url if name == "h" else f"http://127.0.0.1:{self.ports[name]}"

    def fault(self, name: str, **settings: Any) -> None:
        status, _, answer = http_json("POST", self.control + "/faults", {"port": self.ports[name], **settings})
        assert status == 200, answer

    def breaker(self, name: str) -> dict[str, Any]:
        row: dict[str, Any] = endpoints(self.gw)[self.url(name)]["breaker"]  # type: ignore[assignment]
        return row

    def failures(self, name: str) -> int:
        """The failures the endpoint's breaker has counted (in its window of 10 minutes)."""
        return int(self.breaker(name)["window"]["failed"])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    folder = tmp_path_factory.mktemp("trust")
    trap = Trap()
    hostile = Redirector(trap)
    ports = {name: free_port() for name in SIM_POOLS}
    control_port = free_port()
    policy = folder / "policies.yaml"
    policy.write_text(_policy(ports, hostile.url))
    sim = subprocess.Popen([SWITCHYARD, "sim", "--policy", str(policy), "--time-scale", "20",
                            "--control-port", str(control_port),
                            *[arg for pool in SIM_POOLS.values() for arg in ("--pool", pool)]])
    gw: Gateway | None = None
    try:
        for port in ports.values():
            wait_http(f"http://127.0.0.1:{port}/health", sim)
        control = f"http://127.0.0.1:{control_port}"
        wait_http(control + "/health", sim)
        gw = start_gateway(Engines(policy, {}, 0), f"sqlite:///{folder / 'gw.db'}", folder, "sqlite",
                           {"SWITCHYARD_UPSTREAM_MAX_RESPONSE_BYTES": str(MAX_RESPONSE),
                            "SWITCHYARD_UPSTREAM_MAX_EVENT_BYTES": str(MAX_EVENT),
                            "SWITCHYARD_UPSTREAM_READ_TIMEOUT_S": "20", "SWITCHYARD_SCRAPE_INTERVAL_S": "0.2"})
        gw.keys["gold"] = gw.new_key("gold-co", "gold")
        yield World(gw, trap, hostile, ports, control)
    finally:
        if gw is not None:
            assert stop(gw.proc)
        assert stop(sim)
        hostile.close()
        trap.close()


@pytest.fixture
def trust(world: World) -> Iterator[World]:
    yield world
    for name in SIM_POOLS:
        world.fault(name, **CLEAR)


def _is_error(body: Any) -> bool:
    """Whether ``body`` is OpenAI's error object, every field present."""
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and set(error) == {"message", "type", "param", "code"} and bool(error["message"])


def _clean(answer: httpx.Response) -> None:
    """A normal answer, or a clean OpenAI error (never a 5xx of the gateway's own)."""
    assert answer.status_code < 500, (answer.status_code, answer.text[:300])
    body = answer.json()
    if answer.status_code == 200:
        assert body["object"] in ("text_completion", "chat.completion") and body["choices"], body
    else:
        assert _is_error(body), body


# --- nothing a client sends picks where the gateway connects ------------------------------------------------


def test_no_client_request_makes_the_gateway_connect_elsewhere(trust: World) -> None:
    gw, trap = trust.gw, trust.trap
    auth = {"Authorization": f"Bearer {gw.keys['gold']}"}
    chat = {"model": "main", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    hostile_headers = [
        {"Host": f"127.0.0.1:{trap.port}"},
        {"X-Forwarded-Host": f"127.0.0.1:{trap.port}", "X-Forwarded-Proto": "http", "X-Forwarded-Port": str(trap.port),
         "X-Forwarded-For": "127.0.0.1", "Forwarded": f"for=127.0.0.1;host=127.0.0.1:{trap.port};proto=http",
         "X-Real-IP": "127.0.0.1", "X-Host": f"127.0.0.1:{trap.port}"},
        {"X-Original-URL": trap.url + "/v1/chat/completions", "X-Rewrite-URL": trap.url + "/v1/chat/completions",
         "X-Switchyard-Endpoint": trap.url, "X-Switchyard-Pool": trap.url,
         "X-Switchyard-Route": f"endpoint={trap.url}"},
        {"x-switchyard-region": trap.url},
        {"x-switchyard-region": f"us-east@{trap.url}"},
        {"x-switchyard-priority": trap.url},
    ]
    models = [trap.url + "/v1", f"127.0.0.1:{trap.port}", "../../../v1/chat/completions", "main/../../..",
              f"main@{trap.url}", f"main?host=127.0.0.1:{trap.port}", "main\r\nHost: 127.0.0.1", "%2e%2e%2fmain",
              f"auto@{trap.url}"]
    fields = {"base_url": trap.url + "/v1", "api_base": trap.url, "url": trap.url, "endpoint": trap.url,
              "host": f"127.0.0.1:{trap.port}", "extra_body": {"base_url": trap.url},
              "metadata": {"endpoint": trap.url}, "user": trap.url}
    answers: list[httpx.Response] = []
    with httpx.Client(base_url=gw.base_url, timeout=30, headers=auth) as http:
        for headers in hostile_headers:
            answers.append(http.post("/v1/chat/completions", json=chat, headers=headers))
            with http.stream("POST", "/v1/completions", json={"model": "main", "prompt": "hi", "max_tokens": 2,
                                                              "stream": True}, headers=headers) as streamed:
                text = streamed.read().decode()
                assert streamed.status_code in (200, 400), text
                assert text.rstrip().endswith("data: [DONE]") if streamed.status_code == 200 else _is_error(
                    json.loads(text))
        for model in models:
            answer = http.post("/v1/chat/completions", json={**chat, "model": model})
            assert answer.status_code in (400, 403, 404), (model, answer.status_code)
            answers.append(answer)
        answers.append(http.post("/v1/chat/completions", json={**chat, **fields}))
        answers.append(http.post("/v1/completions", json={"model": "main", "prompt": "hi", "max_tokens": 2, **fields}))
        answers.append(http.post(f"/v1/completions?base_url={trap.url}&host=127.0.0.1:{trap.port}",
                                 json={"model": "main", "prompt": "hi", "max_tokens": 2}))
    for answer in answers:
        _clean(answer)
    # Request targets sent as they are (an HTTP client would normalise them): absolute form naming the trap,
    # a network-path reference, dot segments.
    for target in (f"{trap.url}/v1/completions", f"//127.0.0.1:{trap.port}/v1/completions",
                   "/v1/completions/../../admin/api/endpoints", "/v1/..%2f..%2fadmin/api/endpoints"):
        status, body = _raw_post(gw, target, f"127.0.0.1:{trap.port}")
        assert status in (200, 404), (target, status, body[:300])
        assert json.loads(body)["object"] == "text_completion" if status == 200 else _is_error(json.loads(body))
    assert trap.connections == 0


def _raw_post(gw: Gateway, target: str, host: str) -> tuple[int, bytes]:
    """POST a completion request with this request target and Host header, byte for byte; status and body."""
    body = json.dumps({"model": "main", "prompt": "hi", "max_tokens": 2}).encode()
    port = int(gw.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        raw.sendall(f"POST {target} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {gw.keys['gold']}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                    .encode() + body)
        reply = b""
        while chunk := raw.recv(65536):
            reply += chunk
    head, _, content = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), content


def test_batch_lines_cannot_name_another_host(trust: World) -> None:
    sdk = client(trust.gw, "gold")
    trap = trust.trap
    lines = [{"custom_id": "ok", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "main", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                       "base_url": trap.url}},
             {"custom_id": "elsewhere", "method": "POST", "url": trap.url + "/v1/chat/completions",
              "body": {"model": "main", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}}]
    content = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    upload = sdk.files.create(file=("lines.jsonl", content, "application/jsonl"), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.batches.create(input_file_id=upload.id, endpoint=trap.url + "/v1/chat/completions",  # type: ignore[arg-type]
                           completion_window="24h")
    assert refused.value.body["param"] == "endpoint"  # type: ignore[index]
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and batch.errors is not None and batch.errors.data is not None
    assert [(e.line, e.code) for e in batch.errors.data] == [(2, "url_mismatch")]
    assert trap.connections == 0


def test_an_engine_redirect_is_never_followed_and_counts_against_it(trust: World) -> None:
    gw, hostile, trap = trust.gw, trust.hostile, trust.trap
    sdk = client(gw, "gold")
    before, posts = trust.failures("h"), hostile.posts
    raw = sdk.completions.with_raw_response.create(model="redirected", prompt="hi", max_tokens=2)
    parts = route(raw)
    assert parts["model"] == "backup" and parts["moved_on"] == f"{hostile.url} 307", parts
    assert raw.parse().choices[0].text
    with pytest.raises(openai.APIStatusError) as caught:
        sdk.chat.completions.create(model="redirect-only", messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=2, stream=True)
    assert caught.value.status_code == 502 and caught.value.code == "upstream_invalid_response"
    assert "redirect" in caught.value.message
    assert hostile.posts == posts + 2 and trust.failures("h") == before + 2
    # The metric scrapes were redirected too, many times by now, and never followed.
    deadline = time.monotonic() + 5
    while hostile.metrics < 3:
        assert time.monotonic() < deadline, "the gateway never scraped the hostile engine"
        time.sleep(0.05)
    assert trap.connections == 0


# --- garbage from an engine ---------------------------------------------------------------------------------


def _invalid_attempts(gw: Gateway, pool: str) -> float:
    return gateway_counter(gw, "switchyard_upstream_attempts_total", pool=pool, outcome="invalid_response")


@pytest.mark.parametrize("mode", ["invalid_json", "truncate", "wrong_type", "huge"])
def test_a_complete_answer_that_is_garbage_is_a_clean_502_counted_against_the_engine(trust: World,
                                                                                    mode: str) -> None:
    gw = trust.gw
    trust.fault("s", mode=mode)
    before, attempts = trust.failures("s"), _invalid_attempts(gw, "solo-us")
    started = time.monotonic()
    with httpx.Client(base_url=gw.base_url, timeout=30) as http:
        answer = http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {gw.keys['gold']}"},
                           json={"model": "solo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert answer.status_code == 502 and answer.headers["content-type"].startswith("application/json")
    error = answer.json()
    assert _is_error(error) and error["error"]["code"] == "upstream_invalid_response", error
    assert trust.url("s") in error["error"]["message"]
    assert time.monotonic() - started < 10  # a huge answer is cut off at the limit, not read to its end
    assert trust.failures("s") == before + 1
    assert _invalid_attempts(gw, "solo-us") == attempts + 1


@pytest.mark.parametrize("mode", ["invalid_json", "wrong_type"])
def test_a_stream_that_is_garbage_from_its_start_is_a_clean_502(trust: World, mode: str) -> None:
    gw = trust.gw
    trust.fault("s", mode=mode)
    before, attempts = trust.failures("s"), _invalid_attempts(gw, "solo-us")
    with pytest.raises(openai.APIStatusError) as caught:
        client(gw, "gold").chat.completions.create(model="solo", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2, stream=True)
    assert caught.value.status_code == 502 and caught.value.code == "upstream_invalid_response"
    assert trust.failures("s") == before + 1
    assert _invalid_attempts(gw, "solo-us") == attempts + 1


@pytest.mark.parametrize(("mode", "code"), [("truncate", "upstream_stream_broken"),
                                            ("huge", "upstream_invalid_response")])
def test_a_stream_that_turns_to_garbage_ends_with_an_error_event_counted_against_the_engine(
        trust: World, mode: str, code: str) -> None:
    gw = trust.gw
    trust.fault("s", mode=mode)
    before, broken = trust.failures("s"), gateway_counter(gw, "switchyard_streams_broken_total", pool="solo-us")
    with httpx.Client(base_url=gw.base_url, timeout=30) as http, http.stream(
            "POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {gw.keys['gold']}"},
            json={"model": "solo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                  "stream": True}) as streamed:
        assert streamed.status_code == 200
        text = streamed.read().decode()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert text.endswith("\n\n") and "[DONE]" not in events
    *good, last = [json.loads(e) for e in events]  # every event whole and well-formed, none cut
    assert good and all(e["object"] == "chat.completion.chunk" for e in good)
    assert last["error"]["code"] == code and _is_error(last), last
    assert max(len(e) for e in events) < MAX_EVENT
    assert trust.failures("s") == before + 1 and trust.breaker("s")["last_reason"].startswith("broke off mid-stream: ")
    assert gateway_counter(gw, "switchyard_streams_broken_total", pool="solo-us") == broken + 1


def test_garbage_moves_on_along_the_fallback_chain(trust: World) -> None:
    trust.fault("a", mode="invalid_json")
    before = trust.failures("a")
    raw = client(trust.gw, "gold").completions.with_raw_response.create(model="main", prompt="hi", max_tokens=2)
    parts = route(raw)
    assert parts["model"] == "backup" and parts["moved_on"] == f"{trust.url('a')} invalid_response", parts
    assert raw.parse().choices[0].text
    assert trust.failures("a") == before + 1


def test_an_engine_that_answers_well_again_is_served_and_its_failures_reset(trust: World) -> None:
    trust.fault("s", mode="wrong_type")
    with pytest.raises(openai.APIStatusError):
        client(trust.gw, "gold").completions.create(model="solo", prompt="hi", max_tokens=2)
    assert trust.breaker("s")["consecutive_failures"] >= 1
    trust.fault("s", mode="none")
    assert client(trust.gw, "gold").completions.create(model="solo", prompt="hi", max_tokens=2).choices[0].text
    assert trust.breaker("s")["consecutive_failures"] == 0
