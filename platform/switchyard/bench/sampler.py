"""Series sampled from Prometheus ``/metrics`` while a run goes on (queue depth, requests running).

The load generator sees requests; what waits inside the engines (``vllm:num_requests_waiting``)
it cannot see. A :class:`MetricsSampler` reads the named series from a set of ``/metrics`` URLs
every ``bin_s`` on the run's own clock and sums them over the URLs, so the report can plot queue
depth over time in the same bins as throughput. An :class:`EngineStateSampler` reads simulated
engines' own ``/sim/state`` (busy time, sequences running, lag behind the wall clock).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp


def sum_series(text: str, name: str) -> float:
    """Sum of every sample of ``name`` (any labels) in a Prometheus text exposition."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name):]
        if rest[:1] == "{":
            rest = rest[rest.rfind("}") + 1:]
        elif rest[:1] not in (" ", "\t"):
            continue
        fields = rest.split()
        if fields:
            try:
                value = float(fields[0])
            except ValueError:
                continue
            if math.isfinite(value):
                total += value
    return total


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(text_: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of series ``name`` (exactly) in a Prometheus text exposition, with its labels."""
    out = []
    for line in text_.splitlines():
        if not line.startswith(name):
            continue
        match = _SAMPLE.match(line)
        if match is None or match.group(1) != name:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        out.append((dict(_LABEL.findall(match.group(2) or "")), value))
    return out


def by_label(text_: str, name: str, label: str) -> dict[str, float]:
    """The samples of ``name`` summed per value of ``label``."""
    sums: dict[str, float] = {}
    for labels, value in samples(text_, name):
        key = labels.get(label)
        if key is not None:
            sums[key] = sums.get(key, 0.0) + value
    return sums


def histogram_buckets(text: str, name: str, labels: str = "") -> dict[float, float]:
    """The cumulative bucket counts of histogram ``name``, by upper bound; ``labels``: the series' other labels
    as the exposition writes them before ``le`` (``generation="2",``)."""
    prefix = f'{name}_bucket{{{labels}le="'
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            bound, _, rest = line[len(prefix):].partition('"}')
            with contextlib.suppress(ValueError):
                buckets[float(bound)] = float(rest.split()[0])
    return buckets


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> tuple[float | None, int]:
    """The upper bound of the bucket holding quantile ``q`` of the observations between two scrapes of one
    histogram, and how many there were (None, 0: none)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None, 0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= q * total:
            return bound, int(total)
    return bounds[-1], int(total)


async def scrape_text(session: aiohttp.ClientSession, url: str, timeout_s: float = 2.0) -> str | None:
    """The text ``url`` (a ``/metrics``) answers with 200, or None (another status, a timeout, no connection)."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            return await response.text() if response.status == 200 else None
    except (TimeoutError, aiohttp.ClientError):
        return None


async def scrape_sums(session: aiohttp.ClientSession, urls: Sequence[str], names: Sequence[str],
                      timeout_s: float = 2.0) -> tuple[dict[str, float], int]:
    """Each series summed over ``urls``; and how many URLs answered."""
    sums = dict.fromkeys(names, 0.0)
    answered = 0

    async def one(url: str) -> None:
        nonlocal answered
        text = await scrape_text(session, url, timeout_s)
        if text is None:
            return
        answered += 1
        for name in names:
            sums[name] += sum_series(text, name)

    await asyncio.gather(*(one(u) for u in urls))
    return sums, answered


class Sampler(ABC):
    """Runs :meth:`_run` from :meth:`start` (the run's start on the loop's clock) until :meth:`stop`."""

    def __init__(self, bin_s: float) -> None:
        self.bin_s = bin_s
        self._task: asyncio.Task[None] | None = None

    def start(self, at: float) -> None:
        """Begin sampling; bins count from ``at`` on the running loop's clock."""
        self._task = asyncio.get_running_loop().create_task(self._run(at))

    async def stop(self) -> None:
        """Stop sampling."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @abstractmethod
    async def _run(self, at: float) -> None:
        """Sample until cancelled, bins counted from ``at``."""

    async def _bins(self, at: float) -> AsyncIterator[int]:
        """Each bin's index, at the middle of the bin."""
        loop = asyncio.get_running_loop()
        index = 0
        while True:
            await asyncio.sleep(max(0.0, at + (index + 0.5) * self.bin_s - loop.time()))
            yield index
            index += 1


class MetricsSampler(Sampler):
    """Samples series from ``/metrics`` URLs into bins of ``bin_s`` (one value per bin).

    Call :meth:`start` with the run's start (``loop.time()``), :meth:`stop` when it ends;
    :attr:`series` then maps each name to its per-bin values. A URL that does not answer adds
    nothing to the sum (an engine that is down holds no requests).
    """

    def __init__(self, urls: Sequence[str], names: Sequence[str], bin_s: float = 1.0) -> None:
        super().__init__(bin_s)
        self.urls = list(urls)
        self.names = list(names)
        self.series: dict[str, list[float]] = {n: [] for n in names}

    async def _run(self, at: float) -> None:
        async with aiohttp.ClientSession() as session:
            async for _ in self._bins(at):
                sums, _answered = await scrape_sums(session, self.urls, self.names, timeout_s=self.bin_s)
                for name in self.names:
                    self.series[name].append(sums[name])


class EngineStateSampler(Sampler):
    """Samples simulated engines' ``/sim/state`` once per bin of ``bin_s``: how busy they were and how far
    behind their own clock they ran.

    Per bin, over the engines that answered (an engine that is down is out of the fleet, not idle):

    - ``busy``: the share of the bin's time the engines spent computing steps (simulated busy seconds over
      simulated seconds): what a GPU's utilisation counter reports, the share of time a kernel ran;
    - ``occupancy``: sequences running over their sequence slots (``max_num_seqs`` each);
    - ``in_use``: the share of the engines' throughput their steps used (simulated ``used_s`` over simulated
      seconds; each step counts the larger of its slots taken and its compute's share of the roofline, so a
      compute-bound prefill counts whole and a decode of one sequence in four a quarter; idle time counts 0);
    - ``lag_s``: the largest lag of an engine behind its wall clock (simulated seconds): how far the machine
      running the simulators fell short of simulating them in real time;
    - ``engines``: how many answered.
    """

    def __init__(self, urls: Sequence[str], max_num_seqs: int, time_scale: float, bin_s: float = 1.0) -> None:
        super().__init__(bin_s)
        self.urls = list(urls)
        self.max_num_seqs = max_num_seqs
        self.time_scale = time_scale
        self.busy: list[float | None] = []
        self.in_use: list[float | None] = []
        self.occupancy: list[float | None] = []
        self.lag_s: list[float | None] = []
        self.engines: list[int] = []

    async def _run(self, at: float) -> None:
        loop = asyncio.get_running_loop()
        last: dict[str, tuple[float, float, float]] = {}  # url -> (loop time, busy_s, used_s) of its last answer
        async with aiohttp.ClientSession() as session:
            async for _ in self._bins(at):
                states = await asyncio.gather(*(sim_state(session, url, self.bin_s) for url in self.urls))
                now = loop.time()
                busy = used = elapsed = 0.0
                running, lags, answered = 0.0, [], 0
                for url, state in zip(self.urls, states, strict=True):
                    if state is None:
                        last.pop(url, None)
                        continue
                    answered += 1
                    running += float(state["running"])
                    lags.append(float(state["lag_s"]))
                    seen, seen_used = float(state["busy_s"]), float(state.get("used_s", 0.0))
                    if url in last:
                        then, before, before_used = last[url]
                        if seen >= before:
                            busy += seen - before
                            used += seen_used - before_used
                        else:  # a restarted engine counts from 0
                            busy += seen
                            used += seen_used
                        elapsed += (now - then) * self.time_scale
                    last[url] = (now, seen, seen_used)
                self.engines.append(answered)
                self.busy.append(min(1.0, busy / elapsed) if elapsed > 0 else None)
                self.in_use.append(min(1.0, used / elapsed) if elapsed > 0 else None)
                self.occupancy.append(running / (answered * self.max_num_seqs) if answered else None)
                self.lag_s.append(max(lags) if lags else None)


async def sim_state(session: aiohttp.ClientSession, url: str, timeout_s: float) -> dict[str, Any] | None:
    """A simulated engine's ``/sim/state`` (None when it does not answer within ``timeout_s``, or not with 200)."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                return None
            state: dict[str, Any] = await response.json()
            return state
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None
