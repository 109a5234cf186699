"""Helpers for the engine-core tests: a core with chosen limits, and a way to drive it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import pytest

from switchyard.sim.core import EngineCore, StepResult
from switchyard.sim.profiles import PROFILES
from switchyard.sim.request import SimRequest, Status

CoreFactory = Callable[..., EngineCore]


@pytest.fixture
def make_core() -> CoreFactory:
    """Build an 8B-profile core; keyword arguments override its limits."""

    def build(*, kv_cache_tokens: int = 400_000, max_num_seqs: int = 256,
              max_num_batched_tokens: int = 8192, max_model_len: int = 8192,
              frontend_overhead_s: float = 0.0, **profile_overrides: object) -> EngineCore:
        profile = dataclasses.replace(PROFILES["h100-8b"], **profile_overrides)  # type: ignore[arg-type]
        return EngineCore(profile, kv_cache_tokens=kv_cache_tokens, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len, frontend_overhead_s=frontend_overhead_s)

    return build


_ids = iter(range(10**9))


def make_request(prompt: list[int], max_output: int = 4, *, priority: int = 0,
                 arrival: float = 0.0, seed: int = 1) -> SimRequest:
    """A request with a given prompt that generates exactly ``max_output`` tokens."""
    return SimRequest(request_id=f"r{next(_ids)}", prompt=list(prompt), max_output=max_output,
                      priority=priority, arrival=arrival, seed=seed)


def prompt_of(n: int, offset: int = 0) -> list[int]:
    """``n`` distinct token ids (different offsets give prompts that share nothing)."""
    return [2000 + offset * 100_000 % 90_000 + i % 50_000 for i in range(n)]


def run_until_done(core: EngineCore, requests: Iterable[SimRequest],
                   max_steps: int = 100_000) -> list[StepResult]:
    """Step until every request finished; return the step results."""
    reqs = list(requests)
    results: list[StepResult] = []
    while not all(r.status is Status.FINISHED for r in reqs):
        assert len(results) < max_steps, "the engine made no progress"
        results.append(core.step())
    return results
