"""Resilience through a real gateway and real simulated engines: every fallback trigger, breakers that
open and recover, health probes, mid-stream aborts, and no retry storm.

Engines (one ``switchyard sim`` process with a fault control server): model ``main`` has two replicas in
us-east (``us-a``, ``us-b``, pool ``main-us``) and one in eu-west (``eu``, pool ``main-eu``); its fallback
chain is ``main@eu-west`` then model ``backup`` (``bk``, pool ``backup-us``). Gateways run in us-east.

Two policies differ only in ``resilience``: *passive* probes and scrapes rarely (every 60 s), so a test
sees each trigger on the request path itself; *active* probes every 0.2 s. Each test gets a fresh gateway
(breakers and health start clean) and leaves every engine without faults.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import (
    FAULTS_CLEAR,
    FaultFleet,
    Gateway,
    client,
    endpoints,
    fault_fleet,
    gateway_counter,
    http_json,
    route,
    stop,
)

NAMES = ("us-a", "us-b", "eu", "bk")
CLEAR = FAULTS_CLEAR

PASSIVE = """\
  health: {probe_interval: 60, unhealthy_after: 2, healthy_after: 2}
  breakers:
    endpoint: {consecutive_failures: 3, open_for: 1, half_open_requests: 1}
  retries: {max_attempts: 4}
  first_token_timeout: 1
"""
ACTIVE = """\
  health: {probe_interval: 0.2, probe_timeout: 0.5, unhealthy_after: 2, healthy_after: 2}
  first_token_timeout: 1
"""
#: Breakers that never open and a tight retry budget: what is left to stop a storm is the budget.
BUDGET_ONLY = """\
  health: {probe_interval: 60}
  breakers:
    endpoint: {consecutive_failures: 1000, error_rate: 1, min_requests: 100000}
    pool: {consecutive_failures: 1000, error_rate: 1, min_requests: 100000}
  retries: {max_attempts: 3, budget_ratio: 0.2, budget_window: 60, min_retries_per_s: 0}
"""

#: A first byte later than 0.3 s counts against the endpoint; a pool breaker that opens on two failures. (Hang
#: detection is off: an engine 5000 times slower than it should be would be found hung, a token every few seconds.)
SLOW_AND_POOL = """\
  health: {probe_interval: 60, max_ttfb: 0.3}
  breakers:
    endpoint: {consecutive_failures: 1000, min_requests: 100000}
    pool: {consecutive_failures: 2, open_for: 60}
  first_token_timeout: 20
  hang_detection: {enabled: false}
"""


def _policy(ports: dict[str, int], resilience: str, resume: bool = True) -> str:
    def url(name: str) -> str:
        return f"http://127.0.0.1:{ports[name]}"

    price = "{input_per_mtok: 1, output_per_mtok: 1}"
    return f"""\
schema: 1
regions: [us-east, eu-west]
pools:
  - {{name: main-us, region: us-east, served_model: sim-m, endpoints: [{url("us-a")}, {url("us-b")}],
      kv_cache_tokens: 100000}}
  - {{name: main-eu, region: eu-west, served_model: sim-m, endpoints: [{url("eu")}], kv_cache_tokens: 100000}}
  - {{name: backup-us, region: us-east, served_model: sim-m, endpoints: [{url("bk")}], kv_cache_tokens: 100000}}
models:
  - {{name: main, pools: [main-us, main-eu], context_window: 4096, price: {price},
      fallback: [main@eu-west, backup], resume_streams: {"true" if resume else "false"}}}
  - {{name: backup, pools: [backup-us], context_window: 4096, price: {price}}}
priorities:
  critical: {{max_queue_ms: 10000}}
tiers:
  - {{name: gold, priority: critical, models: ["*"]}}
resilience:
{resilience}"""


Fleet = FaultFleet


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    def policies(ports: dict[str, int]) -> dict[str, str]:
        return {**{name: _policy(ports, section) for name, section in (
            ("passive", PASSIVE), ("active", ACTIVE), ("budget", BUDGET_ONLY), ("pool", SLOW_AND_POOL))},
            "passive-noresume": _policy(ports, PASSIVE, resume=False)}

    yield from fault_fleet(tmp_path_factory.mktemp("resilience"), NAMES, policies, "active")


def _gateway(fleet: Fleet, tmp_path: Path, policy: str) -> Iterator[Gateway]:
    gw = fleet.gateway(tmp_path, policy, {"SWITCHYARD_UPSTREAM_READ_TIMEOUT_S": "20",
                                          "SWITCHYARD_SCRAPE_INTERVAL_S": "60" if policy != "active" else "0.5"},
                       {"gold": ("gold-co", "gold")})
    try:
        yield gw
    finally:
        fleet.fault(**CLEAR)
        assert stop(gw.proc)


@pytest.fixture
def passive(fleet: Fleet, tmp_path: Path) -> Iterator[Gateway]:
    yield from _gateway(fleet, tmp_path, "passive")


@pytest.fixture
def passive_noresume(fleet: Fleet, tmp_path: Path) -> Iterator[Gateway]:
    yield from _gateway(fleet, tmp_path, "passive-noresume")


@pytest.fixture
def active(fleet: Fleet, tmp_path: Path) -> Iterator[Gateway]:
    yield from _gateway(fleet, tmp_path, "active")


@pytest.fixture
def pool_gw(fleet: Fleet, tmp_path: Path) -> Iterator[Gateway]:
    yield from _gateway(fleet, tmp_path, "pool")


@pytest.fixture
def budget_only(fleet: Fleet, tmp_path: Path) -> Iterator[Gateway]:
    yield from _gateway(fleet, tmp_path, "budget")


def ask(gw: Gateway, prompt: str = "hello", model: str = "main", **extra: Any) -> dict[str, str]:
    """One completion; the route header's parts."""
    raw = client(gw, "gold").completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=3, **extra)
    return route(raw)


def moved_on(parts: dict[str, str]) -> list[str]:
    return parts["moved_on"].split(", ") if "moved_on" in parts else []


def attempts(gw: Gateway, pool: str | None = None) -> float:
    labels = {"pool": pool} if pool else {}
    return gateway_counter(gw, "switchyard_upstream_attempts_total", **labels)


def breaker_metric(gw: Gateway, sample: str, labels: dict[str, str]) -> float:
    """A breaker metric's value (its ``name`` label clashes with ``gateway_counter``'s parameter)."""
    with urllib.request.urlopen(gw.base_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def eventually(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# --- triggers -----------------------------------------------------------------------------------------------


def test_a_refused_connection_moves_on_and_takes_the_endpoint_out(fleet: Fleet, passive: Gateway) -> None:
    us_a, us_b, eu = fleet.url("us-a"), fleet.url("us-b"), fleet.url("eu")
    fleet.down("us-a", "us-b", mode="down")
    first = ask(passive)
    # Both home replicas refused, the request fell back to eu-west, and the header says so.
    assert first["endpoint"] == eu and first["region"] == "eu-west"
    assert sorted(moved_on(first)) == sorted([f"{us_a} connect_error", f"{us_b} connect_error"])
    assert first["attempt"] == "3"
    rows = endpoints(passive)
    assert rows[us_a]["up"] is False and "cannot connect" in str(rows[us_a]["failure"])
    # From now on they are passed over: nothing more is sent to them.
    before = attempts(passive, "main-us")
    for i in range(5):
        parts = ask(passive, f"q{i}")
        assert parts["endpoint"] == eu and "moved_on" not in parts
    assert attempts(passive, "main-us") == before
    assert gateway_counter(passive, "switchyard_fallbacks_total", model="main", reason="connect_error") == 2


@pytest.mark.parametrize(("settings", "kind", "breaker_counts"), [
    ({"error_rate": 1.0}, "500", True),
    ({"overload_rate": 1.0}, "503", True),
    ({"throttle_rate": 1.0}, "429", False),
])
def test_engine_errors_and_overload_move_on(fleet: Fleet, passive: Gateway, settings: dict[str, float], kind: str,
                                           breaker_counts: bool) -> None:
    us_a, us_b = fleet.url("us-a"), fleet.url("us-b")
    fleet.fault(pool="main-us", **settings)
    parts = ask(passive)
    assert parts["region"] == "eu-west"
    assert sorted(moved_on(parts)) == sorted([f"{us_a} {kind}", f"{us_b} {kind}"])
    rows = endpoints(passive)
    # 5xx counts against the engine's breaker; 429 says it is busy, not broken.
    assert rows[us_a]["breaker"]["consecutive_failures"] == (1 if breaker_counts else 0)  # type: ignore[index]
    assert rows[us_a]["up"] is True  # it answered: health is not the problem


def test_no_first_token_in_time_moves_on_before_anything_reached_the_client(fleet: Fleet, passive: Gateway) -> None:
    fleet.fault(pool="main-us", mode="hang")
    started = time.monotonic()
    raw = client(passive, "gold").chat.completions.with_raw_response.create(
        model="main", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True)
    parts = route(raw)
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert text and parts["region"] == "eu-west"
    assert [m.rpartition(" ")[2] for m in moved_on(parts)] == ["first_token_timeout", "first_token_timeout"]
    assert time.monotonic() - started >= 2  # two first-token timeouts of 1 s each went by first


def test_a_client_error_from_the_engine_is_never_retried(fleet: Fleet, passive: Gateway) -> None:
    before = attempts(passive)
    with pytest.raises(openai.BadRequestError) as caught:
        # A prompt the engine's context window cannot hold: its 400 is the client's mistake.
        client(passive, "gold").completions.create(model="main", prompt="word " * 5000, max_tokens=3)
    assert "x-switchyard-attempts" not in caught.value.response.headers
    assert attempts(passive) == before + 1
    assert gateway_counter(passive, "switchyard_fallbacks_total") == 0


def test_the_chain_reaches_another_model_and_then_no_healthy_endpoint_is_a_fast_503(fleet: Fleet,
                                                                                   passive: Gateway) -> None:
    fleet.fault(pool="main-us", mode="down")
    fleet.fault(pool="main-eu", mode="down")
    parts = ask(passive)
    assert parts["model"] == "backup" and parts["fallback_from"] == "main" and parts["pool"] == "backup-us"
    fleet.fault(pool="backup-us", mode="down")
    with pytest.raises(openai.APIStatusError):
        ask(passive, "x")  # the backup refuses too: every endpoint is now known to be out
    with pytest.raises(openai.InternalServerError) as caught:
        ask(passive, "y")
    error = caught.value
    assert error.status_code == 503 and error.code == "no_healthy_endpoint"
    assert "main: " in error.message and "backup: " in error.message and "down (" in error.message
    assert int(error.response.headers["retry-after"]) >= 1


# --- breakers and health ------------------------------------------------------------------------------------


def test_a_breaker_opens_on_failures_and_closes_after_a_good_trial(fleet: Fleet, passive: Gateway) -> None:
    us_a = fleet.url("us-a")
    fleet.fault(port=fleet.ports["us-a"], error_rate=1.0)
    fleet.down("us-b", mode="down")  # us-b is out: every request tries us-a first
    for i in range(3):
        parts = ask(passive, f"q{i}")
        assert f"{us_a} 500" in moved_on(parts), parts
    row = endpoints(passive)[us_a]
    assert row["breaker"]["state"] == "open" and row["healthy"] is False  # type: ignore[index]
    assert "3 failures in a row" in row["breaker"]["last_reason"]  # type: ignore[index]
    # While open, us-a is passed over without a try.
    before = attempts(passive, "main-us")
    assert moved_on(ask(passive, "skip")) == []
    assert attempts(passive, "main-us") == before
    assert breaker_metric(passive, "switchyard_breaker_state", {"scope": "endpoint", "name": us_a}) == 2
    fleet.fault(port=fleet.ports["us-a"], error_rate=0.0)
    # After open_for (1 s) the gateway sends a trial request of its own; it succeeds and closes the breaker.
    eventually(lambda: endpoints(passive)[us_a]["breaker"]["state"] == "closed",  # type: ignore[index]
               "the breaker never closed")
    assert attempts(passive, "main-us") == before  # the trial was not a client request
    assert breaker_metric(passive, "switchyard_breaker_transitions_total", {"name": us_a, "to": "half_open"}) == 1
    assert breaker_metric(passive, "switchyard_breaker_transitions_total", {"name": us_a, "to": "closed"}) == 1
    assert ask(passive, "back")["endpoint"] == us_a


def test_a_failed_trial_opens_the_breaker_again_and_no_client_request_is_a_trial(fleet: Fleet,
                                                                                passive: Gateway) -> None:
    us_a = fleet.url("us-a")
    fleet.fault(port=fleet.ports["us-a"], error_rate=1.0)
    fleet.down("us-b", mode="down")
    for i in range(3):
        ask(passive, f"q{i}")
    before = attempts(passive, "main-us")
    deadline = time.monotonic() + 3.5  # open_for 1 s: two or three trials fail meanwhile
    while time.monotonic() < deadline:
        assert ask(passive, f"t{time.monotonic()}")["region"] == "eu-west"
    assert attempts(passive, "main-us") == before  # clients went to eu-west all along
    assert breaker_metric(passive, "switchyard_breaker_transitions_total", {"name": us_a, "to": "half_open"}) >= 2
    assert breaker_metric(passive, "switchyard_breaker_transitions_total", {"name": us_a, "to": "closed"}) == 0
    assert "trial failed: trial request answered 500" in endpoints(passive)[us_a]["breaker"]["last_reason"]  # type: ignore[operator]


def test_a_pool_breaker_takes_the_whole_pool_out(fleet: Fleet, pool_gw: Gateway) -> None:
    fleet.fault(pool="main-us", error_rate=1.0)
    first = ask(pool_gw)  # us-a and us-b fail once each: the pool's second failure in a row opens it
    assert first["region"] == "eu-west" and len(moved_on(first)) == 2
    pools = {p["pool"]: p["breaker"] for p in http_json("GET", pool_gw.base_url + "/admin/api/endpoints")[2]["pools"]}
    assert pools["main-us"]["state"] == "open" and pools["main-eu"]["state"] == "closed"
    # Its endpoints' own breakers are closed, yet nothing more is sent to the pool.
    assert endpoints(pool_gw)[fleet.url("us-a")]["breaker"]["state"] == "closed"  # type: ignore[index]
    before = attempts(pool_gw, "main-us")
    assert {ask(pool_gw, f"q{i}")["region"] for i in range(4)} == {"eu-west"}
    assert attempts(pool_gw, "main-us") == before
    assert breaker_metric(pool_gw, "switchyard_breaker_state", {"scope": "pool", "name": "main-us"}) == 2


def test_a_late_first_byte_counts_against_the_endpoint_but_is_served(fleet: Fleet, pool_gw: Gateway) -> None:
    us_a = fleet.url("us-a")
    fleet.down("us-b", mode="down")
    fleet.down("us-a", mode="slow", slow_factor=5000)
    raw = client(pool_gw, "gold").chat.completions.with_raw_response.create(
        model="main", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True)
    parts = route(raw)
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    breaker = endpoints(pool_gw)[us_a]["breaker"]
    assert parts["endpoint"] == us_a
    assert breaker["consecutive_failures"] == 1 and "max_ttfb 0.3 s" in breaker["last_reason"]  # type: ignore[index]


def test_health_probes_take_an_endpoint_out_and_bring_it_back(fleet: Fleet, active: Gateway) -> None:
    us_a = fleet.url("us-a")
    eventually(lambda: endpoints(active)[us_a]["probe_streak"] >= 1, "never probed")  # type: ignore[operator]
    fleet.down("us-a", mode="unavailable")  # /health answers 503; connections are still accepted
    eventually(lambda: endpoints(active)[us_a]["up"] is False, "failed probes never took us-a out")
    assert endpoints(active)[us_a]["failure"] == "/health answered 503"
    assert gateway_counter(active, "switchyard_endpoint_up", endpoint=us_a) == 0
    assert {ask(active, f"q{i}")["endpoint"] for i in range(6)} == {fleet.url("us-b")}
    fleet.down("us-a", mode="none")
    eventually(lambda: endpoints(active)[us_a]["up"] is True, "good probes never brought us-a back")
    assert gateway_counter(active, "switchyard_endpoint_up", endpoint=us_a) == 1
    eventually(lambda: ask(active, f"r{time.monotonic()}")["endpoint"] == us_a, "no request reached us-a again")


def test_a_region_that_goes_down_and_comes_back_is_detected_by_probes(fleet: Fleet, active: Gateway) -> None:
    us_a, us_b = fleet.url("us-a"), fleet.url("us-b")
    fleet.fault(region="us-east", mode="down")
    eventually(lambda: not endpoints(active)[us_a]["up"] and not endpoints(active)[us_b]["up"],
               "probes never noticed the region was down")
    parts = ask(active)
    assert parts["region"] == "eu-west" and "moved_on" not in parts  # nothing tried in the dead region
    fleet.fault(region="us-east", mode="none")
    eventually(lambda: ask(active, f"back {time.monotonic()}")["region"] == "us-east", "us-east never came back")


# --- streaming ----------------------------------------------------------------------------------------------


def test_a_stream_broken_after_its_first_byte_ends_with_an_error_event_and_is_accounted(
        fleet: Fleet, passive_noresume: Gateway) -> None:
    """With ``resume_streams: false`` (tests/integration/test_stream_faults.py resumes them)."""
    passive = passive_noresume
    fleet.fault(pool="main-us", abort_rate=1.0, abort_after_tokens=3)
    fleet.fault(pool="main-eu", abort_rate=1.0, abort_after_tokens=3)
    completion_before = gateway_counter(passive, "switchyard_tokens_total", model="main", kind="completion")
    raw = client(passive, "gold").chat.completions.with_raw_response.create(
        model="main", messages=[{"role": "user", "content": "tell me a long story"}], max_tokens=50, stream=True)
    parts = route(raw)
    pieces: list[str] = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
    assert "mid-stream" in caught.value.message
    assert 1 <= len(pieces) <= 3  # what the engine sent before it broke off reached the client
    # No fallback once bytes had gone out. The engine sends its 3 tokens and breaks at once: a gateway that
    # reads the first try only after the break sees no byte of it and may move on, as it should when the
    # client has had nothing yet; the try that did reach the client breaks and is the last, though a third
    # endpoint and attempts were left.
    header = raw.headers["x-switchyard-route"]
    if "moved_on" in parts:
        assert parts["moved_on"].endswith(" broken") and parts["attempt"] == "2", header
    else:
        assert "attempt" not in parts, header
    eventually(lambda: gateway_counter(passive, "switchyard_tokens_total", model="main", kind="completion")
               >= completion_before + len(pieces), "the broken stream's tokens were never accounted")
    assert gateway_counter(passive, "switchyard_streams_broken_total") == 1


# --- no retry storm -----------------------------------------------------------------------------------------


def test_a_dead_region_sends_the_healthy_one_each_request_once(fleet: Fleet, active: Gateway) -> None:
    fleet.fault(region="us-east", mode="down")
    n = 40
    eu_before = attempts(active, "main-eu")
    ok = sum(ask(active, f"storm {i}")["region"] == "eu-west" for i in range(n))
    assert ok == n
    # eu-west got each request once; the dead region was tried at most once per replica (then left out).
    assert attempts(active, "main-eu") - eu_before == n
    assert attempts(active, "main-us") <= 2


def test_the_retry_budget_caps_retries_when_breakers_do_not_stop_them(fleet: Fleet, budget_only: Gateway) -> None:
    fleet.fault(pool="main-us", error_rate=1.0)
    n = 30
    outcomes = []
    for i in range(n):
        try:
            outcomes.append(ask(budget_only, f"b{i}")["region"])
        except openai.APIStatusError as error:
            outcomes.append(str(error.status_code))
    sent = attempts(budget_only)
    # Without a budget each request would have cost 3 attempts (us-a, us-b, eu): 90. With 20% of 30 requests
    # as retries, at most 36 attempts were sent, and the requests beyond the budget failed with their error.
    assert sent <= n * 1.2
    assert gateway_counter(budget_only, "switchyard_retry_budget_exhausted_total") >= n - 6
    assert outcomes.count("eu-west") <= 3 and outcomes.count("500") + outcomes.count("502") >= n - 3
