"""Flow control through a real gateway to real sim processes: priorities, shedding, fairness, lanes.

Engines of this module (each a `switchyard sim` process):

- ``busy-a``, ``busy-b``: pool ``busy``, four sequences each (the pool declares ``max_num_seqs: 4``);
- ``gate``: pool ``gate``, one sequence at a time, so one long request saturates it;
- ``spare``: pool ``spare``, the cheaper model that ``fancy`` is downgraded to.
"""

from __future__ import annotations

import asyncio
import random
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec
import openai
import pytest

from tests.helpers import free_port
from tests.integration.conftest import (
    SWITCHYARD,
    Engines,
    Gateway,
    client,
    gateway_counter,
    start_gateway,
    stop,
    wait_http,
)

CLASSES = ("critical", "standard", "sheddable")


def _policy(ports: dict[str, int]) -> str:
    def url(name: str) -> str:
        return f"http://127.0.0.1:{ports[name]}"

    price = "{input_per_mtok: 1, output_per_mtok: 1}"
    return f"""\
schema: 1
regions: [us-east]
pools:
  - {{name: busy, region: us-east, served_model: sim-busy, endpoints: [{url("busy-a")}, {url("busy-b")}],
      kv_cache_tokens: 100000, max_num_seqs: 4, priority_scheduling: true}}
  - {{name: gate, region: us-east, served_model: sim-gate, endpoints: [{url("gate")}], kv_cache_tokens: 100000,
      max_num_seqs: 1, priority_scheduling: true}}
  - {{name: spare, region: us-east, served_model: sim-spare, endpoints: [{url("spare")}],
      kv_cache_tokens: 100000}}
models:
  - {{name: busy, pools: [busy], context_window: 8192, price: {price}}}
  - {{name: gated, pools: [gate], context_window: 8192, price: {price}}}
  - {{name: fancy, pools: [gate], context_window: 8192, price: {price},
      on_saturation: {{downgrade_to: spare, classes: [standard]}}}}
  - {{name: spare, pools: [spare], context_window: 8192, price: {price}}}
priorities:
  critical: {{max_queue_ms: 10000}}
  standard: {{max_queue_ms: 3000}}
  sheddable: {{max_queue_ms: 1000, shed_above_utilisation: 0.75}}
  batch: {{lane: batch, max_queue_ms: 30000, max_utilisation: 0.5}}
tiers:
  - {{name: critical, priority: critical, models: ["*"]}}
  - {{name: standard, priority: standard, models: ["*"]}}
  - {{name: sheddable, priority: sheddable, models: ["*"]}}
  - {{name: batch, priority: batch, models: ["*"]}}
  - {{name: metered, priority: standard, models: ["*"], limits: {{tokens_per_minute: 20000}}}}
"""


@pytest.fixture(scope="module")
def flow_gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    seqs = {"busy-a": 4, "busy-b": 4, "gate": 1, "spare": 8}
    served = {"busy-a": "sim-busy", "busy-b": "sim-busy", "gate": "sim-gate", "spare": "sim-spare"}
    ports = {name: free_port() for name in seqs}
    tmp = tmp_path_factory.mktemp("flow")
    policy = tmp / "policies.yaml"
    policy.write_text(_policy(ports))
    procs: list[subprocess.Popen[bytes]] = []
    gateway: Gateway | None = None
    try:
        for i, (name, n) in enumerate(seqs.items()):
            procs.append(subprocess.Popen([SWITCHYARD, "sim", "--model", served[name], "--port", str(ports[name]),
                                           "--max-num-seqs", str(n), "--seed", str(i)]))
        for proc, name in zip(procs, seqs, strict=True):
            wait_http(f"http://127.0.0.1:{ports[name]}/health", proc)
        gateway = start_gateway(Engines(policy, {}, 0), f"sqlite:///{tmp / 'gw.db'}", tmp, "sqlite",
                                {"SWITCHYARD_SCRAPE_INTERVAL_S": "0.2", "SWITCHYARD_UPSTREAM_READ_TIMEOUT_S": "30"})
        for cls in CLASSES:
            for who in ("noisy", "quiet"):
                gateway.keys[f"{cls}-{who}"] = gateway.new_key(f"{cls}-{who}", cls)
        gateway.keys["batch"] = gateway.new_key("bulk-co", "batch")
        gateway.keys["metered"] = gateway.new_key("metered-co", "metered")
        yield gateway
    finally:
        if gateway is not None:
            assert stop(gateway.proc)
        for proc in procs:
            stop(proc)


def aclient(gw: Gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=gw.keys[key], max_retries=0, timeout=60)


async def until(check: Callable[[], bool], failure: str) -> None:
    """Until ``check()`` holds (two seconds at most)."""
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(failure)


@dataclass
class Outcome:
    cls: str
    tenant: str
    sent: float
    done: float
    status: int
    code: str | None = None
    retry_after: str | None = None
    queue_ms: float = 0.0
    served_class: str | None = None


async def one(api: openai.AsyncOpenAI, key: str, cls: str, sent: float, max_tokens: int) -> Outcome:
    try:
        raw = await api.completions.with_raw_response.create(
            model="busy", prompt=f"{key} says hello", max_tokens=max_tokens, extra_body={"ignore_eos": True})
    except openai.APIStatusError as err:
        body = err.body if isinstance(err.body, dict) else {}
        return Outcome(cls, key, sent, time.monotonic(), err.status_code, body.get("code"),
                       err.response.headers.get("retry-after"))
    headers = raw.headers
    return Outcome(cls, key, sent, time.monotonic(), 200, queue_ms=float(headers.get("x-switchyard-queue-ms", 0)),
                   served_class=headers["x-switchyard-class"].split()[1])


async def burst(gw: Gateway, seconds: float, rate: float, max_tokens: int) -> list[Outcome]:
    """Poisson arrivals at ``rate``/s: 20% critical, 40% standard, 40% sheddable; 3:1 noisy:quiet tenants."""
    rng = random.Random(5)
    # One client per tenant, made before the clock starts (making one takes tens of milliseconds).
    apis = {f"{cls}-{who}": aclient(gw, f"{cls}-{who}") for cls in CLASSES for who in ("noisy", "quiet")}
    start = time.monotonic()
    at, tasks = 0.0, []
    while at < seconds:
        at += rng.expovariate(rate)
        cls = rng.choices(CLASSES, weights=(2, 4, 4))[0]
        who = "noisy" if rng.random() < 0.75 else "quiet"
        delay = start + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        key = f"{cls}-{who}"
        tasks.append(asyncio.create_task(one(apis[key], key, cls, time.monotonic(), max_tokens)))
    # No request may hang: every one ends well inside the longest deadline plus its service time.
    return list(await asyncio.wait_for(asyncio.gather(*tasks), timeout=60))


@pytest.mark.alone  # it compares timings (or orders) that a busy second worker would shift
def test_a_burst_at_twice_capacity_degrades_the_least_important_first(flow_gw: Gateway) -> None:
    gw = flow_gw
    max_tokens = 60
    # Capacity: 8 sequence slots; one request of 60 tokens takes about 0.4 s on the sim: ~20/s.
    began = time.monotonic()
    with client(gw, "critical-noisy") as c:
        c.completions.create(model="busy", prompt="warm up", max_tokens=max_tokens, extra_body={"ignore_eos": True})
    service_s = time.monotonic() - began
    capacity = 8 / service_s
    outcomes = asyncio.run(burst(gw, 4.0, 2 * capacity, max_tokens))
    by_class = {cls: [o for o in outcomes if o.cls == cls] for cls in CLASSES}
    summary = {cls: (len(os), sum(o.status == 200 for o in os)) for cls, os in by_class.items()}

    assert {o.status for o in outcomes} <= {200, 503}, summary
    # Critical: every request served, within its 10 s queue deadline.
    assert all(o.status == 200 for o in by_class["critical"]), summary
    assert max(o.queue_ms for o in by_class["critical"]) < 10_000
    assert all(o.served_class == o.cls for o in outcomes if o.status == 200)
    # Sheddable goes first: the first refusal is a sheddable one, refused at once (not after waiting),
    # and sheddable loses a larger share than standard.
    refused = sorted((o for o in outcomes if o.status == 503), key=lambda o: o.done)
    assert refused, f"nothing was shed at twice the capacity: {summary}"
    assert refused[0].cls == "sheddable"
    shed = [o for o in by_class["sheddable"] if o.status == 503]
    assert {o.code for o in shed} <= {"shed_utilisation", "queue_deadline_exceeded", "queue_wait_too_long"}
    assert any(o.code == "shed_utilisation" and o.done - o.sent < 0.5 for o in shed), \
        (summary, [(o.code, round(o.done - o.sent, 2)) for o in shed])
    assert all(o.retry_after is not None and int(o.retry_after) >= 1 for o in refused)

    def share_served(cls: str) -> float:
        n, ok = summary[cls]
        return ok / n

    assert share_served("sheddable") < share_served("standard") <= 1.0
    # The noisy standard tenant does not starve its quiet neighbour.
    quiet = [o for o in by_class["standard"] if o.tenant.endswith("quiet")]
    noisy = [o for o in by_class["standard"] if o.tenant.endswith("noisy")]
    quiet_ok = sum(o.status == 200 for o in quiet) / max(1, len(quiet))
    noisy_ok = sum(o.status == 200 for o in noisy) / max(1, len(noisy))
    assert quiet_ok >= noisy_ok, (quiet_ok, noisy_ok, summary)
    # The gateway's metrics tell the same story.
    assert gateway_counter(gw, "switchyard_shed_total", **{"class": "sheddable"}) >= len(shed)
    assert gateway_counter(gw, "switchyard_queue_wait_seconds_count", pool="busy", lane="interactive") > 0
    assert gateway_counter(gw, "switchyard_queue_depth", pool="busy") == 0  # everything left the queue


async def blocker(gw: Gateway, max_tokens: int) -> openai.types.Completion:
    """Occupy the gate pool's only sequence slot for about ``max_tokens`` x 4.5 ms."""
    return await aclient(gw, "critical-noisy").completions.create(
        model="gated", prompt="block", max_tokens=max_tokens, extra_body={"ignore_eos": True})


async def until_busy(gw: Gateway, pool: str = "gate") -> None:
    await until(lambda: gateway_counter(gw, "switchyard_upstream_in_flight", pool=pool) >= 1,
                f"pool {pool} never got busy")


def test_a_saturated_model_is_downgraded_for_the_classes_it_names(flow_gw: Gateway) -> None:
    gw = flow_gw

    async def scenario() -> tuple[openai.APIResponse[object], openai.APIResponse[object], float]:
        block = asyncio.create_task(blocker(gw, 300))
        await until_busy(gw)
        standard = await aclient(gw, "standard-quiet").completions.with_raw_response.create(
            model="fancy", prompt="hello", max_tokens=5)
        critical = await aclient(gw, "critical-quiet").completions.with_raw_response.create(
            model="fancy", prompt="hello", max_tokens=5)
        done = time.monotonic()
        await block
        return standard, critical, done

    standard, critical, _ = asyncio.run(scenario())
    route = dict(part.split("=", 1) for part in standard.headers["x-switchyard-route"].split("; "))
    assert route["model"] == "spare" and route["downgraded_from"] == "fancy" and route["class"] == "standard"
    assert standard.headers["x-switchyard-degraded"].startswith("fancy -> spare: the pools of fancy are saturated")
    assert "x-switchyard-queue-ms" not in standard.headers
    # Critical is not downgraded: it waited for the gate and was served by fancy's own pool.
    route = dict(part.split("=", 1) for part in critical.headers["x-switchyard-route"].split("; "))
    assert route["model"] == "fancy" and route["pool"] == "gate" and "downgraded_from" not in route
    assert int(critical.headers["x-switchyard-queue-ms"]) > 0
    assert gateway_counter(gw, "switchyard_downgrades_total", model="fancy", reason="saturated",
                  **{"class": "standard"}) == 1


@pytest.mark.alone  # it compares timings (or orders) that a busy second worker would shift
def test_interactive_work_overtakes_batch_and_a_deadline_sheds(flow_gw: Gateway) -> None:
    gw = flow_gw
    finished: list[str] = []

    async def call(key: str, label: str, max_tokens: int = 5, model: str = "gated") -> None:
        await aclient(gw, key).completions.create(model=model, prompt=label, max_tokens=max_tokens)
        finished.append(label)

    async def scenario() -> Exception:
        block = asyncio.create_task(blocker(gw, 200))
        await until_busy(gw)
        bulk = asyncio.create_task(call("batch", "batch"))
        await asyncio.sleep(0.1)
        chat = asyncio.create_task(call("standard-noisy", "standard"))
        await asyncio.gather(block, bulk, chat)
        # A deadline: the gate is held for ~4 s, standard may wait 3 s.
        long = asyncio.create_task(blocker(gw, 900))
        await until_busy(gw)
        try:
            await call("standard-quiet", "too late")
        except openai.APIStatusError as err:
            await long
            return err
        raise AssertionError("a request past its queue deadline was served")

    err = asyncio.run(scenario())
    assert finished == ["standard", "batch"]
    assert isinstance(err, openai.APIStatusError) and err.status_code == 503
    body = err.body if isinstance(err.body, dict) else {}
    assert body["code"] == "queue_deadline_exceeded" and "standard" in body["message"]
    assert err.response.headers["retry-after"] == "3"
    assert err.response.headers["x-request-id"]
    assert err.response.headers["x-switchyard-class"] == "class standard (tier standard)"


def test_a_batch_request_in_flight_gives_way_to_an_interactive_one_and_runs_again(flow_gw: Gateway) -> None:
    """The gate's one slot holds a batch-lane request of ~1.8 s; an interactive one preempts it at once."""
    gw = flow_gw
    preempted_before = gateway_counter(gw, "switchyard_preemptions_total", pool="gate")
    tokens_before = gateway_counter(gw, "switchyard_tokens_total", model="gated", kind="completion")
    order: list[str] = []

    async def bulk() -> tuple[openai.types.Completion, dict[str, str]]:
        raw = await aclient(gw, "batch").completions.with_raw_response.create(
            model="gated", prompt="a long batch job", max_tokens=400, extra_body={"ignore_eos": True})
        order.append("batch")
        return raw.parse(), dict(raw.headers)

    async def chat() -> float:
        sent = time.monotonic()
        await aclient(gw, "standard-quiet").completions.create(model="gated", prompt="quick", max_tokens=5)
        order.append("standard")
        return time.monotonic() - sent

    async def scenario() -> tuple[tuple[openai.types.Completion, dict[str, str]], float]:
        job = asyncio.create_task(bulk())
        await until_busy(gw)
        await asyncio.sleep(0.3)  # well into its answer
        took = await chat()
        return await job, took

    (answer, headers), took = asyncio.run(scenario())
    assert order == ["standard", "batch"]
    assert took < 1.0, f"the interactive request took {took:.2f} s: it waited for the batch request"
    assert headers["x-switchyard-preempted"] == "1"
    assert answer.usage is not None and answer.usage.completion_tokens == 400
    assert gateway_counter(gw, "switchyard_preemptions_total", pool="gate") == preempted_before + 1
    # Only what was answered is counted: the preempted try is charged nothing.
    assert gateway_counter(gw, "switchyard_tokens_total", model="gated", kind="completion") == tokens_before + 405


def test_a_streamed_batch_request_is_never_preempted(flow_gw: Gateway) -> None:
    """A stream has sent bytes to its client: the interactive request waits for it instead."""
    gw = flow_gw
    preempted_before = gateway_counter(gw, "switchyard_preemptions_total", pool="gate")

    async def scenario() -> float:
        stream = await aclient(gw, "batch").completions.create(
            model="gated", prompt="a long streamed batch job", max_tokens=200, stream=True,
            extra_body={"ignore_eos": True})

        async def drain() -> None:
            async for _ in stream:
                pass

        job = asyncio.create_task(drain())
        await until_busy(gw)
        sent = time.monotonic()
        await aclient(gw, "standard-quiet").completions.create(model="gated", prompt="quick", max_tokens=5)
        took = time.monotonic() - sent
        await job
        return took

    took = asyncio.run(scenario())
    assert took > 0.4, "the interactive request did not wait for the streamed batch request"
    assert gateway_counter(gw, "switchyard_preemptions_total", pool="gate") == preempted_before


def test_a_request_may_lower_its_class_but_not_name_an_unknown_one(flow_gw: Gateway) -> None:
    gw = flow_gw

    async def scenario() -> tuple[openai.APIStatusError, openai.APIResponse[object]]:
        block = asyncio.create_task(blocker(gw, 200))
        await until_busy(gw)
        try:
            await aclient(gw, "critical-quiet").completions.create(
                model="gated", prompt="hi", max_tokens=5, extra_headers={"x-switchyard-priority": "sheddable"})
        except openai.APIStatusError as err:
            shed = err
        else:
            raise AssertionError("a request lowered to sheddable was not shed at a saturated pool")
        await block
        ok = await aclient(gw, "critical-quiet").completions.with_raw_response.create(
            model="gated", prompt="hi", max_tokens=5, extra_body={"priority": "standard"})
        return shed, ok

    shed, ok = asyncio.run(scenario())
    assert shed.status_code == 503 and isinstance(shed.body, dict) and shed.body["code"] == "shed_utilisation"
    assert shed.response.headers["retry-after"] == "1"
    assert ok.headers["x-switchyard-class"] == (
        "class standard (tier critical's class critical, lowered by the body's priority)")
    with pytest.raises(openai.BadRequestError) as caught:
        client(gw, "standard-quiet").completions.create(model="gated", prompt="hi", max_tokens=5,
                                                        extra_headers={"x-switchyard-priority": "urgent"})
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "invalid_priority"
    assert caught.value.body["param"] == "x-switchyard-priority"


def test_a_client_that_disconnects_while_queued_leaves_and_releases_its_reservation(flow_gw: Gateway) -> None:
    gw = flow_gw
    host, port = gw.base_url.removeprefix("http://").split(":")
    left_before = gateway_counter(gw, "switchyard_queue_abandoned_total", **{"class": "standard"})

    async def scenario() -> openai.APIResponse[object]:
        block = asyncio.create_task(blocker(gw, 300))
        await until_busy(gw)
        # A raw HTTP request that reserves over 8,000 of the tenant's 20,000 tokens per minute, then hangs up.
        body = msgspec.json.encode({"model": "gated", "prompt": "wait for me", "max_tokens": 8000})
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {gw.keys['metered']}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                     + body)
        def depth() -> float:
            return gateway_counter(gw, "switchyard_queue_depth", pool="gate", **{"class": "standard"})

        await until(lambda: depth() == 1, "the request never queued")
        sock.close()
        await until(lambda: depth() == 0, "the disconnected request stayed in the queue")
        await block
        return await aclient(gw, "metered").completions.with_raw_response.create(
            model="gated", prompt="after", max_tokens=10)

    after = asyncio.run(scenario())
    assert gateway_counter(gw, "switchyard_queue_abandoned_total", **{"class": "standard"}) == left_before + 1
    # Only this request's own reservation is gone from the minute's 20,000 tokens.
    assert int(after.headers["x-ratelimit-remaining-tokens"]) > 19_000
