"""A closed-loop saturation driver: N connections, each sending its next request when the last ends.

The open loop (``bench.loadgen``) is the right tool for latency at a given rate; to find how many
requests per second a server can carry at all, a closed loop is simpler and steadier: with enough
concurrent clients the server is never idle, and its completions per second are its capacity.
``switchyard bench`` reports that figure as *max sustained requests/s*: completions per second
over the measuring window, after a warm-up, with every request answered (the caller checks the
error rate). Latencies here include queueing inside the server and say little; the open loop
measures latency.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from switchyard.bench.results import Result
from switchyard.bench.sender import Target, send_one
from switchyard.bench.spec import RequestSpec


@dataclass(frozen=True, slots=True)
class Saturation:
    """What one closed-loop run measured.

    Attributes:
        arm: The target's name.
        concurrency: Clients sending back to back.
        window_s: The measuring window (after the warm-up).
        results: Requests that *ended* inside the window.
        throughput_rps: Successful completions per second of the window.
        error_rate: Failed fraction of the requests that ended in the window (None: none ended).
    """

    arm: str
    concurrency: int
    window_s: float
    results: list[Result]
    throughput_rps: float
    error_rate: float | None


async def run_closed_loop(spec: RequestSpec, target: Target, *, concurrency: int = 32, duration_s: float = 5.0,
                          warmup_s: float = 1.0, timeout_s: float = 30.0) -> Saturation:
    """Send ``spec``'s request from ``concurrency`` clients back to back for ``warmup_s + duration_s``.

    Every client reuses one keep-alive connection (the pool holds ``concurrency``). Requests
    that end inside ``[warmup_s, warmup_s + duration_s)`` are counted.
    """
    body = spec.encode()
    url = target.url(spec.kind)
    headers = {**target.headers_for(spec.tenant), **spec.labels.headers}
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0)
    loop = asyncio.get_running_loop()
    now = loop.time
    window: list[Result] = []
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        start = now()
        begin, end = warmup_s, warmup_s + duration_s

        async def client() -> None:
            while True:
                at = now() - start
                if at >= end:
                    return
                result = Result(spec.index, target.name, spec.tenant, spec.request_class, spec.model, spec.kind,
                                spec.stream, spec.prompt_tokens, spec.max_tokens, spec.prefix_group, at)
                await send_one(session, body, url, headers, result, now, start)
                if begin <= result.done_s < end:
                    window.append(result)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    ok = sum(r.ok for r in window)
    return Saturation(target.name, concurrency, duration_s, window, ok / duration_s,
                      (len(window) - ok) / len(window) if window else None)
