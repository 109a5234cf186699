"""Which endpoint serves a resolved model: least outstanding requests across its pools.

This is the first picker; load- and prefix-aware scoring comes with the routing work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from switchyard.policy.schema import Model, Pool
from switchyard.policy.snapshot import PolicySnapshot


@dataclass(frozen=True, slots=True)
class Candidate:
    """An endpoint that could serve the request."""

    pool: Pool
    url: str


@dataclass(frozen=True, slots=True)
class EndpointChoice:
    """The chosen endpoint and why."""

    pool: Pool
    url: str
    outstanding: int
    trace: str


def candidates(snapshot: PolicySnapshot, model: Model) -> list[Candidate]:
    """Every endpoint of every pool of ``model``, in policy order."""
    return [Candidate(pool, url) for pool in snapshot.model_pools[model.name] for url in pool.endpoints]


def pick_least_outstanding(options: Sequence[Candidate], outstanding: Callable[[str], int],
                           rotation: int) -> EndpointChoice:
    """The candidate with the fewest requests in flight; ties go round-robin by ``rotation``.

    Raises:
        ValueError: ``options`` is empty.
    """
    if not options:
        raise ValueError("no endpoint to choose from")
    n = len(options)
    best: Candidate | None = None
    best_load = 0
    for i in range(n):
        option = options[(rotation + i) % n]
        load = outstanding(option.url)
        if best is None or load < best_load:
            best, best_load = option, load
    assert best is not None
    return EndpointChoice(best.pool, best.url, best_load,
                          f"endpoint {best.url} of pool {best.pool.name}: {best_load} outstanding, "
                          f"least of {n}")
