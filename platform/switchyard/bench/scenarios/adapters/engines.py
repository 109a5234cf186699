"""What the ``adapters`` scenario reads from its simulated engines' ``/sim/state``: their adapter counters (loads,
activations, seconds spent loading) before and after an arm, and, sampled while it runs, the requests deferred for
an adapter slot, the requests waiting and running, the adapter loads so far and how far the engines lagged behind
the wall clock."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from switchyard.bench.sampler import Sampler, sim_state

#: Seconds between two samples of the engines' state while an arm runs.
SAMPLE_S = 1.0


@dataclass(frozen=True, slots=True)
class LoraCounters:
    """The adapter counters of a set of engines at one moment, summed over them.

    Attributes:
        loads: Adapters read into the CPU cache (from disk: the expensive kind).
        activations: Adapters copied into a GPU slot (every load is one too).
        load_seconds: Simulated seconds steps spent loading and copying adapters.
        engines: Engines that answered.
    """

    loads: int = 0
    activations: int = 0
    load_seconds: float = 0.0
    engines: int = 0

    def minus(self, before: LoraCounters) -> LoraCounters:
        """What happened between ``before`` and now."""
        return LoraCounters(self.loads - before.loads, self.activations - before.activations,
                            self.load_seconds - before.load_seconds, min(self.engines, before.engines))


def lora_counters(states: Sequence[Mapping[str, Any]]) -> LoraCounters:
    """The adapter counters of engines' ``/sim/state`` answers (an engine without LoRA adds nothing)."""
    loads = activations = answered = 0
    seconds = 0.0
    for state in states:
        lora = state.get("lora") or {}
        if "loads" not in lora:
            continue
        answered += 1
        loads += int(lora["loads"])
        activations += int(lora.get("activations", 0))
        seconds += float(lora.get("load_seconds", 0.0))
    return LoraCounters(loads, activations, seconds, answered)


def load_cost_s(states: Sequence[Mapping[str, Any]]) -> float | None:
    """What one adapter load costs the engines (``lora.costs.load_s``, simulated seconds), as the first engine that
    says reports it."""
    for state in states:
        costs = (state.get("lora") or {}).get("costs") or {}
        if "load_s" in costs:
            return float(costs["load_s"])
    return None


class StateSampler(Sampler):
    """Samples engines' ``/sim/state`` every ``every_s`` from :meth:`start` until :meth:`stop`, summing over them.

    Attributes:
        series: Per sample: requests deferred for an adapter slot (``lora.deferred``), waiting (``waiting``, the
            deferred among them) and running; adapter loads so far (``lora.loads``); the largest lag of an engine
            behind its wall clock (``lag_s``, simulated seconds).
    """

    def __init__(self, urls: Sequence[str], every_s: float = SAMPLE_S) -> None:
        super().__init__(every_s)
        self.urls = list(urls)
        self.series: dict[str, list[float]] = {"deferred": [], "waiting": [], "running": [], "loads": [],
                                               "lag_s": []}

    async def _run(self, at: float) -> None:
        timeout_s = max(self.bin_s, 1.0)
        async with aiohttp.ClientSession() as session:
            async for _ in self._bins(at):
                states = [s for s in await asyncio.gather(*(sim_state(session, u, timeout_s) for u in self.urls))
                          if s]
                if not states:
                    continue
                lora = [s.get("lora") or {} for s in states]
                self.series["deferred"].append(float(sum(int(x.get("deferred", 0)) for x in lora)))
                self.series["waiting"].append(float(sum(int(s.get("waiting", 0)) for s in states)))
                self.series["running"].append(float(sum(int(s.get("running", 0)) for s in states)))
                self.series["loads"].append(float(sum(int(x.get("loads", 0)) for x in lora)))
                self.series["lag_s"].append(max(float(s.get("lag_s", 0.0)) for s in states))
