"""The gateway end to end: real processes on loopback, driven by the official `openai` SDK.

Every test here runs twice: with the gateway on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.integration.conftest import Engines, Gateway, gateway_counter, http_json


def client(gateway: Gateway, tier: str = "pro", **kwargs: Any) -> OpenAI:
    return OpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.keys[tier], max_retries=0, **kwargs)


def route_of(headers: Any) -> dict[str, str]:
    value = headers.get("x-switchyard-route")
    assert value, "every served response names its route"
    return dict(part.split("=", 1) for part in value.split("; "))


def sim_state(url: str) -> dict[str, Any]:
    status, _, body = http_json("GET", f"{url}/sim/state")
    assert status == 200
    return body  # type: ignore[no-any-return]


def aborted_requests(url: str) -> int:
    """Requests the engine aborted because their client left (vLLM 0.32 counts them in no metric)."""
    return int(sim_state(url)["aborted"])


def assert_openai_error(body: Any, status: int, code: str | None = None) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code, error


# --- serving ---------------------------------------------------------------------------------

def test_models_are_listed_per_tier(gateway: Gateway) -> None:
    free = {m.id for m in client(gateway, "free").models.list()}
    pro = {m.id for m in client(gateway, "pro").models.list()}
    assert free == {"auto", "small"}
    assert {"auto", "small", "large"} <= pro


def test_chat_completion_sync(gateway: Gateway) -> None:
    raw = client(gateway).chat.completions.with_raw_response.create(
        model="small", messages=[{"role": "user", "content": "Say something."}], max_tokens=12,
        extra_headers={"x-request-id": "req-123"})
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage is not None and completion.usage.completion_tokens == 12
    assert completion.model == "sim-small", "the response names the served model, as OpenAI's does"
    route = route_of(raw.headers)
    assert route["model"] == "small" and route["pool"] in {"small-us", "small-eu"}
    assert route["policy"] == "v1" and route["endpoint"].startswith("http://127.0.0.1:")
    assert raw.headers["x-request-id"] == "req-123"
    assert "server" not in raw.headers and raw.headers["date"]  # (the server's software is not announced)


async def test_chat_completion_async_spreads_over_endpoints(gateway: Gateway) -> None:
    async with AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.keys["pro"], max_retries=0) as c:
        responses = await asyncio.gather(*[
            c.chat.completions.with_raw_response.create(
                model="small", messages=[{"role": "user", "content": f"question {i}"}], max_tokens=40)
            for i in range(24)])
    endpoints = {route_of(r.headers)["endpoint"] for r in responses}
    assert all(r.parse().choices[0].message.content for r in responses)
    assert len(endpoints) >= 2, f"least-outstanding picking must spread concurrent load, got {endpoints}"


def test_streaming_passes_chunks_through_as_they_come(gateway: Gateway, engines: Engines) -> None:
    stream = client(gateway).chat.completions.create(
        model="large", messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=3000,
        stream=True, stream_options={"include_usage": True})
    first = next(iter(stream))
    assert first.choices and first.choices[0].delta.role == "assistant"
    # The engine is still generating when the first chunk reaches the client: nothing is buffered.
    assert sim_state(engines.url("large-us"))["running"] >= 1
    chunks = [first, *stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) > 1000
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3000
    assert chunks[-2].choices[0].finish_reason == "length"


def test_completions_plain_and_streaming(gateway: Gateway) -> None:
    c = client(gateway)
    done = c.completions.create(model="small", prompt="Once upon a time", max_tokens=8)
    assert done.choices[0].text and done.usage and done.usage.completion_tokens == 8
    parts = list(c.completions.create(model="small", prompt="Once upon a time", max_tokens=8, stream=True,
                                      stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == done.choices[0].text
    assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == 8


@pytest.mark.parametrize(("prompt", "model", "rule"), [
    ("hi", "small", "short"),
    ("Prove that 2 is prime.", "large", "hard"),
    ("word " * 400, "large", "default"),
])
def test_auto_route_resolves_by_rules(gateway: Gateway, prompt: str, model: str, rule: str) -> None:
    raw = client(gateway).chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": prompt}], max_tokens=4)
    route = route_of(raw.headers)
    assert (route["model"], route["route"], route["rule"]) == (model, "auto", rule)


def test_client_disconnect_aborts_the_upstream_request(gateway: Gateway, engines: Engines) -> None:
    url = engines.url("large-us")
    before = aborted_requests(url)
    stream = client(gateway).chat.completions.create(
        model="large", messages=[{"role": "user", "content": "Go on for a long time."}], max_tokens=8000,
        stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and aborted_requests(url) == before:
        time.sleep(0.05)
    assert aborted_requests(url) == before + 1, "the engine must see the client leave"
    assert sim_state(url)["running"] == 0


# --- refusals and errors ---------------------------------------------------------------------

def test_missing_bad_and_revoked_keys_are_401(gateway: Gateway) -> None:
    status, _, body = http_json("POST", f"{gateway.base_url}/v1/chat/completions",
                                {"model": "small", "messages": [{"role": "user", "content": "x"}]})
    assert status == 401
    assert_openai_error(body, 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{gateway.base_url}/v1", api_key="sk-sy-wrong", max_retries=0).models.list()
    key = gateway.new_key("revoked-co", "pro")
    c = OpenAI(base_url=f"{gateway.base_url}/v1", api_key=key, max_retries=0)
    assert c.models.list().data
    listing = gateway.cli("keys", "list", "--tenant", "revoked-co", "--json").stdout
    key_id = json.loads(listing)[0]["id"]
    gateway.cli("keys", "revoke", str(key_id))
    time.sleep(0.5)  # the gateway trusts a key lookup for SWITCHYARD_KEY_CACHE_TTL_S (0.3 s here)
    with pytest.raises(openai.AuthenticationError):
        c.models.list()


def test_model_not_allowed_for_tier_is_403(gateway: Gateway) -> None:
    with pytest.raises(openai.PermissionDeniedError) as caught:
        client(gateway, "free").chat.completions.create(model="large", messages=[{"role": "user", "content": "x"}])
    assert caught.value.code == "model_not_allowed"


def test_unknown_model_is_404(gateway: Gateway) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client(gateway).chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "x"}])
    assert caught.value.code == "model_not_found"


@pytest.mark.parametrize(("raw", "param"), [
    (b"{not json", None),
    (b"[1, 2]", None),
    (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
    (b'{"model": "small", "messages": []}', "messages"),
    (b'{"model": "small", "messages": [{"role": "wizard", "content": "x"}]}', "messages[0].role"),
    (b'{"model": "small", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', "max_tokens"),
    (b'{"model": "small", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
])
def test_malformed_bodies_are_400(gateway: Gateway, raw: bytes, param: str | None) -> None:
    status, _, body = http_json("POST", f"{gateway.base_url}/v1/chat/completions", raw=raw,
                                headers={"Authorization": f"Bearer {gateway.keys['pro']}"})
    assert status == 400
    assert_openai_error(body, 400)
    assert body["error"]["param"] == param


def test_body_too_large_is_413(gateway: Gateway) -> None:
    """The gateway refuses a body over the limit from its Content-Length, before reading it (so
    the client is told without sending it; a client still writing may see the connection close)."""
    host, port = gateway.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("Authorization", f"Bearer {gateway.keys['pro']}")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(1_200_000))
        conn.endheaders()
        response = conn.getresponse()
        status, body = response.status, json.loads(response.read())
    finally:
        conn.close()
    assert status == 413
    assert_openai_error(body, 413, "request_too_large")


def test_engine_client_errors_pass_through_as_400(gateway: Gateway) -> None:
    # (max_tokens above the context window is the gateway's own 400 now: tests/integration/test_limits.py)
    with pytest.raises(openai.BadRequestError) as caught:
        client(gateway).chat.completions.create(
            model="small", messages=[{"role": "user", "content": "x"}], temperature=3)
    assert "temperature must be in [0, 2], got 3" in caught.value.message


def test_an_unreachable_engine_is_out_of_service_503(gateway: Gateway) -> None:
    """Nothing listens at the dead pool's endpoint: the first request to try it gets 502 (unless a health
    probe found it first); from then on it is out of service and requests are refused at once with 503."""
    with pytest.raises(openai.InternalServerError) as caught:
        client(gateway).chat.completions.create(model="dead", messages=[{"role": "user", "content": "x"}])
    if caught.value.status_code == 502:
        assert "dead-us" in caught.value.message
        assert route_of(caught.value.response.headers)["pool"] == "dead-us"
        with pytest.raises(openai.InternalServerError) as caught:
            client(gateway).chat.completions.create(model="dead", messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == 503 and caught.value.code == "no_healthy_endpoint"
    assert "dead: http://127.0.0.1:" in caught.value.message and "down (" in caught.value.message
    assert int(caught.value.response.headers["retry-after"]) >= 1


def test_engine_not_serving_the_model_is_502(gateway: Gateway) -> None:
    with pytest.raises(openai.InternalServerError) as caught:
        client(gateway).chat.completions.create(model="misnamed", messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == 502
    assert caught.value.code == "upstream_model_missing"


def test_hanging_engine_is_504(gateway: Gateway, engines: Engines) -> None:
    status, _, _ = http_json("POST", f"{engines.url('hang-us')}/sim/faults", {"mode": "hang"})
    assert status == 200
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as caught:
        client(gateway).chat.completions.create(model="hangs", messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == 504
    assert caught.value.code == "upstream_timeout"
    assert time.monotonic() - started < 30


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/nothing-here", 404),
    ("GET", "/v1/chat/completions", 405),
])
def test_unknown_routes_answer_openai_errors(gateway: Gateway, method: str, path: str, status: int) -> None:
    got, _, body = http_json(method, f"{gateway.base_url}{path}")
    assert got == status
    assert_openai_error(body, status)


# --- operations ------------------------------------------------------------------------------

def test_health_ready_and_metrics(gateway: Gateway) -> None:
    assert http_json("GET", f"{gateway.base_url}/healthz")[0] == 200
    status, _, body = http_json("GET", f"{gateway.base_url}/readyz")
    assert status == 200 and body["checks"]["database"]["ok"] and body["checks"]["policy"]["version"] == "v1"
    client(gateway).chat.completions.create(model="small", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    status, headers, text = http_json("GET", f"{gateway.base_url}/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert gateway_counter(gateway, "switchyard_requests_total", model="small", status="200", tier="pro",
                           outcome="ok", **{"class": "standard"}) >= 1
    assert gateway_counter(gateway, "switchyard_requests_total", model="small", pool="small-us", region="us-east") \
        + gateway_counter(gateway, "switchyard_requests_total", model="small", pool="small-eu", region="eu-west") >= 1
    assert gateway_counter(gateway, "switchyard_requests_total", model="-", pool="-", status="404",
                           outcome="refused") >= 1
    assert 'switchyard_policy_info{sha256=' in text
    assert "switchyard_time_to_first_byte_seconds_bucket" in text
    # The loop-lag probe runs every 10 ms from start-up: the gateway has been up for a while.
    assert gateway_counter(gateway, "switchyard_event_loop_lag_seconds_count") > 10
    # The collector's pauses are timed from start-up, by generation (each timing: tests/unit/gateway/test_gc_timer.py;
    # at the gateway's thresholds a young collection may not have come yet).
    assert all(f'switchyard_gc_pause_seconds_count{{generation="{g}"}}' in text for g in range(3))


def test_console_overview_and_live_partial(gateway: Gateway) -> None:
    assert httpx.get(f"{gateway.base_url}/admin/").headers["location"].startswith("/admin/login?next=")
    console = gateway.console("viewer")
    answer = console.get("/admin/")
    status, headers, page = answer.status_code, answer.headers, answer.text
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "policy v1" in page and 'id="engines"' in page and "small-us" in page
    assert "/static/htmx-2.0.11.min.js" in page
    answer = console.get("/admin/", headers={"HX-Request": "true"})
    status, partial = answer.status_code, answer.text
    assert status == 200 and partial.lstrip().startswith('<div id="engines"') and "<html" not in partial
    # Scraped signals show per endpoint; the dead pool's engine is shown down with the reason.
    deadline = time.monotonic() + 5
    while "cannot connect" not in partial and time.monotonic() < deadline:
        time.sleep(0.2)
        partial = console.get("/admin/", headers={"HX-Request": "true"}).text
    assert "<th>Running</th>" in partial and "cannot connect" in partial and ">down" in partial
    status, headers, _ = http_json("GET", f"{gateway.base_url}/static/htmx-2.0.11.min.js")
    assert status == 200 and "javascript" in headers["content-type"]
