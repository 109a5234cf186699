"""The ``overload`` scenario's run: the engines and gateway of each arm, fresh, the capacity measured before
its load, the load itself, then the goals and the report (what the scenario registry calls is :func:`run`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from switchyard.bench.loadgen import run_open_loop
from switchyard.bench.procs import free_ports, http_get
from switchyard.bench.report import build_report, write_report
from switchyard.bench.results import Outcome as RequestOutcome
from switchyard.bench.results import Result
from switchyard.bench.sampler import MetricsSampler
from switchyard.bench.scenarios.arms import Arm, EngineShape, FreshArms, Stack
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.scenarios.overload.figures import class_rows, gateway_view, ratio_rows, tables_of
from switchyard.bench.scenarios.overload.workload import (
    ARMS,
    BASELINE,
    CLASS_SHARE,
    CLASSES,
    CONTEXT,
    DOWNGRADED_CLASSES,
    KV_TOKENS,
    MAIN_REPLICAS,
    MAX_NUM_SEQS,
    MAX_QUEUE_MS,
    MODEL,
    OVERLOAD,
    PROFILE,
    SERVED,
    SHED_ABOVE,
    SLO_TTFT_S,
    SMALL_MODEL,
    SMALL_REPLICAS,
    SMALL_SERVED,
    TENANTS,
    mix,
    overload_policy,
    slo_spec,
    tenant_name,
)
from switchyard.bench.sender import Target
from switchyard.bench.spec import Workload
from switchyard.bench.stats import ratio
from switchyard.bench.synthetic import RequestTemplate
from switchyard.bench.tables import goal
from switchyard.figures import fixed, percent

#: Seconds per arm with ``--quick`` (``arms.DURATION_S`` without; the other timings are ``arms``'s).
QUICK_DURATION_S = 5.0
GOAL_CRITICAL = 0.99
ENGINE_SERIES = ("vllm:num_requests_waiting", "vllm:num_requests_running")
QUEUE_DEPTH = "switchyard_queue_depth"


@dataclass
class ArmRun(Arm):
    """What one arm measured."""

    gateway: dict[str, dict[str, Any]] = field(default_factory=dict)
    series: dict[str, list[float]] = field(default_factory=dict)


class Overload(FreshArms[ArmRun]):
    """The overload scenario's run."""

    scenario = "overload"
    arm_names = ARMS
    arm_type = ArmRun
    pool = "main pool"
    model = MODEL
    served = SERVED
    shape = EngineShape(PROFILE, MAX_NUM_SEQS, KV_TOKENS, CONTEXT)
    load_factor = OVERLOAD
    quick_duration_s = QUICK_DURATION_S

    def start_engines(self, name: str) -> Stack:
        """Start an arm's engines (fresh ones, on new ports) and write its policy; nothing waited for."""
        ctx = self.ctx
        ports = free_ports(MAIN_REPLICAS + SMALL_REPLICAS)
        main, small = ports[:MAIN_REPLICAS], ports[MAIN_REPLICAS:]
        self.policy_path(name).write_text(overload_policy(main, small, priority_scheduling=name == "flow-control-on"))
        ctx.say(f"overload: {name}: starting {MAIN_REPLICAS}+{SMALL_REPLICAS} simulated replicas and the gateway")
        engines = {p: self.engine(f"overload-{name}-{'main' if p in main else 'small'}-{i}", p,
                                  SERVED if p in main else SMALL_SERVED)
                   for i, p in enumerate(ports)}
        return Stack(name, main, engines)

    def env(self, name: str) -> dict[str, str]:
        """The settings of an arm's Switchyard processes (one database for all: the keys outlive gateways)."""
        return {**super().env(name), "SWITCHYARD_FLOW_CONTROL": "true" if name == "flow-control-on" else "false"}

    def tenants(self) -> list[tuple[str, str]]:
        """A key per tenant, its class's tier."""
        return [(tenant_name(cls, kind), cls) for cls in CLASSES for kind, _ in TENANTS]

    def mix(self, model: str) -> list[RequestTemplate]:
        return mix(model)

    def load(self, stack: Stack, arm: ArmRun, workload: Workload) -> None:
        """Offer ``workload`` to the arm's gateway, sampling its queue and the main pool's engines."""
        ctx = self.ctx
        gateway = stack.gateway
        assert gateway is not None
        engine_sampler = MetricsSampler([f"http://127.0.0.1:{p}/metrics" for p in stack.pool], ENGINE_SERIES)
        queue_sampler = MetricsSampler([f"{gateway.base_url}/metrics"], [QUEUE_DEPTH])

        def started(at: float) -> None:
            engine_sampler.start(at)
            queue_sampler.start(at)

        async def drive() -> list[Result]:
            try:
                return await run_open_loop(workload, Target(gateway.base_url, arm.name, api_keys=self.keys),
                                           progress=ctx.options.progress, timeout_s=self.timeout_s,
                                           on_start=started)
            finally:
                await engine_sampler.stop()
                await queue_sampler.stop()

        ctx.say(f"overload: {arm.name}: {len(workload)} requests over {workload.duration_s:.0f} s")
        wall = time.monotonic()
        arm.results = asyncio.run(drive())
        arm.wall_s = time.monotonic() - wall
        try:
            arm.gateway = gateway_view(http_get(f"{gateway.base_url}/metrics").decode())
        except OSError:
            arm.gateway = {}
        arm.series = {"gateway queue": queue_sampler.series[QUEUE_DEPTH],
                      "engine queue (waiting)": engine_sampler.series[ENGINE_SERIES[0]],
                      "engine running": engine_sampler.series[ENGINE_SERIES[1]]}


def run(ctx: ScenarioContext) -> Outcome:
    """Run the overload scenario and write its report into ``ctx.out_dir``."""
    o = Overload(ctx)
    started = time.monotonic()
    o.run()
    assert o.workload is not None
    assert o.capacity is not None
    slo = slo_spec()
    arms = {a.name: a.results for a in o.arms}
    window = o.workload.duration_s
    rows = class_rows(arms, slo, window)
    ratios = ratio_rows(rows)
    tables = tables_of(o, rows, ratios)
    by = {(r["class"], r["arm"]): r for r in rows}
    on, off = ARMS[0], BASELINE
    critical = by[("critical", on)]["attainment"]
    good = ratio(by[("all", on)]["goodput_rps"], by[("all", off)]["goodput_rps"])
    errors = sum(1 for r in arms[on] if r.outcome in (RequestOutcome.ERROR, RequestOutcome.TIMEOUT))
    goals = [
        goal(f"critical TTFT SLO attainment at {OVERLOAD:g}x capacity, flow control on",
             f"≥ {GOAL_CRITICAL * 100:g}%", critical, None if critical is None else critical >= GOAL_CRITICAL,
             unit="%", multiplier=100, decimals=1,
             note=f"off (FCFS): {percent(by[('critical', off)]['attainment'])}"),
        goal("goodput (requests meeting their SLO), flow control on ÷ off", "> 1x", good,
             None if good is None else good > 1.0, unit="x",
             note=f"{by[('all', on)]['goodput_rps']:.2f} vs {by[('all', off)]['goodput_rps']:.2f} requests/s"),
        goal("errors and hung requests with flow control on", "0 (overload answers with a clear 503)",
             float(errors), errors == 0, decimals=0, note=f"of {len(arms[on])}; off (FCFS): "
             f"{sum(1 for r in arms[off] if r.outcome in (RequestOutcome.ERROR, RequestOutcome.TIMEOUT))}"),
    ]
    slo_words = ", ".join(f"{c} {SLO_TTFT_S[c] * 1000:g} ms" for c in CLASSES)
    notes = [f"TTFT SLOs (from the scheduled time): {slo_words}. Queue deadlines: "
             + ", ".join(f"{c} {MAX_QUEUE_MS[c]} ms" for c in CLASSES)
             + f"; sheddable is shed above a utilisation of {SHED_ABOVE:g}; {', '.join(DOWNGRADED_CLASSES)} "
             f"is downgraded to `{SMALL_MODEL}` when `{MODEL}`'s pool is saturated.",
             f"Main pool: {MAIN_REPLICAS} replicas of `{PROFILE}`, --max-num-seqs {MAX_NUM_SEQS} (declared as the "
             f"pool's max_num_seqs), priority scheduling; downgrade pool: {SMALL_REPLICAS} replica, the same; time "
             f"scale {o.time_scale:g}. Each arm ran on fresh engines and a fresh gateway with the same requests at the "
             "same times; gateway defaults otherwise.",
             "A downgraded answer counts as served (it met the SLO if its first token came in time); the downgrade "
             "rate says how many were.",
             "Flow control off: the gateway sends every request to the engines at once, without `priority`; the "
             "engines queue what does not fit (first come, first served). Beyond SWITCHYARD_UPSTREAM_MAX_CONNECTIONS "
             "(default 1000) requests in flight, the rest wait for a connection in the gateway's pool, first come, "
             "first served too. A client that gives up closes its connection, and the engine drops the request."]
    parameters = {"scenario": "overload", "overload": OVERLOAD, "duration_s": o.duration_s,
                  "time_scale": o.time_scale, "client_timeout_s": o.timeout_s, "capacity_rps": o.capacity.rps,
                  "capacity_output_tps": o.capacity.output_tps, "capacity_clients": o.capacity.clients,
                  "capacity_rps_by_arm": {a.name: a.capacity.rps if a.capacity else None for a in o.arms},
                  "offered_rps": o.workload.offered_rate_per_s, "slo_ttft_s": SLO_TTFT_S,
                  "max_queue_ms": MAX_QUEUE_MS, "shed_above_utilisation": SHED_ABOVE,
                  "class_share": CLASS_SHARE, "tenant_share": dict(TENANTS), "main_replicas": MAIN_REPLICAS,
                  "small_replicas": SMALL_REPLICAS, "max_num_seqs": MAX_NUM_SEQS, "profile": PROFILE,
                  "arm_wall_s": {a.name: a.wall_s for a in o.arms}, "wall_s": time.monotonic() - started}
    report = build_report(arms, title="switchyard bench: overload (flow control)", workload=o.workload,
                          parameters=parameters, seeds={"engines": ctx.options.seed,
                                                        "capacity_workload": ctx.options.seed + 1},
                          slo=slo, groups=("class", "tenant"), baseline=BASELINE, tables=tables, goals=goals,
                          notes=notes, extra_series={a.name: a.series for a in o.arms})
    write_report(report, ctx.out_dir)
    sheddable_shed = by[("sheddable", on)]["shed_rate"]
    summary = (f"critical SLO attainment {percent(critical)} with flow control vs "
               f"{percent(by[('critical', off)]['attainment'])} FCFS; goodput "
               + fixed(good, decimals=2, unit="x") + f"; sheddable shed {percent(sheddable_shed)}")
    return Outcome("overload", "ok", summary, goals, tables[:2], "overload/report.md", notes=notes[:1])
