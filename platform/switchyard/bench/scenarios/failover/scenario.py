"""The ``failover`` scenario's run: two regions of simulated engines with fault control, the gateway, a steady
load with the outages staged under it (the control server's modes, and the ``HOME`` region's process killed and
started again), the gateway watched through its admin API; then the report (what the scenario registry calls is
:func:`run`)."""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp

from switchyard.bench.loadgen import run_open_loop
from switchyard.bench.policies import TENANT, TIER, two_region_policy
from switchyard.bench.procs import Proc, free_ports, wait_http
from switchyard.bench.results import Result
from switchyard.bench.sampler import MetricsSampler, scrape_text
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.scenarios.failover.report import write
from switchyard.bench.scenarios.failover.timeline import Counters, Outage, Timeline, engine_received, read_counters
from switchyard.bench.scenarios.failover.watch import GatewayWatch, stop
from switchyard.bench.scenarios.failover.workload import (
    CONTEXT,
    HEDGE_AFTER,
    HOME,
    KIND_WORDS,
    KINDS,
    KV_TOKENS,
    PHASE_S,
    PHASES,
    PROFILE,
    QUICK_PHASE_S,
    RATE,
    REGIONS,
    REPLICAS,
    SERVED,
    TIME_SCALE,
    TTFT_OBJECTIVE_S,
    mix,
)
from switchyard.bench.sender import Target
from switchyard.bench.spec import Workload
from switchyard.bench.stack import create_key, post_faults, start_gateway, start_sims, state_env
from switchyard.bench.synthetic import poisson

CLIENT_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 30.0
SCRAPE_TIMEOUT_S = 2.0
#: How long the staging waits for the gateway to take a region back before the next fault.
BACK_TIMEOUT_S = 15.0
#: The next fault comes at least this long after the region is back in service: its engines carry traffic again
#: and the gateway has seen them busy and moving (a hang of an idle engine is another experiment: only the
#: first-token deadline finds it).
SETTLE_S = 2.0
#: The admin API's bearer token of this run's gateway (loopback only, made afresh for each run).
ADMIN_TOKEN = secrets.token_urlsafe(16)


class Failover:
    """The failover scenario's run."""

    def __init__(self, ctx: ScenarioContext) -> None:
        self.ctx = ctx
        opts = ctx.options
        self.phase_s = dict.fromkeys(PHASES, opts.duration_s / len(PHASES)) if opts.duration_s else \
            dict(QUICK_PHASE_S if opts.quick else PHASE_S)
        self.duration_s = sum(self.phase_s.values())
        self.time_scale = opts.time_scale or TIME_SCALE
        self.line = Timeline(outages=[Outage(kind) for kind in KINDS])
        self.results: list[Result] = []
        self.series: dict[str, list[float]] = {}
        self.workload: Workload | None = None
        self.ports: dict[str, list[int]] = {}
        self.control: dict[str, int] = {}
        self.sims: dict[str, Proc] = {}
        self.policy = Path()

    @property
    def home_urls(self) -> list[str]:
        """The endpoints of the region that fails."""
        return [f"http://127.0.0.1:{p}" for p in self.ports.get(HOME, [])]

    def _start_region(self, region: str) -> Proc:
        return start_sims(self.ctx.procs, f"failover-sims-{region}", self.policy, self.ports[region],
                          time_scale=self.time_scale, seed=self.ctx.options.seed, regions=[region],
                          control_port=self.control[region], timeout_s=READY_TIMEOUT_S)

    def _kill_region(self, region: str) -> None:
        self.ctx.procs.stop(self.sims[region], grace_s=5.0, sig=signal.SIGKILL)

    def run(self) -> None:
        ctx = self.ctx
        ports = free_ports(2 * REPLICAS + 2)
        self.ports = {"us-east": ports[:REPLICAS], "eu-west": ports[REPLICAS:2 * REPLICAS]}
        self.control = {"us-east": ports[-2], "eu-west": ports[-1]}
        self.policy = ctx.state_dir / "policies.yaml"
        self.policy.write_text(two_region_policy(
            self.ports["us-east"], self.ports["eu-west"], served_model=SERVED, profile=PROFILE,
            kv_cache_tokens=KV_TOKENS, context_window=CONTEXT, ttft_objective=TTFT_OBJECTIVE_S,
            hedge_after=HEDGE_AFTER))
        ctx.say("failover: starting two regions of simulated engines (with fault control) and the gateway")
        env = state_env(ctx.state_dir / "switchyard", self.policy)
        with ThreadPoolExecutor(len(REGIONS) + 1) as pool:  # the regions' engines and the key, side by side
            starting = {region: pool.submit(self._start_region, region) for region in REGIONS}
            made = pool.submit(create_key, env, TENANT, TIER)
            self.sims = {region: future.result() for region, future in starting.items()}
            key = made.result()
        gateway = start_gateway(ctx.procs, "failover-gateway", {**env, "SWITCHYARD_ADMIN_TOKEN": ADMIN_TOKEN})
        workload = poisson(RATE, self.duration_s, mix(), ctx.options.seed)
        ctx.say(f"failover: {len(workload)} requests over {self.duration_s:g} s ("
                + ", ".join(f"{p} {self.phase_s[p]:g} s" for p in PHASES) + ")")
        samplers = {region: MetricsSampler([f"http://127.0.0.1:{p}/metrics" for p in self.ports[region]],
                                           ["vllm:num_requests_running"]) for region in REGIONS}
        self.results = asyncio.run(self._drive(workload, gateway.base_url, key, samplers))
        self.workload = workload
        bins = max(1, math.ceil(max((r.done_s for r in self.results), default=0.0) - 1e-9))  # the report's 1 s bins
        self.series = {f"{region} engines running": s.series["vllm:num_requests_running"][:bins]
                       for region, s in samplers.items()}
        ctx.procs.stop_all()  # the gateway and both regions' engines, side by side
        if self.line.errors:
            raise RuntimeError("the outages could not be staged: " + "; ".join(self.line.errors))

    async def _counters(self, session: aiohttp.ClientSession, gateway_url: str, at_s: float) -> Counters:
        async def engine(port: int) -> float | None:
            base = f"http://127.0.0.1:{port}"
            text, state = await asyncio.gather(scrape_text(session, f"{base}/metrics", SCRAPE_TIMEOUT_S),
                                               scrape_text(session, f"{base}/sim/state", SCRAPE_TIMEOUT_S))
            aborted = _aborted(state)
            return engine_received(text, aborted)

        gateway_text, counts = await asyncio.gather(
            scrape_text(session, f"{gateway_url}/metrics", SCRAPE_TIMEOUT_S),
            asyncio.gather(*(engine(p) for region in REGIONS for p in self.ports[region])))
        by_region = {region: counts[i * REPLICAS:(i + 1) * REPLICAS] for i, region in enumerate(REGIONS)}
        return read_counters(at_s, gateway_text, by_region)

    async def _set_mode(self, mode: str) -> None:
        answer = await asyncio.to_thread(post_faults, self.control[HOME], {"region": HOME, "mode": mode})
        engines = [e for e in answer.get("engines", []) if e.get("region") == HOME]
        wrong = [e.get("url") for e in engines if (e.get("faults") or {}).get("mode") != mode]
        if not engines or wrong:
            raise RuntimeError(f"the control server did not put every {HOME} engine in mode {mode}: {answer}")

    async def _stage(self, session: aiohttp.ClientSession, gateway_url: str, began: asyncio.Event,
                     watch: GatewayWatch) -> None:
        ctx, line = self.ctx, self.line
        loop = asyncio.get_running_loop()
        await began.wait()
        assert line.start is not None
        start = line.start

        def now() -> float:
            return loop.time() - start

        settled = 0.0  # the previous outage's region is back in service and carrying traffic again
        for outage in line.outages:
            kind = outage.kind
            at = sum(self.phase_s[p] for p in PHASES[:PHASES.index(kind)])
            lasts = self.phase_s[kind]
            await asyncio.sleep(max(0.0, at - now(), settled - now()))
            ctx.say(f"failover: {HOME} {kind} ({KIND_WORDS[kind]}) for {lasts:g} s")
            outage.before = await self._counters(session, gateway_url, now())
            outage.start_s = now()
            if kind == "kill":
                await asyncio.to_thread(self._kill_region, HOME)
                outage.restarted = HOME
            else:
                await self._set_mode(kind)
            outage.applied_s = now()
            await asyncio.sleep(max(0.0, outage.start_s + lasts - now()))  # a late fault still lasts its phase
            ctx.say(f"failover: {HOME} engines back")
            outage.after = await self._counters(session, gateway_url, now())
            outage.end_s = now()
            if kind == "kill":
                self.sims[HOME] = await asyncio.to_thread(self._start_region, HOME)
                outage.restored_s = now()
            else:
                await self._set_mode("none")
                outage.restored_s = now()
                for port in self.ports[HOME]:
                    await asyncio.to_thread(wait_http, f"http://127.0.0.1:{port}/health", self.sims[HOME],
                                            READY_TIMEOUT_S)
            outage.ready_s = now()
            if await watch.wait_back(BACK_TIMEOUT_S):
                outage.back_s = now()
            settled = now() + SETTLE_S

    async def _drive(self, workload: Workload, gateway_url: str, key: str,
                     samplers: dict[str, MetricsSampler]) -> list[Result]:
        line = self.line
        began = asyncio.Event()
        watch = GatewayWatch(gateway_url, ADMIN_TOKEN, self.home_urls, line)
        watching: dict[str, asyncio.Task[None]] = {}

        async with aiohttp.ClientSession() as session:
            loop = asyncio.get_running_loop()

            def started(at: float) -> None:
                line.start = at
                line.wall_start = time.time() - (loop.time() - at)
                began.set()
                for sampler in samplers.values():
                    sampler.start(at)
                watching["task"] = loop.create_task(watch.run(session, lambda: loop.time() - at))

            line.first = await self._counters(session, gateway_url, 0.0)
            faults = asyncio.create_task(self._stage(session, gateway_url, began, watch))
            try:
                results = await run_open_loop(
                    workload, Target(gateway_url, "switchyard", default_api_key=key),
                    progress=self.ctx.options.progress, timeout_s=CLIENT_TIMEOUT_S, on_start=started)
            except BaseException:
                faults.cancel()  # interrupted: do not stage the rest
                raise
            finally:
                for sampler in samplers.values():  # the load is over (the staging may wait for the region a while)
                    await sampler.stop()
                await self._finish_staging(faults)
                await stop(watching.get("task"))
            await watch.poll_records(session)
            end = max((r.done_s for r in results), default=0.0)
            line.last = await self._counters(session, gateway_url, end)
            return results

    async def _finish_staging(self, faults: asyncio.Task[None]) -> None:
        line = self.line
        try:
            await faults
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # reported, and the run's figures say what they can
            line.errors.append(f"{type(exc).__name__}: {exc}")
            if any(o.start_s is not None for o in line.outages) and self.sims[HOME].alive():
                try:  # never leave the region failed
                    await asyncio.to_thread(post_faults, self.control[HOME], {"mode": "none"})
                except OSError as again:
                    line.errors.append(f"{type(again).__name__}: {again}")


def _aborted(state: str | None) -> float | None:
    """The ``aborted`` count of a simulator's ``/sim/state`` text (None: unread)."""
    if state is None:
        return None
    try:
        value: Any = json.loads(state).get("aborted")
    except (ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) else None


def run(ctx: ScenarioContext) -> Outcome:
    """Run the failover (chaos) scenario and write its report into ``ctx.out_dir``."""
    f = Failover(ctx)
    started = time.monotonic()
    f.run()
    return write(ctx, f.results, f.line, workload=f.workload, series=f.series, phase_s=f.phase_s,
                 time_scale=f.time_scale, home_urls=f.home_urls, wall_s=time.monotonic() - started)
