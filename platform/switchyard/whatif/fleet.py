"""The simulated engines of a policy: one engine core per endpoint, on one simulated clock.

Each pool's endpoints get the engine ``switchyard sim --policy`` would start for them: the
pool's ``sim_profile`` (a profile name, or a profile file relative to the policy's folder), its
``kv_cache_tokens``, and as context window the largest of the models it serves.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from switchyard.decide.views import Candidate, EndpointView
from switchyard.policy.fleet import Pool
from switchyard.policy.snapshot import PolicySnapshot
from switchyard.sim.config import EngineConfig, ResolvedConfig, resolve, with_pool_adapters
from switchyard.sim.core import EngineCore
from switchyard.sim.profiles import looks_like_profile_path
from switchyard.sim.request import SimRequest


def pool_profile(pool: Pool, base_dir: Path | None) -> str:
    """The hardware profile a pool is simulated with (a relative file path is taken from ``base_dir``)."""
    profile = pool.sim_profile
    if base_dir is not None and looks_like_profile_path(profile) and not Path(profile).is_absolute():
        profile = str(base_dir / profile)
    return profile


def pool_context(snapshot: PolicySnapshot, pool: Pool) -> int | None:
    """The context window a pool's engines need: the largest of the models it serves."""
    return max((m.context_window for m in snapshot.models.values() if pool.name in m.pools), default=None)


def pool_engine_config(snapshot: PolicySnapshot, pool: Pool, *, port: int = 0, host: str = "127.0.0.1",
                       time_scale: float = 1.0, seed: int = 0, base_dir: Path | None = None) -> EngineConfig:
    """The simulated engine of one endpoint of ``pool`` (with LoRA when the pool serves adapters)."""
    config = EngineConfig(served_model=pool.served_model, port=port, host=host,
                          profile=pool_profile(pool, base_dir), kv_cache_tokens=pool.kv_cache_tokens,
                          max_model_len=pool_context(snapshot, pool), max_num_seqs=pool.max_num_seqs,
                          time_scale=time_scale, seed=seed, region=pool.region, pool=pool.name)
    adapters = [(m.served_name, m.adapter_path) for m in snapshot.models.values()
                if m.adapter_of == pool.name and m.served_name is not None]
    return with_pool_adapters(config, adapters, max_loras=pool.max_loras, runtime_loading=pool.runtime_lora_loading)


class FleetError(ValueError):
    """A pool of the policy cannot be simulated (unknown profile, context larger than the KV cache)."""


@dataclass(slots=True)
class SimEndpoint:
    """One endpoint's engine core and the configuration it was built from."""

    url: str
    pool: Pool
    config: ResolvedConfig
    core: EngineCore
    #: Prompt + output budget of the replay's requests in this engine (the gateway's reservations).
    reserved: int = 0

    def view(self) -> EndpointView:
        """What the gateway would know of this engine from a scrape taken now: requests in it and those
        queued, and its utilisation from them and the gateway's own reservations there (the terms of
        ``EndpointState.utilisation``)."""
        core = self.core
        queued = core.num_waiting + core.num_pending
        running = len(core.running)
        utilisation = max(core.kv.usage, self.reserved / max(1, self.config.kv_cache_tokens),
                          (running + queued) / core.max_num_seqs)
        if queued:
            utilisation = max(utilisation, 1.0 + queued / max(running, 1))
        return EndpointView(True, float(running + queued), float(queued), utilisation)

    def submit(self, request: SimRequest) -> None:
        """Hand a request that reached this engine at ``request.arrival`` to its core."""
        self.core.add_request(request)


class Fleet:
    """Every endpoint of a policy as a simulated engine, advanced together in simulated time."""

    def __init__(self, snapshot: PolicySnapshot, base_dir: Path | None = None, seed: int = 0) -> None:
        """Build one engine core per endpoint URL of the policy's pools.

        Raises:
            FleetError: A pool cannot be simulated (the message names it).
        """
        self.endpoints: dict[str, SimEndpoint] = {}
        self.add(snapshot, base_dir, seed)

    def add(self, snapshot: PolicySnapshot, base_dir: Path | None = None, seed: int = 0) -> None:
        """Build an engine core for each endpoint URL of ``snapshot``'s pools that has none yet (a canary's
        candidate next to the active version: an endpoint both name is one engine, built from the first).

        Raises:
            FleetError: A pool cannot be simulated (the message names it).
        """
        for pool in snapshot.pools.values():
            if all(url in self.endpoints for url in pool.endpoints):
                continue
            try:
                config = resolve(pool_engine_config(snapshot, pool, seed=seed, base_dir=base_dir))
            except (ValueError, KeyError, OSError) as error:
                raise FleetError(f"pool {pool.name}: {error}") from error
            for url in pool.endpoints:
                if url in self.endpoints:
                    continue
                core = EngineCore(config.profile, kv_cache_tokens=config.kv_cache_tokens,
                                  max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_model_len=config.max_model_len)
                self.endpoints[url] = SimEndpoint(url, pool, config, core)

    def occupy(self, url: str, count: int, output_tokens: int = 256) -> None:
        """Start ``count`` requests in ``url``'s engine that no replayed request sent (other gateways' traffic):
        short prompts, ``output_tokens`` each."""
        endpoint = self.endpoints[url]
        for i in range(count):
            endpoint.submit(SimRequest(request_id=f"background-{url}-{i}", prompt=list(range(1, 17)),
                                       max_output=output_tokens, arrival=0.0, seed=i, budget=output_tokens))

    def view(self, candidate: Candidate) -> EndpointView:
        """The picker's view of an endpoint."""
        return self.endpoints[candidate.url].view()

    def advance(self, t: float) -> list[SimRequest]:
        """Run every engine up to simulated time ``t`` (an engine mid-step finishes that step);
        the requests that finished meanwhile."""
        finished: list[SimRequest] = []
        for endpoint in self.endpoints.values():
            core = endpoint.core
            while core.has_work() and core.now < t:
                finished += [r for r in core.advance(t) if r.finished_at is not None]
            core.advance_to(t)
        return finished

    def drain(self) -> float:
        """Run every engine until it has nothing left; the simulated time the last one finished."""
        end = 0.0
        for endpoint in self.endpoints.values():
            core = endpoint.core
            while core.has_work():
                core.advance(core.now + 3600.0)
            end = max(end, core.now)
        return end

    def cores(self) -> Iterable[EngineCore]:
        """Every engine core."""
        return (e.core for e in self.endpoints.values())
