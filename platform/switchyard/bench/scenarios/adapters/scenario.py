"""The ``adapters`` scenario's run: each arm on fresh engines and a fresh gateway, the same schedule offered to
both, the engines' adapter counters read around it; then the figures and the report (what the scenario registry
calls is :func:`run`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from switchyard.bench.loadgen import run_open_loop
from switchyard.bench.policies import TENANT, TIER
from switchyard.bench.procs import cpu_seconds, engine_states, free_ports
from switchyard.bench.report import build_report, write_report
from switchyard.bench.results import Result
from switchyard.bench.scenarios.adapters.engines import (
    LoraCounters,
    StateSampler,
    load_cost_s,
    lora_counters,
)
from switchyard.bench.scenarios.adapters.figures import arm_rows, goals_of, notes_of, summary_of, tables_of
from switchyard.bench.scenarios.adapters.plots import write_adapter_plot
from switchyard.bench.scenarios.adapters.workload import (
    ADAPTERS,
    ARMS,
    BANDS,
    BASELINE,
    CONTEXT,
    KV_TOKENS,
    MAX_LORAS,
    OUTPUT_TOKENS,
    PICKER,
    PROFILE,
    PROMPT_TOKENS,
    REPLICAS,
    ZIPF_S,
    adapters_policy,
    band_shares,
    mix,
)
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.sender import Target
from switchyard.bench.spec import Workload
from switchyard.bench.stack import create_key, start_gateway, start_sims, state_env
from switchyard.bench.synthetic import poisson

#: Offered requests per second (times ``--rate-multiplier``), seconds per arm, and the engines' time scale. At half
#: speed, 16 requests/s of wall clock are 32 of simulated time: some 8 per replica, about 4 streams in flight on
#: each, as many as its adapter slots (near what least-loaded's batches of 4 adapters can serve, short of
#: saturation); the gateway then uses about 14% of a core and the engines' process 9%. At real time the engines
#: would see 2 streams in flight, with no contention for slots; at a quarter speed (64 requests/s simulated) both
#: arms saturate and shed.
RATE = 16.0
DURATION_S = 60.0
QUICK_DURATION_S = 5.0
TIME_SCALE = 0.5
#: A request unanswered after this long is given up (an error).
CLIENT_TIMEOUT_S = 30.0
QUICK_CLIENT_TIMEOUT_S = 15.0
#: The plot's file name.
PLOT = "adapter_loads.png"


@dataclass
class ArmRun:
    """What one arm measured.

    Attributes:
        name: The arm.
        results: One per request of the schedule.
        before: The engines' adapter counters just before the load (after their start-up registrations).
        after: The same once every request had ended.
        series: The engines' state sampled while the load ran (``engines.StateSampler.series``).
        wall_s: Seconds from the first send to the last answer.
        gateway_cpu_s: The gateway process's CPU seconds over the load (None: unknown).
        sims_cpu_s: The simulated engines' process's CPU seconds over the load (None: unknown).
    """

    name: str
    results: list[Result] = field(default_factory=list)
    before: LoraCounters = field(default_factory=LoraCounters)
    after: LoraCounters = field(default_factory=LoraCounters)
    series: dict[str, list[float]] = field(default_factory=dict)
    wall_s: float = 0.0
    gateway_cpu_s: float | None = None
    sims_cpu_s: float | None = None

    @property
    def counted(self) -> LoraCounters:
        """The engines' adapter counters over the load."""
        return self.after.minus(self.before)


class AdaptersBench:
    """The adapters scenario's run: both arms, one after the other, each on fresh engines and a fresh gateway."""

    def __init__(self, ctx: ScenarioContext) -> None:
        self.ctx = ctx
        opts = ctx.options
        self.duration_s = opts.duration_s or (QUICK_DURATION_S if opts.quick else DURATION_S)
        self.time_scale = opts.time_scale or TIME_SCALE
        self.rate = RATE * (opts.rate_multiplier or 1.0)
        self.timeout_s = QUICK_CLIENT_TIMEOUT_S if opts.quick else CLIENT_TIMEOUT_S
        self.workload: Workload = poisson(self.rate, self.duration_s, mix(), opts.seed, max_model_len=CONTEXT)
        self.key: str | None = None
        self.arms: list[ArmRun] = []
        #: What one adapter load costs the engines (simulated seconds), as they report it.
        self.load_s: float | None = None

    def run(self) -> None:
        for name in ARMS:
            self.arms.append(self.run_arm(name))

    def run_arm(self, name: str) -> ArmRun:
        """Start the arm's engines and gateway, offer the schedule, read the engines around it, stop them."""
        ctx = self.ctx
        procs = ctx.procs
        ports = free_ports(REPLICAS)
        policy = ctx.state_dir / f"policies-{name}.yaml"
        policy.write_text(adapters_policy(ports))
        ctx.say(f"adapters: {name}: starting {REPLICAS} simulated replicas ({ADAPTERS} adapters, max_loras "
                f"{MAX_LORAS}) and the gateway")
        sims = start_sims(procs, f"adapters-sims-{name}", policy, ports, time_scale=self.time_scale,
                          seed=ctx.options.seed)
        env = {**state_env(ctx.state_dir / "switchyard", policy), "SWITCHYARD_PICKER": PICKER[name]}
        if self.key is None:  # one database for both arms: the key outlives the gateways
            self.key = create_key(env, TENANT, TIER)
        gateway = start_gateway(procs, f"adapters-gateway-{name}", env)
        arm = ArmRun(name)
        sampler = StateSampler([f"http://127.0.0.1:{p}/sim/state" for p in ports])
        states = engine_states(ports)
        arm.before = lora_counters(states)
        self.load_s = self.load_s or load_cost_s(states)
        cpu0, sims0 = cpu_seconds(gateway.proc.pid), cpu_seconds(sims.pid)
        target = Target(gateway.base_url, name, default_api_key=self.key)

        async def drive() -> list[Result]:
            try:
                return await run_open_loop(self.workload, target, progress=ctx.options.progress,
                                           timeout_s=self.timeout_s, on_start=sampler.start)
            finally:
                await sampler.stop()

        ctx.say(f"adapters: {name}: {len(self.workload)} requests over {self.workload.duration_s:g} s")
        wall = time.monotonic()
        arm.results = asyncio.run(drive())
        arm.wall_s = time.monotonic() - wall
        cpu1, sims1 = cpu_seconds(gateway.proc.pid), cpu_seconds(sims.pid)
        arm.gateway_cpu_s = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
        arm.sims_cpu_s = sims1 - sims0 if sims0 is not None and sims1 is not None else None
        arm.after = lora_counters(engine_states(ports))
        arm.series = sampler.series
        procs.stop(gateway.proc)
        procs.stop(sims)
        return arm


def run(ctx: ScenarioContext) -> Outcome:
    """Run the adapters scenario and write its report into ``ctx.out_dir``."""
    started = time.monotonic()
    bench = AdaptersBench(ctx)
    bench.run()
    rows = arm_rows(bench.arms, bench.workload)
    tables = tables_of(bench.arms, rows, bench.workload, bench.load_s)
    goals = goals_of(rows, bench.arms)
    notes = notes_of(bench, rows)
    parameters = {"scenario": "adapters", "replicas": REPLICAS, "profile": PROFILE, "adapters": ADAPTERS,
                  "max_loras": MAX_LORAS, "max_cpu_loras": MAX_LORAS, "adapters_registered": "at start-up",
                  "zipf_s": ZIPF_S, "bands": {name: [low, high] for name, low, high in BANDS},
                  "band_shares": band_shares(), "rate": bench.rate, "duration_s": bench.duration_s,
                  "time_scale": bench.time_scale, "client_timeout_s": bench.timeout_s,
                  "prompt_tokens": list(PROMPT_TOKENS), "output_tokens": list(OUTPUT_TOKENS),
                  "kv_cache_tokens": KV_TOKENS, "context": CONTEXT, "adapter_load_s": bench.load_s,
                  "picker": dict(PICKER),
                  "arm_wall_s": {a.name: a.wall_s for a in bench.arms}, "wall_s": time.monotonic() - started}
    report = build_report({a.name: a.results for a in bench.arms}, title="switchyard bench: adapters (LoRA "
                          "adapter-aware picking)", workload=bench.workload, parameters=parameters,
                          seeds={"workload": ctx.options.seed, "engines": ctx.options.seed}, groups=("class",),
                          baseline=BASELINE, tables=tables, goals=goals, notes=notes,
                          extra_series={a.name: {k: a.series[k] for k in ("deferred", "waiting")} for a in bench.arms})
    write_report(report, ctx.out_dir)
    # The scenario's own plot, then the report again so that both files list it.
    write_adapter_plot(report, bench.arms, ctx.out_dir / PLOT)
    report["plots"] = sorted({*report["plots"], PLOT})
    write_report(report, ctx.out_dir, plots=False)
    return Outcome("adapters", "ok", summary_of(rows), goals, tables[:2], "adapters/report.md", notes=notes[:1])
