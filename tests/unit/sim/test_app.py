"""The engine app in process (Litestar's test client): routes, shapes, faults, clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
from litestar.testing import AsyncTestClient
from prometheus_client import generate_latest

from switchyard.sim import EngineConfig, create_engine_app


@pytest.fixture
async def client() -> AsyncIterator[AsyncTestClient]:  # type: ignore[type-arg]
    app = create_engine_app(EngineConfig(served_model="m", port=1, time_scale=1000, seed=1))
    async with AsyncTestClient(app=app) as c:
        yield c


def _events(body: str) -> list[str]:
    return [line.removeprefix("data: ") for line in body.split("\n\n") if line]


async def test_create_engine_app_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match="unknown profile"):
        create_engine_app(EngineConfig(served_model="m", port=1, profile="x"))
    with pytest.raises(ValueError, match="time_scale"):
        create_engine_app(EngineConfig(served_model="m", port=1, time_scale=-1))


async def test_simulated_timings_do_not_depend_on_wall_clock(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    # At time_scale 1000 one millisecond of timer slack would be a whole simulated second;
    # the engine's own clock must still report the model's ~12 ms TTFT and ~6.4 ms ITL.
    resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
    assert resp.status_code == 200
    metrics = (await client.get("/metrics")).text
    values = dict(line.rsplit(" ", 1) for line in metrics.splitlines()
                  if line and not line.startswith("#"))
    labels = '{engine="0",model_name="m"}'
    ttft = float(values[f"vllm:time_to_first_token_seconds_sum{labels}"])
    itl = float(values[f"vllm:inter_token_latency_seconds_sum{labels}"])
    assert 0.010 < ttft < 0.020
    assert 4 * 0.006 < itl < 4 * 0.008


async def test_multi_prompt_streaming_interleaves_choices(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    resp = await client.post("/v1/completions", json={
        "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}, "priority": -1})
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = _events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = [msgspec.json.decode(e) for e in events[:-1]]
    per_choice = [sum(1 for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
                  for i in (0, 1)]
    assert per_choice == [4, 4]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["prompt_tokens"] == 5
    assert chunks[-1]["usage"]["completion_tokens"] == 8


async def test_chat_stream_shape(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    resp = await client.post("/v1/chat/completions", headers={"x-request-id": "abc"}, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True})
    chunks = [msgspec.json.decode(e) for e in _events(resp.text)[:-1]]
    assert chunks[0]["id"] == "chatcmpl-abc"
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert all("usage" not in c for c in chunks)


async def test_client_mistakes_never_500(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    for body in (b"", b"{", b"[]", b'{"prompt": null}', b'{"prompt": "x", "max_tokens": -1}',
                 b'{"messages": [{"role": 1}]}', b'{"prompt": [1, 2.5]}'):
        for path in ("/v1/completions", "/v1/chat/completions"):
            resp = await client.post(path, content=body)
            assert resp.status_code == 400, (path, body, resp.text)
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert (await client.get("/v1/completions")).status_code == 405


async def test_fault_settings_validate_and_round_trip(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    assert (await client.get("/sim/faults")).json() == {
        "mode": "none", "slow_factor": 5.0, "drip_interval_s": 2.0, "error_rate": 0.0, "throttle_rate": 0.0,
        "overload_rate": 0.0, "abort_rate": 0.0, "abort_after_tokens": 4, "abort_with": "close"}
    for bad in ({"mode": "broken"}, {"mode": "error"}, {"error_rate": 2}, {"slow_factor": 0}, {"colour": 1}, [1],
                {"abort_after_tokens": -1}, {"throttle_rate": "x"}, {"drip_interval_s": 0}, {"abort_with": "drop"}):
        resp = await client.post("/sim/faults", json=bad)
        assert resp.status_code == 400
        assert resp.json()["error"]["type"] == "BadRequestError"
    resp = await client.post("/sim/faults", json={"error_rate": 0.25, "abort_after_tokens": 2,
                                                  "drip_interval_s": 0.5, "abort_with": "error"})
    assert resp.status_code == 200
    assert resp.json() == (await client.get("/sim/faults")).json() == {
        "mode": "none", "slow_factor": 5.0, "drip_interval_s": 0.5, "error_rate": 0.25, "throttle_rate": 0.0,
        "overload_rate": 0.0, "abort_rate": 0.0, "abort_after_tokens": 2, "abort_with": "error"}


async def test_error_rate_is_a_fraction(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    await client.post("/sim/faults", json={"error_rate": 0.5})
    codes = [(await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}))
             .status_code for _ in range(40)]
    assert set(codes) == {200, 500}
    assert 8 <= codes.count(500) <= 32


async def test_rejections_are_shaped_and_take_no_capacity(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    before = (await client.get("/metrics")).text
    for rate, status, err_type in (("throttle_rate", 429, "RateLimitError"),
                                   ("overload_rate", 503, "ServiceUnavailableError"),
                                   ("error_rate", 500, "InternalServerError")):
        await client.post("/sim/faults", json={rate: 1})
        for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            resp = await client.post(path, json=body)
            assert resp.status_code == status
            assert resp.json()["error"]["type"] == err_type
            assert resp.headers.get("retry-after") == (None if status == 500 else "1")
        await client.post("/sim/faults", json={rate: 0})
    state = (await client.get("/sim/state")).json()
    assert state["faulted"] == {"error": 2, "throttle": 2, "overload": 2, "abort": 0}
    assert state["in_flight"] == 0 and state["kv_blocks_used"] == 0 and state["steps"] == 0
    assert (await client.get("/metrics")).text.count("request_success_total{") == before.count(
        "request_success_total{")
    assert 'vllm:prompt_tokens_total{engine="0",model_name="m"} 0.0' in (await client.get("/metrics")).text


async def test_rates_apply_in_modes_none_and_slow_only(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    await client.post("/sim/faults", json={"mode": "unavailable", "error_rate": 1})
    resp = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
    assert resp.status_code == 503 and "unavailable" in resp.json()["error"]["message"]
    assert (await client.get("/health")).status_code == 503
    await client.post("/sim/faults", json={"mode": "slow"})
    assert (await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})).status_code == 500
    await client.post("/sim/faults", json={"mode": "none", "error_rate": 0})
    assert (await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})).status_code == 200


async def test_down_in_process_answers_503(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    """With no socket to close (no server), ``down`` answers like ``unavailable``."""
    await client.post("/sim/faults", json={"mode": "down"})
    assert (await client.get("/health")).status_code == 503
    assert (await client.get("/sim/state")).json()["listening"] is True
    await client.post("/sim/faults", json={"mode": "none"})
    assert (await client.get("/health")).status_code == 200


async def test_state_reports_internals(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    await client.post("/v1/completions", json={"prompt": "x " * 100, "max_tokens": 2})
    state = (await client.get("/sim/state")).json()
    for key in ("running", "waiting", "kv_blocks_used", "kv_blocks_total", "kv_blocks_cached",
                "preemptions", "clock_s", "faults", "lag_s"):
        assert key in state
    assert state["kv_blocks_cached"] >= 6 and state["kv_blocks_used"] == 0
    assert state["clock_s"] > 0


async def test_multi_turn_conversation_reuses_the_previous_turn(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    history = [{"role": "system", "content": "You are terse. " * 20},
               {"role": "user", "content": "Describe the cache."}]
    first = (await client.post("/v1/chat/completions",
                               json={"messages": history, "max_tokens": 40})).json()
    answer = first["choices"][0]["message"]["content"]
    history += [{"role": "assistant", "content": answer},
                {"role": "user", "content": "And then?"}]
    second = (await client.post("/v1/chat/completions",
                                json={"messages": history, "max_tokens": 5})).json()
    previous = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # Everything up to the last full block of the previous turn's output is reused.
    assert cached >= (previous - 1) // 16 * 16 - 16
    assert cached > first["usage"]["prompt_tokens"]


#: vLLM 0.32's event for a request that fails mid-stream (``json.dumps`` of its ErrorResponse), then [DONE].
STREAM_ERROR = ('{"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, '
                '"code": 500}}')


@pytest.fixture
async def real_time() -> AsyncIterator[AsyncTestClient]:  # type: ignore[type-arg]
    """An engine on the wall clock: at time scale 1000 a short answer is computed in one go, before
    its first token is shown (the loop is always "behind"), so there is nothing left to abort."""
    async with AsyncTestClient(app=create_engine_app(EngineConfig(served_model="m", port=1, seed=1))) as c:
        yield c


@pytest.mark.parametrize(("after", "max_tokens", "tokens"), [(2, 10, 2), (0, 10, 0), (10, 4, 2), (5, 1, 0)])
async def test_abort_with_error_ends_a_stream_with_vllms_error_event(
        real_time: AsyncTestClient, after: int, max_tokens: int, tokens: int) -> None:  # type: ignore[type-arg]
    client = real_time
    await client.post("/sim/faults", json={"abort_rate": 1, "abort_with": "error", "abort_after_tokens": after})
    resp = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "stream": True,
        "stream_options": {"include_usage": True}})
    assert resp.status_code == 200
    assert resp.text.endswith(f"data: {STREAM_ERROR}\n\ndata: [DONE]\n\n")  # the response is ended properly
    events = _events(resp.text)
    chunks = [msgspec.json.decode(e) for e in events[:-2]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(chunks) == 1 + tokens  # never the usage chunk, never a finish_reason
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    state = (await client.get("/sim/state")).json()
    assert state["aborted"] == 1 and state["in_flight"] == 0 and state["kv_blocks_used"] == 0
    assert state["faulted"]["abort"] == 1
    # A text completion the same way.
    text = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": max_tokens, "stream": True})
    assert text.text.endswith(f"data: {STREAM_ERROR}\n\ndata: [DONE]\n\n")
    assert len(_events(text.text)) == tokens + 2


async def test_metrics_are_made_again_only_when_what_they_report_changed(
        client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    metrics = client.app.state["metrics"]
    first = metrics.render()
    assert metrics.render() is first  # an idle engine: the text made once is the text served
    assert (await client.get("/metrics")).content == first
    # While requests run, every scrape is what the registry says right now.
    seen: set[bytes] = set()
    done = asyncio.Event()

    async def scrape() -> None:
        while not done.is_set():
            text = metrics.render()
            assert text == generate_latest(metrics.registry)
            seen.add(text)
            await asyncio.sleep(0)

    scraping = asyncio.create_task(scrape())
    await asyncio.gather(*(client.post("/v1/completions", json={"prompt": f"hi {i}", "max_tokens": 8, "stream": s})
                           for i, s in enumerate((False, True, False, True))))
    done.set()
    await scraping
    after = metrics.render()
    assert after == generate_latest(metrics.registry) and after != first and len(seen) >= 2
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 4.0' in after.decode()
