"""Switchyard in front of real vLLM servers for the rest of the API: embeddings from a pooling server, the
Responses API, the tokenizer endpoints, and LoRA adapters (one served from the start, one the gateway loads at
run time), through the official SDK.

The servers are the tier's feature servers (``tests/realvllm.py``): ``tiny-llama`` with LoRA on
(``--max-loras 1``, runtime loading allowed) and ``tiny-embed`` (the tiny Llama as an embedding model).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests import realvllm
from tests.integration.conftest import Engines, Gateway, http_json, start_gateway, stop
from tests.realvllm import VllmServer


def _policy(lora: str, embed: str, runtime_path: Path) -> str:
    return f"""\
schema: 1
regions: [local]
pools:
  - {{name: lora, region: local, served_model: {realvllm.LORA_BASE}, endpoints: [{lora}], kv_cache_tokens: 8192,
      max_loras: {realvllm.MAX_LORAS}, runtime_lora_loading: true}}
  - {{name: emb, region: local, served_model: {realvllm.EMBED_MODEL}, endpoints: [{embed}], kv_cache_tokens: 8192,
      task: embed}}
models:
  - {{name: tiny, pools: [lora], context_window: 512, price: {{input_per_mtok: 1, output_per_mtok: 2}}}}
  - {{name: support, adapter_of: lora, adapter: {realvllm.LORA_STATIC}, context_window: 512,
      price: {{input_per_mtok: 1, output_per_mtok: 2}}}}
  - {{name: legal, adapter_of: lora, adapter: {realvllm.LORA_RUNTIME}, adapter_path: "{runtime_path}",
      context_window: 512, price: {{input_per_mtok: 1, output_per_mtok: 2}}}}
  - {{name: embed, kind: embedding, pools: [emb], context_window: 512, price: {{input_per_mtok: 0.5}}}}
priorities:
  standard: {{max_queue_ms: 120000}}
tiers:
  - {{name: pro, priority: standard, models: ["*"]}}
  - {{name: chat-only, priority: standard, models: [tiny]}}
resilience:
  health: {{probe_timeout: 5s, unhealthy_after: 3}}
  breakers:
    endpoint: {{consecutive_failures: 10}}
    pool: {{consecutive_failures: 10}}
"""


@pytest.fixture(scope="module")
def gateway(vllm_lora_server: VllmServer, vllm_embed_server: VllmServer, tiny_lora_adapters: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gw-vllm-api")
    policy = tmp / "policies.yaml"
    policy.write_text(_policy(vllm_lora_server.url, vllm_embed_server.url, tiny_lora_adapters[realvllm.LORA_RUNTIME]))
    gw = start_gateway(Engines(policy, {}, 0), f"sqlite:///{tmp / 'gw.db'}", tmp, "sqlite",
                       {"SWITCHYARD_UPSTREAM_READ_TIMEOUT_S": "120", "SWITCHYARD_SCRAPE_INTERVAL_S": "0.5",
                        "SWITCHYARD_UPSTREAM_CONNECT_TIMEOUT_S": "15", "SWITCHYARD_KEY_CACHE_TTL_S": "600"})
    try:
        gw.keys = {"pro": gw.new_key("pro-co", "pro"), "chat-only": gw.new_key("chat-co", "chat-only")}
        yield gw
    finally:
        assert stop(gw.proc)
        # The LoRA server is shared: it leaves with only its start-up adapter, as it came.
        http_json("POST", vllm_lora_server.url + "/v1/unload_lora_adapter", {"lora_name": realvllm.LORA_RUNTIME})


def sdk(gw: Gateway, key: str = "pro") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=gw.keys[key], max_retries=0, timeout=120)


def route(raw: openai.APIResponse[object]) -> dict[str, str]:
    return dict(part.split("=", 1) for part in raw.headers["x-switchyard-route"].split("; "))


def trace(gw: Gateway, request_id: str) -> list[str]:
    token = gw.env["SWITCHYARD_ADMIN_TOKEN"]
    deadline = time.monotonic() + 10
    while True:
        status, _, body = http_json("GET", f"{gw.base_url}/admin/api/requests/{request_id}",
                                    headers={"Authorization": f"Bearer {token}"})
        if status == 200:
            return list(body["trace"])
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_embeddings_from_a_real_pooling_server(gateway: Gateway) -> None:
    raw = sdk(gateway).embeddings.with_raw_response.create(model="embed", input=["refund my order", "hello"])
    answer = raw.parse()
    assert [len(d.embedding) for d in answer.data] == [realvllm.EMBED_DIM] * 2
    assert answer.usage.prompt_tokens > 0 and route(raw)["pool"] == "emb"
    short = sdk(gateway).embeddings.create(model="embed", input=[[1, 2, 3]], dimensions=16)
    assert len(short.data[0].embedding) == 16 and short.usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError) as wrong:
        sdk(gateway).embeddings.create(model="tiny", input="hi")
    assert wrong.value.code == "model_not_supported"


def test_a_response_and_its_stream_from_real_vllm(gateway: Gateway) -> None:
    client = sdk(gateway)
    raw = client.responses.with_raw_response.create(model="tiny", input="Say something.", max_output_tokens=6,
                                                    extra_body={"ignore_eos": True})
    answer = raw.parse()
    assert answer.usage is not None and answer.usage.output_tokens == 6 and route(raw)["pool"] == "lora"
    events = list(client.responses.create(model="tiny", input="Say something.", max_output_tokens=4, stream=True,
                                          extra_body={"ignore_eos": True}))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert sum(e.type == "response.output_text.delta" for e in events) >= 1
    assert events[-1].response.usage.output_tokens == 4  # type: ignore[union-attr]


def test_tokenize_and_detokenize_through_the_gateway(gateway: Gateway) -> None:
    headers = {"Authorization": f"Bearer {gateway.keys['pro']}"}
    tokens = httpx.post(gateway.base_url + "/tokenize", json={"model": "tiny", "prompt": "hello world"},
                        headers=headers, timeout=60)
    assert tokens.status_code == 200, tokens.text
    ids = tokens.json()["tokens"]
    assert tokens.json()["count"] == len(ids) and tokens.json()["max_model_len"] == 512
    text = httpx.post(gateway.base_url + "/detokenize", json={"model": "tiny", "tokens": ids}, headers=headers,
                      timeout=60)
    assert text.status_code == 200 and "hello world" in text.json()["prompt"]
    refused = httpx.post(gateway.base_url + "/tokenize", json={"model": "embed", "prompt": "x"},
                         headers={"Authorization": f"Bearer {gateway.keys['chat-only']}"}, timeout=60)
    assert refused.status_code == 403


def test_adapters_served_by_name_loaded_at_run_time_and_reported_by_the_engine(gateway: Gateway,
                                                                               vllm_lora_server: VllmServer) -> None:
    client = sdk(gateway)
    chat = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 6, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    base = client.chat.completions.create(model="tiny", **chat)  # type: ignore[arg-type]
    static = client.chat.completions.with_raw_response.create(model="support", **chat)  # type: ignore[arg-type]
    assert static.parse().model == realvllm.LORA_STATIC and route(static)["model"] == "support"
    assert static.parse().choices[0].message.content != base.choices[0].message.content  # the adapter ran
    # Registered at start: the gateway's load finds it there already.
    assert any(line.startswith(f"adapter: {realvllm.LORA_STATIC} was loaded at") for line in
               trace(gateway, static.headers["x-request-id"]))
    # Not registered: the gateway loads it on the replica first, then sends the request.
    loaded = client.chat.completions.with_raw_response.create(model="legal", **chat)  # type: ignore[arg-type]
    assert loaded.parse().model == realvllm.LORA_RUNTIME
    lines = trace(gateway, loaded.headers["x-request-id"])
    assert any(line.startswith(f"adapter: loaded {realvllm.LORA_RUNTIME} at {vllm_lora_server.url} in ")
               for line in lines), lines
    status, _, models = http_json("GET", vllm_lora_server.url + "/v1/models")
    assert status == 200 and realvllm.LORA_RUNTIME in {m["id"] for m in models["data"]}
    # The gateway reads which adapters the engine runs from its vllm:lora_requests_info.
    token = gateway.env["SWITCHYARD_ADMIN_TOKEN"]
    deadline = time.monotonic() + 10
    while True:
        _, _, rows = http_json("GET", gateway.base_url + "/admin/api/endpoints",
                               headers={"Authorization": f"Bearer {token}"})
        row = next(r for r in rows["endpoints"] if r["url"] == vllm_lora_server.url)
        if row["scrape"]["max_loras"] == realvllm.MAX_LORAS and row["scrape"]["lora_adapters"] is not None:
            break
        assert time.monotonic() < deadline, row
        time.sleep(0.2)
    assert realvllm.LORA_RUNTIME in row["adapters_loaded"]
