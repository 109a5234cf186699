"""LoRA adapters loaded on engines at run time, before the first request that needs one there.

A model with ``adapter_of`` is served on its base pool's replicas under the adapter's name. Where the pool's
replicas run with runtime loading (``runtime_lora_loading``: vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``),
they start without the adapter, and a request naming it would get a 404: the gateway first asks the chosen
replica to load it (``POST /v1/load_lora_adapter`` with the model's ``adapter_path``) and remembers that it
did (:attr:`~switchyard.engines.endpoints.EndpointState.adapters_loaded`, forgotten when the endpoint goes
down; a 404 naming the model makes it load again). Concurrent requests for one adapter at one replica share
one load. An engine that says the adapter is loaded already counts as loaded.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import msgspec

from switchyard.engines.endpoints import EndpointRegistry
from switchyard.engines.http1 import EngineClient
from switchyard.engines.upstream import UpstreamFailure, engine_url, post
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.policy.fleet import Model, Pool

#: Most of an engine's answer to a load that is read (its error message).
_MAX_ANSWER = 4096


@dataclass(frozen=True, slots=True)
class Loaded:
    """A load's outcome: ``loaded`` (it took ``seconds``), ``already`` (the engine had it) or ``shared`` (another
    request's load, waited for)."""

    outcome: str
    seconds: float


class AdapterLoadFailed(Exception):
    """The engine would not load the adapter (or could not be reached)."""


class AdapterLoader:
    """Loads adapters on endpoints on demand (one per gateway process)."""

    def __init__(self, endpoints: EndpointRegistry, metrics: GatewayMetrics) -> None:
        self.endpoints = endpoints
        self.metrics = metrics
        self._loading: dict[tuple[str, str], asyncio.Future[Loaded]] = {}

    @staticmethod
    def needed(pool: Pool, model: Model) -> bool:
        """Whether ``model``'s requests to ``pool`` need their adapter loaded first."""
        return pool.runtime_lora_loading and model.adapter_of is not None

    def loaded(self, url: str, model: Model) -> bool:
        """Whether this process knows ``model``'s adapter is loaded at ``url``."""
        name = model.served_name
        return name is not None and name in self.endpoints.state(url).adapters_loaded

    def forget(self, url: str, model: Model) -> None:
        """``url`` does not have ``model``'s adapter (it answered 404 for it): load it again next time."""
        if model.served_name is not None:
            self.endpoints.state(url).adapters_loaded.discard(model.served_name)

    async def ensure(self, http: EngineClient, url: str, pool: Pool, model: Model) -> Loaded:
        """Load ``model``'s adapter at ``url`` unless it is known to be there; how that went.

        Raises:
            AdapterLoadFailed: The engine refused, or could not be reached.
        """
        name = model.served_name
        assert name is not None
        key = (url, name)
        pending = self._loading.get(key)
        if pending is not None:
            done = await asyncio.shield(pending)
            return Loaded("shared", done.seconds)
        future: asyncio.Future[Loaded] = asyncio.get_running_loop().create_future()
        self._loading[key] = future
        try:
            result = await self._load(http, url, pool, model, name)
        except BaseException as exc:
            future.set_exception(exc if isinstance(exc, AdapterLoadFailed)
                                 else AdapterLoadFailed(f"loading adapter {name} at {url} was interrupted"))
            future.exception()  # (retrieved: a load nobody shared must not warn)
            raise
        finally:
            self._loading.pop(key, None)
        future.set_result(result)
        return result

    async def _load(self, http: EngineClient, url: str, pool: Pool, model: Model, name: str) -> Loaded:
        started = time.perf_counter()
        payload = msgspec.json.encode({"lora_name": name, "lora_path": model.adapter_path or name})
        outcome = "failed"
        try:
            try:
                response = await post(http, engine_url(url, "/v1/load_lora_adapter"), payload,
                                      {"Content-Type": "application/json"})
            except UpstreamFailure as failure:
                raise AdapterLoadFailed(f"loading adapter {name}: {failure}") from None
            async with response:
                text = (await response.content.read(_MAX_ANSWER)).decode("utf-8", "replace")
            if response.status == 200:
                outcome = "loaded"
            elif response.status == 400 and "already been loaded" in text:
                outcome = "already"
            else:
                raise AdapterLoadFailed(f"{url} refused to load adapter {name} ({response.status}): "
                                        f"{text[:300]}")
        finally:
            seconds = time.perf_counter() - started
            self.metrics.adapter_loads.labels(pool.name, model.name, outcome).inc()
            if outcome == "loaded":
                self.metrics.adapter_load_seconds.labels(pool.name).observe(seconds)
        self.endpoints.state(url).adapters_loaded.add(name)
        return Loaded(outcome, seconds)
