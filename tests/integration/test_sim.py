"""`switchyard sim` as a real process, driven with the official OpenAI SDK.

One engine is started for the module (time scale 20) and reset to a healthy fault mode after
every test; the shutdown and port-in-use tests start their own processes.
"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from switchyard.sim import EngineConfig, serve_engines

MODEL = "sim-llama-8b"
SWITCHYARD = Path(sys.executable).with_name("switchyard")
HEALTHY = {"mode": "none", "error_rate": 0.0, "throttle_rate": 0.0, "overload_rate": 0.0, "abort_rate": 0.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _start(port: int, *extra: str) -> subprocess.Popen[str]:
    assert SWITCHYARD.exists(), f"console script not found next to {sys.executable}"
    return subprocess.Popen(
        [str(SWITCHYARD), "sim", "--model", MODEL, "--port", str(port), "--time-scale", "20",
         *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_healthy(proc: subprocess.Popen[str], base: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sim exited with {proc.returncode}: {proc.stderr.read()}")  # type: ignore[union-attr]
        try:
            if httpx.get(f"{base}/health", timeout=0.5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError("sim did not become healthy")


def _stop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    """Base URL of a running sim engine."""
    port = _free_port()
    proc = _start(port, "--max-model-len", "4096", "--seed", "3")
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base)
        yield base
    finally:
        assert _stop(proc) == 0


@pytest.fixture
def client(engine: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{engine}/v1", api_key="sim", max_retries=0,
                       timeout=20) as c:
        yield c
    httpx.post(f"{engine}/sim/faults", json=HEALTHY)


def _metrics(base: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _metric(metrics: dict[str, float], name: str, **labels: str) -> float:
    want = {"model_name": MODEL, "engine": "0", **labels}
    for key, value in metrics.items():
        series, _, rest = key.partition("{")
        if series == name and dict(re.findall(r'(\w+)="([^"]*)"', rest)) == want:
            return value
    raise KeyError(f"{name} {want} not in /metrics")


def _state(base: str) -> dict[str, Any]:
    state: dict[str, Any] = httpx.get(f"{base}/sim/state").json()
    return state


def _wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "vllm"
    assert (models[0].model_extra or {})["max_model_len"] == 4096


def test_chat_completion(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say something."}], max_tokens=12)
    assert resp.id.startswith("chatcmpl-")
    assert resp.object == "chat.completion"
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant" and choice.message.content
    assert resp.usage is not None and resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
    assert resp.usage.prompt_tokens_details is not None


def test_chat_without_max_tokens_stops_naturally(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me more."}])
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None and 16 <= resp.usage.completion_tokens <= 256


def test_completion_with_two_prompts(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=["one", "two three"], max_tokens=5)
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.finish_reason == "length" and c.text for c in resp.choices)
    assert resp.usage is not None and resp.usage.completion_tokens == 10


def test_chat_streaming_with_usage(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Stream please."}]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) == 20  # one chunk per generated token
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage is not None
    assert usage.usage.completion_tokens == 20
    # The same request without streaming generates the same text.
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20)
    assert "".join(c.choices[0].delta.content or "" for c in content) == \
        full.choices[0].message.content


def test_completion_streaming(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon", max_tokens=7,
                                            stream=True))
    assert len(chunks) == 7
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_errors_are_vllm_shaped(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert "The model `nope` does not exist." in str(not_found.value)
    with pytest.raises(openai.BadRequestError) as too_much:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=5000)
    assert "cannot be greater than max_model_len=4096" in str(too_much.value)
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt=[7] * 5000, max_tokens=5)
    assert "maximum context length is 4096 tokens" in str(too_long.value)
    with pytest.raises(openai.BadRequestError, match="n must be at least 1"):
        client.completions.create(model=MODEL, prompt="hi", n=0)
    bad = httpx.post(str(client.base_url.join("chat/completions")), content=b"{oops")
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "Bad Request"


def test_max_tokens_past_the_window_is_cut_to_fit(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=[7] * 4000, max_tokens=200)
    assert resp.usage is not None and resp.usage.completion_tokens == 96
    assert resp.choices[0].finish_reason == "length"


def test_n_samples_per_prompt(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=["one", "two"], n=2, max_tokens=3)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.usage is not None and resp.usage.completion_tokens == 12
    assert resp.choices[0].text != resp.choices[1].text  # two samples of the same prompt


def test_metrics_move_and_prefix_cache_hits_show(client: openai.OpenAI, engine: str) -> None:
    before = _metrics(engine)
    document = " ".join(f"Paragraph {i} explains how the scheduler admits requests." for i in
                        range(120))
    messages: Any = [{"role": "system", "content": document},
                     {"role": "user", "content": "Summarise."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    after = _metrics(engine)
    assert first.usage is not None and second.usage is not None
    prompt = first.usage.prompt_tokens
    assert prompt > 1000
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens >= prompt - 16

    def delta(name: str, **labels: str) -> float:
        return _metric(after, name, **labels) - _metric(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == 2 * prompt
    assert delta("vllm:generation_tokens_total") == 8
    assert delta("vllm:prefix_cache_queries_total") == 2 * prompt
    assert delta("vllm:prefix_cache_hits_total") >= prompt - 16
    assert delta("vllm:request_success_total", finished_reason="length") == 2
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == 6
    assert delta("vllm:request_queue_time_seconds_count") == 2
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"):
        _metric(after, gauge)
    assert _metric(after, "vllm:time_to_first_token_seconds_bucket", le="0.02") >= 0


def test_client_disconnect_aborts_the_request(engine: str) -> None:
    before = _metrics(engine)
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", f"{engine}/v1/completions", json=body, timeout=10) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        assert _state(engine)["kv_blocks_used"] > 0
    _wait_for(lambda: _state(engine)["in_flight"] == 0)
    state = _state(engine)
    assert state["running"] == 0 and state["kv_blocks_used"] == 0
    after = _metrics(engine)
    assert state["aborted"] >= 1
    # As in vLLM 0.32, an abandoned request is not counted as finished (not even as "abort").
    for reason in ("abort", "length"):
        assert _metric(after, "vllm:request_success_total", finished_reason=reason) == \
            _metric(before, "vllm:request_success_total", finished_reason=reason)


def test_fault_error_rate(client: openai.OpenAI, engine: str) -> None:
    assert httpx.post(f"{engine}/sim/faults", json={"error_rate": 1.0}).json() == {
        "mode": "none", "slow_factor": 5.0, "error_rate": 1.0, "throttle_rate": 0.0, "overload_rate": 0.0,
        "abort_rate": 0.0, "abort_after_tokens": 4, "drip_interval_s": 2.0, "abort_with": "close"}
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert err.value.status_code == 500
    assert httpx.get(f"{engine}/health").status_code == 200
    bad = httpx.post(f"{engine}/sim/faults", json={"mode": "sideways"})
    assert bad.status_code == 400 and "mode must be one of" in bad.text
    gone = httpx.post(f"{engine}/sim/faults", json={"mode": "error"})
    assert gone.status_code == 400 and "set error_rate instead" in gone.text


def test_fault_slow_mode_stretches_simulated_time(client: openai.OpenAI, engine: str) -> None:
    def e2e_of_one() -> float:
        before = _metric(_metrics(engine), "vllm:e2e_request_latency_seconds_sum")
        client.completions.create(model=MODEL, prompt=[7, 8, 9], max_tokens=8)
        return _metric(_metrics(engine), "vllm:e2e_request_latency_seconds_sum") - before

    normal = e2e_of_one()
    httpx.post(f"{engine}/sim/faults", json={"mode": "slow", "slow_factor": 4})
    slow = e2e_of_one()
    assert slow > 2.5 * normal


def test_fault_hang_mode(client: openai.OpenAI, engine: str) -> None:
    httpx.post(f"{engine}/sim/faults", json={"mode": "hang"})
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.3).completions.create(model=MODEL, prompt="x",
                                                            max_tokens=2)
    # A hung request resumes once the mode changes.
    result: dict[str, Any] = {}

    def call() -> None:
        result["resp"] = client.completions.create(model=MODEL, prompt="y", max_tokens=3)

    worker = threading.Thread(target=call)
    worker.start()
    time.sleep(0.3)
    assert "resp" not in result
    httpx.post(f"{engine}/sim/faults", json={"mode": "none"})
    worker.join(timeout=10)
    assert result["resp"].usage.completion_tokens == 3


def test_fault_unavailable_mode(client: openai.OpenAI, engine: str) -> None:
    httpx.post(f"{engine}/sim/faults", json={"mode": "unavailable"})
    assert httpx.get(f"{engine}/health").status_code == 503
    assert httpx.get(f"{engine}/v1/models").status_code == 503
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert err.value.status_code == 503
    assert httpx.get(f"{engine}/sim/state").status_code == 200
    httpx.post(f"{engine}/sim/faults", json={"mode": "none"})
    assert httpx.get(f"{engine}/health").status_code == 200


def test_sigterm_stops_cleanly_with_streams_in_flight() -> None:
    port = _free_port()
    proc = _start(port)
    base = f"http://127.0.0.1:{port}"
    _wait_healthy(proc, base)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(f"sim: {MODEL} on http://127.0.0.1:{port} (profile h100-8b")
    body = {"model": MODEL, "prompt": "go", "max_tokens": 1500, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=10) as resp:
        lines = resp.iter_lines()
        next(lines)
        proc.send_signal(signal.SIGTERM)
        tail = list(lines)
    assert "data: [DONE]" in tail  # the stream in flight was allowed to finish
    assert proc.wait(timeout=10) == 0


def test_port_in_use_is_a_clear_error(engine: str) -> None:
    port = int(engine.rsplit(":", 1)[1])
    proc = _start(port)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in err
    assert "Traceback" not in err


async def test_serve_engines_runs_many_engines_in_one_loop_until_cancelled() -> None:
    ports = [_free_port(), _free_port()]
    configs = [EngineConfig(served_model="small", port=ports[0], time_scale=50),
               EngineConfig(served_model="large", port=ports[1], profile="h100-70b",
                            time_scale=50)]
    task = asyncio.create_task(serve_engines(configs))
    async with httpx.AsyncClient(timeout=5) as http:
        for port in ports:
            for _ in range(200):
                try:
                    if (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    await asyncio.sleep(0.02)
            else:
                pytest.fail(f"engine on {port} did not start")
        resp = await http.post(f"http://127.0.0.1:{ports[1]}/v1/completions",
                               json={"model": "large", "prompt": "hi", "max_tokens": 3})
        assert resp.json()["usage"]["completion_tokens"] == 3
        models = (await http.get(f"http://127.0.0.1:{ports[0]}/v1/models")).json()
        assert models["data"][0]["id"] == "small"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with httpx.AsyncClient(timeout=5) as http:
        with pytest.raises(httpx.ConnectError):
            await http.get(f"http://127.0.0.1:{ports[0]}/health")
