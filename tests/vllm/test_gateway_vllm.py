"""Switchyard in front of two real vLLM servers (CPU, tiny random-weight Llama).

What a client sees through the gateway, and what the gateway does with the engines' real
signals: priority forwarded and honoured, load read from the real ``/metrics``, a repeated long
prompt kept on the replica whose prefix cache then hits, and a replica killed mid-run.

The gateway runs with its own queues off (``SWITCHYARD_FLOW_CONTROL=false``) so that requests queue
inside vLLM, where the forwarded ``priority`` is what orders them (flow control itself is tested
against the simulator, ``tests/integration/test_flow_control.py``).
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import Engines, Gateway, http_json, start_gateway, stop

MODEL = "tiny-llama"
#: Tries at the priority test's setup (each ends within about ten seconds). 12 were used up twice in a row
#: once on a loaded machine (a clean run passed right after), so a flaky setup gets more room; the
#: assertions after it are not retried.
TRIES = 24
EXACT = {"ignore_eos": True}  # the model's text is noise: exact lengths need ignore_eos


def _policy(a: str, b: str) -> str:
    return f"""\
schema: 1
regions: [local]
pools:
  - {{name: pa, region: local, served_model: {MODEL}, endpoints: [{a}], kv_cache_tokens: 8192,
      priority_scheduling: true}}
  - {{name: pb, region: local, served_model: {MODEL}, endpoints: [{b}], kv_cache_tokens: 8192,
      priority_scheduling: true}}
models:
  - {{name: tiny, pools: [pa, pb], context_window: 512, price: {{input_per_mtok: 0, output_per_mtok: 0}}}}
  - {{name: tiny-a, pools: [pa], context_window: 512, price: {{input_per_mtok: 0, output_per_mtok: 0}}}}
priorities:
  critical: {{max_queue_ms: 120000}}
  sheddable: {{max_queue_ms: 120000}}
tiers:
  - {{name: gold, priority: critical, models: ["*"]}}
  - {{name: free, priority: sheddable, models: ["*"]}}
# Two vLLM servers computing on both cores starve their own API servers: /health may take seconds,
# and one slow answer must not take a one-endpoint pool out for the tests that follow.
resilience:
  health: {{probe_timeout: 5s, unhealthy_after: 3}}
  breakers:
    endpoint: {{consecutive_failures: 10}}
    pool: {{consecutive_failures: 10}}
"""


@pytest.fixture(scope="module")
def gateway(vllm_servers: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    vllm_servers.ensure_running()
    tmp = tmp_path_factory.mktemp("gw-vllm")
    policy = tmp / "policies.yaml"
    policy.write_text(_policy(vllm_servers.a.url, vllm_servers.b.url))
    gw = start_gateway(Engines(policy, {}, 0), f"sqlite:///{tmp / 'gw.db'}", tmp, "sqlite",
                       {"SWITCHYARD_UPSTREAM_READ_TIMEOUT_S": "120", "SWITCHYARD_SCRAPE_INTERVAL_S": "0.5",
                        "SWITCHYARD_FLOW_CONTROL": "false", "SWITCHYARD_UPSTREAM_CONNECT_TIMEOUT_S": "15",
                        "SWITCHYARD_KEY_CACHE_TTL_S": "600"})
    try:
        gw.keys = {"gold": gw.new_key("gold-co", "gold"), "free": gw.new_key("free-co", "free")}
        yield gw
    finally:
        assert stop(gw.proc)


def client(gw: Gateway, tier: str = "gold") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=gw.keys[tier], max_retries=0, timeout=180)


def route(raw: openai.APIResponse[object]) -> dict[str, str]:
    return dict(part.split("=", 1) for part in raw.headers["x-switchyard-route"].split("; "))


def counter(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def sized_prompt(url: str, topic: str, tokens: int) -> str:
    """A prompt of about ``tokens`` tokens under the tiny model's tokenizer (asked of vLLM's /tokenize)."""
    words: list[str] = []
    while True:
        text = f"{topic}: " + " ".join(words)
        _, _, body = http_json("POST", url + "/tokenize", {"model": MODEL, "prompt": text})
        if body["count"] >= tokens:
            return text
        words += [f"{topic.split()[0]}{len(words) + i}" for i in range(8)]


def endpoint_rows(gw: Gateway) -> dict[str, dict[str, Any]]:
    status, _, body = http_json("GET", gw.base_url + "/admin/api/endpoints")
    assert status == 200
    return {row["url"]: row for row in body["endpoints"]}


def test_chat_and_completions_with_usage_through_the_gateway(gateway: Gateway) -> None:
    c = client(gateway)
    raw = c.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hello there"}], max_tokens=7, extra_body=EXACT)
    chat = raw.parse()
    assert route(raw)["pool"] in ("pa", "pb")
    assert chat.model == MODEL and chat.object == "chat.completion"
    assert chat.usage is not None and chat.usage.completion_tokens == 7
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 7 and chat.usage.prompt_tokens > 0
    assert chat.choices[0].finish_reason == "length"

    done = c.completions.create(model="tiny", prompt="once upon a time", max_tokens=5, extra_body=EXACT)
    assert done.object == "text_completion" and done.usage is not None and done.usage.completion_tokens == 5

    chunks = list(c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "stream please"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}, extra_body=EXACT))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) >= 1

    text = list(c.completions.create(model="tiny", prompt="abc", max_tokens=4, stream=True,
                                     stream_options={"include_usage": True}, extra_body=EXACT))
    assert text[-1].usage is not None and text[-1].usage.completion_tokens == 4


def test_engine_errors_reach_the_client_as_openai_errors(gateway: Gateway) -> None:
    c = client(gateway)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="tiny", prompt="x " * 2000, max_tokens=5)
    assert err.value.status_code == 400
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                  temperature=-3)


async def test_priority_is_forwarded_and_a_queued_higher_class_overtakes(vllm_servers: Any,
                                                                         gateway: Gateway) -> None:
    """Server a runs 8 sequences at most: 16 equal free-tier requests make 8 run and 8 queue,
    then a short free and a short gold request queue behind them. Gold (priority 0, critical) is
    scheduled ahead of the eight queued free requests (priority 10, sheddable) — at once, when
    vLLM preempts a running free request for it, else when a slot frees — and finishes before the
    second wave does; the short free request waits its turn behind them (FCFS would put both in
    the third wave, after every free request).

    (Whether the gateway's scrape of /metrics shows the queue is not asserted here: on two cores
    vLLM's API server is starved while its engine computes, and a scrape landing inside the 2 s
    that the queue lasts was luck — it failed one clean run in three. The scraped signals of real
    vLLM are checked idle in ``test_load_signals_come_from_the_real_metrics``.)"""
    a = vllm_servers.a.url
    clients = {tier: openai.AsyncOpenAI(base_url=gateway.base_url + "/v1", api_key=gateway.keys[tier],
                                        max_retries=0, timeout=180) for tier in ("free", "gold")}
    finished: dict[str, float] = {}

    async def call(tier: str, tokens: int, label: str) -> None:
        await clients[tier].completions.create(model="tiny-a", prompt=f"{label} go", max_tokens=tokens,
                                               extra_body=EXACT)
        finished[label] = time.monotonic()

    sent: list[asyncio.Task[None]] = []

    async def in_flight(count: int) -> bool:
        """Until the gateway has sent ``count`` requests on to server a (False: one finished first)."""
        deadline = time.monotonic() + 30
        while (await asyncio.to_thread(endpoint_rows, gateway))[a]["in_flight"] < count:
            for task in sent:
                if task.done() and task.exception() is not None:
                    raise AssertionError(f"a request failed early: {task.exception()!r}")
            if finished:
                return False  # a request finished before the rest arrived: no queue formed
            assert time.monotonic() < deadline, f"the gateway never had {count} requests in flight at {a}"
            # Not much more often: on two busy cores each look takes the gateway's time from the requests.
            await asyncio.sleep(0.05)
        return True

    async def scenario() -> bool:
        """One try; False when the arrivals trickled in too slowly for a queue to form (two busy cores)."""
        finished.clear()
        sent.clear()
        # Sixteen connections opened (client to gateway, gateway to vLLM) before the clock matters.
        await asyncio.gather(*(clients["free"].completions.create(model="tiny-a", prompt="warm", max_tokens=1)
                               for _ in range(16)))
        sent.extend(asyncio.create_task(call("free", 480, f"fill{i}")) for i in range(16))
        try:
            if not await in_flight(16):
                return False
            sent.append(asyncio.create_task(call("free", 3, "low")))
            if not await in_flight(17):
                return False
            sent.append(asyncio.create_task(call("gold", 3, "high")))
            return await in_flight(18)
        finally:
            await asyncio.gather(*sent)

    # The setup may be retried; the assertions below are not. On two cores a try fails its setup more
    # often than not (seen: 1, 2, 4 and 5 tries to a good one): the engine computing the first wave
    # starves the gateway's arrivals and vLLM's own API server, which then answers in bursts.
    for _ in range(TRIES):
        if await scenario():
            break
    else:
        raise AssertionError(f"{TRIES} tries, and the requests never all arrived before one finished: {finished}")
    fills = sorted(finished[f"fill{i}"] for i in range(16))
    # Gold jumped the eight queued free requests (first come, first served it would finish after all
    # sixteen); free's own short request did not (it finishes after the second wave began).
    assert finished["high"] < fills[-1] and fills[8] < finished["low"], finished


def test_load_signals_come_from_the_real_metrics(vllm_servers: Any, gateway: Gateway) -> None:
    """Idle engines: fresh scrapes of both, showing nothing running or waiting (once the
    previous test's last requests have left the engines' gauges). One request straight to each
    engine first: the earlier tests may have sent none to server b, whose prefix-cache counters
    then read 0."""
    for server in (vllm_servers.a, vllm_servers.b):
        status, _, _ = http_json("POST", server.url + "/v1/completions", {"model": MODEL, "prompt": "count me",
                                                                          "max_tokens": 1})
        assert status == 200
    deadline = time.monotonic() + 10
    while True:
        rows = endpoint_rows(gateway)
        scrapes = [rows[url]["scrape"] for url in (vllm_servers.a.url, vllm_servers.b.url)]
        if all(s["fresh"] and s["running"] == 0 and s["waiting"] == 0 and s["prefix_cache_queries"]
               for s in scrapes):
            break
        assert time.monotonic() < deadline, scrapes
        time.sleep(0.1)
    for scrape in scrapes:
        assert scrape["error"] is None
        assert 0 <= scrape["kv_usage"] <= 1
        assert scrape["prefix_cache_queries"] > 0 and scrape["prefix_cache_hits"] >= 0
    assert rows[vllm_servers.a.url]["load"] == 0 and rows[vllm_servers.a.url]["healthy"] is True


def test_a_repeated_long_prompt_stays_on_the_replica_whose_prefix_cache_hits(
        vllm_servers: Any, gateway: Gateway) -> None:
    urls = [vllm_servers.a.url, vllm_servers.b.url]
    homes = set()
    for topic in ("rivers and mountains", "ships at sea"):
        # About 300 tokens: over two of the CPU backend's 128-token KV blocks, inside 512.
        text = sized_prompt(vllm_servers.a.url, topic, 300)
        before = {u: counter(u, "vllm:prefix_cache_hits_total") for u in urls}
        served = []
        for _ in range(3):
            raw = client(gateway).completions.with_raw_response.create(
                model="tiny", prompt=text, max_tokens=2, extra_body=EXACT)
            usage = raw.parse().usage
            assert usage is not None and 128 * 2 <= usage.prompt_tokens < 500, usage
            served.append(route(raw)["endpoint"])
        assert len(set(served)) == 1, served
        home = served[0]
        other = next(u for u in urls if u != home)
        after = {u: counter(u, "vllm:prefix_cache_hits_total") for u in urls}
        assert after[home] - before[home] >= 2 * 128, (before, after)
        assert after[other] == before[other], (before, after)
        homes.add(home)
    # Ties between idle replicas go at random: ten more new prompts (one token each) all landing on the
    # replica that served both topics has probability 2^-11 in all.
    for i in range(10):
        raw = client(gateway).completions.with_raw_response.create(
            model="tiny", prompt=f"a fresh topic, number {i}", max_tokens=1, extra_body=EXACT)
        homes.add(route(raw)["endpoint"])
    assert homes == set(urls), "two different prompts should not be herded onto one replica when both are idle"


@pytest.mark.kills_a_server
def test_a_replica_killed_mid_run_and_the_other_takes_over(vllm_servers: Any, gateway: Gateway) -> None:
    b = vllm_servers.b.url
    results: list[tuple[str, str]] = []
    errors: list[BaseException] = []
    stop_load = threading.Event()

    def load() -> None:
        c = client(gateway)
        i = 0
        while not stop_load.is_set():
            i += 1
            try:
                raw = c.completions.with_raw_response.create(model="tiny", prompt=f"request {i}", max_tokens=30,
                                                             extra_body=EXACT)
                assert raw.parse().usage.completion_tokens == 30  # type: ignore[union-attr]
                results.append((route(raw)["endpoint"], route(raw).get("attempt", "1")))
            except BaseException as exc:  # collected and reported below
                errors.append(exc)

    try:
        workers = [threading.Thread(target=load) for _ in range(3)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 60
        while not any(ep == b for ep, _ in results) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any(ep == b for ep, _ in results), "replica b never got traffic"
        vllm_servers.b.kill()
        killed_at = len(results)
        time.sleep(4)
        stop_load.set()
        for w in workers:
            w.join(timeout=120)
        assert not errors, errors
        after = results[killed_at + 3:]  # requests in flight at the kill may have started on b
        assert after and all(ep != b for ep, _ in after), results
        assert endpoint_rows(gateway)[b]["healthy"] is False
    finally:
        stop_load.set()  # b stays down: the next test that needs it starts it again


@pytest.mark.kills_a_server
def test_a_stream_whose_replica_is_killed_mid_answer_completes_on_the_other(vllm_servers: Any,
                                                                           gateway: Gateway) -> None:
    """SIGKILL the real server streaming an answer: the gateway continues it on the other server with vLLM's
    ``continue_final_message``, and the client's one stream carries the whole answer."""
    vllm_servers.ensure_running()
    # Both replicas in service in the gateway's view (an earlier test may have killed one: its probes and breaker
    # must have brought it back), so that the other can take the answer over.
    deadline = time.monotonic() + 90
    while not all(row["healthy"] for row in endpoint_rows(gateway).values()):
        assert time.monotonic() < deadline, endpoint_rows(gateway)
        time.sleep(0.5)
    messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    budget = 400

    def attempt() -> tuple[Any, Any, list[Any], dict[str, Any]]:
        raw = client(gateway).chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=budget, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=EXACT)
        serving = route(raw)["endpoint"]
        server, other = ((vllm_servers.a, vllm_servers.b) if serving == vllm_servers.a.url else
                         (vllm_servers.b, vllm_servers.a))
        stream = raw.parse()
        head: list[Any] = []
        for chunk in stream:
            head.append(chunk)
            if sum(1 for c in head if c.choices and c.choices[0].delta.content) >= 3:
                break
        server.kill()  # mid-answer: the connection to the gateway is cut (it stays down: see the loop below)
        chunks = head + list(stream)
        status, _, body = http_json("GET", f"{gateway.base_url}/admin/api/requests/{raw.headers['x-request-id']}")
        assert status == 200, body
        return server, other, chunks, body

    # The kill can come too late: a tiny model on CPU may have sent the whole answer, buffered on its way to the
    # client, before the client read its third token. Such a try (answered by the killed server alone) tests
    # nothing and is made again.
    for _ in range(3):
        server, other, chunks, body = attempt()
        if not (body["resumes"] == 0 and body["endpoint"] == server.url and body["status"] == 200):
            break
        vllm_servers.ensure_running()  # the killed server, back for another try
        deadline = time.monotonic() + 90
        while not all(row["healthy"] for row in endpoint_rows(gateway).values()):
            assert time.monotonic() < deadline, endpoint_rows(gateway)
            time.sleep(0.5)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    text = "".join(pieces)
    assert len({c.id for c in chunks}) == 1
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == budget  # the two engines' tokens add up to the budget
    # What came after the break is what the other server answers the request continued from the text the client
    # had (greedy decoding: the same input gives the same output).
    assert body["resumes"] == 1 and body["endpoint"] == other.url, body
    resumed = next(line for line in body["trace"] if line.startswith("stream: resuming after "))
    produced = int(resumed.split("stream: resuming after ", 1)[1].split(" ", 1)[0])
    so_far = "".join(pieces[:produced])
    status, _, direct = http_json("POST", other.url + "/v1/chat/completions", {
        "model": MODEL, "messages": [*messages, {"role": "assistant", "content": so_far}], "temperature": 0,
        "max_tokens": budget - produced, "continue_final_message": True, "add_generation_prompt": False, **EXACT})
    assert status == 200, direct
    assert text == so_far + direct["choices"][0]["message"]["content"]
    assert direct["usage"]["completion_tokens"] == budget - produced
