"""Priority, load signals, prefix affinity and fallback, through a real gateway to real sim processes.

The module has its own engines and gateway (the shared ones carry other tests' traffic):

- ``pri``: one engine running one sequence at a time, with priority scheduling (queues form);
- ``two``: two replicas in eu-west, for prefix affinity;
- ``flaky``: a replica nobody listens on, then a live one;
- ``dead``: nobody listens; model ``rescued`` falls back to ``two@eu-west``;
- ``errs``: an engine answering 500 to everything; model ``errs`` falls back to ``live``.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import free_port
from tests.integration.conftest import (
    SWITCHYARD,
    Engines,
    Gateway,
    client,
    endpoints,
    gateway_counter,
    http_json,
    route,
    start_gateway,
    stop,
    wait_http,
)

LONG = 3_000  # characters: ~750 tokens, many prefix blocks


def _policy(ports: dict[str, int]) -> str:
    def url(name: str) -> str:
        return f"http://127.0.0.1:{ports[name]}"

    return f"""\
schema: 1
regions: [us-east, eu-west]
pools:
  - {{name: pri, region: us-east, served_model: sim-pri, endpoints: [{url("pri")}], kv_cache_tokens: 100000,
      priority_scheduling: true, max_num_seqs: 1}}
  - {{name: two, region: eu-west, served_model: sim-two, endpoints: [{url("two-a")}, {url("two-b")}],
      kv_cache_tokens: 100000}}
  - {{name: flaky, region: us-east, served_model: sim-live, endpoints: [{url("dead-1")}, {url("live")}],
      kv_cache_tokens: 100000}}
  - {{name: dead, region: us-east, served_model: sim-live, endpoints: [{url("dead-2")}], kv_cache_tokens: 100000}}
  - {{name: errs, region: us-east, served_model: sim-errs, endpoints: [{url("errs")}], kv_cache_tokens: 100000}}
models:
  - {{name: pri, pools: [pri], context_window: 8192, price: {{input_per_mtok: 1, output_per_mtok: 1}}}}
  - {{name: two, pools: [two], context_window: 8192, price: {{input_per_mtok: 1, output_per_mtok: 1}}}}
  - {{name: live, pools: [flaky], context_window: 8192, price: {{input_per_mtok: 1, output_per_mtok: 1}}}}
  - {{name: rescued, pools: [dead], context_window: 8192, price: {{input_per_mtok: 1, output_per_mtok: 1}},
      fallback: ["two@eu-west"]}}
  - {{name: errs, pools: [errs], context_window: 8192, price: {{input_per_mtok: 1, output_per_mtok: 1}},
      fallback: [live]}}
priorities:
  critical: {{max_queue_ms: 30000}}
  sheddable: {{max_queue_ms: 30000}}
tiers:
  - {{name: gold, priority: critical, models: ["*"]}}
  - {{name: free, priority: sheddable, models: ["*"]}}
"""


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, dict[str, int]]]:
    names = ["pri", "two-a", "two-b", "live", "errs", "dead-1", "dead-2"]
    ports = {name: free_port() for name in names}
    served = {"pri": "sim-pri", "two-a": "sim-two", "two-b": "sim-two", "live": "sim-live", "errs": "sim-errs"}
    procs: list[subprocess.Popen[bytes]] = []
    tmp = tmp_path_factory.mktemp("routing")
    policy = tmp / "policies.yaml"
    policy.write_text(_policy(ports))
    gateway: Gateway | None = None
    try:
        for name, model in served.items():
            args = [SWITCHYARD, "sim", "--model", model, "--port", str(ports[name]), "--seed", str(len(procs))]
            if name == "pri":
                args += ["--max-num-seqs", "1"]
            procs.append(subprocess.Popen(args))
        for proc, name in zip(procs, served, strict=True):
            wait_http(f"http://127.0.0.1:{ports[name]}/health", proc)
        http_json("POST", f"http://127.0.0.1:{ports['errs']}/sim/faults", {"error_rate": 1.0})
        gateway = start_gateway(Engines(policy, {}, 0), f"sqlite:///{tmp / 'gw.db'}", tmp, "sqlite",
                                {"SWITCHYARD_SCRAPE_INTERVAL_S": "0.2", "SWITCHYARD_UPSTREAM_READ_TIMEOUT_S": "30"})
        gateway.keys = {"gold": gateway.new_key("gold-co", "gold"), "free": gateway.new_key("free-co", "free")}
        yield gateway, ports
    finally:
        if gateway is not None:
            assert stop(gateway.proc)
        for proc in procs:
            stop(proc)


def engine_counter(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


@pytest.mark.alone  # it compares timings (or orders) that a busy second worker would shift
def test_a_higher_class_overtakes_a_queued_lower_one(routed: tuple[Gateway, dict[str, int]]) -> None:
    """gold (critical → priority 0) and free (sheddable → 10) queue behind one running request."""
    gw, _ = routed
    finished: dict[str, float] = {}

    def call(tier: str, tokens: int, label: str, **extra: object) -> None:
        client(gw, tier).completions.create(model="pri", prompt=f"{label} please", max_tokens=tokens,
                                            extra_body=extra or None)
        finished[label] = time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        blocker = pool.submit(call, "free", 400, "blocker")
        time.sleep(0.3)  # the blocker holds the engine's only sequence slot
        low = pool.submit(call, "free", 5, "low")
        time.sleep(0.1)
        high = pool.submit(call, "gold", 5, "high")
        time.sleep(0.1)
        # A gold client may lower its own request below free's class, never raise it.
        lowered = pool.submit(call, "gold", 5, "lowered", priority=50)
        for f in (blocker, low, high, lowered):
            f.result()
    assert finished["blocker"] < finished["high"] < finished["low"] < finished["lowered"], finished


def test_load_signals_are_scraped_from_the_engines(routed: tuple[Gateway, dict[str, int]]) -> None:
    gw, ports = routed
    pri = f"http://127.0.0.1:{ports['pri']}"
    seen_waiting = 0.0
    # Sent to the engine directly, as another gateway would: this gateway knows of them only by scraping
    # (it never sends more than the pool's max_num_seqs itself).
    direct = openai.OpenAI(base_url=pri + "/v1", api_key="-", max_retries=0, timeout=60)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(direct.completions.create, model="sim-pri", prompt="x", max_tokens=200)
                   for _ in range(3)]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(f.done() for f in futures):
            scrape = endpoints(gw)[pri]["scrape"]
            assert isinstance(scrape, dict)
            if scrape["fresh"] and scrape["waiting"]:
                seen_waiting = max(seen_waiting, float(scrape["waiting"]))
                # --max-num-seqs 1 (0 when the scrape falls between one request finishing and the next starting)
                assert scrape["running"] <= 1
            time.sleep(0.05)
        for f in futures:
            f.result()
    assert seen_waiting >= 1, "the engine's queue never showed in the scraped signals"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        row = endpoints(gw)[pri]
        scrape = row["scrape"]
        assert isinstance(scrape, dict)
        if scrape["fresh"] and scrape["running"] == 0 and scrape["waiting"] == 0:
            assert row["in_flight"] == 0 and row["load"] == 0
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"signals did not drain: {endpoints(gw)[pri]}")


def test_a_repeated_long_prompt_goes_to_the_replica_that_caches_it(routed: tuple[Gateway, dict[str, int]]) -> None:
    gw, ports = routed
    port_of = {f"http://127.0.0.1:{ports[n]}": ports[n] for n in ("two-a", "two-b")}
    chosen: set[str] = set()
    for i, word in enumerate(("alpha", "bravo", "charlie", "delta")):
        prompt = [{"role": "user", "content": f"{word} {i} " + "lorem ipsum dolor sit amet " * (LONG // 27)}]
        before = {url: engine_counter(port, "vllm:prefix_cache_hits_total") for url, port in port_of.items()}
        urls = []
        for _ in range(3):
            raw = client(gw, "gold").chat.completions.with_raw_response.create(
                model="two", messages=prompt, max_tokens=4)  # type: ignore[arg-type]
            urls.append(route(raw)["endpoint"])
        assert len(set(urls)) == 1, f"prompt {word} was spread over {urls}"
        after = {url: engine_counter(port, "vllm:prefix_cache_hits_total") for url, port in port_of.items()}
        (home,) = set(urls)
        other = next(u for u in port_of if u != home)
        assert after[home] - before[home] >= 2 * 500, (before, after)  # two repeats, ~750 tokens each
        assert after[other] == before[other]
    # Different prompts are not all herded onto one replica (ties between idle replicas go at random:
    # twelve new prompts all landing on one of two replicas has probability 2^-11).
    for i in range(12):
        prompt = [{"role": "user", "content": f"fresh {i} " + "consectetur adipiscing " * (LONG // 23)}]
        raw = client(gw, "gold").chat.completions.with_raw_response.create(
            model="two", messages=prompt, max_tokens=1)  # type: ignore[arg-type]
        chosen.add(route(raw)["endpoint"])
    assert chosen == set(port_of)


def test_a_refused_connection_moves_to_the_next_replica_and_is_left_out(
        routed: tuple[Gateway, dict[str, int]]) -> None:
    gw, ports = routed
    dead = f"http://127.0.0.1:{ports['dead-1']}"
    live = f"http://127.0.0.1:{ports['live']}"
    routes = []
    for _ in range(6):
        raw = client(gw, "gold").chat.completions.with_raw_response.create(
            model="live", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert raw.parse().choices[0].message.content
        routes.append(route(raw))
    assert {r["endpoint"] for r in routes} == {live}
    # At most one request paid for the dead replica (none if a scrape found it down first);
    # afterwards it is in cool-down and left out.
    refused = gateway_counter(gw, "switchyard_upstream_attempts_total", pool="flaky", outcome="connect_error")
    assert refused <= 1
    assert sum(1 for r in routes if r.get("attempt") == "2") == refused
    row = endpoints(gw)[dead]
    assert row["healthy"] is False and "cannot connect" in str(row["failure"])


def test_the_fallback_chain_serves_when_a_model_has_no_live_engine(routed: tuple[Gateway, dict[str, int]]) -> None:
    gw, _ = routed
    raw = client(gw, "gold").chat.completions.with_raw_response.create(
        model="rescued", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    r = route(raw)
    assert (r["model"], r["fallback_from"], r["region"], r["pool"]) == ("two", "rescued", "eu-west", "two")
    # Its only engine was already out of service (probes and scrapes were refused): the stage was passed
    # over without a try, and the header says so.
    assert "attempt" not in r and r["moved_on"] == "rescued unavailable"
    assert gateway_counter(gw, "switchyard_upstream_attempts_total", pool="dead") == 0
    assert gateway_counter(gw, "switchyard_fallbacks_total", model="rescued", reason="unavailable") >= 1
    assert raw.parse().usage.completion_tokens == 3
    # Streaming falls back the same way: nothing had been sent to the client yet.
    stream = client(gw, "gold").chat.completions.create(
        model="rescued", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_engine_5xx_falls_back_but_client_errors_are_not_retried(routed: tuple[Gateway, dict[str, int]]) -> None:
    gw, _ = routed
    raw = client(gw, "gold").chat.completions.with_raw_response.create(
        model="errs", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    r = route(raw)
    assert (r["model"], r["fallback_from"], r["pool"]) == ("live", "errs", "flaky")
    assert gateway_counter(gw, "switchyard_upstream_attempts_total", pool="errs", outcome="500") >= 1
    before = gateway_counter(gw, "switchyard_upstream_attempts_total", pool="flaky")
    with pytest.raises(openai.BadRequestError) as err:
        client(gw, "gold").chat.completions.create(
            model="live", messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=-1)
    assert err.value.status_code == 400 and "temperature" in str(err.value.message)
    assert gateway_counter(gw, "switchyard_upstream_attempts_total", pool="flaky") == before + 1


def test_when_every_attempt_fails_the_error_lists_them(routed: tuple[Gateway, dict[str, int]],
                                                      tmp_path: Path) -> None:
    """``errs`` falls back to ``live``; with ``live``'s engine answering 500 too, both are named."""
    gw, ports = routed
    live = f"http://127.0.0.1:{ports['live']}"
    http_json("POST", f"{live}/sim/faults", {"error_rate": 1.0})
    try:
        status, headers, body = http_json(
            "POST", gw.base_url + "/v1/chat/completions",
            {"model": "errs", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            {"Authorization": f"Bearer {gw.keys['gold']}"})
    finally:
        http_json("POST", f"{live}/sim/faults", {"mode": "none", "error_rate": 0.0})
    assert status == 502
    assert headers["x-switchyard-attempts"] == "2"
    message = body["error"]["message"]
    assert message.startswith("All 2 attempts failed") and f":{ports['errs']}" in message and live in message
