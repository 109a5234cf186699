"""What the decisions read of the world, as read-only views the executing side hands in.

The decision procedure (:mod:`switchyard.decide.procedure`) and the decisions it calls never own
state that changes and never read a clock. Each executor supplies what it knows its own way: the
gateway from its endpoint registry, queues and indexes (live), the dry-run an idle fleet with no
history, the what-if replay its simulated engines on a simulated clock. These protocols are the
whole of what may be read; the memory of stateful scorers (prefix, session) is written only
through those scorers' observation hooks (:mod:`switchyard.decide.plugins`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from switchyard.policy.fleet import Pool
from switchyard.policy.tiers import Lane


@dataclass(slots=True)
class Candidate:
    """An endpoint that could serve the request."""

    pool: Pool
    url: str


@dataclass(slots=True)
class EndpointView:
    """What the picker knows of one endpoint.

    Attributes:
        healthy: In service: not down by health, and neither its breaker nor its pool's is open.
        load: Requests at the engine (scraped running + waiting, plus what this gateway sent since); as an
            interactive request weighs them: without the batch work that gives way to it, with the interactive
            streams in their prefill counted twice (:meth:`switchyard.engines.endpoints.EndpointState.load`).
        queued: Requests waiting inside the engine at the last fresh scrape.
        utilisation: How full it is, as the request's lane sees it
            (:meth:`switchyard.engines.endpoints.EndpointState.utilisation`, :func:`switchyard.decide.flow.batch_view`).
        inflight_tokens: Tokens this gateway has in flight there (prompt + expected output).
        models: The models its engine reports serving (None: not known from a fresh scrape).
        adapters: The LoRA adapters active there (its engine's running and waiting ones, and this executor's
            requests in flight there).
        recent_adapters: The adapters this executor sent there lately (likely still loaded).
        max_loras: How many adapters its engine runs at once.
    """

    healthy: bool = True
    load: float = 0.0
    queued: float = 0.0
    utilisation: float = 0.0
    inflight_tokens: int = 0
    models: frozenset[str] | None = None
    adapters: frozenset[str] = frozenset()
    recent_adapters: frozenset[str] = frozenset()
    max_loras: int = 1


class PrefixMemory(Protocol):
    """Which endpoints hold which prompt blocks (the prefix-affinity scorer's memory)."""

    def affinity(self, hashes: Sequence[bytes], urls: Sequence[str], now: float) -> dict[str, float]:
        """For each of ``urls``, the fraction of ``hashes`` it holds as an unbroken leading run."""
        ...

    def record(self, hashes: Sequence[bytes], url: str, now: float) -> None:
        """``url`` holds every block of ``hashes`` now."""
        ...


class SessionMemory(Protocol):
    """Which endpoint served each session last (the session-affinity scorer's memory)."""

    def get(self, key: str, now: float) -> str | None:
        """The endpoint of session ``key``, if it is known and fresh."""
        ...

    def record(self, key: str, url: str, now: float) -> None:
        """``url`` served session ``key`` now."""
        ...


class EngineCacheView(Protocol):
    """What each engine's prefix cache holds, as the engines report it (the precise scorer's truth): the
    gateway's index fed by KV-cache events, the replay's simulated engines themselves."""

    def knows(self, url: str, now: float) -> bool:
        """Whether the engine at ``url`` is reported on now (cheap: the prompt is rendered only if one is)."""
        ...

    def held(self, url: str, tokens: Sequence[int], now: float) -> int | None:
        """Tokens of ``tokens``' longest leading run the engine at ``url`` holds now; None when not known
        (no events from it, or its stream is syncing, stale or cut)."""
        ...

    def expect(self, url: str, tokens: Sequence[int], held: int, now: float) -> None:
        """A request with ``tokens`` was sent to ``url``, which held ``held`` of them (the engine must report
        the blocks it computes: a stream that then stays silent is stale)."""
        ...


class ScorerMemory(Protocol):
    """The state of the stateful scorers, owned by the executor."""

    @property
    def prefixes(self) -> PrefixMemory: ...

    @property
    def sessions(self) -> SessionMemory: ...

    @property
    def engine_caches(self) -> EngineCacheView: ...


class _Forgets:
    """Memory that holds nothing: an idle fleet with no history (the dry-run)."""

    def affinity(self, hashes: Sequence[bytes], urls: Sequence[str], now: float) -> dict[str, float]:
        return dict.fromkeys(urls, 0.0)

    def get(self, key: str, now: float) -> str | None:
        return None

    def record(self, *_args: object) -> None:
        return None

    def knows(self, url: str, now: float) -> bool:
        return False

    def held(self, url: str, tokens: Sequence[int], now: float) -> int | None:
        return None

    def expect(self, *_args: object) -> None:
        return None


class NoMemory:
    """:class:`ScorerMemory` with nothing in it, that keeps nothing."""

    prefixes: PrefixMemory = _Forgets()
    sessions: SessionMemory = _Forgets()
    engine_caches: EngineCacheView = _Forgets()


NO_MEMORY = NoMemory()


class LaneView(Protocol):
    """One lane of one pool's queue, read-only."""

    def tokens_before(self, tenant: str, rank: int) -> int:
        """Tokens served before a newcomer from ``tenant`` of class ``rank``."""
        ...

    def __len__(self) -> int:
        """Requests waiting in the lane."""
        ...


class QueueView(Protocol):
    """A pool's queues as flow control's decisions read them (:class:`switchyard.state.queues.PoolQueues`)."""

    def lane(self, lane: Lane) -> LaneView: ...

    def saturated(self, lane: Lane, utilisation: float, ceiling: float) -> bool:
        """Whether the pool is full for a newcomer of ``lane``."""
        ...

    def has_room(self, lane: Lane, utilisation: float, ceiling: float) -> bool:
        """Whether a newcomer of ``lane`` may go now."""
        ...


class DrainView(Protocol):
    """How fast a pool finishes its work (:class:`switchyard.state.queues.ServiceTime`)."""

    def drain_rate(self, in_flight_tokens: int) -> float | None:
        """Tokens per second it finishes while holding ``in_flight_tokens`` (None: not known yet)."""
        ...


class FleetView(Protocol):
    """Everything the decision procedure reads of the fleet and of the executor's own state."""

    @property
    def memory(self) -> ScorerMemory:
        """The stateful scorers' memory."""
        ...

    @property
    def rng(self) -> random.Random | None:
        """Breaks ties between equally scored endpoints (None: the first of them, reproducibly)."""
        ...

    def now(self) -> float:
        """The executor's clock (monotonic or simulated seconds)."""
        ...

    def rotation(self) -> int:
        """A counter for the round-robin picker (advanced by each call)."""
        ...

    def endpoint(self, candidate: Candidate, lane: Lane, now: float) -> EndpointView:
        """What the picker knows of ``candidate`` for a request of ``lane``."""
        ...

    def pool_utilisation(self, pool: Pool, lane: Lane, now: float) -> float:
        """The pool's utilisation as a newcomer of ``lane`` sees it (flow control); ``math.inf`` when none of its
        endpoints is in service."""
        ...

    def queues(self, pool: Pool) -> QueueView:
        """The pool's queues."""
        ...

    def service(self, pool: Pool) -> DrainView:
        """The pool's service time."""
        ...

    def reserved_tokens(self, pool: Pool) -> int:
        """Tokens the executor has in flight at the pool's endpoints."""
        ...

    def out_of_service(self, options: Sequence[Candidate], now: float) -> tuple[str, float]:
        """Why none of ``options`` can take a request now, and in how many seconds one might again."""
        ...

    def yielders(self, url: str) -> Sequence[float]:
        """When each request at ``url`` that gives way to interactive work was sent, oldest first."""
        ...

    def prefilling(self, url: str) -> int:
        """Interactive streams at ``url`` still waiting for their first byte."""
        ...

    def ttft_quantile(self, pool: Pool, quantile: float, now: float) -> float | None:
        """The ``quantile`` (in (0, 1)) of the pool's observed times to first token lately, in seconds (None:
        not known)."""
        ...

    def available(self, candidate: Candidate, now: float) -> bool:
        """Whether a request may go to ``candidate`` now (health and breakers)."""
        ...

    def full(self, candidate: Candidate, ceiling: float, now: float, preempting: bool) -> bool:
        """Whether ``candidate`` is at ``ceiling`` (``preempting``: without the work that gives way)."""
        ...
