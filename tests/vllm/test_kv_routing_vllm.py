"""The gateway's knowledge of real vLLM caches, from their KV-cache events (CPU, tiny random-weight Llama).

Two real vLLM servers publish their events (``--kv-events-config``, see ``tests/conftest.py``); a gateway
follows them, with the tiny model's tokenizer.json and chat template as the model's. For a set of prompts
sent straight to each engine, what the gateway predicts that engine holds of the prompt (its admin API's
lookup, what the ``kv-cache-precise`` scorer reads) equals the engine's own ``cached_tokens`` within one
block; a reset of an engine's prefix cache empties the gateway's index of it; and through the gateway, a
conversation's next turn goes to the engine that holds its prefix, with the trace naming the events.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.integration.conftest import Engines, Gateway, eventually, http_json, start_gateway, stop

MODEL = "tiny-llama"


def _policy(servers: Any, tokenizer: str) -> str:
    a, b = servers.a, servers.b
    sockets = ", ".join(f'"{s.url}": {{events: "{s.kv_events.endpoint}", replay: "{s.kv_events.replay_endpoint}"}}'
                        for s in (a, b))
    return f"""\
schema: 1
regions: [local]
pools:
  - {{name: p, region: local, served_model: {MODEL}, endpoints: [{a.url}, {b.url}], kv_cache_tokens: 8192,
      kv_events: {{sockets: {{{sockets}}}}}}}
models:
  - {{name: tiny, pools: [p], context_window: 512, tokenizer: "{tokenizer}", endpoint_profile: precise,
      price: {{input_per_mtok: 0, output_per_mtok: 0}}}}
endpoint_profiles:
  precise:
    filters: [{{type: healthy}}]
    scorers: [{{type: kv-cache-precise, weight: 2}}, {{type: load, weight: 1}}]
    picker: {{type: max-score}}
priorities:
  critical: {{max_queue_ms: 120000}}
tiers:
  - {{name: gold, priority: critical, models: ["*"]}}
resilience:
  health: {{probe_timeout: 5s, unhealthy_after: 3}}
"""


@pytest.fixture(scope="module")
def gateway(vllm_servers: Any, tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    vllm_servers.ensure_running()
    tmp = tmp_path_factory.mktemp("gw-vllm-kv")
    policy = tmp / "policies.yaml"
    policy.write_text(_policy(vllm_servers, str(tiny_model / "tokenizer.json")))
    gw = start_gateway(Engines(policy, {}, 0), f"sqlite:///{tmp / 'gw.db'}", tmp, "sqlite",
                       {"SWITCHYARD_UPSTREAM_READ_TIMEOUT_S": "120", "SWITCHYARD_FLOW_CONTROL": "false",
                        "SWITCHYARD_UPSTREAM_CONNECT_TIMEOUT_S": "15"})
    try:
        gw.keys = {"gold": gw.new_key("kv-co", "gold")}
        eventually(lambda: all(r["kv_events"]["state"] == "live" for r in rows(gw).values()), timeout=30)
        yield gw
    finally:
        assert stop(gw.proc)


def rows(gw: Gateway) -> dict[str, dict[str, Any]]:
    status, _, body = http_json("GET", gw.base_url + "/admin/api/endpoints")
    assert status == 200
    return {row["url"]: row for row in body["endpoints"]}


def predicted(gw: Gateway, messages: list[dict[str, str]]) -> tuple[int, dict[str, int | None]]:
    status, _, body = http_json("POST", gw.base_url + "/admin/api/kv-cache/lookup",
                                {"model": "tiny", "messages": messages})
    assert status == 200 and body["renders"], body
    return body["prompt_tokens"], {r["url"]: r["cached_tokens"] for r in body["endpoints"]}


def block_size(gw: Gateway) -> int:
    sizes = {r["kv_events"]["block_size"] for r in rows(gw).values()} - {None}
    assert len(sizes) == 1, sizes
    return int(sizes.pop())


def direct(url: str, messages: list[dict[str, str]]) -> tuple[int, int]:
    """Send ``messages`` straight to the engine at ``url``: its prompt and cached token counts."""
    engine = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    reply = engine.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens or 0


def conversation(topic: str, turns: int) -> list[dict[str, str]]:
    out = [{"role": "system", "content": f"You answer questions about {topic}. " + "Be brief and exact. " * 5}]
    for i in range(turns):
        out.append({"role": "user", "content": f"Question {i} on {topic}: " + "why and how, in detail " * 3})
        out.append({"role": "assistant", "content": f"Answer {i}: " + "because of the blocks " * 3})
    return out[:-1]


def test_the_gateways_prediction_of_each_engines_cache_is_what_the_engine_then_reports(
        gateway: Gateway, vllm_servers: Any) -> None:
    size = block_size_after_warm_up(gateway, vllm_servers)
    cases = [conversation("tides", 1), conversation("tides", 1), conversation("tides", 2),
             conversation("orbits", 2), conversation("tides", 3)[:3], conversation("orbits", 2)]
    compared = hits = 0
    for messages in cases:
        for server in (vllm_servers.a, vllm_servers.b):
            tokens, guess = predicted(gateway, messages)
            assert tokens < 500
            least = (tokens // size - 1) * size
            prompt_tokens, cached = direct(server.url, messages)
            assert prompt_tokens == tokens  # the gateway renders the prompt as the engine does
            held = guess[server.url]
            assert held is not None and abs(held - cached) <= size, (server.url, held, cached, messages)
            hits += cached > 0
            compared += 1
            # The engine stored the prompt's full blocks; the gateway sees them before the next case.
            eventually(lambda s=server, m=messages, n=least: (predicted(gateway, m)[1][s.url] or 0) >= n, timeout=30)
    assert compared == 12 and hits >= 6  # (measured: the prediction equalled cached_tokens in all 12)


def block_size_after_warm_up(gw: Gateway, servers: Any) -> int:
    """Each engine's block size, as its events say (one long prompt sent to each makes them store blocks)."""
    for server in (servers.a, servers.b):
        direct(server.url, conversation("warm-up", 2))
    eventually(lambda: all(r["kv_events"]["block_size"] for r in rows(gw).values()), timeout=30)
    return block_size(gw)


def test_a_reset_prefix_cache_empties_the_index_and_the_next_turn_follows_its_prefix(
        gateway: Gateway, vllm_servers: Any) -> None:
    sdk = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=gateway.keys["gold"], max_retries=0,
                        timeout=180)
    first = sdk.chat.completions.with_raw_response.create(model="tiny", messages=conversation("rivers", 1),  # type: ignore[arg-type]
                                                          max_tokens=1)
    holder = dict(p.split("=", 1) for p in first.headers["x-switchyard-route"].split("; "))["endpoint"]
    eventually(lambda: (predicted(gateway, conversation("rivers", 2))[1][holder] or 0) > 0, timeout=30)
    raw = sdk.chat.completions.with_raw_response.create(model="tiny", messages=conversation("rivers", 2),  # type: ignore[arg-type]
                                                        max_tokens=1)
    assert dict(p.split("=", 1) for p in raw.headers["x-switchyard-route"].split("; "))["endpoint"] == holder
    status, _, record = http_json("GET", f"{gateway.base_url}/admin/api/requests/{raw.headers['x-request-id']}")
    assert status == 200 and any("kv-cache-precise: engine events:" in line for line in record["trace"])

    assert rows(gateway)[holder]["kv_events"]["blocks"] > 0
    status, _, _ = http_json("POST", holder + "/reset_prefix_cache")
    assert status == 200
    # vLLM sends the clear with its next step: a prompt shorter than a block stores nothing new.
    direct(holder, [{"role": "user", "content": "hi"}])
    eventually(lambda: rows(gateway)[holder]["kv_events"]["blocks"] == 0, timeout=30)
    assert predicted(gateway, conversation("rivers", 2))[1][holder] == 0
