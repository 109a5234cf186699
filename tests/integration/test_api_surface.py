"""The rest of what vLLM serves, under the same policy: embeddings, the Responses API, the tokenizer endpoints and
LoRA adapters, through a real gateway and real simulated engines (the official SDK as the client).

Engines (one ``switchyard sim`` process with a fault control server): ``chat-a``/``chat-b`` serve the generating
model ``small`` (pool ``chat-us``); ``emb-a``/``emb-b`` the embedding model ``embed`` (pool ``embed-us``, ``task:
embed``); ``lora-a``/``lora-b`` the base model of pool ``lora-us``, whose adapters ``support`` and ``legal`` are
loaded at run time by the gateway (``runtime_lora_loading``, one adapter at a time per replica). Tier ``pro`` may
use everything; ``free`` only ``small``; ``tight`` the embedding model with a small token budget.
"""

from __future__ import annotations

import base64
import json
import struct
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.integration.conftest import (
    FAULTS_CLEAR,
    FaultFleet,
    Gateway,
    client,
    fault_fleet,
    gateway_counter,
    http_json,
    route,
    stop,
)

NAMES = ("chat-a", "chat-b", "emb-a", "emb-b", "lora-a", "lora-b")
EMBEDDING_DIM = 384  # the simulator's


def _policy(ports: dict[str, int]) -> str:
    def urls(*names: str) -> str:
        return "[" + ", ".join(f"http://127.0.0.1:{ports[n]}" for n in names) + "]"

    return f"""\
schema: 1
regions: [us-east]
pools:
  - {{name: chat-us, region: us-east, served_model: sim-chat, endpoints: {urls("chat-a", "chat-b")},
      kv_cache_tokens: 100000}}
  - {{name: embed-us, region: us-east, served_model: sim-embed, endpoints: {urls("emb-a", "emb-b")},
      kv_cache_tokens: 100000, task: embed}}
  - {{name: lora-us, region: us-east, served_model: sim-base, endpoints: {urls("lora-a", "lora-b")},
      kv_cache_tokens: 100000, max_loras: 1, runtime_lora_loading: true}}
models:
  - {{name: small, pools: [chat-us], context_window: 4096, tokenizer: switchyard-sim,
      price: {{input_per_mtok: 1, output_per_mtok: 2}}}}
  - {{name: embed, kind: embedding, pools: [embed-us], context_window: 512, price: {{input_per_mtok: 0.5}}}}
  - {{name: support, adapter_of: lora-us, adapter: support-v1, adapter_path: /adapters/support-v1,
      context_window: 4096, price: {{input_per_mtok: 1, output_per_mtok: 2}}}}
  - {{name: legal, adapter_of: lora-us, adapter_path: /adapters/legal, context_window: 4096,
      price: {{input_per_mtok: 1, output_per_mtok: 2}}}}
priorities:
  standard: {{max_queue_ms: 5000}}
tiers:
  - {{name: pro, priority: standard, models: ["*"]}}
  - {{name: free, priority: standard, models: [small]}}
  - {{name: tight, priority: standard, models: [embed], limits: {{tokens_per_minute: 300}}}}
cache:
  - {{name: embeddings, match: {{models: [embed]}}, ttl: 10m}}
resilience:
  health: {{probe_interval: 1}}
  breakers:
    endpoint: {{consecutive_failures: 1000, min_requests: 100000, open_for: 60}}
    pool: {{consecutive_failures: 1000, min_requests: 100000}}
tests:
  - {{name: embeddings go to the embedding pool, request: {{model: embed, tier: pro, kind: embedding, prompt: hi}},
      expect: {{pool: embed-us}}}}
  - {{name: the free tier cannot tokenize for the embedding model,
      request: {{model: embed, tier: free, kind: tokenize, prompt: hi}}, expect: {{status: 403}}}}
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultFleet]:
    yield from fault_fleet(tmp_path_factory.mktemp("api-surface"), NAMES, lambda ports: {"policies": _policy(ports)},
                           "policies")


@pytest.fixture(scope="module")
def gw(fleet: FaultFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gateway = fleet.gateway(tmp_path_factory.mktemp("api-surface-gw"), "policies", {},
                            {"pro": ("acme", "pro"), "free": ("cheap", "free"), "tight": ("small-co", "tight")})
    try:
        yield gateway
    finally:
        assert stop(gateway.proc), "the gateway must stop cleanly on SIGTERM"


@pytest.fixture(autouse=True)
def _clear(fleet: FaultFleet) -> None:
    fleet.fault(**FAULTS_CLEAR)


def _post(gw: Gateway, path: str, body: dict[str, Any], key: str = "pro") -> httpx.Response:
    return httpx.post(gw.base_url + path, json=body, headers={"Authorization": f"Bearer {gw.keys[key]}"}, timeout=30)


def _request_log(gw: Gateway, request_id: str) -> dict[str, Any]:
    """The request's row of the activity API (the Requests page's source)."""
    def found() -> dict[str, Any] | None:
        status, _, body = http_json("GET", f"{gw.base_url}/admin/api/requests/{request_id}",
                                    headers={"Authorization": f"Bearer {gw.env['SWITCHYARD_ADMIN_TOKEN']}"})
        return body if status == 200 else None

    deadline = time.monotonic() + 10
    while (row := found()) is None:
        assert time.monotonic() < deadline, f"request {request_id} never reached the request log"
        time.sleep(0.1)
    return row


# --- embeddings ----------------------------------------------------------------------------------------

def test_embeddings_through_the_sdk_in_every_input_and_format(gw: Gateway) -> None:
    sdk = client(gw, "pro")
    raw = sdk.embeddings.with_raw_response.create(model="embed", input=["refund my order", "the weather today"])
    answer = raw.parse()
    assert [d.index for d in answer.data] == [0, 1]
    assert all(len(d.embedding) == EMBEDDING_DIM for d in answer.data)
    assert answer.usage.prompt_tokens > 0 and answer.usage.total_tokens == answer.usage.prompt_tokens
    where = route(raw)
    assert where["model"] == "embed" and where["pool"] == "embed-us" and where["policy"] == "v1"
    assert raw.headers["x-switchyard-class"].startswith("class standard")

    # One string, a shortened vector (re-normalised), token ids and lists of token ids, base64.
    one = sdk.embeddings.create(model="embed", input="refund my order", dimensions=16)
    assert len(one.data[0].embedding) == 16
    assert abs(sum(v * v for v in one.data[0].embedding) - 1.0) < 1e-6
    ids = sdk.embeddings.create(model="embed", input=[101, 102, 103])
    assert len(ids.data) == 1 and ids.usage.prompt_tokens == 3
    lists = sdk.embeddings.create(model="embed", input=[[101, 102], [103]])
    assert len(lists.data) == 2 and lists.usage.prompt_tokens == 3
    packed = httpx.post(gw.base_url + "/v1/embeddings", json={"model": "embed", "input": "refund my order",
                                                              "encoding_format": "base64"},
                        headers={"Authorization": f"Bearer {gw.keys['pro']}"}, timeout=30).json()
    vector = struct.unpack(f"<{EMBEDDING_DIM}f", base64.b64decode(packed["data"][0]["embedding"]))
    full = sdk.embeddings.create(model="embed", input="refund my order", encoding_format="float")
    assert vector == pytest.approx(full.data[0].embedding, abs=1e-6)


def test_embeddings_are_served_from_the_exact_cache_and_charged_in_input_tokens(gw: Gateway) -> None:
    sdk = client(gw, "pro")
    spent = gateway_counter(gw, "switchyard_spend_total", model="embed")
    text = f"cached embedding {time.monotonic_ns()}"
    first = sdk.embeddings.with_raw_response.create(model="embed", input=text)
    assert first.headers["x-switchyard-cache"].startswith("miss")
    second = sdk.embeddings.with_raw_response.create(model="embed", input=text)
    assert second.headers["x-switchyard-cache"].startswith("hit")
    assert second.parse().data[0].embedding == first.parse().data[0].embedding
    assert "cache=embeddings" in second.headers["x-switchyard-route"]
    row = _request_log(gw, first.headers["x-request-id"])
    assert row["kind"] == "embedding" and row["resolved_model"] == "embed" and row["status"] == 200
    assert row["prompt_tokens"] == first.parse().usage.prompt_tokens and row["completion_tokens"] == 0
    # The console's Requests page says what kind of request each was.
    page = gw.console("viewer").get("/admin/requests").text
    assert f'id="req-{first.headers["x-request-id"]}"' in page and '<span class="badge kind">embedding</span>' in page
    # Priced per input token (0.5 per million); the hit is free (the rule's hit_charge is 0).
    assert gateway_counter(gw, "switchyard_spend_total", model="embed") - spent == pytest.approx(
        row["prompt_tokens"] * 0.5 / 1e6)


def test_the_wrong_kind_of_model_is_a_clear_400(gw: Gateway) -> None:
    sdk = client(gw, "pro")
    with pytest.raises(openai.BadRequestError) as wrong:
        sdk.embeddings.create(model="small", input="hi")
    assert wrong.value.code == "model_not_supported" and "kind embedding" in wrong.value.message
    with pytest.raises(openai.BadRequestError) as wrong:
        sdk.chat.completions.create(model="embed", messages=[{"role": "user", "content": "hi"}])
    assert wrong.value.code == "model_not_supported" and "/v1/embeddings" in wrong.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.embeddings.create(model="embed", input=[])
    assert bad.value.body["param"] == "input"  # type: ignore[index]


def test_tiers_and_token_limits_apply_to_embeddings(gw: Gateway) -> None:
    with pytest.raises(openai.PermissionDeniedError):
        client(gw, "free").embeddings.create(model="embed", input="hi")
    tight = client(gw, "tight")
    # 300 input tokens a minute: a 200-token input fits once, not twice (no output is reserved for embeddings).
    text = " ".join(["word"] * 199)
    first = tight.embeddings.with_raw_response.create(model="embed", input=text, extra_headers={
        "x-switchyard-cache-control": "no-store"})
    assert first.parse().usage.prompt_tokens == 200
    with pytest.raises(openai.RateLimitError) as limited:
        tight.embeddings.create(model="embed", input=text + " again", extra_headers={
            "x-switchyard-cache-control": "no-store"})
    assert "tokens_per_minute" in limited.value.message


def test_an_embedding_engine_failure_falls_back_to_the_other_replica(gw: Gateway, fleet: FaultFleet) -> None:
    fleet.down("emb-a", error_rate=1.0)
    sdk = client(gw, "pro")
    for i in range(4):
        raw = sdk.embeddings.with_raw_response.create(model="embed", input=f"fallback {i} {time.monotonic_ns()}")
        assert raw.status_code == 200
        assert route(raw)["endpoint"] == fleet.url("emb-b")


def test_a_batch_of_embedding_lines(gw: Gateway) -> None:
    sdk = client(gw, "pro")
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "embed", "input": f"batch line {i}"}} for i in range(3)]
    uploaded = sdk.files.create(file=("e.jsonl", "\n".join(json.dumps(x) for x in lines).encode(),
                                      "application/jsonl"), purpose="batch")
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 60
    while (batch := sdk.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.3)
    assert batch.status == "completed" and batch.request_counts is not None
    assert batch.request_counts.completed == 3
    assert batch.output_file_id is not None
    out = [json.loads(x) for x in sdk.files.content(batch.output_file_id).content.splitlines()]
    assert sorted(o["custom_id"] for o in out) == ["e0", "e1", "e2"]
    assert all(len(o["response"]["body"]["data"][0]["embedding"]) == EMBEDDING_DIM for o in out)


# --- the Responses API ----------------------------------------------------------------------------------

def test_a_response_through_the_sdk_is_decided_and_accounted_like_a_chat(gw: Gateway) -> None:
    sdk = client(gw, "pro")
    raw = sdk.responses.with_raw_response.create(model="small", instructions="Be brief.", input="Say hello",
                                                 max_output_tokens=12)
    answer = raw.parse()
    assert answer.object == "response" and answer.status in ("completed", "incomplete") and answer.output_text
    assert answer.usage is not None and answer.usage.output_tokens <= 12
    where = route(raw)
    assert where["model"] == "small" and where["pool"] == "chat-us"
    row = _request_log(gw, raw.headers["x-request-id"])
    assert row["kind"] == "responses" and row["status"] == 200
    assert (row["prompt_tokens"], row["completion_tokens"]) == (answer.usage.input_tokens, answer.usage.output_tokens)
    assert row["max_tokens"] == 12
    # The free tier may not call what it is not allowed, whatever the API.
    with pytest.raises(openai.PermissionDeniedError):
        client(gw, "free").responses.create(model="support", input="hi")


def test_a_streamed_response_passes_the_engines_events_on_and_counts_its_usage(gw: Gateway) -> None:
    sdk = client(gw, "pro")
    with sdk.responses.with_streaming_response.create(model="small", input=[
            {"role": "user", "content": [{"type": "input_text", "text": "tell me a story"}]}],
            max_output_tokens=8, stream=True) as raw:
        request_id = raw.headers["x-request-id"]
        assert raw.headers["content-type"].startswith("text/event-stream")
        events = list(raw.parse())
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert types.count("response.output_text.delta") == 8
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response  # type: ignore[union-attr]
    row = _request_log(gw, request_id)
    assert row["kind"] == "responses" and row["stream"] is True and row["ttft_ms"] is not None
    assert (row["prompt_tokens"], row["completion_tokens"]) == (final.usage.input_tokens, final.usage.output_tokens)


def test_a_follow_up_to_a_response_no_engine_kept_is_the_clients_404(gw: Gateway) -> None:
    # The simulated engines keep no responses (as vLLM without VLLM_ENABLE_RESPONSES_API_STORE): every replica
    # is asked (one may have kept it), none counts it as a fault, and the client gets the engines' 404.
    token = {"Authorization": f"Bearer {gw.env['SWITCHYARD_ADMIN_TOKEN']}"}

    def failures() -> int:
        _, _, rows = http_json("GET", gw.base_url + "/admin/api/endpoints", headers=token)
        return sum(r["breaker"]["consecutive_failures"] for r in rows["endpoints"] if r["pool"] == "chat-us")

    before = failures()
    with pytest.raises(openai.NotFoundError) as missing:
        client(gw, "pro").responses.create(model="small", input="and then?", previous_response_id="resp_gone")
    assert missing.value.code == "response_not_found" and missing.value.param == "previous_response_id"
    assert "Response with id 'resp_gone' not found" in missing.value.message
    assert missing.value.response.headers["x-switchyard-attempts"] == "2"
    assert failures() == before


def test_a_response_moves_on_before_its_first_byte_and_a_broken_stream_ends_with_an_error_event(
        gw: Gateway, fleet: FaultFleet) -> None:
    sdk = client(gw, "pro")
    fleet.down("chat-a", error_rate=1.0)
    for _ in range(3):
        raw = sdk.responses.with_raw_response.create(model="small", input="hi", max_output_tokens=4)
        assert route(raw)["endpoint"] == fleet.url("chat-b")
    fleet.fault(**FAULTS_CLEAR)
    fleet.down("chat-a", abort_rate=1.0, abort_after_tokens=2)
    fleet.down("chat-b", abort_rate=1.0, abort_after_tokens=2)
    with httpx.stream("POST", gw.base_url + "/v1/responses", json={
            "model": "small", "input": "tell me a story", "max_output_tokens": 20, "stream": True},
            headers={"Authorization": f"Bearer {gw.keys['pro']}"}, timeout=30) as response:
        assert response.status_code == 200
        body = b"".join(response.iter_bytes())
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1].startswith(b"event: error\ndata: ")
    error = json.loads(events[-1].split(b"data: ", 1)[1])
    assert error["type"] == "error" and error["code"] == "upstream_stream_broken"
    assert error["sequence_number"] == len(events) - 1  # numbered after the last event passed on
    assert gateway_counter(gw, "switchyard_streams_broken_total", pool="chat-us") >= 1


# --- LoRA adapters ---------------------------------------------------------------------------------------

def _registered(fleet: FaultFleet, name: str) -> set[str]:
    lora = fleet.state(name)["lora"]
    return {a["name"] for a in lora.get("registered", [])}


def test_adapters_are_loaded_where_they_are_sent_and_kept_there(gw: Gateway, fleet: FaultFleet) -> None:
    sdk = client(gw, "pro")
    loads = gateway_counter(gw, "switchyard_adapter_loads_total", pool="lora-us", model="support", outcome="loaded")
    first = sdk.chat.completions.with_raw_response.create(
        model="support", messages=[{"role": "user", "content": "help with my account"}], max_tokens=4)
    answer, where = first.parse(), route(first)
    assert where["model"] == "support" and where["pool"] == "lora-us"
    assert answer.model == "support-v1"  # the engine answered as the adapter, under the name it serves it by
    home = next(name for name in ("lora-a", "lora-b") if fleet.url(name) == where["endpoint"])
    other = "lora-b" if home == "lora-a" else "lora-a"
    assert "support-v1" in _registered(fleet, home) and "support-v1" not in _registered(fleet, other)
    trace = _request_log(gw, first.headers["x-request-id"])["trace"]
    assert any(line.startswith(f"adapter: loaded support-v1 at {where['endpoint']} in ") for line in trace)
    assert gateway_counter(gw, "switchyard_adapter_loads_total", pool="lora-us", model="support",
                           outcome="loaded") == loads + 1
    # Its next requests stay where it is loaded (no second load); the other adapter takes the free replica.
    for _ in range(3):
        again = sdk.chat.completions.with_raw_response.create(
            model="support", messages=[{"role": "user", "content": "and again"}], max_tokens=4)
        assert route(again)["endpoint"] == where["endpoint"]
    legal = sdk.chat.completions.with_raw_response.create(
        model="legal", messages=[{"role": "user", "content": "a contract question"}], max_tokens=4)
    assert route(legal)["endpoint"] == fleet.url(other)
    assert "legal" in _registered(fleet, other)
    assert gateway_counter(gw, "switchyard_adapter_loads_total", pool="lora-us", model="support",
                           outcome="loaded") == loads + 1
    # The engine reports the adapter it runs: a long stream keeps it in vllm:lora_requests_info meanwhile.
    stream = sdk.chat.completions.create(model="support", messages=[{"role": "user", "content": "a long story"}],
                                         max_tokens=200, stream=True)
    next(iter(stream))
    with httpx.Client(timeout=5) as http:
        metrics = http.get(where["endpoint"] + "/metrics").text
    assert 'running_lora_adapters="support-v1"' in metrics
    stream.close()


def test_an_adapter_an_engine_lost_is_loaded_again(gw: Gateway, fleet: FaultFleet) -> None:
    sdk = client(gw, "pro")
    first = sdk.chat.completions.with_raw_response.create(
        model="legal", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    url = route(first)["endpoint"]
    lost = next(n for n in ("lora-a", "lora-b") if fleet.url(n) == url)
    kept = "lora-b" if lost == "lora-a" else "lora-a"
    # The engine forgets it behind the gateway's back (as a restarted engine would): its 404 moves the request on.
    status, _, _ = http_json("POST", url + "/v1/unload_lora_adapter", {"lora_name": "legal"})
    assert status == 200 and "legal" not in _registered(fleet, lost)
    moved = sdk.chat.completions.with_raw_response.create(
        model="legal", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert route(moved)["endpoint"] == fleet.url(kept) and f"{url} 404" in route(moved)["moved_on"]
    # The gateway forgot it had it there: sent there again, it loads it first.
    fleet.down(kept, mode="down")
    back = sdk.chat.completions.with_raw_response.create(
        model="legal", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert route(back)["endpoint"] == url and "legal" in _registered(fleet, lost)
    trace = _request_log(gw, back.headers["x-request-id"])["trace"]
    assert any(line.startswith(f"adapter: loaded legal at {url}") for line in trace)


# --- n > 1 ----------------------------------------------------------------------------------------------

def test_several_choices_are_generated_counted_and_reserved(gw: Gateway) -> None:
    sdk = client(gw, "pro")
    raw = sdk.chat.completions.with_raw_response.create(
        model="small", messages=[{"role": "user", "content": "name a colour"}], n=3, max_tokens=5)
    chat = raw.parse()
    assert sorted(c.index for c in chat.choices) == [0, 1, 2] and chat.usage is not None
    assert chat.usage.completion_tokens == 15  # (the simulator generates max_tokens: no end of its own here)
    row = _request_log(gw, raw.headers["x-request-id"])
    assert row["completion_tokens"] == 15
    stream = sdk.chat.completions.create(model="small", messages=[{"role": "user", "content": "hi"}], n=2,
                                         max_tokens=4, stream=True, stream_options={"include_usage": True})
    seen, usage = set(), None
    for chunk in stream:
        seen |= {c.index for c in chunk.choices}
        usage = chunk.usage or usage
    assert seen == {0, 1} and usage is not None and usage.completion_tokens == 8
    text = sdk.completions.create(model="small", prompt="once upon a time", n=2, max_tokens=3)
    assert len(text.choices) == 2 and text.usage is not None and text.usage.completion_tokens == 6


# --- the tokenizer endpoints ----------------------------------------------------------------------------

def test_tokenize_and_detokenize_under_the_keys_model_permissions(gw: Gateway) -> None:
    tokens = _post(gw, "/tokenize", {"model": "small", "prompt": "hello world"})
    assert tokens.status_code == 200, tokens.text
    body = tokens.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 4096
    assert route_of(tokens)["pool"] == "chat-us"
    text = _post(gw, "/detokenize", {"model": "small", "tokens": body["tokens"]})
    assert text.status_code == 200 and "hello world" in text.json()["prompt"]
    chat = _post(gw, "/tokenize", {"model": "small", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["count"] > 3  # the chat template's tokens too
    assert _post(gw, "/tokenize", {"model": "embed", "prompt": "hi"}).json()["max_model_len"] == 512
    refused = _post(gw, "/tokenize", {"model": "embed", "prompt": "hi"}, key="free")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"
    assert _post(gw, "/tokenize", {"model": "nope", "prompt": "hi"}).status_code == 404
    assert _post(gw, "/tokenize", {"model": "small"}).json()["error"]["param"] == "prompt"
    unauthenticated = httpx.post(gw.base_url + "/tokenize", json={"model": "small", "prompt": "hi"}, timeout=10)
    assert unauthenticated.status_code == 401
    # Nothing is charged or counted as usage: the tokenizer endpoints use no GPU.
    row = _request_log(gw, tokens.headers["x-request-id"])
    assert row["kind"] == "tokenize" and row["pool"] == "chat-us" and row["status"] == 200
    assert any("tokenize: uses only the model's tokenizer" in line for line in row["trace"])


def route_of(response: httpx.Response) -> dict[str, str]:
    return dict(part.split("=", 1) for part in response.headers["x-switchyard-route"].split("; "))


# --- the OpenAPI document and the models list -------------------------------------------------------------

def test_the_new_endpoints_are_in_the_openapi_document_and_the_models_list(gw: Gateway) -> None:
    status, _, document = http_json("GET", gw.base_url + "/openapi/openapi.json")
    assert status == 200
    for path in ("/v1/embeddings", "/v1/responses", "/tokenize", "/detokenize"):
        assert "post" in document["paths"][path], path
    listed = {m.id for m in client(gw, "pro").models.list()}
    assert {"small", "embed", "support", "legal"} <= listed
    assert {m.id for m in client(gw, "free").models.list()} == {"small"}
    assert gateway_counter(gw, "switchyard_requests_total") > 0
