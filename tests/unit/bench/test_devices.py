"""The bench's measuring devices: the instant engine, closed loop, sampler, profile summary, LiteLLM helpers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator

import msgspec
import pytest
from ruamel.yaml import YAML

from switchyard.bench import instant, litellm_env
from switchyard.bench.closedloop import run_closed_loop
from switchyard.bench.loadgen import run_open_loop
from switchyard.bench.profile import owner, summarize_collapsed
from switchyard.bench.sampler import MetricsSampler, sum_series
from switchyard.bench.sender import Target
from switchyard.bench.sse import SseParser
from switchyard.bench.synthetic import RequestTemplate, poisson
from switchyard.engines.scrape import parse_engine_metrics
from tests.helpers import free_port


def test_the_instant_engine_answers_in_vllm_shapes() -> None:
    proto = instant.InstantProtocol(instant.Replies())
    raw = proto.answer(b"POST", b"/v1/chat/completions", b'{"model": "m", "messages": []}')
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK")
    reply = msgspec.json.decode(body)
    assert reply["model"] == "m" and reply["choices"][0]["message"]["content"] == "ok"
    assert reply["usage"]["completion_tokens"] == 1

    raw = proto.answer(b"POST", b"/v1/completions",
                       b'{"model": "m", "stream": true, "stream_options": {"include_usage": true}}')
    head, _, chunked = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head
    size, _, rest = chunked.partition(b"\r\n")
    events = SseParser().feed(rest[: int(size, 16)])
    assert events[-1].data == b"[DONE]"
    chunks = [msgspec.json.decode(e.data) for e in events[:-1]]
    assert chunks[0]["choices"][0]["text"] == "ok" and chunks[-1]["usage"]["total_tokens"] == 2

    assert proto.answer(b"GET", b"/v1/chat/completions", b"").startswith(b"HTTP/1.1 405")
    assert proto.answer(b"POST", b"/v1/chat/completions", b"{nope").startswith(b"HTTP/1.1 400")
    assert proto.answer(b"GET", b"/nowhere", b"").startswith(b"HTTP/1.1 404")
    metrics = proto.answer(b"GET", b"/metrics", b"").partition(b"\r\n\r\n")[2].decode()
    signals = parse_engine_metrics(metrics)  # the gateway's scraper accepts it
    assert signals.running == 0 and signals.waiting == 0


@contextlib.asynccontextmanager
async def _engine() -> AsyncIterator[str]:
    port = free_port()
    ready = asyncio.Event()
    task = asyncio.create_task(instant.serve("127.0.0.1", port, ready))
    await asyncio.wait_for(ready.wait(), 5)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.parametrize("stream", [False, True])
async def test_loads_against_the_instant_engine_succeed(stream: bool) -> None:
    template = RequestTemplate(prompt_tokens=(8, 8), output_tokens=(1, 1), stream=stream)
    async with _engine() as url:
        target = Target(url, "direct")
        results = await run_open_loop(poisson(200, 0.5, [template], 1), target, progress=False)
        assert results and all(r.ok for r in results)
        spec = poisson(200, 0.5, [template], 1).specs[0]
        sat = await run_closed_loop(spec, target, concurrency=4, duration_s=0.3, warmup_s=0.1)
        assert sat.results and sat.error_rate == 0 and sat.throughput_rps > 0
        assert all(0.1 <= r.done_s < 0.4 for r in sat.results)


async def test_the_sampler_sums_series_over_engines_per_bin() -> None:
    async with _engine() as a, _engine() as b:
        dead = f"http://127.0.0.1:{free_port()}"
        sampler = MetricsSampler([f"{u}/metrics" for u in (a, b, dead)], ["vllm:num_requests_running"], bin_s=0.1)
        sampler.start(asyncio.get_running_loop().time())
        await asyncio.sleep(0.35)
        await sampler.stop()
    values = sampler.series["vllm:num_requests_running"]
    assert len(values) >= 2 and all(v == 0.0 for v in values)


def test_sum_series_adds_every_label_set_and_ignores_longer_names() -> None:
    text = ('# HELP x\nvllm:num_requests_running{engine="0"} 2.0\nvllm:num_requests_running{engine="1"} 3\n'
            "vllm:num_requests_running_total 100\nvllm:num_requests_running 1\n")
    assert sum_series(text, "vllm:num_requests_running") == 6.0


def test_profile_summary_by_library_and_function() -> None:
    lines = ["handle (switchyard/gateway/proxy.py:10);_request (aiohttp/client.py:5) 30",
             "run (asyncio/runners.py:1);data_received (uvicorn/protocols/http/httptools_impl.py:3) 10",
             "handle (switchyard/gateway/proxy.py:10) 10", "garbage"]
    s = summarize_collapsed(lines)
    assert s.samples == 50
    assert s.by_library == {"aiohttp": 30, "uvicorn": 10, "switchyard": 10}
    assert s.by_function["_request (client.py)"] == 30
    assert s.switchyard_inclusive == {"handle (proxy.py)": 40}
    rows = s.table("t")["rows"]
    assert rows[0] == {"what": "library", "name": "aiohttp", "samples": 30, "share": 0.6}
    assert owner("/usr/lib/python3.11/asyncio/events.py") == "asyncio"
    assert owner("/x/lib/python3.11/site-packages/litestar/app.py") == "litestar"


def test_the_litellm_config_points_at_the_engine_with_a_master_key() -> None:
    config = YAML(typ="safe").load(litellm_env.proxy_config("bench", "http://127.0.0.1:9/", "instant", "sk-x"))
    params = config["model_list"][0]["litellm_params"]
    assert config["model_list"][0]["model_name"] == "bench"
    assert params == {"model": "openai/instant", "api_base": "http://127.0.0.1:9/v1", "api_key": "none"}
    assert config["general_settings"]["master_key"] == "sk-x"
    assert config["litellm_settings"]["telemetry"] is False


def test_the_litellm_environment_reaches_nothing_outside() -> None:
    env = litellm_env.proxy_env({"PATH": "/bin", "OPENAI_API_KEY": "secret", "DATABASE_URL": "postgres://x",
                                 "LITELLM_MASTER_KEY": "k"})
    assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True" and env["PATH"] == "/bin"
    assert not {"OPENAI_API_KEY", "DATABASE_URL", "LITELLM_MASTER_KEY"} & set(env)


def test_outside_connections_ignores_loopback() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    try:
        assert litellm_env.outside_connections(os.getpid()) == []
    finally:
        client.close()
        server.close()
    assert litellm_env._peer("0100007F") == "127.0.0.1"
    assert not litellm_env._loopback("10.1.2.3") and litellm_env._loopback("::ffff:127.0.0.1")
