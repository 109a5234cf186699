"""Active health checks: every endpoint's ``/health``, probed on the policy's interval.

vLLM's ``/health`` answers 200 with an empty body while its engine is alive (500 when the engine
core died; nothing at all when the server is gone). A probe that gets anything but 200 within
``probe_timeout`` fails. The registry (:meth:`EndpointRegistry.record_probe`) decides what a streak
of probes means; refused connections to requests and metric scrapes take an endpoint out at once
(:meth:`EndpointRegistry.mark_down`), and only probes bring it back.

The prober also sends the trial requests of half-open circuit breakers
(:mod:`switchyard.engines.breakers`): a one-token completion to an endpoint whose breaker, or whose
pool's, is half-open, bounded by the first-token timeout. ``/health`` cannot tell a hung engine
from a working one; a completion can.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp
import msgspec

from switchyard.engines.breakers import Trial
from switchyard.engines.endpoints import EndpointRegistry
from switchyard.engines.upstream import UpstreamFailure, read_body

log = logging.getLogger("switchyard.health")
_JSON = {"Content-Type": "application/json"}

#: Called when an endpoint goes in (True) or out (False) of service, with why.
Change = Callable[[str, bool, str | None], None]
#: How often half-open breakers are looked at for trials to send (seconds).
TRIAL_TICK_S = 0.1
#: The largest answer to a one-token trial request (anything larger is garbage and fails the trial).
TRIAL_MAX_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Target:
    """An endpoint whose breakers trial requests test: where they go, and what they ask for (a one-token
    completion; an embedding of one word for a pool of ``task: embed``)."""

    url: str
    pool: str
    served_model: str
    task: str = "generate"


class HealthProber:
    """Probes every endpoint each ``resilience.health.probe_interval`` seconds.

    Args:
        registry: Where probe results go (and whose ``resilience`` sets interval and timeout).
        session: The upstream connection pool.
        urls: The endpoints to probe (read each round: a policy reload may change them).
        changed: Told when an endpoint goes in or out of service.
    """

    def __init__(self, registry: EndpointRegistry, session: aiohttp.ClientSession,
                 urls: Callable[[], Iterable[str]], changed: Change,
                 targets: Callable[[], Iterable[Target]] = tuple) -> None:
        self.registry = registry
        self.session = session
        self.urls = urls
        self.changed = changed
        self.targets = targets
        self._trials: set[asyncio.Task[None]] = set()
        self._trying: set[str] = set()

    async def probe(self, url: str) -> None:
        """Probe one endpoint and record the result."""
        health = self.registry.resilience.health
        reason: str | None = None
        refused = False
        try:
            async with self.session.get(url + "/health", allow_redirects=False,
                                        timeout=aiohttp.ClientTimeout(total=health.probe_timeout)) as response:
                if response.status != 200:
                    reason = f"/health answered {response.status}"
        except aiohttp.ClientConnectorError as exc:
            reason = f"/health: cannot connect: {exc.os_error.strerror or exc.os_error}"
            refused = True
        except TimeoutError:
            reason = f"/health did not answer within {health.probe_timeout:g} s"
        except aiohttp.ClientError as exc:
            reason = f"/health: {exc.__class__.__name__}: {exc}"
        now = time.monotonic()
        if refused:
            assert reason is not None
            if self.registry.mark_down(url, reason, now):
                self.changed(url, False, reason)
            return
        change = self.registry.record_probe(url, reason is None, reason, now)
        if change is not None:
            self.changed(url, change, reason)

    def send_trials(self, now: float) -> None:
        """Start a trial request at every endpoint that a half-open breaker (its own or its pool's) waits on."""
        registry = self.registry
        for target in self.targets():
            if target.url in self._trying:
                continue
            state = registry.state(target.url)
            pool = registry.pool_breaker(target.pool)
            if not state.up or pool.state(now) == "open" or state.breaker.state(now) == "open":
                continue
            if state.breaker.wants_trial(now) or pool.wants_trial(now):
                trial = Trial.start(state.breaker, pool, now)
                self._trying.add(target.url)
                task = asyncio.get_running_loop().create_task(self._trial(target, trial))
                self._trials.add(task)
                task.add_done_callback(self._trials.discard)

    async def _trial(self, target: Target, trial: Trial) -> None:
        resilience = self.registry.resilience
        if target.task == "embed":
            path, payload = "/v1/embeddings", msgspec.json.encode({"model": target.served_model, "input": "Hi"})
        else:
            path = "/v1/completions"
            payload = msgspec.json.encode({"model": target.served_model, "prompt": "Hi", "max_tokens": 1})
        reason: str | None = None
        try:
            async with self.session.post(target.url + path, data=payload, headers=_JSON,
                                         allow_redirects=False,
                                         timeout=aiohttp.ClientTimeout(total=resilience.first_token_timeout)) as r:
                if r.status >= 500 or r.status in (404, 408) or 300 <= r.status < 400:
                    reason = f"trial request answered {r.status}"
                elif r.status < 300:
                    await read_body(r, TRIAL_MAX_BYTES)  # garbage (not a JSON object) fails the trial
        except UpstreamFailure as failure:
            reason = f"trial request: {failure}"
        except TimeoutError:
            reason = f"trial request: no answer within {resilience.first_token_timeout:g} s"
        except aiohttp.ClientError as exc:
            reason = f"trial request: {exc.__class__.__name__}: {exc}"
        finally:
            self._trying.discard(target.url)
        now = time.monotonic()
        if reason is None:
            trial.succeeded(now)
        else:
            trial.failed(now, reason)

    async def _trial_loop(self) -> None:
        while True:
            self.send_trials(time.monotonic())
            await asyncio.sleep(TRIAL_TICK_S)

    async def run(self) -> None:
        """Probe and send trials forever (cancel the task to stop)."""
        trials = asyncio.create_task(self._trial_loop(), name="switchyard-breaker-trials")
        try:
            await self._probe_loop()
        finally:
            trials.cancel()
            for task in (trials, *self._trials):
                task.cancel()
            await asyncio.gather(trials, *self._trials, return_exceptions=True)

    async def _probe_loop(self) -> None:
        while True:
            started = time.monotonic()
            urls = sorted(set(self.urls()))
            if urls:
                await asyncio.gather(*(self.probe(url) for url in urls))
            interval = self.registry.resilience.health.probe_interval
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))
