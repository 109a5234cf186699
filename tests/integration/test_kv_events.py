"""Routing from engine truth, end to end: simulated engines publishing vLLM's KV-cache events, two `switchyard
serve` processes following them, the official SDK as the client.

- a conversation's next turn goes to the endpoint that holds its prefix, and the decision trace says the
  engine's events decided;
- both gateways hold the same index of every engine once the streams are drained;
- the endpoint rows, the console and /metrics show each stream's state;
- a reset of an engine's prefix cache empties the gateways' index of it.
"""

from __future__ import annotations

import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.helpers import free_port
from tests.integration.conftest import (
    SIM_TIME_SCALE,
    SWITCHYARD,
    Engines,
    Gateway,
    client,
    endpoints,
    eventually,
    http_json,
    route,
    start_gateway,
    stop,
    wait_http,
)

TOPIC = "kv-events"


def _ports() -> tuple[list[int], int, int]:
    """Two HTTP ports and offsets to the events and replay ports, all eight ports free and distinct."""
    while True:
        http = [free_port(), free_port()]
        events_offset, replay_offset = free_port() - http[0], free_port() - http[0]
        used = {*http, *(p + events_offset for p in http), *(p + replay_offset for p in http)}
        if len(used) == 6 and all(0 < p < 65536 for p in used) and all(_free(p) for p in used - set(http)):
            return http, events_offset, replay_offset


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _policy(http: list[int], events_offset: int, replay_offset: int) -> str:
    eps = ", ".join(f"http://127.0.0.1:{p}" for p in http)
    return f"""\
schema: 1
regions: [us-east]
pools:
  - {{name: chat-us, region: us-east, served_model: sim-chat, endpoints: [{eps}], kv_cache_tokens: 200000,
      kv_events: {{port_offset: {events_offset}, replay_port_offset: {replay_offset}, topic: {TOPIC}}}}}
models:
  - {{name: chat, pools: [chat-us], context_window: 8192, tokenizer: switchyard-sim, endpoint_profile: precise,
      price: {{input_per_mtok: 0.1, output_per_mtok: 0.2}}}}
endpoint_profiles:
  precise:
    filters: [{{type: healthy}}]
    scorers: [{{type: kv-cache-precise, weight: 2}}, {{type: load, weight: 1}}]
    picker: {{type: max-score}}
priorities:
  standard: {{max_queue_ms: 1000}}
tiers:
  - {{name: pro, priority: standard, models: ["*"]}}
"""


@dataclass
class Fleet:
    engines: Engines
    gateways: list[Gateway]
    sims: subprocess.Popen[bytes]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("kv-events")
    http, events_offset, replay_offset = _ports()
    policy_file = tmp / "policies.yaml"
    policy_file.write_text(_policy(http, events_offset, replay_offset))
    engines = Engines(policy_file, {"chat-us": http}, free_port())
    sims = subprocess.Popen([SWITCHYARD, "sim", "--policy", str(policy_file), "--time-scale", str(SIM_TIME_SCALE)])
    gateways: list[Gateway] = []
    try:
        for port in http:
            wait_http(f"http://127.0.0.1:{port}/health", sims)
        for name in "ab":
            data = tmp / name
            data.mkdir()
            gw = start_gateway(engines, f"sqlite:///{data / 'switchyard.db'}", data, "sqlite")
            gw.keys = {"pro": gw.new_key("kv-co", "pro")}
            gateways.append(gw)
        for gw in gateways:  # both gateways read each engine's (empty) history before traffic starts
            eventually(lambda gw=gw: all(row["kv_events"]["state"] == "live" for row in endpoints(gw).values()))
        fleet = Fleet(engines, gateways, sims)
        yield fleet
        sims = fleet.sims  # (a test restarts them)
    finally:
        for gw in gateways:
            stop(gw.proc)
        stop(sims)


def _turns(n: int) -> list[dict[str, str]]:
    """A conversation of ``n`` user turns with a long shared context (several blocks of the sim's 16 tokens)."""
    system = {"role": "system", "content": "You are a careful assistant for the fleet's operators. " * 30}
    out = [system]
    for i in range(n):
        out.append({"role": "user", "content": f"Question {i}: how does the gateway route turn {i}? " * 5})
        out.append({"role": "assistant", "content": f"Turn {i} is routed by the engines' own reports. " * 5})
    return out[:-1]


def test_the_next_turn_goes_where_its_prefix_is_cached_and_the_trace_says_the_events_decided(fleet: Fleet) -> None:
    gw = fleet.gateways[0]
    sdk = client(gw, "pro")
    first = sdk.chat.completions.with_raw_response.create(model="chat", messages=_turns(1), max_tokens=4)  # type: ignore[arg-type]
    holder = route(first)["endpoint"]
    # The engine reports the blocks it stored; the gateway sees them before the next turn is picked.
    eventually(lambda: endpoints(gw)[holder]["kv_events"]["blocks"] > 0)
    for turns in (2, 3):
        raw = sdk.chat.completions.with_raw_response.create(model="chat", messages=_turns(turns), max_tokens=4)  # type: ignore[arg-type]
        assert route(raw)["endpoint"] == holder
        usage = raw.parse().usage
        assert usage is not None and usage.prompt_tokens_details is not None
        assert (usage.prompt_tokens_details.cached_tokens or 0) > 0
        status, _, record = http_json("GET", f"{gw.base_url}/admin/api/requests/{raw.headers['x-request-id']}")
        assert status == 200
        assert any("kv-cache-precise: engine events:" in line for line in record["trace"]), record["trace"]
    # The admin API says what each endpoint holds of a prompt: the holder its whole conversation so far.
    status, _, found = http_json("POST", f"{gw.base_url}/admin/api/kv-cache/lookup",
                                 {"model": "chat", "messages": _turns(3)})
    assert status == 200 and found["renders"] and found["prompt_tokens"] > 100
    held = {row["url"]: row["cached_tokens"] for row in found["endpoints"]}
    assert held[holder] >= found["prompt_tokens"] - 2 * 16  # all but its last, partial blocks
    assert all(v == 0 for u, v in held.items() if u != holder)
    status, _, missing = http_json("POST", f"{gw.base_url}/admin/api/kv-cache/lookup", {"model": "auto"})
    assert status == 404 and "give a model, not a route" in missing["error"]["message"]


def test_two_gateways_fed_the_same_engines_hold_the_same_index(fleet: Fleet) -> None:
    a, b = fleet.gateways
    for i, gw in enumerate((a, b, a, b)):
        sdk = client(gw, "pro")
        for j in range(3):
            messages = [{"role": "user", "content": f"Tenant {i} document {j}: " + "lorem ipsum dolor " * 40}]
            sdk.chat.completions.create(model="chat", messages=messages, max_tokens=8)  # type: ignore[arg-type]

    def same() -> bool:
        rows_a, rows_b = endpoints(a), endpoints(b)
        return all(rows_a[u]["kv_events"]["digest"] == rows_b[u]["kv_events"]["digest"]
                   and rows_a[u]["kv_events"]["last_seq"] == rows_b[u]["kv_events"]["last_seq"] for u in rows_a)

    eventually(same)
    rows = endpoints(a)
    assert sum(int(r["kv_events"]["blocks"]) for r in rows.values()) > 0
    for row in rows.values():
        kv = row["kv_events"]
        assert kv["state"] == "live" and kv["gaps"] == 0 and kv["restarts"] == 0 and kv["orphans"] == 0, kv


def test_each_stream_is_shown_in_metrics_and_on_the_overview(fleet: Fleet) -> None:
    gw = fleet.gateways[0]
    url = fleet.engines.url("chat-us")

    def scraped() -> str:
        with urllib.request.urlopen(gw.base_url + "/metrics", timeout=5) as r:
            return str(r.read().decode())

    connected = f'switchyard_kv_events_connected{{endpoint="{url}"}} 1.0'
    text = eventually(lambda: next((t for t in [scraped()] if connected in t), None), timeout=15)
    assert f'switchyard_kv_events_stale{{endpoint="{url}"}} 0.0' in text
    assert "switchyard_kv_events_processing_seconds_total" in text
    assert f'switchyard_kv_events_blocks{{endpoint="{url}"}}' in text
    page = gw.console().get("/admin/").text
    assert "KV events" in page and "live" in page


def test_a_reset_prefix_cache_empties_the_gateways_index_of_that_engine(fleet: Fleet) -> None:
    url = fleet.engines.url("chat-us", 1)
    sdk = client(fleet.gateways[0], "pro")
    for j in range(4):
        sdk.chat.completions.create(model="chat", max_tokens=4,  # type: ignore[arg-type]
                                    messages=[{"role": "user", "content": f"reset case {j}: " + "words " * 80}])
    eventually(lambda: all(endpoints(gw)[url]["kv_events"]["blocks"] > 0 for gw in fleet.gateways))
    status, _, _ = http_json("POST", url + "/reset_prefix_cache")
    assert status == 200
    # As vLLM, the engine publishes the clear with its next step: a prompt shorter than a block stores nothing.
    status, _, _ = http_json("POST", url + "/v1/completions", {"model": "sim-chat", "prompt": "hi", "max_tokens": 1})
    assert status == 200
    eventually(lambda: all(endpoints(gw)[url]["kv_events"]["blocks"] == 0 for gw in fleet.gateways))



def test_a_restarted_engine_is_never_taken_for_holding_what_it_held_before(fleet: Fleet) -> None:
    sdk = client(fleet.gateways[0], "pro")
    for j in range(4):
        sdk.chat.completions.create(model="chat", max_tokens=4,  # type: ignore[arg-type]
                                    messages=[{"role": "user", "content": f"before restart {j}: " + "word " * 80}])
    eventually(lambda: sum(int(r["kv_events"]["blocks"]) for r in endpoints(fleet.gateways[1]).values()) > 0)
    stop(fleet.sims)
    # Cut off: the index is dropped at once, and the scorer does not route on it.
    for gw in fleet.gateways:
        eventually(lambda gw=gw: all(r["kv_events"]["state"] == "disconnected" and r["kv_events"]["blocks"] == 0
                                     for r in endpoints(gw).values()))
    fleet.sims = subprocess.Popen([SWITCHYARD, "sim", "--policy", str(fleet.engines.policy_file),
                                   "--time-scale", str(SIM_TIME_SCALE)])
    for port in fleet.engines.ports["chat-us"]:
        wait_http(f"http://127.0.0.1:{port}/health", fleet.sims)
    for gw in fleet.gateways:  # read again from the new engines' start: empty
        eventually(lambda gw=gw: all(r["kv_events"]["state"] == "live" for r in endpoints(gw).values()), timeout=15)
        assert all(r["kv_events"]["blocks"] == 0 for r in endpoints(gw).values())
        eventually(lambda gw=gw: all(r["healthy"] for r in endpoints(gw).values()), timeout=15)
    sdk.chat.completions.create(model="chat", max_tokens=4,  # type: ignore[arg-type]
                                messages=[{"role": "user", "content": "after restart: " + "word " * 80}])
    eventually(lambda: sum(int(r["kv_events"]["blocks"]) for r in endpoints(fleet.gateways[1]).values()) > 0)
