"""The gateway's live view of its fleet, as the decision procedure reads it (a
:class:`~switchyard.decide.views.FleetView`).

Every figure comes from this process's state as it is at the moment of reading: the endpoint
registry (health, breakers, scraped engine metrics and this process's own in-flight accounting),
flow control's queues and yielders, and the stateful scorers' memory (the prefix and session
indexes).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

from switchyard.decide.flow import batch_view
from switchyard.decide.views import Candidate, EndpointView
from switchyard.engines.endpoints import EndpointRegistry
from switchyard.engines.latency import PoolLatencies
from switchyard.gateway.flow import FlowController
from switchyard.policy.fleet import Pool
from switchyard.policy.tiers import Lane
from switchyard.state.memory import Memory
from switchyard.state.queues import PoolQueues, ServiceTime

#: How long an adapter this process sent to an endpoint counts as likely still loaded there (vLLM keeps the
#: adapters it ran last in its GPU and CPU caches until others push them out).
RECENT_ADAPTER_S = 60.0


class LiveView:
    """This process's view of its fleet (see the module doc)."""

    def __init__(self, endpoints: EndpointRegistry, flow: FlowController, memory: Memory,
                 rotation: Callable[[], int], rng: random.Random, latencies: PoolLatencies | None = None) -> None:
        self.endpoints = endpoints
        self.latencies = latencies or PoolLatencies()
        self.flow = flow
        self.memory = memory
        self._rotation = rotation
        self.rng: random.Random | None = rng

    def now(self) -> float:
        return time.monotonic()

    def rotation(self) -> int:
        return self._rotation()

    def endpoint(self, candidate: Candidate, lane: Lane, now: float) -> EndpointView:
        """What the picker knows of ``candidate`` at ``now``: an interactive request sees utilisation and load
        without this process's batch work that gives way to it; batch work sees every interactive prefill
        there as a full endpoint (:func:`~switchyard.decide.flow.batch_view`)."""
        registry = self.endpoints
        state = registry.state(candidate.url)
        age = registry.signal_max_age
        pool = candidate.pool
        preempting = lane == "interactive"
        healthy = state.healthy(now) and registry.pool_breaker(pool.name).allows(now)
        u = state.utilisation(now, age, pool.kv_cache_tokens, pool.max_num_seqs, preempting)
        if not preempting:
            u = batch_view(u, state.prefilling, state.batch_prefilling(now))
        view = EndpointView(healthy, state.load(now, age, preempting), state.queued(now, age), u, state.reserved,
                            state.served_models(now, age))
        if state.adapter_used or (state.signals is not None and state.signals.adapters is not None):
            view.adapters = state.adapters(now, age)
            view.recent_adapters = state.recent_adapters(now, RECENT_ADAPTER_S)
            view.max_loras = state.max_loras(pool.max_loras)
        elif pool.max_loras is not None:
            view.max_loras = pool.max_loras
        return view

    def pool_utilisation(self, pool: Pool, lane: Lane, now: float) -> float:
        if lane == "interactive":
            return self.flow.utilisation(pool, now, preempting=True)
        return self.flow.batch_utilisation(pool, now)

    def queues(self, pool: Pool) -> PoolQueues:
        return self.flow.queues(pool)

    def service(self, pool: Pool) -> ServiceTime:
        return self.flow.service(pool)

    def reserved_tokens(self, pool: Pool) -> int:
        return sum(self.endpoints.state(url).reserved for url in pool.endpoints)

    def out_of_service(self, options: Sequence[Candidate], now: float) -> tuple[str, float]:
        """Why none of ``options`` can take a request now, and in how many seconds one might again."""
        registry = self.endpoints
        reasons: list[str] = []
        waits: list[float] = []
        pools_open = set()
        for option in options:
            pool = registry.pool_breaker(option.pool.name)
            if not pool.allows(now):
                if option.pool.name not in pools_open:
                    pools_open.add(option.pool.name)
                    reasons.append(f"pool {option.pool.name} breaker {pool.state(now).replace('_', '-')}")
                    waits.append(pool.retry_in(now))
                continue
            state = registry.state(option.url)
            if not state.up:
                reasons.append(f"{option.url} down ({state.failure})")
                waits.append(registry.resilience.health.probe_interval * registry.resilience.health.healthy_after)
            elif not state.breaker.allows(now):
                reasons.append(f"{option.url} breaker {state.breaker.state(now).replace('_', '-')}")
                waits.append(state.breaker.retry_in(now))
        return ", ".join(reasons) or "no endpoint", min((w for w in waits if w > 0), default=1.0)

    def yielders(self, url: str) -> Sequence[float]:
        return self.flow.yielder_starts(url)

    def prefilling(self, url: str) -> int:
        return self.endpoints.state(url).prefilling

    def ttft_quantile(self, pool: Pool, quantile: float, now: float) -> float | None:
        return self.latencies.quantile(pool.name, quantile, now)

    def available(self, candidate: Candidate, now: float) -> bool:
        return self.endpoints.available(candidate.url, candidate.pool.name, now)

    def full(self, candidate: Candidate, ceiling: float, now: float, preempting: bool) -> bool:
        return self.flow.full(candidate.pool, candidate.url, ceiling, now, preempting)
