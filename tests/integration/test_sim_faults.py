"""Fault injection through a `switchyard sim` process's control server (`--control-port`), on loopback.

One process serves a two-region policy: two us-east engines of ``small-us``, one of ``large-us``
and two eu-west engines of ``small-eu``, twenty times faster than the wall clock. The stalls (``hang``,
``drip``) are watched on another process's single engine at the wall clock's pace, where an answer
lasts long enough to be caught mid-way. Every test leaves every engine healthy again.
"""

from __future__ import annotations

import http.client
import itertools
import json
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import free_port
from tests.integration.conftest import SWITCHYARD, http_json, stop, wait_http
from tests.unit.policy.base import base, to_yaml

CLEAR = {"mode": "none", "slow_factor": 5.0, "drip_interval_s": 2.0, "error_rate": 0.0, "throttle_rate": 0.0,
         "overload_rate": 0.0, "abort_rate": 0.0, "abort_after_tokens": 4, "abort_with": "close"}
#: The event vLLM 0.32 sends when generation fails mid-stream, byte for byte (then ``data: [DONE]``).
STREAM_ERROR = ('{"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, '
                '"code": 500}}')


@dataclass
class Sim:
    """The running sim process: its control URL and the ports of each pool."""

    control: str
    ports: dict[str, list[int]]
    proc: subprocess.Popen[bytes]

    def region(self, name: str) -> list[int]:
        pools = {"us-east": ("small-us", "large-us"), "eu-west": ("small-eu",)}[name]
        return [p for pool in pools for p in self.ports[pool]]

    def set(self, body: dict[str, Any]) -> tuple[int, Any]:
        status, _, answer = http_json("POST", self.control + "/faults", body)
        return status, answer

    def faults(self) -> dict[int, dict[str, Any]]:
        status, _, answer = http_json("GET", self.control + "/faults")
        assert status == 200
        return {e["port"]: e for e in answer["engines"]}


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    ports = {"small-us": [free_port(), free_port()], "small-eu": [free_port(), free_port()],
             "large-us": [free_port()]}
    doc = base()
    for pool in doc["pools"]:
        pool["endpoints"] = [f"http://127.0.0.1:{p}" for p in ports[pool["name"]]]
    policy = tmp_path_factory.mktemp("faults") / "policies.yaml"
    policy.write_text(to_yaml(doc))
    control_port = free_port()
    proc = subprocess.Popen([SWITCHYARD, "sim", "--policy", str(policy), "--time-scale", "20",
                             "--control-port", str(control_port)])
    control = f"http://127.0.0.1:{control_port}"
    try:
        for port in [p for pool in ports.values() for p in pool]:
            wait_http(f"http://127.0.0.1:{port}/health", proc)
        wait_http(f"{control}/health", proc)
        yield Sim(control, ports, proc)
    finally:
        assert stop(proc)


@pytest.fixture(scope="module")
def paced() -> Iterator[int]:
    """The port of a single engine at time scale 1 (a token every ~6 ms), in a process of its own."""
    port = free_port()
    proc = subprocess.Popen([SWITCHYARD, "sim", "--model", "llama-8b", "--port", str(port), "--time-scale", "1"])
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc)
        yield port
    finally:
        assert stop(proc)


@pytest.fixture(autouse=True)
def healthy_again(sim: Sim) -> Iterator[None]:
    yield
    assert sim.set(CLEAR)[0] == 200


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def _refused(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        try:
            s.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return True
    return False


def _complete(port: int, **extra: Any) -> httpx.Response:
    body = {"model": "llama-8b", "prompt": "hello there", "max_tokens": 5, **extra}
    return httpx.post(f"{_url(port)}/v1/completions", json=body, timeout=20)


def _state(port: int) -> dict[str, Any]:
    state: dict[str, Any] = httpx.get(f"{_url(port)}/sim/state", timeout=5).json()
    return state


def test_control_lists_every_engine_with_its_labels(sim: Sim) -> None:
    engines = sim.faults()
    assert sorted(engines) == sorted(p for pool in sim.ports.values() for p in pool)
    port = sim.ports["small-eu"][1]
    assert engines[port] == {"url": _url(port), "port": port, "model": "llama-8b", "pool": "small-eu",
                             "region": "eu-west", "listening": True, "faults": CLEAR}
    assert engines[sim.ports["large-us"][0]]["model"] == "llama-70b"


def test_down_by_region_refuses_connections_there_only_and_comes_back(sim: Sim) -> None:
    eu, us = sim.region("eu-west"), sim.region("us-east")
    assert _complete(eu[0]).status_code == 200
    steps = _state(eu[0])["steps"]
    keep_alive = http.client.HTTPConnection("127.0.0.1", eu[1], timeout=5)
    keep_alive.request("GET", "/health")
    assert keep_alive.getresponse().read() == b""  # the connection stays open for the next request

    status, answer = sim.set({"region": "eu-west", "mode": "down"})
    assert status == 200
    assert sorted(e["port"] for e in answer["engines"]) == sorted(eu)
    assert all(not e["listening"] and e["faults"]["mode"] == "down" for e in answer["engines"])
    assert all(_refused(p) for p in eu)
    assert not any(_refused(p) for p in us)
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        keep_alive.request("GET", "/health")
        keep_alive.getresponse().read()
    keep_alive.close()
    assert _complete(us[0]).status_code == 200

    status, answer = sim.set({"region": "eu-west", "mode": "none"})
    assert status == 200 and all(e["listening"] for e in answer["engines"])
    for port in eu:
        assert httpx.get(f"{_url(port)}/health", timeout=5).status_code == 200
    assert _complete(eu[0]).json()["usage"]["completion_tokens"] == 5
    assert _state(eu[0])["steps"] > steps  # the same engine, its state kept


def test_down_breaks_a_stream_in_flight_and_frees_its_capacity(sim: Sim) -> None:
    port = sim.ports["small-eu"][0]
    assert sim.set({"port": port, "mode": "slow", "slow_factor": 200})[0] == 200
    body = {"model": "llama-8b", "prompt": "go", "max_tokens": 500, "stream": True}
    with pytest.raises(httpx.RemoteProtocolError), \
            httpx.stream("POST", f"{_url(port)}/v1/completions", json=body, timeout=20) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        assert sim.set({"port": port, "mode": "down"})[0] == 200
        for _ in lines:
            pass
    assert sim.set({"port": port, "mode": "none"})[0] == 200
    state = _state(port)
    assert state["in_flight"] == 0 and state["running"] == 0 and state["aborted"] >= 1


def test_unavailable_answers_503_everywhere_but_sim(sim: Sim) -> None:
    eu = sim.ports["small-eu"][0]
    status, answer = sim.set({"region": "eu-west", "pool": "small-eu", "port": eu, "mode": "unavailable"})
    assert status == 200 and [e["port"] for e in answer["engines"]] == [eu]
    health = httpx.get(f"{_url(eu)}/health", timeout=5)
    assert health.status_code == 503 and health.json()["error"]["code"] == 503
    assert _complete(eu).status_code == 503
    assert httpx.get(f"{_url(eu)}/sim/state", timeout=5).status_code == 200
    assert httpx.get(f"{_url(sim.ports['small-eu'][1])}/health", timeout=5).status_code == 200


@pytest.mark.parametrize(("rate", "status", "err_type", "retry_after"), [
    ("throttle_rate", 429, "RateLimitError", "1"),
    ("overload_rate", 503, "ServiceUnavailableError", "1"),
    ("error_rate", 500, "InternalServerError", None),
])
def test_rejecting_rates(sim: Sim, rate: str, status: int, err_type: str, retry_after: str | None) -> None:
    port = sim.ports["small-us"][1]
    before = httpx.get(f"{_url(port)}/metrics", timeout=5).text
    faulted = _state(port)["faulted"]
    answer = sim.set({"pool": "small-us", rate: 1})[1]
    assert [e["faults"][rate] for e in answer["engines"]] == [1.0, 1.0]
    for extra in ({}, {"stream": True}):
        resp = _complete(port, **extra)
        assert resp.status_code == status
        assert resp.json()["error"]["type"] == err_type
        assert resp.headers.get("retry-after") == retry_after
    chat = httpx.post(f"{_url(port)}/v1/chat/completions", timeout=20,
                      json={"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == status
    assert httpx.get(f"{_url(port)}/health", timeout=5).status_code == 200
    assert _complete(sim.ports["large-us"][0], model="llama-70b").status_code == 200  # another pool
    # Rejected before the scheduler: no capacity taken, no vLLM metric moved.
    state = _state(port)
    assert state["in_flight"] == 0 and state["running"] == 0
    kind = {"throttle_rate": "throttle", "overload_rate": "overload", "error_rate": "error"}[rate]
    assert state["faulted"][kind] == faulted[kind] + 3
    after = httpx.get(f"{_url(port)}/metrics", timeout=5).text
    for series in ("vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:e2e_request_latency_seconds_count"):
        assert _samples(after, series) == _samples(before, series), series


def _samples(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def test_abort_breaks_a_stream_after_some_tokens(sim: Sim) -> None:
    port = sim.ports["small-us"][0]
    answer = sim.set({"port": port, "abort_rate": 1, "abort_after_tokens": 3})[1]
    assert answer["engines"][0]["faults"]["abort_after_tokens"] == 3
    aborted = _state(port)["aborted"]
    body = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True}
    events: list[str] = []
    with pytest.raises(httpx.RemoteProtocolError), \
            httpx.stream("POST", f"{_url(port)}/v1/chat/completions", json=body, timeout=20) as resp:
        assert resp.status_code == 200
        events.extend(line.removeprefix("data: ") for line in resp.iter_lines() if line)
    assert "[DONE]" not in events
    chunks = [json.loads(e) for e in events]
    content = [c["choices"][0]["delta"].get("content") for c in chunks]
    assert content[0] == "" and len([t for t in content[1:] if t]) == 3  # the role chunk, then 3 tokens
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    _wait(lambda: _state(port)["in_flight"] == 0)
    assert _state(port)["aborted"] == aborted + 1
    assert _state(port)["faulted"]["abort"] >= 1


def test_abort_breaks_a_complete_answer(sim: Sim) -> None:
    port = sim.ports["small-us"][0]
    sim.set({"port": port, "abort_rate": 1})
    with pytest.raises(httpx.RemoteProtocolError):
        _complete(port)
    raw = http_answer(port, {"model": "llama-8b", "prompt": "x", "max_tokens": 3})
    length = int(re.search(rb"content-length: (\d+)", raw, re.IGNORECASE).group(1))  # type: ignore[union-attr]
    assert 0 < len(raw.split(b"\r\n\r\n", 1)[1]) < length
    sim.set({"port": port, "abort_rate": 0})
    assert _complete(port).status_code == 200


def http_answer(port: int, body: dict[str, Any]) -> bytes:
    """Everything the engine sends back for one completion on a raw socket, until it closes."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _wait(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_bad_settings_or_no_match_change_nothing(sim: Sim) -> None:
    before = sim.faults()
    for body, message in (({"region": "eu-west", "mode": "down", "error_rate": 3}, "error_rate must be within"),
                          ({"mode": "error"}, "set error_rate instead"),
                          ({"region": "eu-west", "colour": "red"}, "unknown fault settings: colour"),
                          ({"port": "x", "mode": "down"}, "port must be an integer"),
                          ({"region": "mars", "mode": "down"}, "no engine matches region=mars; regions: eu-west, "
                                                               "us-east; pools: large-us, small-eu, small-us")):
        status, answer = sim.set(body)
        assert status == 400 and message in answer["error"]["message"], answer
    port = sim.ports["small-us"][0]
    status, answer = sim.set({"port": port, "pool": "small-eu", "mode": "down"})
    assert status == 400 and str(port) in answer["error"]["message"]
    assert sim.faults() == before
    assert not any(_refused(p) for p in before)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SWITCHYARD, "sim", *args], capture_output=True, text=True, timeout=60)


def test_cli_round_trip(sim: Sim) -> None:
    eu = sim.region("eu-west")
    done = _cli("fault", "--control", sim.control, "--region", "eu-west", "--mode", "down")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == [_url(p) for p in eu]
    assert all("pool=small-eu region=eu-west listening=no mode=down" in line for line in lines)
    assert all(_refused(p) for p in eu)

    done = _cli("fault", "--control", sim.control, "--pool", "small-us", "--throttle-rate", "0.5",
                "--abort-rate", "0.25", "--abort-after-tokens", "2")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 2
    assert "throttle_rate=0.5 overload_rate=0 abort_rate=0.25 abort_after_tokens=2" in done.stdout

    listed = _cli("faults", "--control", sim.control)
    assert listed.returncode == 0, listed.stderr
    by_url = {line.split()[0]: line for line in listed.stdout.splitlines()}
    assert len(by_url) == 5
    assert "listening=no mode=down" in by_url[_url(eu[0])]
    assert "mode=none" in by_url[_url(sim.ports["large-us"][0])]

    done = _cli("fault", "--control", sim.control, "--port", str(sim.ports["large-us"][0]), "--mode", "drip",
                "--drip-interval-s", "0.5", "--abort-rate", "1", "--abort-with", "error")
    assert done.returncode == 0, done.stderr
    assert "mode=drip slow_factor=5 drip_interval_s=0.5 " in done.stdout
    assert "abort_rate=1 abort_after_tokens=4 abort_with=error" in done.stdout
    assert sim.faults()[sim.ports["large-us"][0]]["faults"] == {**CLEAR, "mode": "drip", "drip_interval_s": 0.5,
                                                                "abort_rate": 1.0, "abort_with": "error"}

    done = _cli("fault", "--control", sim.control, "--clear")
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 5
    assert all(e["faults"] == CLEAR and e["listening"] for e in sim.faults().values())
    assert httpx.get(f"{_url(eu[1])}/health", timeout=5).status_code == 200


def test_cli_errors_are_one_clear_line(sim: Sim) -> None:
    for args, message in (
        (("fault", "--control", sim.control, "--region", "mars", "--mode", "down"), "no engine matches region=mars"),
        (("fault", "--control", sim.control, "--error-rate", "2"), "error_rate must be within [0, 1]"),
        (("fault", "--control", sim.control, "--mode", "drip", "--drip-interval-s", "0"),
         "drip_interval_s must be a finite number > 0"),
        (("faults", "--control", f"http://127.0.0.1:{free_port()}"), "cannot reach the fault control server"),
    ):
        done = _cli(*args)
        assert done.returncode == 1
        assert done.stderr.startswith("Error: ") and message in done.stderr and done.stderr.count("\n") == 1
    for usage in (["fault", "--control", sim.control], ["fault", "--control", sim.control, "--clear", "--mode", "down"],
                  ["fault", "--control", sim.control, "--mode", "error"],
                  ["fault", "--control", sim.control, "--abort-with", "reset"]):
        assert _cli(*usage).returncode == 2
    assert all(e["faults"] == CLEAR for e in sim.faults().values())


# --- stalls: hang and drip (a single engine at the wall clock's pace) ---------------------------------


@pytest.fixture
def engine(paced: int) -> Iterator[str]:
    """The paced engine's URL; healthy again afterwards."""
    url = _url(paced)
    yield url
    assert httpx.post(f"{url}/sim/faults", json=CLEAR, timeout=5).status_code == 200


class StreamReader(threading.Thread):
    """Reads a server-sent event stream in the background, stamping each event with its arrival time."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, {**body, "stream": True}
        self.events: list[tuple[float, str]] = []
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=30) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line:
                        self.events.append((time.monotonic(), line.removeprefix("data: ")))
        except Exception as exc:  # handed to the test thread
            self.error = exc

    def content_times(self) -> list[float]:
        """When each chunk that carries content tokens arrived (chat or text completion chunks)."""
        return [t for t, e in self.events if e != "[DONE]" and (c := json.loads(e))["choices"]
                and (c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text"))]


#: The series the gateway reads to tell a working engine from a hung one, and ones that move with every step.
WATCHED = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:iteration_tokens_total_count",
           "vllm:iteration_tokens_total_sum", "vllm:request_success_total", "vllm:num_requests_running",
           "vllm:num_requests_waiting", "vllm:inter_token_latency_seconds_count", "vllm:kv_cache_usage_perc")


def _series(url: str) -> dict[str, float]:
    totals = dict.fromkeys(WATCHED, 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


def _chat(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "llama-8b", "messages": [{"role": "user", "content": "Tell me about the river."}],
            "max_tokens": max_tokens, **extra}


def _raw_post(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """A request sent on a socket of its own (``Connection: close``), its answer left to read."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
              f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return s


def _state_of(url: str) -> dict[str, Any]:
    state: dict[str, Any] = httpx.get(f"{url}/sim/state", timeout=5).json()
    return state


def _read_all(s: socket.socket) -> bytes:
    chunks = []
    while chunk := s.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_hang_freezes_a_stream_mid_answer_and_it_completes_after(engine: str) -> None:
    reader = StreamReader(f"{engine}/v1/chat/completions", _chat(400))
    reader.start()
    _wait(lambda: len(reader.events) >= 10)
    assert httpx.post(f"{engine}/sim/faults", json={"mode": "hang"}, timeout=5).json()["mode"] == "hang"
    time.sleep(0.1)  # what was already on its way lands
    received, before, steps = len(reader.events), _series(engine), _state_of(engine)["steps"]
    assert before["vllm:num_requests_running"] == 1 and before["vllm:kv_cache_usage_perc"] > 0
    late = _raw_post(engine, "/v1/completions", {"model": "llama-8b", "prompt": "late", "max_tokens": 3})
    late.settimeout(0.3)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        health = httpx.get(f"{engine}/health", timeout=2)
        assert health.status_code == 200  # the server is fine; the engine makes no step
        time.sleep(0.1)
    assert len(reader.events) == received, "bytes came during the hang"
    assert _series(engine) == before  # running kept, no token or request counter moved
    assert _state_of(engine)["steps"] == steps
    with pytest.raises(TimeoutError):
        late.recv(1)  # accepted, and not a byte back

    assert httpx.post(f"{engine}/sim/faults", json={"mode": "none"}, timeout=5).status_code == 200
    reader.join(timeout=20)
    assert reader.error is None and not reader.is_alive()
    assert reader.events[-1][1] == "[DONE]"
    tokens = sum(len(json.loads(e)["choices"][0]["delta"].get("content") or "") > 0
                 for _, e in reader.events[:-1])
    assert tokens == 400  # the whole answer, nothing lost (one chunk per token at this pace)
    late.settimeout(10)
    answer = _read_all(late)
    late.close()
    assert answer.startswith(b"HTTP/1.1 200") and b'"completion_tokens":3' in answer
    after = _series(engine)
    assert after["vllm:generation_tokens_total"] > before["vllm:generation_tokens_total"]
    assert after["vllm:request_success_total"] == before["vllm:request_success_total"] + 2
    assert after["vllm:num_requests_running"] == 0


def test_a_stream_accepted_while_hung_gets_its_headers_and_no_event(engine: str) -> None:
    """As from vLLM: its server starts a streamed answer before the engine's first output."""
    assert httpx.post(f"{engine}/sim/faults", json={"mode": "hang"}, timeout=5).status_code == 200
    steps = _state_of(engine)["steps"]
    reader = StreamReader(f"{engine}/v1/completions", {"model": "llama-8b", "prompt": "x", "max_tokens": 4})
    reader.start()
    time.sleep(0.5)
    assert reader.events == [] and reader.error is None and reader.is_alive()  # the 200 came, no event
    state = _state_of(engine)
    assert state["in_flight"] == 1 and state["steps"] == steps and state["running"] == 0
    assert httpx.post(f"{engine}/sim/faults", json={"mode": "none"}, timeout=5).status_code == 200
    reader.join(timeout=10)
    assert reader.error is None and [e for _, e in reader.events][-1] == "[DONE]"
    assert len(reader.content_times()) == 4


def test_a_client_that_leaves_a_hung_engine_frees_its_request(engine: str) -> None:
    body = {"model": "llama-8b", "prompt": "word " * 300, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{engine}/v1/completions", json=body, timeout=10) as resp:
        lines = resp.iter_lines()  # (dropping the iterator would close the stream at once)
        assert next(lines).startswith("data: ")
        assert httpx.post(f"{engine}/sim/faults", json={"mode": "hang"}, timeout=5).status_code == 200
        time.sleep(0.1)
        state = _state_of(engine)
        assert state["kv_blocks_used"] > 0 and state["running"] == 1 and state["in_flight"] == 1
    _wait(lambda: _state_of(engine)["in_flight"] == 0)  # the client is gone: aborted, hung or not
    state = _state_of(engine)
    assert state["running"] == 0 and state["kv_blocks_used"] == 0 and state["faults"]["mode"] == "hang"


@pytest.mark.alone  # it times a sleep of 0.65 s to within a second: nothing may run beside it
def test_drip_gives_a_token_per_interval(engine: str) -> None:
    assert httpx.post(f"{engine}/sim/faults", json={"mode": "drip", "drip_interval_s": 0.3},
                      timeout=5).status_code == 200
    reader = StreamReader(f"{engine}/v1/chat/completions", _chat(6))
    reader.start()
    _wait(lambda: len(reader.content_times()) >= 2)
    before = _series(engine)
    started = time.monotonic()
    assert httpx.get(f"{engine}/health", timeout=2).status_code == 200
    time.sleep(0.65)
    moved = _series(engine)["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert time.monotonic() - started < 1.0
    assert 1 <= moved <= 3  # the counters creep: a step (one token here) per interval
    reader.join(timeout=10)
    assert reader.error is None and reader.events[-1][1] == "[DONE]"
    times = reader.content_times()
    assert len(times) == 6
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(0.2 < gap < 0.6 for gap in gaps), gaps  # about the interval, never a burst
    assert httpx.post(f"{engine}/sim/faults", json={"mode": "none"}, timeout=5).status_code == 200
    quick = StreamReader(f"{engine}/v1/chat/completions", _chat(6))
    quick.run()  # back to full speed at once
    fast = quick.content_times()
    assert len(fast) == 6 and fast[-1] - fast[0] < 0.2


# --- abort_with: error ---------------------------------------------------------------------------------


def test_abort_with_error_ends_the_stream_with_vllms_error_event(sim: Sim) -> None:
    port = sim.ports["small-us"][0]
    answer = sim.set({"port": port, "abort_rate": 1, "abort_with": "error", "abort_after_tokens": 3})[1]
    assert answer["engines"][0]["faults"]["abort_with"] == "error"
    aborted = _state(port)["aborted"]
    body = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{_url(port)}/v1/chat/completions", json=body, timeout=20) as resp:
        assert resp.status_code == 200
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line]  # read to its proper end
    assert events[-2:] == [STREAM_ERROR, "[DONE]"]
    chunks = [json.loads(e) for e in events[:-2]]
    content = [c["choices"][0]["delta"].get("content") for c in chunks]
    assert content[0] == "" and len([t for t in content[1:] if t]) == 3  # the role chunk, then 3 tokens
    assert all(c["choices"] and c["choices"][0]["finish_reason"] is None for c in chunks)  # no usage chunk
    _wait(lambda: _state(port)["in_flight"] == 0)
    assert _state(port)["aborted"] == aborted + 1  # aborted in the engine, as a broken-off stream is
    # A complete answer is still cut halfway, whatever abort_with says.
    with pytest.raises(httpx.RemoteProtocolError):
        _complete(port)


# --- continue_final_message --------------------------------------------------------------------------------

STORY = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a"}]


def test_continue_final_message(sim: Sim) -> None:
    url = _url(sim.ports["small-eu"][0])
    both = httpx.post(f"{url}/v1/chat/completions", timeout=20, json={
        "model": "llama-8b", "messages": STORY, "continue_final_message": True, "add_generation_prompt": True})
    assert both.status_code == 400
    assert both.json() == {"error": {"message": "Cannot set both `continue_final_message` and "
                                                "`add_generation_prompt` to True.",
                                     "type": "BadRequestError", "param": None, "code": 400}}
    implicit = httpx.post(f"{url}/v1/chat/completions", timeout=20, json={
        "model": "llama-8b", "messages": STORY, "continue_final_message": True})
    assert implicit.status_code == 400
    assert implicit.json()["error"]["message"].startswith(
        "continue_final_message and add_generation_prompt are not compatible.")

    flags = {"continue_final_message": True, "add_generation_prompt": False}
    resp = httpx.post(f"{url}/v1/chat/completions", timeout=20,
                      json={"model": "llama-8b", "messages": STORY, "max_tokens": 5, **flags})
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    message = answer["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"].startswith(" ")  # "Once upon a" goes on
    count = httpx.post(f"{url}/tokenize", json={"messages": STORY, **flags}, timeout=5).json()["count"]
    closed = httpx.post(f"{url}/tokenize", json={"messages": STORY, "add_generation_prompt": False},
                        timeout=5).json()["count"]
    assert answer["usage"]["prompt_tokens"] == count == closed - 1  # the rendered prompt, with no end of turn
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=20,
                      json={"model": "llama-8b", "messages": STORY, "max_tokens": 3, "stream": True, **flags}) as s:
        first = json.loads(next(s.iter_lines()).removeprefix("data: "))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
