"""Loading LoRA adapters on engines at run time: once per replica, shared by concurrent requests, and what an
engine's refusal means (a real HTTP server on loopback answers as vLLM does)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from switchyard.engines.endpoints import EndpointRegistry
from switchyard.engines.http1 import EngineClient
from switchyard.engines.upstream import UpstreamTimeouts, create_engine_client
from switchyard.gateway.adapters import AdapterLoader, AdapterLoadFailed
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.policy.fleet import Model, Pool
from tests.helpers import free_port

POOL = Pool(name="lora-us", region="us-east", served_model="base", endpoints=["http://127.0.0.1:1"],
            kv_cache_tokens=1000, runtime_lora_loading=True)
ADAPTER = Model(name="support", adapter_of="lora-us", adapter="support-v1", adapter_path="/adapters/s",
                context_window=4096, price={"input_per_mtok": 1, "output_per_mtok": 1})


@dataclass
class Engine:
    """A vLLM-like load endpoint: answers ``status`` with ``text`` after ``delay`` seconds; counts the loads."""

    url: str = ""
    status: int = 200
    text: str = "Success: LoRA adapter 'support-v1' added successfully."
    delay: float = 0.0
    bodies: list[dict[str, str]] = field(default_factory=list)


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    state = Engine()

    async def load(request: web.Request) -> web.Response:
        state.bodies.append(await request.json())
        await asyncio.sleep(state.delay)
        return web.Response(status=state.status, text=state.text)

    app = web.Application()
    app.router.add_post("/v1/load_lora_adapter", load)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    state.url = f"http://127.0.0.1:{port}"
    yield state
    await runner.cleanup()


def loader() -> AdapterLoader:
    return AdapterLoader(EndpointRegistry(), GatewayMetrics())


@contextlib.asynccontextmanager
async def engine_client() -> AsyncIterator[EngineClient]:
    """The gateway's client of requests to engines (adapter loads go through it)."""
    client = create_engine_client(UpstreamTimeouts(connect_s=2, read_s=10), max_connections=8)
    try:
        yield client
    finally:
        await client.close()


def loads(metrics: GatewayMetrics, outcome: str) -> float:
    return metrics.adapter_loads.labels("lora-us", "support", outcome)._value.get()


async def test_an_adapter_is_loaded_once_per_replica_and_concurrent_requests_share_the_load(engine: Engine) -> None:
    adapters = loader()
    assert adapters.needed(POOL, ADAPTER) and not adapters.loaded(engine.url, ADAPTER)
    engine.delay = 0.2
    async with engine_client() as http:
        results = await asyncio.gather(*(adapters.ensure(http, engine.url, POOL, ADAPTER) for _ in range(5)))
    assert engine.bodies == [{"lora_name": "support-v1", "lora_path": "/adapters/s"}]
    assert sorted(r.outcome for r in results) == ["loaded", "shared", "shared", "shared", "shared"]
    assert all(r.seconds >= 0.2 for r in results)
    assert adapters.loaded(engine.url, ADAPTER) and loads(adapters.metrics, "loaded") == 1
    # Forgotten (its engine answered 404 for it), it is loaded again next time.
    adapters.forget(engine.url, ADAPTER)
    assert not adapters.loaded(engine.url, ADAPTER)
    # An engine that has it already (another gateway loaded it) counts as loaded.
    engine.status, engine.text = 400, ('{"error":{"message":"The lora adapter \'support-v1\' has already been loaded. '
                                       'If you want to load the adapter in place, set \'load_inplace\' to True."}}')
    async with engine_client() as http:
        assert (await adapters.ensure(http, engine.url, POOL, ADAPTER)).outcome == "already"
    assert adapters.loaded(engine.url, ADAPTER) and loads(adapters.metrics, "already") == 1


async def test_an_engine_that_will_not_load_it_fails_the_load_with_its_reason(engine: Engine) -> None:
    adapters = loader()
    engine.status, engine.text = 500, "Call to add_lora method failed: LoRA is not enabled."
    async with engine_client() as http:
        with pytest.raises(AdapterLoadFailed, match=r"refused to load adapter support-v1 \(500\).*not enabled"):
            await adapters.ensure(http, engine.url, POOL, ADAPTER)
        assert not adapters.loaded(engine.url, ADAPTER) and loads(adapters.metrics, "failed") == 1
        with pytest.raises(AdapterLoadFailed, match="cannot connect"):
            await adapters.ensure(http, f"http://127.0.0.1:{free_port()}", POOL, ADAPTER)
    # A pool whose replicas load their adapters at start needs no load.
    assert not adapters.needed(POOL.model_copy(update={"runtime_lora_loading": False}), ADAPTER)


def test_a_replica_that_goes_down_forgets_what_was_loaded_there() -> None:
    registry = EndpointRegistry()
    registry.state("http://a").adapters_loaded.add("support-v1")
    registry.mark_down("http://a", "connection refused")
    assert registry.state("http://a").adapters_loaded == set()
