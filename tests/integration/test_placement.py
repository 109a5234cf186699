"""Home regions, spill-over, data residency, session affinity and the serves-model filter, through a
real gateway to real sim processes.

Engines: model ``m`` has two replicas in us-east (``us-a``, ``us-b``) and one in eu-west (``eu-a``,
``max_num_seqs: 1``, so one request in flight saturates it); model ``mixed`` has a replica that
serves another model than its pool declares (``wrong``) and a right one; ``emb`` is an embeddings
pool for the ``triage`` route's embedding classifier.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import time
from collections import Counter
from collections.abc import Iterator

import openai
import pytest

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

NAMES = ("us-a", "us-b", "eu-a", "wrong", "right", "emb")


def _policy(ports: dict[str, int]) -> str:
    def url(name: str) -> str:
        return f"http://127.0.0.1:{ports[name]}"

    price = "{input_per_mtok: 1, output_per_mtok: 1}"
    return f"""\
schema: 1
regions: [us-east, eu-west]
pools:
  - {{name: m-us, region: us-east, served_model: sim-m, endpoints: [{url("us-a")}, {url("us-b")}],
      kv_cache_tokens: 100000}}
  - {{name: m-eu, region: eu-west, served_model: sim-m, endpoints: [{url("eu-a")}], kv_cache_tokens: 100000,
      max_num_seqs: 1}}
  - {{name: mixed, region: us-east, served_model: sim-m, endpoints: [{url("wrong")}, {url("right")}],
      kv_cache_tokens: 100000}}
  - {{name: emb, region: us-east, served_model: sim-emb, task: embed, endpoints: [{url("emb")}],
      kv_cache_tokens: 100000}}
classifiers:
  refunds:
    type: embedding
    pool: emb
    timeout_ms: 300
    examples:
      positive: ["I want my money back for this order", "please refund my purchase",
                 "how do I get a refund for a damaged item"]
      negative: ["write a poem about the sea", "what is the capital of France", "explain quantum computing"]
routes:
  - name: triage
    rules:
      - {{name: refunds, when: {{classifier: refunds}}, model: us-only}}
    default: m
models:
  - {{name: m, pools: [m-us, m-eu], context_window: 8192, price: {price}}}
  - {{name: us-only, pools: [m-us], context_window: 8192, price: {price}}}
  - {{name: mixed, pools: [mixed], context_window: 8192, price: {price}}}
priorities:
  critical: {{max_queue_ms: 10000}}
tiers:
  - {{name: gold, priority: critical, models: ["*"]}}
  - {{name: eu, priority: critical, models: ["*"], regions: [eu-west]}}
"""


@pytest.fixture(scope="module")
def placed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, dict[str, int]]]:
    ports = {name: free_port() for name in NAMES}
    procs: list[subprocess.Popen[bytes]] = []
    tmp = tmp_path_factory.mktemp("placement")
    policy = tmp / "policies.yaml"
    policy.write_text(_policy(ports))
    gateway: Gateway | None = None
    try:
        for i, name in enumerate(NAMES):
            model = {"wrong": "sim-other", "emb": "sim-emb"}.get(name, "sim-m")
            procs.append(subprocess.Popen([SWITCHYARD, "sim", "--model", model, "--port", str(ports[name]),
                                           "--seed", str(i)]))
        for proc, name in zip(procs, NAMES, strict=True):
            wait_http(f"http://127.0.0.1:{ports[name]}/health", proc)
        gateway = start_gateway(Engines(policy, {}, 0), f"sqlite:///{tmp / 'gw.db'}", tmp, "sqlite",
                                {"SWITCHYARD_SCRAPE_INTERVAL_S": "0.2", "SWITCHYARD_UPSTREAM_READ_TIMEOUT_S": "30",
                                 "SWITCHYARD_REGION": "us-east"})
        gateway.keys = {"gold": gateway.new_key("gold-co", "gold"), "eu": gateway.new_key("eu-co", "eu")}
        yield gateway, ports
    finally:
        if gateway is not None:
            assert stop(gateway.proc)
        for proc in procs:
            stop(proc)


def served(gw: Gateway, tier: str, model: str = "m", prompt: str = "hello", **headers: str) -> dict[str, str]:
    raw = client(gw, tier).completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=2,
                                                                extra_headers=headers or None)
    return route(raw)


def test_requests_stay_in_their_home_region(placed: tuple[Gateway, dict[str, int]]) -> None:
    gw, ports = placed
    # The gateway's own region (SWITCHYARD_REGION=us-east) is the home of requests that name none.
    us = Counter(served(gw, "gold", prompt=f"q{i}")["endpoint"] for i in range(12))
    assert set(us) == {f"http://127.0.0.1:{ports['us-a']}", f"http://127.0.0.1:{ports['us-b']}"}, us
    # The header moves the home.
    eu = {served(gw, "gold", prompt=f"q{i}", **{"x-switchyard-region": "eu-west"})["region"] for i in range(5)}
    assert eu == {"eu-west"}
    # So does the key's region, and the tenant's for keys without one.
    gw.keys["eu-key"] = gw.cli("keys", "create", "--tenant", "roamer", "--tier", "gold", "--region",
                               "eu-west").stdout.strip()
    assert {served(gw, "eu-key", prompt=f"k{i}")["region"] for i in range(4)} == {"eu-west"}
    gw.cli("tenants", "set-region", "gold-co", "eu-west")
    deadline = time.monotonic() + 10  # the gateway's key cache (0.3 s here) picks the change up
    while served(gw, "gold", prompt="t")["region"] != "eu-west":
        assert time.monotonic() < deadline, "the tenant's region never applied"
        time.sleep(0.2)
    assert {served(gw, "gold", prompt=f"t{i}")["region"] for i in range(4)} == {"eu-west"}
    gw.cli("tenants", "set-region", "gold-co", "--clear")
    while served(gw, "gold", prompt="t")["region"] != "us-east":
        assert time.monotonic() < deadline + 10, "the tenant's region was never cleared"
        time.sleep(0.2)


def test_a_saturated_home_region_spills_over_and_comes_back(placed: tuple[Gateway, dict[str, int]]) -> None:
    gw, ports = placed
    eu = f"http://127.0.0.1:{ports['eu-a']}"
    http_json("POST", eu + "/sim/faults", {"mode": "hang"})
    home = {"x-switchyard-region": "eu-west"}
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # One request hangs at eu-a: with max_num_seqs 1, eu-west is saturated.
            blocker = pool.submit(served, gw, "gold", "m", "blocker", **home)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if endpoints(gw)[eu]["in_flight"] == 1:
                    break
                time.sleep(0.05)
            spilled = [served(gw, "gold", prompt=f"s{i}", **home) for i in range(4)]
            assert {r["region"] for r in spilled} == {"us-east"}, spilled
            http_json("POST", eu + "/sim/faults", {"mode": "none"})
            assert blocker.result(timeout=30)["endpoint"] == eu
    finally:
        http_json("POST", eu + "/sim/faults", {"mode": "none"})
    assert served(gw, "gold", prompt="back", **home)["region"] == "eu-west"


def test_a_tier_limited_to_a_region_is_never_served_elsewhere(placed: tuple[Gateway, dict[str, int]]) -> None:
    gw, _ = placed
    assert {served(gw, "eu", prompt=f"r{i}")["region"] for i in range(6)} == {"eu-west"}
    with pytest.raises(openai.PermissionDeniedError) as denied:
        served(gw, "eu", **{"x-switchyard-region": "us-east"})
    assert denied.value.code == "region_not_allowed"
    with pytest.raises(openai.PermissionDeniedError) as denied:
        served(gw, "eu", model="us-only")
    assert denied.value.code == "region_not_allowed" and "has no pool there" in denied.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        served(gw, "gold", **{"x-switchyard-region": "atlantis"})
    assert bad.value.code == "invalid_region" and bad.value.param == "x-switchyard-region"


@pytest.mark.alone  # its spread of sessions over replicas read one-sided once beside a busy worker (scrapes late)
def test_a_session_stays_on_its_replica(placed: tuple[Gateway, dict[str, int]]) -> None:
    gw, _ = placed
    homes = set()
    for session in range(8):
        turns = {served(gw, "gold", prompt=f"turn {turn} of a different question", **{"x-session-id": f"s{session}"}
                        )["endpoint"] for turn in range(4)}
        assert len(turns) == 1, f"session {session} moved: {turns}"
        homes |= turns
    # Sessions themselves are spread (ties go at random; all eight on one of two replicas: p = 2^-7).
    assert len(homes) == 2
    # The body's `user` names a session too.
    users = {route(client(gw, "gold").completions.with_raw_response.create(
        model="m", prompt=f"p{i}", max_tokens=1, user="alice"))["endpoint"] for i in range(4)}
    assert len(users) == 1


def test_a_replica_serving_another_model_is_left_out(placed: tuple[Gateway, dict[str, int]]) -> None:
    gw, ports = placed
    wrong, right = (f"http://127.0.0.1:{ports[n]}" for n in ("wrong", "right"))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # one scrape of each is enough
        rows = endpoints(gw)
        if all(rows[u]["scrape"]["fresh"] for u in (wrong, right)):  # type: ignore[index]
            break
        time.sleep(0.1)
    picked = [served(gw, "gold", model="mixed", prompt=f"x{i}") for i in range(8)]
    assert {p["endpoint"] for p in picked} == {right}
    assert all("attempt" not in p for p in picked)  # never tried (and failed over from) the wrong one


def test_an_embedding_classifier_routes_through_its_pool(placed: tuple[Gateway, dict[str, int]]) -> None:
    gw, ports = placed
    refund = served(gw, "gold", model="triage", prompt="Can I get a refund for my broken order?")
    assert (refund["rule"], refund["model"]) == ("refunds", "us-only")
    other = served(gw, "gold", model="triage", prompt="Write a short poem about autumn leaves")
    assert (other["rule"], other["model"]) == ("default", "m")
    # An embeddings pool that does not answer in time: the rule does not match, the request is served.
    emb = f"http://127.0.0.1:{ports['emb']}"
    http_json("POST", emb + "/sim/faults", {"mode": "hang"})
    try:
        late = served(gw, "gold", model="triage", prompt="Can I get a refund for my broken order?")
    finally:
        http_json("POST", emb + "/sim/faults", {"mode": "none"})
    assert late["rule"] == "default"
    assert gateway_counter(gw, "switchyard_classifier_total", classifier="refunds", outcome="timeout") == 1
    assert gateway_counter(gw, "switchyard_classifier_total", classifier="refunds", outcome="yes") >= 1
