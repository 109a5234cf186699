"""``failover``: one region's engines stop under steady load, then come back.

Two regions of two simulated replicas each. Clients call ``chat-us`` or ``chat-eu`` (their home
region, half each); each model falls back to the other region (``bench.policies.two_region_policy``).
A steady open-loop Poisson load of streaming requests runs throughout; a third of the way in,
the us-east engine process is stopped (SIGTERM: it stops accepting connections and finishes
what it holds within a few seconds), and after ``outage_s`` it is started again on the same ports.
The gateway runs with its default settings (endpoint cool-down, attempts, scrape interval).

Figures: success rate (overall, and of requests sent during the outage); *time to detect*: from
the stop to the first us-east request served in eu-west; *time to recover*: from the moment the
restarted engines answer their health check to the first us-east request served in us-east again;
TTFT of us-east requests before, during and after the outage. Goal: at least 99.9% of requests
succeed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from switchyard.bench.loadgen import Target, run_open_loop
from switchyard.bench.policies import TENANT, TIER, two_region_policy
from switchyard.bench.procs import Proc, create_key, free_ports, start_gateway, start_sims, state_env
from switchyard.bench.report import build_report, write_report
from switchyard.bench.results import Result
from switchyard.bench.sampler import MetricsSampler
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.spec import Workload
from switchyard.bench.stats import percentiles
from switchyard.bench.synthetic import RequestTemplate, poisson
from switchyard.bench.tables import goal, ms, num, pct, table, text

REGIONS = ("us-east", "eu-west")
REPLICAS = 2
PROFILE = "h100-8b"
SERVED = "sim-8b"
RATE = 20.0
DURATION_S = 60.0
QUICK_DURATION_S = 6.0
TIME_SCALE = 1.0
GOAL_SUCCESS = 0.999
KV_TOKENS = 100_000
CONTEXT = 8192


@dataclass
class Timeline:
    """When the outage happened, in seconds on the load generator's clock (from the run's start)."""

    start: float | None = None  # loop time of the run's start
    stop_s: float | None = None  # SIGTERM sent to the us-east engines
    stopped_s: float | None = None  # their process exited
    restart_s: float | None = None  # started again
    ready_s: float | None = None  # every restarted engine answers /health
    errors: list[str] = field(default_factory=list)


def _mix() -> list[RequestTemplate]:
    return [RequestTemplate(tenant=TENANT, request_class=region, model=f"chat-{region.split('-')[0]}",
                            prompt_tokens=(200, 800), output_tokens=(16, 48), stream=True, name=region)
            for region in REGIONS]


def served_region(result: Result) -> str | None:
    """The region that served ``result`` (from its route header)."""
    return result.route_fields.get("region")


def analyse(results: Sequence[Result], line: Timeline, home: str = "us-east") -> dict[str, Any]:
    """Success, detection, recovery and TTFT around the outage of ``home``."""
    ours = sorted((r for r in results if r.request_class == home), key=lambda r: r.sent_s)
    stop, ready = line.stop_s, line.ready_s
    detect = recover = back_after_restart = None
    if stop is not None:
        first = next((r for r in ours if r.sent_s >= stop and r.ok and served_region(r) != home), None)
        detect = first.sent_s - stop if first else None
    if ready is not None:
        back = next((r for r in ours if r.sent_s >= ready and r.ok and served_region(r) == home), None)
        recover = back.sent_s - ready if back else None
        if back is not None and line.restart_s is not None:
            back_after_restart = back.sent_s - line.restart_s
    end_out = ready if ready is not None else float("inf")

    def window(lo: float | None, hi: float | None) -> list[Result]:
        return [r for r in ours if (lo is None or r.sent_s >= lo) and (hi is None or r.sent_s < hi)]

    phases = {"before": window(None, stop), "outage": window(stop, end_out) if stop is not None else [],
              "after": window(ready, None) if ready is not None else []}
    rows = []
    for phase, rs in phases.items():
        ttft = percentiles([r.ttft_s for r in rs if r.ok and r.ttft_s is not None], (50, 90, 99))
        rows.append({"phase": phase, "requests": len(rs), "ok_rate": sum(r.ok for r in rs) / len(rs) if rs else None,
                     "fallback_rate": sum(r.fell_back for r in rs) / len(rs) if rs else None,
                     "ttft_p50_s": ttft["p50"], "ttft_p90_s": ttft["p90"], "ttft_p99_s": ttft["p99"],
                     "in_home": sum(served_region(r) == home for r in rs if r.ok) / len(rs) if rs else None})
    failures = [r for r in results if not r.ok]
    return {"detect_s": detect, "recover_s": recover, "back_after_restart_s": back_after_restart, "phases": rows,
            "success": sum(r.ok for r in results) / len(results) if results else None,
            "failures": len(failures), "requests": len(results),
            "failure_kinds": sorted({f"{r.status or '-'} {r.error_type or ''}".strip() for r in failures})}


class Failover:
    """The failover scenario's run."""

    def __init__(self, ctx: ScenarioContext) -> None:
        self.ctx = ctx
        opts = ctx.options
        self.duration_s = opts.duration_s or (QUICK_DURATION_S if opts.quick else DURATION_S)
        self.outage_at_s = self.duration_s / 3
        self.outage_s = self.duration_s / 3
        self.time_scale = opts.time_scale or TIME_SCALE
        self.line = Timeline()
        self.results: list[Result] = []
        self.series: dict[str, list[float]] = {}
        self.workload: Workload | None = None

    def run(self) -> None:
        ctx = self.ctx
        procs = ctx.procs
        ports = free_ports(2 * REPLICAS)
        us, eu = ports[:REPLICAS], ports[REPLICAS:]
        policy = ctx.state_dir / "policies.yaml"
        policy.write_text(two_region_policy(us, eu, served_model=SERVED, profile=PROFILE, kv_cache_tokens=KV_TOKENS,
                                            context_window=CONTEXT))
        ctx.say("failover: starting two regions of simulated engines and the gateway")
        seed = ctx.options.seed

        def start_region(region: str, region_ports: Sequence[int]) -> Proc:
            return start_sims(procs, f"failover-sims-{region}", policy, region_ports, time_scale=self.time_scale,
                              seed=seed, regions=[region])

        sims = {"us-east": start_region("us-east", us), "eu-west": start_region("eu-west", eu)}
        env = state_env(ctx.state_dir / "switchyard", policy)
        key = create_key(env, TENANT, TIER)
        gateway = start_gateway(procs, "failover-gateway", env)
        workload = poisson(RATE, self.duration_s, _mix(), seed)
        samplers = {region: MetricsSampler([f"http://127.0.0.1:{p}/metrics" for p in region_ports],
                                           ["vllm:num_requests_running"])
                    for region, region_ports in (("us-east", us), ("eu-west", eu))}
        line = self.line
        began = asyncio.Event()

        def started(at: float) -> None:
            line.start = at
            began.set()
            for sampler in samplers.values():
                sampler.start(at)

        async def outage() -> None:
            loop = asyncio.get_running_loop()
            await began.wait()
            assert line.start is not None
            start = line.start
            await asyncio.sleep(max(0.0, start + self.outage_at_s - loop.time()))
            ctx.say(f"failover: stopping the us-east engines for {self.outage_s:.0f} s")
            line.stop_s = loop.time() - start
            await asyncio.to_thread(procs.stop, sims["us-east"])
            line.stopped_s = loop.time() - start
            await asyncio.sleep(max(0.0, start + self.outage_at_s + self.outage_s - loop.time()))
            ctx.say("failover: starting the us-east engines again")
            line.restart_s = loop.time() - start
            sims["us-east"] = await asyncio.to_thread(start_region, "us-east", us)
            line.ready_s = loop.time() - start

        async def drive() -> list[Result]:
            faults = asyncio.create_task(outage())
            try:
                return await run_open_loop(workload, Target(gateway.base_url, "switchyard", default_api_key=key),
                                           progress=ctx.options.progress, timeout_s=60.0, on_start=started)
            except BaseException:
                faults.cancel()  # interrupted: do not stage the rest of the outage
                raise
            finally:
                try:
                    await faults
                except asyncio.CancelledError:
                    pass
                except Exception as exc:  # reported, and the run's figures say what they can
                    line.errors.append(f"{type(exc).__name__}: {exc}")
                for sampler in samplers.values():
                    await sampler.stop()

        ctx.say(f"failover: {len(workload)} requests over {self.duration_s:.0f} s")
        self.results = asyncio.run(drive())
        self.workload = workload
        self.series = {f"{region} engines running": s.series["vllm:num_requests_running"]
                       for region, s in samplers.items()}
        procs.stop(gateway.proc)
        for proc in sims.values():
            procs.stop(proc)
        if line.errors:
            raise RuntimeError("the outage could not be staged: " + "; ".join(line.errors))


def run(ctx: ScenarioContext) -> Outcome:
    """Run the failover scenario and write its report into ``ctx.out_dir``."""
    f = Failover(ctx)
    started = time.monotonic()
    f.run()
    line = f.line
    a = analyse(f.results, line)
    timeline = table(
        "Outage timeline and detection",
        [text("what", "what"), num("at_s", "s", 2), text("note", "note")],
        [{"what": "us-east engines stopped (SIGTERM)", "at_s": line.stop_s, "note": ""},
         {"what": "their process exited", "at_s": line.stopped_s,
          "note": "in-flight requests finish first (the simulator's graceful shutdown)"},
         {"what": "started again", "at_s": line.restart_s, "note": ""},
         {"what": "ready again (/health)", "at_s": line.ready_s, "note": ""},
         {"what": "time to detect", "at_s": a["detect_s"],
          "note": "stop → first us-east request served in eu-west"},
         {"what": "time to recover", "at_s": a["recover_s"],
          "note": "ready → first us-east request served in us-east again"},
         {"what": "time back home after the restart began", "at_s": a["back_after_restart_s"],
          "note": "started again → first us-east request served in us-east (includes the engines' start-up)"}],
        "Times in seconds from the start of the load.")
    phases = table(
        "us-east requests before, during and after the outage",
        [text("phase", "phase"), num("requests", "requests", 0), pct("ok_rate", "ok %", 2),
         pct("fallback_rate", "fallback %"), pct("in_home", "served in us-east %"), ms("ttft_p50_s", "TTFT p50 ms", 0),
         ms("ttft_p90_s", "TTFT p90 ms", 0), ms("ttft_p99_s", "TTFT p99 ms", 0)],
        a["phases"], "Phases by send time: the outage lasts from the stop until the engines are ready again.")
    success = a["success"]
    goals = [goal("successful requests through a region outage", f"≥ {GOAL_SUCCESS * 100:g}%", success,
                  None if success is None else success >= GOAL_SUCCESS, unit="%", multiplier=100, decimals=2,
                  note=f"{a['failures']} of {a['requests']} failed"
                  + (f": {', '.join(a['failure_kinds'])}" if a["failure_kinds"] else ""))]
    notes = [f"{RATE:g} requests/s, half with home us-east (`chat-us`), half eu-west (`chat-eu`); "
             f"{REPLICAS} replicas of `{PROFILE}` per region at time scale {f.time_scale:g}; gateway defaults "
             "(SWITCHYARD_ENDPOINT_COOLDOWN_S=5, SWITCHYARD_MAX_ATTEMPTS=3, SWITCHYARD_SCRAPE_INTERVAL_S=1)."]
    parameters = {"scenario": "failover", "rate": RATE, "duration_s": f.duration_s, "outage_at_s": f.outage_at_s,
                  "outage_s": f.outage_s, "time_scale": f.time_scale, "replicas_per_region": REPLICAS,
                  "profile": PROFILE, "timeline": {"stop_s": line.stop_s, "stopped_s": line.stopped_s,
                                                   "restart_s": line.restart_s, "ready_s": line.ready_s},
                  "wall_s": time.monotonic() - started}
    report = build_report({"switchyard": f.results}, title="switchyard bench: failover (resilience)",
                          workload=f.workload, parameters=parameters, seeds={"workload": ctx.options.seed},
                          tables=[timeline, phases], goals=goals, notes=notes,
                          extra_series={"switchyard": f.series})
    write_report(report, ctx.out_dir)
    summary = (f"{100 * success:.2f}% ok" if success is not None else "no requests") + \
        (f", detected in {a['detect_s']:.2f} s" if a["detect_s"] is not None else "") + \
        (f", back in us-east {a['recover_s']:.1f} s after restart" if a["recover_s"] is not None else "")
    return Outcome("failover", "ok", summary, goals, [timeline, phases], "failover/report.md", notes=notes)

