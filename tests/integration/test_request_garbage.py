"""A finished request leaves no reference cycle behind: whatever its outcome, the objects it made are freed by their
reference counts when it ends, not by the garbage collector.

Each cycle costs twice: its objects outlive one or two young collections (each of which walks them) and reach the
oldest generation, where every full collection walks them again. Before the whole answer's cycle was broken (the
decision kept the response, whose background is the try's method), a request left 53 objects of cyclic garbage,
and a closed loop of whole answers counted 1.7 s of collections in 64,000 requests against 0.3 s after. An engine's
fault made cycles too: an error kept by the answer it broke and raised from it (its traceback holds the frames that
hold the answer), a closed connection and its parser, a hedge's cancelled loser and its timeout.

The gateway runs in this process (over simulated engines, as real processes; those of the faults with a fault
control server) so that the collector's garbage can be read: with ``gc.DEBUG_SAVEALL``, every object a collection
would have freed is kept in ``gc.garbage`` instead, and none of them may be the gateway's.
"""

from __future__ import annotations

import contextlib
import gc
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from litestar.testing import TestClient

from switchyard.app import create_app
from switchyard.gateway.runtime import GatewayRuntime
from switchyard.settings import Settings
from switchyard.store import db
from switchyard.store.keys import create_key
from switchyard.store.models import TenantCreate
from switchyard.store.tenants import create_tenant
from tests.integration.conftest import FAULTS_CLEAR, Engines, FaultFleet, fault_fleet
from tests.integration.test_stream_faults import NAMES as FAULT_NAMES
from tests.integration.test_stream_faults import _policy as _fault_policy

#: The modules whose objects a request makes (the collector's own bookkeeping of other libraries is not ours).
OURS = ("switchyard.gateway", "switchyard.decide", "switchyard.engines", "switchyard.store.limits")


def _policy(engines: Engines) -> str:
    small = ", ".join(f"http://127.0.0.1:{port}" for port in engines.ports["small-us"])
    return f"""\
schema: 1
regions: [us-east]
pools:
  - {{name: small-us, region: us-east, served_model: sim-small, endpoints: [{small}], kv_cache_tokens: 200000}}
  - {{name: dead-us, region: us-east, served_model: sim-dead, endpoints: [http://127.0.0.1:{engines.dead_port}],
      kv_cache_tokens: 100000}}
models:
  - {{name: small, pools: [small-us], context_window: 8192, price: {{input_per_mtok: 0.1, output_per_mtok: 0.2}}}}
  - {{name: dead, pools: [dead-us], context_window: 4096, price: {{input_per_mtok: 0, output_per_mtok: 0}}}}
routes:
  - name: auto
    rules:
      - {{name: short, when: {{prompt_tokens_lt: 200}}, model: small}}
    default: small
priorities:
  standard: {{max_queue_ms: 1000}}
tiers:
  - {{name: pro, priority: standard, models: ["*"], limits: {{tokens_per_minute: 100000000}}}}
  - {{name: tiny, priority: standard, models: ["*"], limits: {{requests_per_minute: 1}}}}
cache:
  - {{name: exact, match: {{models: [small]}}, mode: exact, ttl: 1h, scope: tenant}}
"""


#: The in-process gateway's client, and a key of each tier.
Gateway = tuple[TestClient[Any], dict[str, str]]


@pytest.fixture(scope="module")
def gateway(engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    folder = tmp_path_factory.mktemp("garbage")
    policy = folder / "policies.yaml"
    policy.write_text(_policy(engines))
    with _in_process(policy, ("pro", "tiny")) as started:
        yield started


@contextlib.contextmanager
def _in_process(policy: Path, tiers: tuple[str, ...]) -> Iterator[Gateway]:
    """A gateway in us-east on ``policy`` (its data beside it), in this process, with a key of each of ``tiers``."""
    folder = policy.parent
    settings = Settings(data_dir=folder, database_url=f"sqlite:///{folder / 'switchyard.db'}", policy_file=policy,
                        region="us-east", scrape_interval_s=3600, batch_worker=False, upstream_read_timeout_s=30)
    with TestClient(app=create_app(settings)) as client:
        runtime: GatewayRuntime = client.app.state.runtime
        keys = {}
        with db.session_scope(runtime.engine) as session:
            for tier in tiers:
                create_tenant(session, TenantCreate(name=f"garbage-{tier}", tier=tier))
                keys[tier] = create_key(session, f"garbage-{tier}")[0]
        yield client, keys


def _chat(model: str, *, stream: bool = False, cached: bool = False, words: str = "one two three") -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": 4,
                            "stream": stream}
    if cached:
        body["temperature"] = 0
    return body


Send = Callable[[TestClient[Any], dict[str, str]], httpx.Response]


def _post(body: dict[str, Any] | bytes, tier: str | None = "pro", headers: dict[str, str] | None = None,
          path: str = "/v1/chat/completions") -> Send:
    def send(client: TestClient[Any], keys: dict[str, str]) -> httpx.Response:
        auth = {"Authorization": f"Bearer {keys[tier] if tier else 'sk-sy-not-a-key'}"}
        extra = {**auth, **(headers or {})}
        if isinstance(body, bytes):
            return client.post(path, content=body, headers={**extra, "Content-Type": "application/json"})
        return client.post(path, json=body, headers=extra)
    return send


NO_STORE = {"x-switchyard-cache-control": "no-store"}
#: Each outcome a request can have: (the request, the status it gets).
CASES: dict[str, tuple[Send, int]] = {
    "whole answer": (_post(_chat("auto"), headers=NO_STORE), 200),
    "stream": (_post(_chat("auto", stream=True), headers=NO_STORE), 200),
    "completion": (_post({"model": "small", "prompt": "one two", "max_tokens": 4}, path="/v1/completions"), 200),
    "completion, streamed": (_post({"model": "small", "prompt": "one two", "max_tokens": 4, "stream": True},
                                   path="/v1/completions"), 200),
    "responses": (_post({"model": "small", "input": "one two", "max_output_tokens": 4}, path="/v1/responses"), 200),
    "responses, streamed": (_post({"model": "small", "input": "one two", "max_output_tokens": 4, "stream": True},
                                  path="/v1/responses"), 200),
    "cache hit": (_post(_chat("small", cached=True, words="a cached question")), 200),
    "cache hit, streamed": (_post(_chat("small", stream=True, cached=True, words="a cached stream")), 200),
    "unknown model": (_post(_chat("no-such-model")), 404),
    "unknown model, streamed": (_post(_chat("no-such-model", stream=True)), 404),
    "bad key": (_post(_chat("auto"), tier=None), 401),
    "bad body": (_post(b'{"model": "auto", "messages": ['), 400),
    "limited": (_post(_chat("small"), tier="tiny"), 429),
    "limited, streamed": (_post(_chat("small", stream=True), tier="tiny"), 429),
    "engine down": (_post(_chat("dead")), 503),
    "engine down, streamed": (_post(_chat("dead", stream=True)), 503),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_finished_request_leaves_no_reference_cycle(gateway: Gateway, case: str) -> None:
    client, keys = gateway
    send, status = CASES[case]
    first = send(client, keys)  # (the first of a kind may fill caches that live on: not garbage)
    assert first.status_code == status or (case.startswith("limited") and first.status_code == 200), first.text

    def again() -> None:
        answer = send(client, keys)
        assert answer.status_code == status, answer.text
        answer.read()

    ours = _cycles_left(again, 3)
    assert not ours, f"{case}: reference cycles left {dict(ours)}"


def _cycles_left(run: Callable[[], object], times: int) -> Counter[str]:
    """The gateway's objects (by type) that ``times`` runs of ``run`` left for the garbage collector: what a
    collection after them finds unreachable, kept in ``gc.garbage`` by ``gc.DEBUG_SAVEALL``."""
    gc.collect()
    gc.garbage.clear()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(times):
            run()
        gc.collect()
        return Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage
                       if type(o).__module__.startswith(OURS))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def test_the_check_finds_a_cycle() -> None:
    """The tests here can fail: a cycle of the gateway's objects is found in the collector's garbage."""
    from switchyard.decide.decision import Tried

    def cycle() -> None:
        tried = Tried("ok")
        tried.answer = tried

    assert _cycles_left(cycle, 2) == {"switchyard.decide.decision.Tried": 2}


# --- what an engine's fault leads to: a stream continued elsewhere, one that is not, a hedge, a fallback ------------

@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FaultFleet, TestClient[Any], dict[str, str]]]:
    """Simulated engines with a fault control server, and an in-process gateway in us-east over them."""
    folder = tmp_path_factory.mktemp("garbage-faults")
    fleets = fault_fleet(folder, FAULT_NAMES, lambda ports: {"policies": _fault_policy(ports)}, "policies")
    fleet = next(fleets)
    try:
        with _in_process(folder / "policies.yaml", ("gold", "hedge")) as (client, keys):
            yield fleet, client, keys
    finally:
        fleets.close()


def _long(model: str, *, stream: bool) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "tell me a long story about a lighthouse"}],
            "max_tokens": 24, "stream": stream}


#: Each fault: (what the engines are set to, the request, its tier, what its trace says happened).
FAULTS: dict[str, tuple[dict[str, dict[str, Any]], dict[str, Any], str, str]] = {
    "a stream resumed on another engine": ({"us-b": {"mode": "down"}, "us-a": {"abort_rate": 1.0,
                                                                               "abort_after_tokens": 5}},
                                           _long("main", stream=True), "gold", "stream: resumed at"),
    "a stream its model does not resume": ({"so": {"abort_rate": 1.0, "abort_after_tokens": 3}},
                                           _long("solo", stream=True), "gold", "stream:"),
    "a hedged first token": ({"us-b": {"mode": "down"}, "us-a": {"mode": "slow", "slow_factor": 2000}},
                             _long("main", stream=True), "hedge", "hedge: no first token"),
    "a whole answer that falls back": ({"us-a": {"mode": "down"}, "us-b": {"mode": "down"}},
                                       _long("main", stream=False), "gold", "main@eu-west"),
}


@pytest.mark.parametrize("case", list(FAULTS))
def test_a_request_through_an_engine_fault_leaves_no_reference_cycle(
        faulty: tuple[FaultFleet, TestClient[Any], dict[str, str]], case: str) -> None:
    fleet, client, keys = faulty
    faults, body, tier, said = FAULTS[case]
    fleet.fault(**FAULTS_CLEAR)
    for name, settings in faults.items():
        fleet.down(name, **settings)

    def send() -> httpx.Response:
        answer = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {keys[tier]}"})
        answer.read()
        assert answer.status_code == 200, answer.text
        return answer

    try:
        first = send()
        record = client.app.state.runtime.activity.get(first.headers["x-request-id"])
        assert record is not None and any(said in str(line) for line in record.trace), record.trace
        ours = _cycles_left(send, 2)
    finally:
        fleet.fault(**FAULTS_CLEAR)
    assert not ours, f"{case}: reference cycles left {dict(ours)}"
