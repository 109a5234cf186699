"""The stalling fault modes in the engine loop: ``hang`` makes no step, ``drip`` one step per interval.

The engine runs for real here (its asyncio loop on the wall clock, at time scale 1), driven the way
the HTTP handlers drive it: requests submitted with a channel, progress read from the channel. A
stall must freeze everything a client or a scraper sees, and end without a burst of steps catching
up on it: the stalled time shows up once, as the long inter-token latency vLLM would measure.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable

import pytest

from switchyard.sim.config import EngineConfig, resolve
from switchyard.sim.request import SimRequest, Status
from switchyard.sim.runtime import Channel, EngineRuntime, Waker
from switchyard.sim.stats import Histogram

# Timings compared with what they should be: no other test competes for the cores meanwhile.
pytestmark = pytest.mark.alone

_ids = itertools.count()


@pytest.fixture
async def engine() -> AsyncIterator[EngineRuntime]:
    runtime = EngineRuntime(resolve(EngineConfig(served_model="m", port=1, time_scale=1, seed=1)))
    await runtime.start()
    try:
        yield runtime
    finally:
        await runtime.stop()


def submit(engine: EngineRuntime, max_output: int, prompt_len: int = 24) -> Channel:
    """A request as the handlers submit one; its channel shows what a client would have seen."""
    n = next(_ids)
    req = SimRequest(request_id=f"r{n}", prompt=[1000 + 7 * n + i for i in range(prompt_len)],
                     max_output=max_output, seed=n)
    channel = Channel(req, Waker())
    engine.submit(req, channel)
    return channel


async def until(predicate: Callable[[], bool], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def between(hist: Histogram, low: float, high: float | None = None) -> int:
    """Observations in ``(low, high]`` (bounds of the histogram; no ``high``: above ``low``)."""
    stop = None if high is None else hist.bounds.index(high) + 1
    return sum(hist.counts[hist.bounds.index(low) + 1:stop])


def frozen_view(engine: EngineRuntime, *channels: Channel) -> tuple[object, ...]:
    """What a client and a scraper see of the engine (the ``vllm:*`` series come from these)."""
    core, stats = engine.core, engine.core.stats
    return (core.steps, stats.generation_tokens, stats.prompt_tokens, stats.iteration_tokens.count,
            stats.itl.count, stats.ttft.count, len(core.running), core.num_waiting, core.kv.num_used,
            *(c.visible for c in channels))


async def test_hang_stops_every_step_and_the_engine_resumes_without_catching_up(engine: EngineRuntime) -> None:
    running = submit(engine, max_output=3000)
    await until(lambda: running.visible >= 3)
    engine.faults.update({"mode": "hang"})
    await asyncio.sleep(0.05)  # the step in flight, if any, is computed; nothing after it
    before, seen = frozen_view(engine, running), running.visible
    late = submit(engine, max_output=3)  # accepted while hung
    big_itl, slow_ttft = between(engine.core.stats.itl, 0.3), between(engine.core.stats.ttft, 0.25)

    await asyncio.sleep(0.45)
    assert frozen_view(engine, running) == before  # no step, no token, no counter moved
    assert late.visible == 0 and late.request.status is Status.WAITING and engine.core.num_pending == 1
    assert len(engine.core.running) == 1  # vllm:num_requests_running keeps its value

    engine.faults.update({"mode": "none"})
    await until(lambda: late.finished and running.visible >= seen + 5)
    stats = engine.core.stats
    # The stall is one long gap between two tokens of the running request (a catch-up burst would have
    # spread it over dozens of short ones), and the late request's first token waited it out.
    assert between(stats.itl, 0.3) == big_itl + 1
    assert between(stats.ttft, 0.25) == slow_ttft + 1
    assert engine.lag_s < 0.05 and engine.stalled_s >= 0.45
    assert engine.core.now == pytest.approx(engine.wall_to_sim(), abs=0.1)


async def test_a_hung_engine_still_frees_a_request_its_client_left(engine: EngineRuntime) -> None:
    gone = submit(engine, max_output=3000, prompt_len=100)
    await until(lambda: gone.visible >= 1)
    engine.faults.update({"mode": "hang"})
    await asyncio.sleep(0.05)
    assert engine.core.kv.num_used > 0
    engine.abort(gone.request)  # what the handler does when the client disconnects
    assert gone.aborted and engine.core.running == [] and engine.core.kv.num_used == 0
    assert engine.core.stats.aborted == 1 and engine.in_flight == 0
    engine.faults.update({"mode": "none"})
    after = submit(engine, max_output=2)
    await until(lambda: after.finished)


async def test_an_idle_hung_engine_holds_a_new_request_until_it_resumes(engine: EngineRuntime) -> None:
    engine.faults.update({"mode": "hang"})
    held = submit(engine, max_output=2)
    await asyncio.sleep(0.3)
    assert held.visible == 0 and engine.core.steps == 0 and engine.core.stats.prompt_tokens == 0
    engine.faults.update({"error_rate": 0.5})  # a change that leaves the mode alone keeps the engine hung
    await asyncio.sleep(0.1)
    assert engine.core.steps == 0
    engine.faults.update({"mode": "none"})
    await until(lambda: held.finished)
    assert engine.core.stats.ttft.sum >= 0.4  # the first token came after the whole hang


async def test_drip_makes_one_step_per_interval(engine: EngineRuntime) -> None:
    streams = [submit(engine, max_output=3000) for _ in range(2)]
    await until(lambda: all(s.visible >= 2 for s in streams))
    engine.faults.update({"mode": "drip", "drip_interval_s": 0.1})
    await asyncio.sleep(0.15)
    # (Steps, outputs and the metrics move when a step is computed; a channel shows it a few ms later.)
    itl = engine.core.stats.itl
    steps, produced, about_the_interval = engine.core.steps, [len(s.request.output) for s in streams], \
        between(itl, 0.075, 0.2)
    await asyncio.sleep(0.6)
    made = engine.core.steps - steps
    assert 3 <= made <= 7  # about 0.6 / 0.1, never a burst
    assert [len(s.request.output) - k for s, k in zip(streams, produced, strict=True)] == [made, made]
    # vLLM would measure about the interval between two tokens of each stream.
    assert between(itl, 0.075, 0.2) - about_the_interval == 2 * made

    engine.faults.update({"mode": "none"})  # back to full speed at once, from where it was
    at = [s.visible for s in streams]
    await asyncio.sleep(0.1)
    assert all(s.visible - k > 5 for s, k in zip(streams, at, strict=True))
    assert engine.lag_s < 0.05


async def test_a_dripping_engine_starts_a_new_request_at_its_next_step(engine: EngineRuntime) -> None:
    engine.faults.update({"mode": "drip", "drip_interval_s": 0.2})
    first = submit(engine, max_output=3)
    await until(lambda: first.finished, within_s=5)
    steps = engine.core.steps
    assert 3 <= steps <= 4  # one prefill step that also makes the first token, then one per token
    assert engine.core.stats.ttft.sum < 0.2  # an idle engine's first step is not delayed
    assert engine.stalled_s >= 0.3
