"""A replay's view of its simulated fleet, as the decision procedure reads it (a
:class:`~switchyard.decide.views.FleetView`).

What a gateway in front of these engines would know at the replay's simulated time: each engine's
requests and queue as a fresh scrape would report them, the replay's own reservations there, flow
control's queues and service times, and the stateful scorers' memory, all on the simulated clock.
Endpoints named out of service stay out for the whole replay; the others stay healthy (failures are
not modelled), and no request gives way to another (batch preemption is not modelled).

The ``kv-cache-precise`` scorer's truth (:class:`~switchyard.decide.views.EngineCacheView`) is the
simulated engines' own block pools (:class:`FleetCaches`): what a gateway subscribed to their KV-cache
events would know, without delay or loss, for the pools that declare ``kv_events``; the endpoints of
other pools have no events, so the scorer uses the approximate index there, as in the gateway.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import replace

from switchyard.decide.flow import batch_pool_utilisation
from switchyard.decide.views import Candidate, EndpointView
from switchyard.policy.fleet import Pool
from switchyard.policy.tiers import Lane
from switchyard.sim.kv import chain_hashes
from switchyard.state.prefix import PrefixIndex
from switchyard.state.queues import PoolQueues, ServiceTime
from switchyard.state.sessions import SessionIndex
from switchyard.whatif.fleet import Fleet


class FleetCaches:
    """The simulated engines' prefix caches, as the precise scorer reads them (an
    :class:`~switchyard.decide.views.EngineCacheView`): exact and current for the endpoints of pools with
    ``kv_events``, unknown (None) for the others."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        #: The last prompt looked up and its block hashes by block size (the scorer asks once per endpoint).
        self._tokens: Sequence[int] | None = None
        self._hashes: dict[int, list[int]] = {}

    def _block_hashes(self, tokens: Sequence[int], size: int) -> list[int]:
        if tokens is not self._tokens:
            self._tokens, self._hashes = tokens, {}
        hashes = self._hashes.get(size)
        if hashes is None:
            hashes = self._hashes[size] = chain_hashes(tokens, size)
        return hashes

    def knows(self, url: str, now: float) -> bool:
        endpoint = self.fleet.endpoints.get(url)
        return endpoint is not None and endpoint.pool.kv_events is not None

    def held(self, url: str, tokens: Sequence[int], now: float) -> int | None:
        endpoint = self.fleet.endpoints.get(url)
        if endpoint is None or endpoint.pool.kv_events is None:
            return None
        core = endpoint.core
        return len(core.kv.lookup(self._block_hashes(tokens, core.block_size))) * core.block_size

    def expect(self, url: str, tokens: Sequence[int], held: int, now: float) -> None:
        return None


class ReplayMemory:
    """A replay arm's :class:`~switchyard.decide.views.ScorerMemory`: the approximate prefix index and the
    session index as a gateway keeps them, and the engines' caches as their events would report them."""

    def __init__(self, fleet: Fleet) -> None:
        self.prefixes = PrefixIndex()
        self.sessions = SessionIndex()
        self.engine_caches = FleetCaches(fleet)


class ReplayView:
    """A replay arm's fleet, queues and memory at its simulated time (see the module doc)."""

    def __init__(self, fleet: Fleet, clock: Callable[[], float], seed: int, down: frozenset[str] = frozenset()) -> None:
        self.fleet = fleet
        self.down = down
        self._clock = clock
        self.memory = ReplayMemory(fleet)  # (its clock is the simulated one the procedure passes)
        #: Breaks ties between equally scored endpoints, reproducibly.
        self.rng: random.Random | None = random.Random(seed)
        self._rotation = 0
        self._queues: dict[str, PoolQueues] = {}
        self._service: dict[str, ServiceTime] = {}

    def now(self) -> float:
        return self._clock()

    def rotation(self) -> int:
        self._rotation += 1
        return self._rotation

    def endpoint(self, candidate: Candidate, lane: Lane, now: float) -> EndpointView:
        view = self.fleet.endpoints[candidate.url].view()
        return replace(view, healthy=False) if candidate.url in self.down else view

    def pool_utilisation(self, pool: Pool, lane: Lane, now: float) -> float:
        """Its least-loaded endpoint's utilisation (of those in service; infinite when none is, as the gateway
        sees it); the batch lane's keeps the pool's reserved slots free."""
        views = [self.fleet.endpoints[url].view() for url in pool.endpoints if url not in self.down]
        if not views:
            return math.inf
        if lane == "interactive":
            return min(v.utilisation for v in views)
        return batch_pool_utilisation(pool, [v.utilisation for v in views], sum(v.load for v in views))

    def queues(self, pool: Pool) -> PoolQueues:
        queues = self._queues.get(pool.name)
        if queues is None:
            queues = self._queues[pool.name] = PoolQueues()
        return queues

    def service(self, pool: Pool) -> ServiceTime:
        service = self._service.get(pool.name)
        if service is None:
            service = self._service[pool.name] = ServiceTime()
        return service

    def all_queues(self) -> dict[str, PoolQueues]:
        """Every pool's queues so far, by pool name."""
        return self._queues

    def reserved_tokens(self, pool: Pool) -> int:
        return sum(self.fleet.endpoints[url].reserved for url in pool.endpoints)

    def out_of_service(self, options: Sequence[Candidate], now: float) -> tuple[str, float]:
        down = [o.url for o in options if o.url in self.down]
        return (", ".join(f"{url} down (out of service in this replay)" for url in down) or "no endpoint"), 1.0

    def yielders(self, url: str) -> Sequence[float]:
        return ()

    def prefilling(self, url: str) -> int:
        return 0

    def ttft_quantile(self, pool: Pool, quantile: float, now: float) -> float | None:
        return None  # the replay answers every try at once: it never hedges

    def available(self, candidate: Candidate, now: float) -> bool:
        return candidate.url not in self.down

    def full(self, candidate: Candidate, ceiling: float, now: float, preempting: bool) -> bool:
        return self.fleet.endpoints[candidate.url].view().utilisation >= ceiling
