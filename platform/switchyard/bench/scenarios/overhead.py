"""``overhead``: what the gateway adds to a request, and how many requests per second it carries.

Three arms in front of one engine that answers instantly (``bench.instant``): ``direct`` (the
client calls the engine), ``switchyard`` (through ``switchyard serve``) and ``litellm`` (through
the LiteLLM proxy, one worker, installed by ``bench.litellm_env``), each non-streaming and
streaming, back to back on the same engine.

(a) **Added latency**: open-loop Poisson load at fixed rates (25, 100, 250, 500, 1,000 requests/s; 25
is there so that LiteLLM, which sustains 40 to 80 here, has a figure too); a request's
latency is measured from the moment it was sent (the whole body when not streaming, the first
content chunk when streaming). Added latency = the arm's percentile minus the direct arm's
percentile in the same repeat (a difference of percentiles, not a percentile of differences:
requests are not paired); at the goal rate every arm runs three times, interleaved, and the
median difference is reported with the range. The first second of every step is a warm-up and
is left out; a step whose load generator fell behind by more than 50 ms (p99; the machine
stalled) is run again once. An arm is not run at a rate above its own max sustained rate (it
would only queue).

(b) **Max sustained requests/s**: a closed loop (``bench.closedloop``) of 32 connections for a
few seconds after a one-second warm-up: completions per second, provided at most 0.1% failed.
The proxy's CPU use over the window says whether the proxy (about 100% of its core) or the
load generator was the limit.

CPU placement: with two or more CPUs the proxy runs alone on one; the load generator and the
engine share the others (``cpu_plan``), so every arm's client side is the same and the proxy
competes with nothing; the proxies not being measured are paused (SIGSTOP) meanwhile.
The gateway runs the demo policy's kind of request path (``bench.policies.overhead_policy``:
auth from the key cache, ``auto`` route rules, limits, flow control, the exact cache's lookup,
the prefix index, metrics, the request log); the report names it and keeps the file.

Goals (issue #31, one gateway process on one core): added p50 ≤ 0.5 ms and p99 ≤ 2 ms at 500
requests/s non-streamed, first-chunk p99 ≤ 2 ms streamed, p99 ≤ 5 ms at 1,000 requests/s;
at least 3,000 requests/s sustained non-streamed and 2,000 streamed, 25 times LiteLLM's.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import secrets
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from switchyard.bench import litellm_env
from switchyard.bench.closedloop import Saturation, run_closed_loop
from switchyard.bench.loadgen import run_open_loop
from switchyard.bench.policies import TENANT, TIER, overhead_policy
from switchyard.bench.procs import Proc, StartError, cpu_seconds, free_port, wait_http
from switchyard.bench.profile import ProfileSummary, record_profile
from switchyard.bench.results import Result
from switchyard.bench.sampler import by_label, histogram_buckets, scrape_text
from switchyard.bench.scenarios.base import Outcome, ScenarioContext, cpu_plan
from switchyard.bench.scenarios.overhead_figures import (
    CONCURRENCY,
    GOAL_RATE,
    MAX_ERROR_RATE,
    MODES,
    STALL_SAMPLER_MS,
    write,
)
from switchyard.bench.sender import Target
from switchyard.bench.spec import RequestSpec
from switchyard.bench.stack import GatewayHandle, create_key, start_gateway, start_instant_engine, state_env
from switchyard.bench.stats import percentiles
from switchyard.bench.synthetic import RequestTemplate, poisson

MODEL = "auto"
SERVED = "instant"
RATES = (25.0, 100.0, 250.0, 500.0, 1000.0)
QUICK_RATES = (500.0, 1000.0)
#: Sent by the client to the gateway: the exact cache's lookup runs on every request, nothing is stored (a hit
#: would not reach the engine).
CACHE_HEADERS = {"x-switchyard-cache-control": "no-store"}
#: Repeats of each arm's step at the goal rate (p99 jitters between runs on a small machine).
REPEATS = 3
#: A step whose send lateness p99 is above this ran on a stalled machine and is run again.
STALL_S = 0.05
#: The gateway's event-loop lag histogram (it names what stands between the gateway and the p99 goal).
LOOP_LAG_METRIC = "switchyard_event_loop_lag_seconds"
GC_PAUSE_METRIC = "switchyard_gc_pause_seconds"
CACHE_LOOKUPS_METRIC = "switchyard_cache_lookups_total"
#: The most gateway processes the scaling step starts (``switchyard serve --workers N``; at most the CPUs there are).
MAX_WORKERS = 4
#: The line the gateway logs per stall (``gateway/stalls.py``; bench runs the gateway as a process and reads
#: its log, it does not import it).
STALL_PREFIX = "event loop stalled"


@dataclass
class Arm:
    """One way to reach the engine."""

    name: str
    target: Target | None
    proc: Proc | None = None
    unavailable: str | None = None  # why it is not measured
    saturation: dict[str, Saturation] = field(default_factory=dict)
    cpu_share: dict[str, float | None] = field(default_factory=dict)
    loadgen_cpu_share: dict[str, float | None] = field(default_factory=dict)


def _template(stream: bool) -> RequestTemplate:
    return RequestTemplate(tenant=TENANT, request_class="stream" if stream else "non-stream", model=MODEL,
                           prompt_tokens=(16, 16), output_tokens=(1, 1), stream=stream,
                           extra_body={"temperature": 0})


def _one_request(stream: bool, seed: int) -> RequestSpec:
    """The request the closed loop repeats."""
    return poisson(1000.0, 1.0, [_template(stream)], seed).specs[0]


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


class Overhead:
    """The overhead scenario's run (state shared by its steps)."""

    def __init__(self, ctx: ScenarioContext) -> None:
        self.ctx = ctx
        opts = ctx.options
        self.quick = opts.quick
        self.rates = QUICK_RATES if opts.quick else RATES
        self.step_s = opts.duration_s or (1.0 if opts.quick else 5.0)
        self.warmup_s = 0.5 if opts.quick else 1.0
        self.saturation_s = opts.duration_s or (1.0 if opts.quick else 5.0)
        self.plan = cpu_plan()
        self.arms: list[Arm] = []
        self.runs: dict[tuple[str, float, str], list[list[Result]]] = {}
        self.repeats = 1 if opts.quick else REPEATS
        self.stalls: list[str] = []
        self.skipped: dict[tuple[str, float, str], str] = {}
        self.outside: dict[str, list[str]] = {}
        self.checks: dict[str, int] = {}
        self.notes: list[str] = []
        self.profiles: dict[str, ProfileSummary] = {}
        self.watched: Arm | None = None
        #: The gateway's event-loop lag and GC pause histograms (cumulative buckets, by series) before and after
        #: each of its goal-rate steps.
        self.lag: dict[str, list[tuple[dict[str, dict[float, float]], dict[str, dict[float, float]]]]] = {}
        #: The stall lines a second gateway, with the stall sampler on, logged in the uncounted diagnostic step.
        self.stall_lines: list[str] = []
        self.gateway_env: dict[str, str] = {}
        self.gateway_key = ""
        #: The gateway's response-cache lookups over the run, by result (``hit``, ``miss``, ...).
        self.cache_lookups: dict[str, float] = {}
        #: Max sustained requests/s against the gateway's worker processes (``scale_workers``).
        self.scaling: list[dict[str, Any]] = []
        #: The same for one process with its limits and cache on Redis, as the processes of ``scaling`` beyond the
        #: first have them (empty: not measured).
        self.on_redis: dict[str, Any] = {}

    # --- set-up --------------------------------------------------------------------------------

    def start(self) -> None:
        ctx = self.ctx
        procs = ctx.procs
        engine_port = free_port()
        engine = start_instant_engine(procs, "instant-engine", engine_port, cpus=self.plan["engine"])
        engine_url = f"http://127.0.0.1:{engine_port}"
        policy = ctx.state_dir / "policies.yaml"
        policy.write_text(overhead_policy(engine_port, SERVED))
        (ctx.out_dir / "policy.yaml").write_text(policy.read_text())
        env = state_env(ctx.state_dir / "switchyard", policy)
        key = create_key(env, TENANT, TIER)
        self.gateway_env, self.gateway_key = env, key
        ctx.say("overhead: starting the gateway")
        gateway = start_gateway(procs, "gateway", env, cpus=self.plan["proxy"])
        self.arms = [
            Arm("direct", Target(engine_url, "direct"), engine),
            Arm("switchyard", Target(gateway.base_url, "switchyard", default_api_key=key, headers=CACHE_HEADERS),
                gateway.proc),
        ]
        self.arms.append(self._start_litellm(engine_url))

    def _start_litellm(self, engine_url: str) -> Arm:
        ctx = self.ctx
        if not ctx.options.litellm:
            return Arm("litellm", None, unavailable="not measured: --no-litellm")
        try:
            ctx.say(f"overhead: installing LiteLLM {litellm_env.LITELLM_VERSION} (first time only; "
                    f"{litellm_env.env_dir()})")
            env = litellm_env.ensure_litellm(log_file=ctx.procs.log_dir / "litellm-install.log")
            port = free_port()
            master = f"sk-bench-{secrets.token_hex(8)}"
            config = ctx.state_dir / "litellm.yaml"
            config.write_text(litellm_env.proxy_config(MODEL, engine_url, SERVED, master))
            ctx.say("overhead: starting the LiteLLM proxy")
            proc = ctx.procs.start("litellm", litellm_env.proxy_command(env, config, port),
                                   env=litellm_env.proxy_env(), whole_env=True, cpus=self.plan["proxy"],
                                   cwd=ctx.state_dir)
            wait_http(f"http://127.0.0.1:{port}/health/liveliness", proc, 240)
        except (litellm_env.LiteLLMUnavailable, StartError) as exc:
            return Arm("litellm", None, unavailable=f"not measured: {exc}")
        self._check_outside("litellm", proc)
        return Arm("litellm", Target(f"http://127.0.0.1:{port}", "litellm", default_api_key=master), proc)

    def _check_outside(self, name: str, proc: Proc | None) -> None:
        if proc is None or not proc.alive():
            return
        peers = [p for pid in _descendants(proc.pid) for p in litellm_env.outside_connections(pid)]
        self.outside.setdefault(name, [])
        self.outside[name] = sorted(set(self.outside[name]) | set(peers))
        self.checks[name] = self.checks.get(name, 0) + 1

    # --- measuring -----------------------------------------------------------------------------

    def focus(self, arm: Arm | None) -> None:
        """Pause every proxy but ``arm``'s (SIGSTOP), so an idle one cannot take CPU from the one measured.

        ``None`` resumes them all.
        """
        self.watched = arm if arm is not None and arm.name == "litellm" else None
        for other in self.arms:
            if other.name == "direct" or other.proc is None or not other.proc.alive():
                continue
            paused = arm is not None and other is not arm
            other.proc.popen.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)

    async def saturate(self, arm: Arm, mode: str) -> None:
        assert arm.target is not None
        self.focus(arm)
        stream = mode == "stream"
        one = _one_request(stream, self.ctx.options.seed)
        proxy = arm.proc if arm.name != "direct" else None
        before = cpu_seconds(proxy.pid) if proxy else None
        own_before = time.process_time()
        wall = time.monotonic()
        sat = await run_closed_loop(one, arm.target, concurrency=CONCURRENCY, duration_s=self.saturation_s,
                                    warmup_s=self.warmup_s, timeout_s=10.0)
        elapsed = time.monotonic() - wall
        after = cpu_seconds(proxy.pid) if proxy else None
        arm.saturation[mode] = sat
        arm.cpu_share[mode] = (after - before) / elapsed if before is not None and after is not None else None
        arm.loadgen_cpu_share[mode] = (time.process_time() - own_before) / elapsed
        self.ctx.say(f"overhead: {arm.name} {mode}: max sustained {sat.throughput_rps:.0f} requests/s "
                     f"({CONCURRENCY} connections)")

    def sustained(self, arm: Arm, mode: str) -> float | None:
        sat = arm.saturation.get(mode)
        if sat is None or sat.error_rate is None or sat.error_rate > MAX_ERROR_RATE:
            return None
        return sat.throughput_rps

    async def open_loop(self, arm: Arm, mode: str, rate: float, rep: int) -> None:
        """One step: ``arm`` at ``rate`` for ``step_s`` (repeated once if the machine stalled)."""
        assert arm.target is not None
        key = (arm.name, rate, mode)
        limit = self.sustained(arm, mode)
        if arm.name != "direct" and (limit is None or limit < rate):
            shown = f"{limit:.0f}" if limit is not None else "unknown"
            self.skipped[key] = f"not run: above its max sustained rate ({shown} requests/s)"
            return
        stream = mode == "stream"
        workload = poisson(rate, self.warmup_s + self.step_s, [_template(stream)],
                           self.ctx.options.seed + 1000 * rep + int(rate))
        self.focus(arm)
        watch_lag = arm.name == "switchyard" and rate == GOAL_RATE
        for attempt in range(2):
            gc.collect()
            before = await self._loop_lag(arm) if watch_lag else {}
            results = await run_open_loop(workload, arm.target, progress=self.ctx.options.progress,
                                          timeout_s=10.0, request_id_prefix=None)
            after = await self._loop_lag(arm) if watch_lag else {}
            kept = [_shifted(r, self.warmup_s) for r in results if r.scheduled_s >= self.warmup_s]
            late = percentiles([r.lateness_s for r in kept], (99,))["p99"]
            if late is None or late <= STALL_S or attempt:
                break
            self.stalls.append(f"{arm.name} {mode} at {rate:g} requests/s (repeat {rep + 1}): send lateness p99 "
                               f"{late * 1000:.0f} ms, the step was run again")
        self.runs.setdefault(key, []).append(kept)
        if watch_lag and after:
            self.lag.setdefault(mode, []).append((before, after))

    @staticmethod
    async def _loop_lag(arm: Arm) -> dict[str, dict[float, float]]:
        """The gateway's event-loop lag and GC pause histograms now, by series (empty when unreadable)."""
        assert arm.target is not None
        async with aiohttp.ClientSession() as session:
            text = await scrape_text(session, f"{arm.target.base_url}/metrics")
        if not text:
            return {}
        series = {"lag": histogram_buckets(text, LOOP_LAG_METRIC)}
        for generation in range(3):
            series[f"gc{generation}"] = histogram_buckets(text, GC_PAUSE_METRIC, f'generation="{generation}",')
        return series

    async def watch(self) -> None:
        """Check the LiteLLM proxy's sockets twice a second while it is measured (never during other arms)."""
        while True:
            await asyncio.sleep(0.5)
            if self.watched is not None:
                self._check_outside(self.watched.name, self.watched.proc)

    async def measure(self) -> None:
        watcher = asyncio.create_task(self.watch())
        try:
            await self._measure()
        finally:
            watcher.cancel()
        await self._count_cache_lookups()

    async def _count_cache_lookups(self) -> None:
        """The gateway's exact-cache lookups over the run by result: every one should miss (a hit is answered
        without the engine, and would flatter the gateway)."""
        arm = next((a for a in self.arms if a.name == "switchyard"), None)
        if arm is None or arm.target is None:
            return
        async with aiohttp.ClientSession() as session:
            text = await scrape_text(session, f"{arm.target.base_url}/metrics")
        self.cache_lookups = by_label(text, CACHE_LOOKUPS_METRIC, "result") if text else {}

    async def _measure(self) -> None:
        for mode in MODES:
            for arm in self.arms:
                if arm.target is not None:
                    await self.saturate(arm, mode)
                    if arm.name == "litellm":
                        self._check_outside("litellm", arm.proc)
            for rate in self.rates:
                reps = self.repeats if rate == GOAL_RATE else 1
                self.ctx.say(f"overhead: {mode} at {rate:.0f} requests/s" + (f", {reps} times" if reps > 1 else ""))
                for rep in range(reps):  # arms interleaved, so drift hits them alike
                    for arm in self.arms:
                        if arm.target is not None:
                            await self.open_loop(arm, mode, rate, rep)
                            if arm.name in ("litellm", "switchyard"):
                                self._check_outside(arm.name, arm.proc)
        self.focus(None)

    async def scale_workers(self) -> None:
        """Max sustained requests/s of ``switchyard serve --workers N`` for N from 1 to the CPUs there are (at most
        :data:`MAX_WORKERS`), each mode, the measured proxies paused. One worker is the gateway measured above;
        more need Redis (limits and caches shared by the processes), so one process on Redis is measured too
        (:attr:`on_redis`, not a row): the ratio of N processes to it is what adding processes buys, Redis's cost
        apart."""
        gateway = next((a for a in self.arms if a.name == "switchyard"), None)
        if gateway is None or gateway.target is None:
            return
        row: dict[str, Any] = {"workers": 1, "cpus": ",".join(map(str, self.plan["proxy"])) or "all",
                               "note": "the gateway measured above (limits and the cache in process)"}
        for mode in MODES:
            row[f"{mode}_rps"] = self.sustained(gateway, mode)
            row[f"{mode}_cpu"] = gateway.cpu_share.get(mode)
        self.scaling = [row]
        cpus = sorted({c for role in self.plan.values() for c in role}) or [0]  # (this process is pinned by now)
        redis = _redis_url()
        if redis is not None and len(cpus) > 1:
            self.on_redis = await self._scaled(1, cpus, redis)
        for n in range(2, min(MAX_WORKERS, len(cpus)) + 1):
            if redis is None:
                note = ("not measured: `--workers` needs Redis (SWITCHYARD_REDIS_URL, or one answering on "
                        "127.0.0.1:6379)")
                self.scaling.append({"workers": n, "note": note})
                continue
            await self._scaled(n, cpus, redis)

    @contextlib.contextmanager
    def _alone(self, handle: GatewayHandle) -> Iterator[None]:
        """While an extra gateway is measured: the measured proxies paused (SIGSTOP); the gateway stopped after."""
        paused = [a.proc for a in self.arms if a.name != "direct" and a.proc is not None and a.proc.alive()]
        for proc in paused:
            proc.popen.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            for proc in paused:
                proc.popen.send_signal(signal.SIGCONT)
            self.ctx.procs.stop(handle.proc)

    async def _scaled(self, n: int, cpus: list[int], redis: str) -> dict[str, Any]:
        ctx = self.ctx
        # The workers get the last n CPUs when the load generator and engine keep at least one; else every CPU.
        mine = tuple(cpus[-n:]) if len(cpus) > n else ()
        env = {**self.gateway_env, "SWITCHYARD_WORKERS": str(n), "SWITCHYARD_REDIS_URL": redis,
               "SWITCHYARD_REDIS_KEY_PREFIX": f"sy-bench-{secrets.token_hex(4)}:"}
        ctx.say(f"overhead: {n} gateway worker processes")
        handle = start_gateway(ctx.procs, f"gateway-{n}-workers", env, cpus=mine)
        if n > 1:  # ready means one worker answers: wait (30 s at most) for all n and the supervisor
            for _ in range(300):
                if len(_descendants(handle.proc.pid)) >= n + 1:
                    break
                await asyncio.sleep(0.1)
        row: dict[str, Any] = {"workers": n, "cpus": ",".join(map(str, mine)) or "all",
                               "note": "" if mine else "shares its CPUs with the load generator and the engine"}
        with self._alone(handle):
            target = Target(handle.base_url, f"switchyard-{n}-workers", default_api_key=self.gateway_key,
                            headers=CACHE_HEADERS)
            for mode in MODES:
                tree = _descendants(handle.proc.pid)
                before = sum(cpu_seconds(pid) or 0.0 for pid in tree)
                wall = time.monotonic()
                sat = await run_closed_loop(_one_request(mode == "stream", ctx.options.seed), target,
                                            concurrency=CONCURRENCY * n, duration_s=self.saturation_s,
                                            warmup_s=self.warmup_s, timeout_s=10.0)
                used = sum(cpu_seconds(pid) or 0.0 for pid in tree) - before
                ok = sat.error_rate is not None and sat.error_rate <= MAX_ERROR_RATE
                row[f"{mode}_rps"] = sat.throughput_rps if ok else None
                row[f"{mode}_cpu"] = used / (time.monotonic() - wall)
                ctx.say(f"overhead: {n} workers {mode}: max sustained {sat.throughput_rps:.0f} requests/s")
        if n > 1:
            self.scaling.append(row)
        return row

    async def find_stalls(self) -> None:
        """The diagnostic step (not counted): a second gateway with the stall sampler on takes the goal rate in
        each mode while the measured proxies are paused; its log says where its event loop was when it stalled."""
        if not self.gateway_env:
            return
        ctx = self.ctx
        ctx.say(f"overhead: where the gateway's event loop stalls ({STALL_SAMPLER_MS:g} ms sampler, not counted)")
        env = {**self.gateway_env, "SWITCHYARD_STALL_SAMPLER_MS": f"{STALL_SAMPLER_MS:g}"}
        handle = start_gateway(ctx.procs, "gateway-stalls", env, cpus=self.plan["proxy"])
        with self._alone(handle):
            target = Target(handle.base_url, "switchyard-stalls", default_api_key=self.gateway_key,
                            headers=CACHE_HEADERS)
            for mode in MODES:
                workload = poisson(GOAL_RATE, self.warmup_s + self.step_s, [_template(mode == "stream")],
                                   self.ctx.options.seed + 7)
                await run_open_loop(workload, target, progress=False, timeout_s=10.0, request_id_prefix=None)
        text = handle.proc.log_path.read_text(errors="replace")
        self.stall_lines = [line for line in text.splitlines() if STALL_PREFIX in line]

    async def profile(self) -> None:
        """A py-spy profile of the gateway under closed-loop saturation (its figures are not used)."""
        arm = self.arms[1]
        if arm.proc is None or arm.target is None:
            return
        self.focus(arm)
        for mode in MODES:
            stream = mode == "stream"
            one = _one_request(stream, self.ctx.options.seed)
            seconds = max(3.0, self.saturation_s)
            self.ctx.say(f"overhead: profiling the gateway ({mode}, {seconds:.0f} s, py-spy)")
            load = asyncio.create_task(run_closed_loop(one, arm.target, concurrency=CONCURRENCY,
                                                       duration_s=2 * seconds + 2, warmup_s=0.5))
            await asyncio.sleep(0.5)
            summary = await record_profile(arm.proc.pid, self.ctx.out_dir / f"gateway-profile-{mode}", seconds)
            await load
            self.profiles[mode] = summary
        self.focus(None)


def _redis_url() -> str | None:
    """``SWITCHYARD_REDIS_URL``, else a Redis answering on loopback's default port, else None."""
    url = os.environ.get("SWITCHYARD_REDIS_URL")
    if url:
        return url
    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return "redis://127.0.0.1:6379/0" if conn.recv(16).startswith(b"+PONG") else None
    except OSError:
        return None


def _shifted(result: Result, by: float) -> Result:
    """``result`` with its times moved ``by`` seconds earlier (the warm-up cut off)."""
    result.scheduled_s -= by
    result.sent_s -= by
    result.done_s -= by
    if result.first_token_s is not None:
        result.first_token_s -= by
    return result


def run(ctx: ScenarioContext) -> Outcome:
    """Run the overhead scenario and write its report into ``ctx.out_dir``."""
    run_ = Overhead(ctx)
    previous = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        run_.start()
        if run_.plan["loadgen"]:
            os.sched_setaffinity(0, run_.plan["loadgen"])
        asyncio.run(run_.measure())
        asyncio.run(run_.scale_workers())
        asyncio.run(run_.find_stalls())
        if ctx.options.profile:
            asyncio.run(run_.profile())
    finally:
        if previous is not None:
            os.sched_setaffinity(0, previous)
    return write(ctx, run_)
