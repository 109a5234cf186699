"""The response cache through real gateways and a real simulator: exact and semantic hits and misses,
streaming replay read by the official SDK, bypass, tenant scope, accounting, purge, hot reload, and one
Redis cache shared by two gateways.

Engines (one ``switchyard sim`` process): pool ``gen`` (model ``sim-m``) serves every generating model;
pool ``emb`` serves embeddings for the semantic rule. Each cache rule has its own model, so tests do not
meet each other's entries.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.helpers import free_port
from tests.integration.conftest import (
    SWITCHYARD,
    Engines,
    Gateway,
    gateway_counter,
    http_json,
    start_gateway,
    stop,
    wait_http,
)

ADMIN = "cache-admin-token"
PRICE = "{input_per_mtok: 1000, output_per_mtok: 1000}"


def _policy(gen: int, emb: int, rules: str) -> str:
    models = "\n".join(f"  - {{name: {m}, pools: [gen], context_window: 4096, price: {PRICE}}}"
                       for m in ("exact", "faq", "public", "charged", "plain"))
    return f"""\
schema: 1
regions: [us-east]
pools:
  - {{name: gen, region: us-east, served_model: sim-m, endpoints: [http://127.0.0.1:{gen}], kv_cache_tokens: 100000}}
  - {{name: emb, region: us-east, served_model: sim-emb, task: embed, endpoints: [http://127.0.0.1:{emb}],
      kv_cache_tokens: 100000}}
models:
{models}
priorities:
  critical: {{max_queue_ms: 10000}}
tiers:
  - {{name: gold, priority: critical, models: ["*"], limits: {{tokens_per_minute: 100000}}}}
cache:
{rules}"""


RULES = """\
  - {name: exact, match: {models: [exact]}, ttl: 1h}
  - {name: faq, match: {models: [faq]}, mode: semantic, min_similarity: 0.8, embedding_pool: emb, ttl: 1h}
  - {name: public, match: {models: [public]}, ttl: 1h, scope: global}
  - {name: charged, match: {models: [charged]}, ttl: 1h, hit_charge: 0.5}
"""


@dataclass
class Fleet:
    folder: Path
    gen: int
    emb: int

    def engine_requests(self) -> float:
        """Generation requests the engine has finished (any reason)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.gen}/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total{"))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    folder = tmp_path_factory.mktemp("cache")
    gen, emb, control = free_port(), free_port(), free_port()
    (folder / "policies.yaml").write_text(_policy(gen, emb, RULES))
    proc = subprocess.Popen([SWITCHYARD, "sim", "--policy", str(folder / "policies.yaml"), "--time-scale", "20",
                             "--control-port", str(control)])
    try:
        for port in (gen, emb, control):
            wait_http(f"http://127.0.0.1:{port}/health", proc)
        yield Fleet(folder, gen, emb)
    finally:
        stop(proc)


def _start(fleet: Fleet, tmp: Path, policy: Path, env: dict[str, str] | None = None) -> Gateway:
    gw = start_gateway(Engines(policy, {}, 0), f"sqlite:///{tmp / 'gw.db'}", tmp, "sqlite",
                       {"SWITCHYARD_ADMIN_TOKEN": ADMIN, **(env or {})})
    gw.keys = {"a": gw.new_key("tenant-a", "gold"), "b": gw.new_key("tenant-b", "gold")}
    return gw


@pytest.fixture(scope="module")
def gw(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("cache-gw")
    policy = tmp / "policies.yaml"
    policy.write_text((fleet.folder / "policies.yaml").read_text())
    gateway = _start(fleet, tmp, policy)
    try:
        yield gateway
    finally:
        assert stop(gateway.proc)


def sdk(gw: Gateway, who: str = "a") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=gw.keys[who], max_retries=0, timeout=30)


def chat(gw: Gateway, model: str, text: str, who: str = "a", system: str | None = None,
         **extra: Any) -> tuple[str, dict[str, str]]:
    """One chat completion (temperature 0 unless given); its text and response headers."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    extra.setdefault("temperature", 0)
    extra.setdefault("max_tokens", 12)
    raw = sdk(gw, who).chat.completions.with_raw_response.create(model=model, messages=messages,  # type: ignore[arg-type]
                                                                   **extra)
    return raw.parse().choices[0].message.content or "", {k.lower(): v for k, v in raw.headers.items()}


def cache_of(headers: dict[str, str]) -> str:
    return headers.get("x-switchyard-cache", "").split(";")[0]


# --- exact ----------------------------------------------------------------------------------------------------


def test_an_identical_deterministic_request_is_answered_from_the_cache(fleet: Fleet, gw: Gateway) -> None:
    first, h1 = chat(gw, "exact", "Name three rivers in Europe.")
    assert cache_of(h1) == "miss" and "rule=exact" in h1["x-switchyard-cache"]
    engine = fleet.engine_requests()
    second, h2 = chat(gw, "exact", "Name three rivers in Europe.")
    assert cache_of(h2) == "hit" and second == first
    assert fleet.engine_requests() == engine  # the engine did not see it
    assert "cache=exact" in h2["x-switchyard-route"].split("; ")
    # The key is the request's meaning, not its bytes: another key order and spacing hits too.
    body = {"temperature": 0, "max_tokens": 12, "messages": [{"content": "Name three rivers in Europe.",
                                                                "role": "user"}], "model": "exact"}
    status, headers, answer = http_json("POST", gw.base_url + "/v1/chat/completions", raw=json.dumps(body, indent=3)
                                        .encode(), headers={"Authorization": f"Bearer {gw.keys['a']}"})
    assert status == 200 and cache_of(headers) == "hit" and answer["choices"][0]["message"]["content"] == first
    assert gateway_counter(gw, "switchyard_cache_lookups_total", rule="exact", result="hit") >= 2


@pytest.mark.parametrize(("changed", "kwargs"), [
    ("a different number", {"text": "Name four rivers in Europe."}),
    ("a different system prompt", {"system": "Answer in French."}),
    ("other sampling parameters", {"max_tokens": 13}),
])
def test_anything_that_changes_the_answer_misses(gw: Gateway, changed: str, kwargs: dict[str, Any]) -> None:
    chat(gw, "exact", "Name three rivers in Asia.")
    text = kwargs.pop("text", "Name three rivers in Asia.")
    _, headers = chat(gw, "exact", text, **kwargs)
    assert cache_of(headers) == "miss", changed


def test_only_deterministic_requests_are_cached(gw: Gateway) -> None:
    for _ in range(2):
        _, headers = chat(gw, "exact", "Say something random.", temperature=0.8)
        assert "x-switchyard-cache" not in headers
    chat(gw, "exact", "Say something seeded.", temperature=0.8, seed=7)
    _, headers = chat(gw, "exact", "Say something seeded.", temperature=0.8, seed=7)
    assert cache_of(headers) == "hit"


# --- streaming ------------------------------------------------------------------------------------------------


def test_a_streamed_answer_is_stored_once_complete_and_replayed_as_a_stream(fleet: Fleet, gw: Gateway) -> None:
    messages = [{"role": "user", "content": "Stream me a short poem."}]
    live = list(sdk(gw).chat.completions.create(model="exact", messages=messages, max_tokens=12,  # type: ignore[arg-type]
                                                temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in live if c.choices)
    assert all(c.usage is None for c in live)  # the usage chunk the gateway asked for to store it stayed with it
    engine = fleet.engine_requests()
    raw = sdk(gw).chat.completions.with_raw_response.create(
        model="exact", messages=messages, max_tokens=12, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True})
    assert cache_of({k.lower(): v for k, v in raw.headers.items()}) == "hit"
    replayed = list(raw.parse())
    assert "".join(c.choices[0].delta.content or "" for c in replayed if c.choices) == text
    assert replayed[-1].usage is not None and replayed[-1].usage.completion_tokens == 12
    assert replayed[0].choices[0].delta.role == "assistant"
    # A client that does not stream gets the same answer from the entry the stream left.
    full, headers = chat(gw, "exact", "Stream me a short poem.")
    assert cache_of(headers) == "hit" and full == text
    assert fleet.engine_requests() == engine


def test_a_broken_stream_is_never_stored(fleet: Fleet, gw: Gateway) -> None:
    messages = [{"role": "user", "content": "This stream will break."}]
    status, _, _ = http_json("POST", f"http://127.0.0.1:{fleet.gen}/sim/faults", {"abort_rate": 1.0,
                                                                                 "abort_after_tokens": 3})
    assert status == 200
    try:
        with pytest.raises(openai.APIError):
            for _ in sdk(gw).chat.completions.create(model="exact", messages=messages, max_tokens=12,  # type: ignore[arg-type]
                                                     temperature=0, stream=True):
                pass
    finally:
        http_json("POST", f"http://127.0.0.1:{fleet.gen}/sim/faults", {"abort_rate": 0.0})
    _, headers = chat(gw, "exact", "This stream will break.")
    assert cache_of(headers) == "miss"


# --- bypass, scope, accounting --------------------------------------------------------------------------------


def test_the_cache_control_header_skips_reading_or_storing(gw: Gateway) -> None:
    chat(gw, "exact", "Cached already?")
    _, headers = chat(gw, "exact", "Cached already?", extra_headers={"x-switchyard-cache-control": "no-cache"})
    assert headers["x-switchyard-cache"].startswith("bypass")  # served by the engine, stored again
    _, headers = chat(gw, "exact", "Never stored.", extra_headers={"x-switchyard-cache-control": "no-store"})
    assert "store=no" in headers["x-switchyard-cache"]
    _, headers = chat(gw, "exact", "Never stored.")
    assert cache_of(headers) == "miss"
    with pytest.raises(openai.BadRequestError) as bad:
        chat(gw, "exact", "x", extra_headers={"x-switchyard-cache-control": "sometimes"})
    assert bad.value.code == "invalid_cache_control"


def test_tenant_entries_are_never_served_to_another_tenant_but_global_ones_are(gw: Gateway) -> None:
    chat(gw, "exact", "What is our internal roadmap?", who="a")
    assert cache_of(chat(gw, "exact", "What is our internal roadmap?", who="a")[1]) == "hit"
    assert cache_of(chat(gw, "exact", "What is our internal roadmap?", who="b")[1]) == "miss"
    chat(gw, "public", "What is the boiling point of water?", who="a")
    assert cache_of(chat(gw, "public", "What is the boiling point of water?", who="b")[1]) == "hit"


def test_a_hit_costs_what_the_rule_says(gw: Gateway) -> None:
    chat(gw, "exact", "Free when cached.")
    spent = gateway_counter(gw, "switchyard_spend_total", model="exact")
    _, headers = chat(gw, "exact", "Free when cached.")
    # hit_charge 0: no limit is touched and nothing is spent; the usage is recorded as cached tokens.
    assert cache_of(headers) == "hit" and "x-ratelimit-remaining-tokens" not in headers
    assert gateway_counter(gw, "switchyard_spend_total", model="exact") == spent
    assert gateway_counter(gw, "switchyard_tokens_total", model="exact", kind="cache_hit") > 0
    chat(gw, "charged", "Half price when cached.")
    miss_spend = gateway_counter(gw, "switchyard_spend_total", model="charged")
    _, headers = chat(gw, "charged", "Half price when cached.")
    # hit_charge 0.5: the hit goes through the limits and costs half of what the answer cost.
    assert cache_of(headers) == "hit" and "x-ratelimit-remaining-tokens" in headers
    assert gateway_counter(gw, "switchyard_spend_total", model="charged") == pytest.approx(1.5 * miss_spend)


# --- semantic -------------------------------------------------------------------------------------------------


def test_a_paraphrase_hits_the_semantic_cache_and_another_question_misses(gw: Gateway) -> None:
    first, headers = chat(gw, "faq", "What is the capital of France?")
    assert cache_of(headers) == "miss" and "mode=semantic" in headers["x-switchyard-cache"]
    again, headers = chat(gw, "faq", "Tell me the capital of France?")
    assert cache_of(headers) == "hit" and again == first
    assert 0.8 <= float(headers["x-switchyard-cache"].split("similarity=")[1].split(";")[0]) < 1.0
    assert cache_of(chat(gw, "faq", "What is the capital of Germany?")[1]) == "miss"
    # Another conversation context (a system prompt) never shares neighbours.
    assert cache_of(chat(gw, "faq", "What is the capital of France?", system="You are a pirate.")[1]) == "miss"


# --- purge, reload, Redis -------------------------------------------------------------------------------------


def test_purge_by_tenant_through_the_admin_api(gw: Gateway) -> None:
    chat(gw, "exact", "Purge me.", who="a")
    chat(gw, "exact", "Purge me.", who="b")
    status, _, _ = http_json("POST", gw.base_url + "/admin/api/cache/purge", {"tenant": "tenant-a"})
    assert status == 403 or status == 401  # the admin token is required
    status, _, answer = http_json("POST", gw.base_url + "/admin/api/cache/purge", {"tenant": "tenant-a"},
                                  headers={"Authorization": f"Bearer {ADMIN}"})
    assert status == 200 and answer["purged"] >= 1
    assert cache_of(chat(gw, "exact", "Purge me.", who="a")[1]) == "miss"
    assert cache_of(chat(gw, "exact", "Purge me.", who="b")[1]) == "hit"
    status, _, answer = http_json("POST", gw.base_url + "/admin/api/cache/purge", {},
                                  headers={"Authorization": f"Bearer {ADMIN}"})
    assert status == 200 and answer["purged"] >= 1
    assert cache_of(chat(gw, "exact", "Purge me.", who="b")[1]) == "miss"


def test_a_changed_cache_rule_applies_at_the_next_request(fleet: Fleet, tmp_path: Path) -> None:
    policy = tmp_path / "policies.yaml"
    policy.write_text((fleet.folder / "policies.yaml").read_text())
    gateway = _start(fleet, tmp_path, policy)
    try:
        chat(gateway, "exact", "Reload me.")
        assert cache_of(chat(gateway, "exact", "Reload me.")[1]) == "hit"
        policy.write_text(_policy(fleet.gen, fleet.emb, RULES.replace("models: [exact]", "models: [plain]")))
        deadline = 50
        while "x-switchyard-cache" in chat(gateway, "exact", "Reload me.")[1]:
            deadline -= 1
            assert deadline, "the rule change never applied"
    finally:
        assert stop(gateway.proc)


def test_two_gateways_share_one_redis_cache(fleet: Fleet, tmp_path: Path) -> None:
    prefix = f"sy-cache-test-{free_port()}:"
    env = {"SWITCHYARD_REDIS_URL": "redis://127.0.0.1:6379/0", "SWITCHYARD_REDIS_KEY_PREFIX": prefix}
    one = _start(fleet, tmp_path, fleet.folder / "policies.yaml", env)
    try:
        # A second replica on the same database (so the same keys) and the same Redis.
        two = start_gateway(Engines(fleet.folder / "policies.yaml", {}, 0), one.env["SWITCHYARD_DATABASE_URL"],
                            tmp_path, "sqlite", {**env, "SWITCHYARD_ADMIN_TOKEN": ADMIN})
        two.keys = one.keys
        try:
            chat(one, "exact", "Shared between replicas.")
            assert cache_of(chat(two, "exact", "Shared between replicas.")[1]) == "hit"
            chat(two, "faq", "Where is the Eiffel Tower?")
            _, headers = chat(one, "faq", "where is the eiffel tower")
            assert cache_of(headers) == "hit" and "similarity=" in headers["x-switchyard-cache"]
            # A purge through one replica is seen by the other.
            status, _, _ = http_json("POST", one.base_url + "/admin/api/cache/purge", {"model": "exact"},
                                     headers={"Authorization": f"Bearer {ADMIN}"})
            assert status == 200
            assert cache_of(chat(two, "exact", "Shared between replicas.")[1]) == "miss"
        finally:
            assert stop(two.proc)
    finally:
        assert stop(one.proc)
