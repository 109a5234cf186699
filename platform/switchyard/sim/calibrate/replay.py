"""The comparison: one short, fixed workload replayed against the real engine and the simulator.

The workload is a function of a seed and the engine's limits only: prompt lengths and output
lengths drawn from fixed ranges, some prompts opening with one of two shared prefixes (whole
KV blocks, so the prefix cache matters), open-loop Poisson arrivals at a rate chosen from the
fitted profile so that a few requests run at once, and at most a share of what the engine
completed in a short closed-loop pilot (``closed_loop_rate``). Both engines see the identical
requests at the identical offsets, streamed, so TTFT and ITL are observed the same way on both.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from switchyard.figures import percentile
from switchyard.sim.calibrate.client import EngineClient, EngineError, StreamResult
from switchyard.sim.calibrate.fit import StepFit


@dataclass(frozen=True)
class ReplayRequest:
    """One request of the workload: when it is sent (seconds from the start), and what."""

    at: float
    prompt: list[int]
    max_tokens: int
    shared_prefix: bool


@dataclass(frozen=True)
class Workload:
    """The replayed requests and how they were chosen."""

    requests: list[ReplayRequest]
    rate: float
    seed: int
    shared_prefix_tokens: int
    #: Requests per second the engine completed in the pilot (the rate is at most CAPACITY_SHARE of it).
    capacity: float | None = None
    capacity_in_flight: int = 0

    def describe(self) -> str:
        """One line for the report."""
        n = len(self.requests)
        shared = sum(r.shared_prefix for r in self.requests)
        prompts = [len(r.prompt) for r in self.requests]
        outputs = [r.max_tokens for r in self.requests]
        capped = ("" if self.capacity is None else
                  f", {self.rate / self.capacity:.0%} of the {self.capacity:.2f}/s the engine completed "
                  f"with {self.capacity_in_flight} in flight")
        return (f"{n} requests, Poisson arrivals at {self.rate:.2f}/s (seed {self.seed}{capped}); prompts "
                f"{min(prompts)}-{max(prompts)} tokens, outputs {min(outputs)}-{max(outputs)} "
                f"tokens; {shared} open with one of two shared {self.shared_prefix_tokens}-token "
                "prefixes")


def make_workload(fit: StepFit, *, requests: int, max_model_len: int, block_size: int,
                  max_num_seqs: int, vocab_size: int, seed: int) -> Workload:
    """The fixed-seed workload for an engine with these limits and this fitted speed."""
    rng = random.Random(seed)
    lo, hi = min(vocab_size - 1, max(3, vocab_size // 10)), max(4, vocab_size * 9 // 10)

    def ids(n: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(n)]

    max_out = max(8, min(64, max_model_len // 8))
    max_prompt = max(16, min(1024, max_model_len * 6 // 10))
    shared_len = min(max(2 * block_size, 64), max_prompt // 2)
    shared_len -= shared_len % block_size if shared_len >= block_size else 0
    prefixes = [ids(shared_len), ids(shared_len)]
    # Aim for a few requests running at once: batching matters, but the engine (and, on a
    # small machine, the CPU it shares with its API server and this client) is not saturated.
    target = max(1.0, min(3.0, 0.3 * max_num_seqs))
    mean_prompt, mean_out = (16 + max_prompt) / 2, (8 + max_out) / 2
    kv = target * (mean_prompt + mean_out / 2)
    latency = fit.predict_ttft(int(mean_prompt)) + mean_out * fit.predict_itl(round(target), kv)
    rate = target / latency
    t = 0.0
    out: list[ReplayRequest] = []
    for _ in range(requests):
        t += rng.expovariate(rate)
        n = rng.randint(16, max_prompt)
        shared = rng.random() < 0.4 and n > shared_len + 8
        prompt = (rng.choice(prefixes) + ids(n - shared_len)) if shared else ids(n)
        out_len = rng.randint(8, max_out)
        out_len = min(out_len, max_model_len - n - 1)
        out.append(ReplayRequest(at=t, prompt=prompt, max_tokens=out_len, shared_prefix=shared))
    return Workload(requests=out, rate=rate, seed=seed, shared_prefix_tokens=shared_len)


#: The most of the pilot's closed-loop rate the replay offers. A rate from the fitted step time alone
#: leaves out what a small machine spends outside the engine step (the API server streaming every
#: token, this client parsing it), and an open-loop replay above the real engine's capacity measures
#: its queue, not its speed (a CI run on two cores: TTFT p50 246 ms real against 5.2 ms simulated,
#: twice in a row). At this share the queue stays short through Poisson bursts.
CAPACITY_SHARE = 0.4


def within_capacity(workload: Workload, capacity: float, in_flight: int) -> Workload:
    """``workload`` at no more than ``CAPACITY_SHARE`` of ``capacity`` requests per second.

    The same requests in the same order; the offsets scale with the rate (exponential gaps scale
    exactly), so the shape of the arrivals is kept.
    """
    rate = min(workload.rate, CAPACITY_SHARE * capacity)
    scale = workload.rate / rate
    requests = [dataclasses.replace(r, at=r.at * scale) for r in workload.requests]
    return dataclasses.replace(workload, requests=requests, rate=rate, capacity=capacity,
                               capacity_in_flight=in_flight)


async def closed_loop_rate(client: EngineClient, requests: Sequence[ReplayRequest], in_flight: int) -> float:
    """Requests per second the engine completes with ``in_flight`` of ``requests`` always running.

    Everything between the client and the tokens counts (the API server, this process), which is
    what an open-loop replay against the engine must stay under.
    """
    pending = iter(requests)
    start = time.perf_counter()

    async def worker() -> None:
        for req in pending:
            await client.complete(req.prompt, req.max_tokens)

    await asyncio.gather(*[worker() for _ in range(in_flight)])
    return len(requests) / (time.perf_counter() - start)


async def replay(client: EngineClient, workload: Workload) -> list[StreamResult]:
    """Send every request at its offset (open loop) and wait for all of them."""
    start = time.perf_counter()

    async def one(req: ReplayRequest) -> StreamResult:
        await asyncio.sleep(max(0.0, start + req.at - time.perf_counter()))
        return await client.complete(req.prompt, req.max_tokens)

    return list(await asyncio.gather(*[one(r) for r in workload.requests]))


@dataclass(frozen=True)
class LatencySummary:
    """Client-side latencies of one replay, in seconds."""

    requests: int
    output_tokens: int
    ttft: dict[int, float]
    itl: dict[int, float]
    mean_tpot: float
    duration_s: float


QUANTILES = (50, 90, 99)


def summarize(results: Sequence[StreamResult]) -> LatencySummary:
    """TTFT and ITL percentiles over a replay."""
    ttfts = [r.ttft for r in results]
    itls = [g for r in results for g in r.itls()]
    tpots = [(r.last_token_at - r.first_token_at) / (r.completion_tokens - 1)
             for r in results if r.completion_tokens > 1]
    start = min(r.sent_at for r in results)
    end = max(r.last_token_at for r in results)
    return LatencySummary(
        requests=len(results), output_tokens=sum(r.completion_tokens for r in results),
        ttft={q: _or_nan(percentile(ttfts, q)) for q in QUANTILES},
        itl={q: _or_nan(percentile(itls, q)) for q in QUANTILES},
        mean_tpot=sum(tpots) / len(tpots) if tpots else float("nan"), duration_s=end - start)


def _or_nan(value: float | None) -> float:
    """A percentile as the report and the profile's provenance keep it: NaN (shown ``n/a``) for none."""
    return float("nan") if value is None else value


#: Seconds the simulator started for the comparison gets to answer ``/health``.
SIM_START_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def simulated_engine(session: aiohttp.ClientSession, profile_path: Path,
                           model: str) -> AsyncIterator[str]:
    """Run ``switchyard sim`` with a profile file on a free loopback port; yield its URL."""
    port = _free_port()
    errors = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, waited for with asyncio below
        [sys.executable, "-m", "switchyard", "sim", "--profile", str(profile_path),
         "--model", model, "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=errors, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SIM_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                errors.seek(0)
                raise EngineError(f"the simulator exited with {proc.returncode}: "
                                  f"{errors.read().strip()}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url + "/health") as resp:
                    if resp.status == 200:
                        break
            if time.monotonic() > deadline:
                raise EngineError(f"the simulator did not become healthy within "
                                  f"{SIM_START_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.1)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 15)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)
        errors.close()
