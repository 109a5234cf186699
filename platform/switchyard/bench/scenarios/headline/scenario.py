"""The ``headline`` scenario's run: every arm on fresh engines and a fresh gateway, the same day of requests at
the same times, the batch backlog, one region down in the middle; then the figures, the goals and the report
(what the scenario registry calls is :func:`run`).

The first arm (round-robin) measures the fleet's capacity before its day: a closed loop through its gateway
(no admission, no flow control) with twice as many clients as the fleet has sequence slots, on the day's own
lengths and ``auto`` route: what the mix can get from the fleet. That capacity scales the day for every arm.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import msgspec
import numpy as np

from switchyard.bench.loadgen import run_open_loop
from switchyard.bench.procs import free_ports
from switchyard.bench.report import build_report, render_markdown, write_report
from switchyard.bench.results import Result
from switchyard.bench.sampler import EngineStateSampler
from switchyard.bench.scenarios.arms import (
    Arm,
    Capacity,
    EngineShape,
    FreshArms,
    Stack,
    combined,
    measure_capacity,
    start_engine,
)
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.scenarios.batch.progress import get_json, post_json, submit_batch
from switchyard.bench.scenarios.headline import figures
from switchyard.bench.scenarios.headline.day import LENGTHS_TRACE, PEAK, TROUGH, arrival_curve, day, load_at, load_shape
from switchyard.bench.scenarios.headline.fleet import (
    ARMS,
    AUTO_SMALL_BELOW,
    BASELINES,
    BATCH_CLASS,
    BATCH_TENANT,
    BATCH_TIER,
    CONTEXT,
    DOWNGRADE_AT,
    KV_TOKENS,
    LARGE,
    MAX_NUM_SEQS,
    MODELS,
    OUTAGE,
    OUTAGE_REGION,
    PICKER,
    PROFILE,
    REGIONS,
    REPLICAS,
    ROUND_ROBIN,
    SERVED,
    SLO_TTFT_S,
    SMALL,
    SWITCHYARD,
    TENANTS,
    TIERS,
    TOKEN_SCALE,
    WITH_BACKLOG,
    policy,
    ports_of,
)
from switchyard.bench.scenarios.prefix.workloads import SHIPPED_TRACES
from switchyard.bench.sender import Target, send_one
from switchyard.bench.spec import Labels, RequestSpec, Workload
from switchyard.bench.synthetic import RequestTemplate
from switchyard.bench.traces import mooncake

#: Seconds of the day (the trace's hour compressed into it), with and without ``--quick``.
DURATION_S = 180.0
QUICK_DURATION_S = 12.0
#: The backlog: lines enough for this share of the capacity the interactive load leaves idle over the day (in
#: requests of the day's kind: the backlog's lines for the small model are cheaper, some 170 prompt and 22 answer
#: tokens on average against the day's 400 and 33, and at 1.2 its pools ran out of them before the day's end).
BACKLOG_SHARE = 2.0
#: The backlog's lines (prompt and answer lengths, shared prefixes): the other Mooncake trace.
BACKLOG_TRACE = SHIPPED_TRACES / "mooncake_synthetic.jsonl"
#: Readings of that trace at most (each with another seed: other text of the same lengths).
MAX_BACKLOG_CYCLES = 4
#: Workers of the baselines' batch script (lines sent as ordinary requests, each worker one at a time).
BATCH_SCRIPT_WORKERS = 8
#: Seconds between readings of the engines' ``/metrics``.
SAMPLE_BIN_S = 1.0


@dataclass
class ArmRun(Arm):
    """What one arm measured."""

    #: The fleet's engines per bin of the day (:class:`~switchyard.bench.sampler.EngineStateSampler`): the share
    #: of time they computed, the share of their throughput in use, their sequence slots taken, the largest lag
    #: behind the wall clock.
    busy: list[float | None] = field(default_factory=list)
    in_use: list[float | None] = field(default_factory=list)
    occupancy: list[float | None] = field(default_factory=list)
    lag_s: list[float | None] = field(default_factory=list)
    batch_lines: int = 0
    batch_done: int = 0
    batch_failed: int = 0
    batch_via: str = ""
    outage_s: tuple[float, float] | None = None


class Headline(FreshArms[ArmRun]):
    """The headline scenario's run."""

    scenario = "headline"
    arm_names = ARMS
    arm_type = ArmRun
    pool = "fleet"
    model = "auto"
    served = SERVED[SMALL]
    shape = EngineShape(PROFILE[SMALL], MAX_NUM_SEQS, KV_TOKENS, CONTEXT)
    load_factor = PEAK
    quick_duration_s = QUICK_DURATION_S
    duration_default_s = DURATION_S
    measure_every_arm = False  # eight engines and a gateway per arm: the first arm's capacity is the fleet's

    def __init__(self, ctx: ScenarioContext) -> None:
        super().__init__(ctx)
        self.layout: dict[str, dict[tuple[str, str], list[int]]] = {}
        self.backlog: list[RequestSpec] = []
        #: The backlog's lines by the model ``auto`` sends them to.
        self.backlog_models: dict[str, int] = {}
        #: Each model's pools' part of the fleet's capacity (requests per second).
        self.pool_capacity: dict[str, float] = {}

    @property
    def slots(self) -> int:
        return len(REGIONS) * len(MODELS) * REPLICAS * MAX_NUM_SEQS

    def start_engines(self, name: str) -> Stack:
        layout = ports_of(free_ports(len(REGIONS) * len(MODELS) * REPLICAS))
        self.layout[name] = layout
        self.policy_path(name).write_text(policy(name, layout))
        self.ctx.say(f"headline: {name}: starting {sum(len(p) for p in layout.values())} simulated replicas and "
                     "the gateway")
        engines = {port: self.engine_of(name, region, model, i, port)
                   for (region, model), ports in layout.items() for i, port in enumerate(ports)}
        return Stack(name, [p for ports in layout.values() for p in ports], engines)

    def engine_of(self, arm: str, region: str, model: str, i: int, port: int) -> Any:
        shape = EngineShape(PROFILE[model], MAX_NUM_SEQS, KV_TOKENS, CONTEXT)
        return start_engine(self.ctx.procs, f"headline-{arm}-{model}-{region}-{i}", port, SERVED[model], shape,
                            seed=self.ctx.options.seed, time_scale=self.time_scale)

    def env(self, name: str) -> dict[str, str]:
        return {**super().env(name), "SWITCHYARD_PICKER": PICKER[name],
                "SWITCHYARD_FLOW_CONTROL": "false" if name in BASELINES else "true"}

    def tenants(self) -> list[tuple[str, str]]:
        return [(t.name, t.tier) for t in TENANTS] + [(BATCH_TENANT, BATCH_TIER)]

    def mix(self, model: str) -> list[RequestTemplate]:
        return []  # the day is a trace replay (``run`` builds it), not a synthetic mix

    def measure(self, stack: Stack) -> Capacity:
        """The fleet's capacity for the day's requests: every sequence slot of every engine busy, each engine
        called directly (``max_num_seqs`` clients each, no gateway) with the day's kind of requests, whatever
        model its prompt would be routed to; the sum over the fleet. No router can serve more than this."""
        specs = mooncake(LENGTHS_TRACE, limit=4000, seed=self.ctx.options.seed + 1, token_scale=TOKEN_SCALE,
                         max_model_len=CONTEXT, labels=Labels(tenant="shop")).specs
        layout = self.layout[stack.name]
        self.ctx.say(f"headline: {stack.name}: measuring the fleet's capacity, every slot of its {len(stack.pool)} "
                     f"engines busy ({self.slots} clients, {self.capacity_s:g} s)")

        async def both() -> list[Capacity]:
            return await asyncio.gather(*(
                measure_capacity([p for (_, m), ports in layout.items() if m == model for p in ports],
                                 [replace(s, labels=replace(s.labels, model=SERVED[model])) for s in specs],
                                 clients_per_engine=MAX_NUM_SEQS, warmup_s=self.capacity_warmup_s,
                                 duration_s=self.capacity_s, timeout_s=self.timeout_s)
                for model in MODELS))

        parts = asyncio.run(both())
        self.pool_capacity = {model: part.rps for model, part in zip(MODELS, parts, strict=True)}
        capacity = combined(parts)
        if capacity.completed == 0:
            raise RuntimeError(f"{stack.name}: the capacity measurement completed no request")
        return capacity

    def workload_for(self, capacity: Capacity) -> Workload:
        """The day, scaled to the first arm's capacity (and the backlog sized to what it leaves idle)."""
        workload = day(capacity.rps, self.duration_s, self.ctx.options.seed, tenants=TENANTS, class_of_tier=TIERS,
                       model="auto", token_scale=TOKEN_SCALE, max_model_len=CONTEXT)
        self.backlog = self.backlog_lines(capacity, workload)
        return workload

    def backlog_lines(self, capacity: Capacity, workload: Workload) -> list[RequestSpec]:
        """The batch backlog: the Mooncake synthetic trace's rows (long documents, short answers; scaled like the
        day's), enough that each model's lines fill ``BACKLOG_SHARE`` of the capacity its pools leave idle over
        the day (``auto`` sends a line's prompt to one model). A model's pools are loaded by the day's share of
        requests ``auto`` sends it, against their part of the capacity: the large model, a third of the fleet's
        capacity for some two fifths of the day's requests, has far less room than the small one. Lines of a
        model that has its count are passed over; the trace is read again with another seed (other text) when
        it is too short. The lines are then shuffled (a job's file in no particular order): read as chosen, the
        model whose count is reached first would have no fresh line left in the file's second half."""
        shape = load_shape(arrival_curve())
        points = np.linspace(0.0, self.duration_s, 400, endpoint=False)
        parts = self.pool_capacity or {SMALL: capacity.rps}
        small = sum(1 for s in workload.specs if s.prompt_tokens < AUTO_SMALL_BELOW) / max(1, len(workload.specs))
        share = {SMALL: small, LARGE: 1.0 - small} if len(parts) > 1 else dict.fromkeys(parts, 1.0)
        wanted = {model: BACKLOG_SHARE * rps * self.duration_s
                  * float(np.mean([max(0.0, 1.0 - capacity.rps * load_at(shape, t, self.duration_s) * share[model]
                                       / rps) for t in points]))
                  for model, rps in parts.items()}
        labels = Labels(tenant=BATCH_TENANT, request_class=BATCH_CLASS, model="auto", stream=False)
        lines: list[RequestSpec] = []
        counts = dict.fromkeys(wanted, 0)

        def enough() -> bool:
            return all(counts[m] >= wanted[m] for m in wanted)

        for cycle in range(MAX_BACKLOG_CYCLES):
            rows = mooncake(BACKLOG_TRACE, seed=self.ctx.options.seed + 2 + cycle, token_scale=TOKEN_SCALE,
                            max_model_len=CONTEXT, labels=labels).specs
            for spec in rows:
                if enough():
                    break
                model = SMALL if spec.prompt_tokens < AUTO_SMALL_BELOW else LARGE
                if len(parts) == 1:  # (no per-model capacity measured: every line counts towards the one part)
                    model = next(iter(parts))
                if counts[model] >= wanted[model]:
                    continue  # this model has its lines: the trace is read on for the other's
                lines.append(replace(spec, index=len(lines)))
                counts[model] += 1
            if enough():
                break
        self.backlog_models = counts
        order = np.random.default_rng(self.ctx.options.seed + 2).permutation(len(lines))
        return [replace(lines[int(i)], index=n) for n, i in enumerate(order)]

    def load(self, stack: Stack, arm: ArmRun, workload: Workload) -> None:
        self.ctx.say(f"headline: {arm.name}: {len(workload)} requests over {workload.duration_s:g} s"
                     + (f", a backlog of {len(self.backlog)} batch lines" if arm.name in WITH_BACKLOG else "")
                     + f", {OUTAGE_REGION} down from {OUTAGE[0] * workload.duration_s:.0f} s to "
                       f"{OUTAGE[1] * workload.duration_s:.0f} s")
        wall = time.monotonic()
        asyncio.run(self.drive(stack, arm, workload))
        arm.wall_s = time.monotonic() - wall

    async def drive(self, stack: Stack, arm: ArmRun, workload: Workload) -> None:
        gateway = stack.gateway
        assert gateway is not None
        base = gateway.base_url
        loop = asyncio.get_running_loop()
        sampler = EngineStateSampler([f"http://127.0.0.1:{p}/sim/state" for p in stack.pool], MAX_NUM_SEQS,
                                     self.time_scale, SAMPLE_BIN_S)
        tasks: list[asyncio.Task[Any]] = []
        stop_batch = asyncio.Event()
        auth = {"Authorization": f"Bearer {self.keys[BATCH_TENANT]}"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            batch_id = None
            if arm.name in WITH_BACKLOG:
                arm.batch_lines = len(self.backlog)
                if arm.name in BASELINES:
                    arm.batch_via = f"ordinary requests ({BATCH_SCRIPT_WORKERS} workers)"
                else:
                    arm.batch_via = "/v1/batches"
                    batch_id = await self.submit(session, base, auth)

            def started(at: float) -> None:
                sampler.start(at)
                tasks.append(loop.create_task(self.outage(stack, arm, at, workload.duration_s)))
                if arm.name in BASELINES and arm.name in WITH_BACKLOG:
                    tasks.append(loop.create_task(self.batch_script(session, base, arm, at, stop_batch)))

            try:
                arm.results = await asyncio.wait_for(
                    run_open_loop(workload, Target(base, arm.name, api_keys=self.keys),
                                  progress=self.ctx.options.progress, timeout_s=self.timeout_s, on_start=started),
                    timeout=workload.duration_s + self.timeout_s + 60)
            finally:
                stop_batch.set()
                await sampler.stop()
                await asyncio.gather(*tasks, return_exceptions=True)
            arm.busy, arm.in_use, arm.occupancy, arm.lag_s = (sampler.busy, sampler.in_use, sampler.occupancy,
                                                              sampler.lag_s)
            if batch_id is not None:
                batch = await get_json(session, f"{base}/v1/batches/{batch_id}", auth)
                arm.batch_done = int(batch["request_counts"]["completed"])
                arm.batch_failed = int(batch["request_counts"]["failed"])
                if batch["status"] in ("in_progress", "validating"):
                    await post_json(session, f"{base}/v1/batches/{batch_id}/cancel", auth)

    async def submit(self, session: aiohttp.ClientSession, base: str, auth: dict[str, str]) -> str:
        """The backlog through the Batch API, submitted just before the day starts."""
        encode = msgspec.json.Encoder().encode
        content = b"".join(encode({"custom_id": f"line-{s.index}", "method": "POST", "url": "/v1/chat/completions",
                                   "body": s.body()}) + b"\n" for s in self.backlog)
        return await submit_batch(session, base, auth, content, "headline")

    async def batch_script(self, session: aiohttp.ClientSession, base: str, arm: ArmRun, start: float,
                           stop: asyncio.Event) -> None:
        """The baselines' backlog: what a batch script does without a batch lane (each of a few workers sends
        the next line as an ordinary request when its last one ends), until the day is over."""
        loop = asyncio.get_running_loop()
        target = Target(base, arm.name, api_keys=self.keys)
        lines = iter(self.backlog)

        async def worker() -> None:
            for spec in lines:
                if stop.is_set():
                    return
                result = Result(spec.index, arm.name, spec.tenant, spec.request_class, spec.model, spec.kind,
                                spec.stream, spec.prompt_tokens, spec.max_tokens, spec.prefix_group,
                                loop.time() - start)
                await send_one(session, spec.encode(), target.url(spec.kind), target.headers_for(spec.tenant),
                               result, loop.time, start)
                if result.ok:
                    arm.batch_done += 1
                else:
                    arm.batch_failed += 1

        await asyncio.gather(*(worker() for _ in range(BATCH_SCRIPT_WORKERS)))

    async def outage(self, stack: Stack, arm: ArmRun, start: float, duration_s: float) -> None:
        """Take the outage region's engines down (killed) in the middle of the day, and start them again."""
        loop = asyncio.get_running_loop()
        down_at, up_at = (start + share * duration_s for share in OUTAGE)
        layout = self.layout[arm.name]
        ports = [(model, i, port) for (region, model), ps in layout.items() if region == OUTAGE_REGION
                 for i, port in enumerate(ps)]
        await asyncio.sleep(max(0.0, down_at - loop.time()))
        for _, _, port in ports:
            await asyncio.to_thread(self.ctx.procs.stop, stack.engines[port], 1.0, signal.SIGKILL)
        went_down = loop.time() - start
        await asyncio.sleep(max(0.0, up_at - loop.time()))
        for model, i, port in ports:
            stack.engines[port] = await asyncio.to_thread(self.engine_of, arm.name, OUTAGE_REGION, model, i, port)
        arm.outage_s = (went_down, loop.time() - start)


def run(ctx: ScenarioContext) -> Outcome:
    """Run the headline scenario and write its report into ``ctx.out_dir``."""
    h = Headline(ctx)
    started = time.monotonic()
    h.run()
    assert h.workload is not None
    assert h.capacity is not None
    workload, capacity = h.workload, h.capacity
    measured = figures.measure(h.arms, workload)
    tables = figures.tables_of(measured, capacity, workload, h.pool_capacity)
    down = next((a.outage_s for a in h.arms if a.name == SWITCHYARD and a.outage_s), None)
    reachable = figures.attainable(workload, capacity.rps, down or (OUTAGE[0] * h.duration_s, OUTAGE[1] * h.duration_s),
                                   1.0 - 1.0 / len(REGIONS))
    goals = figures.goals_of(measured, reachable)
    notes = figures.notes_of(h, capacity)
    parameters = {"scenario": "headline", "duration_s": h.duration_s, "time_scale": h.time_scale,
                  "client_timeout_s": h.timeout_s, "capacity_rps": capacity.rps,
                  "capacity_output_tps": capacity.output_tps, "capacity_clients": capacity.clients,
                  "peak": PEAK, "trough": TROUGH, "outage": {"region": OUTAGE_REGION, "share_of_day": list(OUTAGE)},
                  "regions": list(REGIONS), "replicas_per_model_and_region": REPLICAS, "max_num_seqs": MAX_NUM_SEQS,
                  "profiles": PROFILE, "served": SERVED, "token_scale": TOKEN_SCALE,
                  "pool_capacity_rps": h.pool_capacity, "slo_ttft_s": SLO_TTFT_S, "downgrade_at": DOWNGRADE_AT,
                  "batch_lines": len(h.backlog),
                  "batch_lines_by_model": h.backlog_models, "batch_trace": str(BACKLOG_TRACE),
                  "outage_s": {a.name: list(a.outage_s) if a.outage_s else None for a in h.arms},
                  "batch": {a.name: {"lines": a.batch_lines, "done": a.batch_done, "failed": a.batch_failed,
                                     "via": a.batch_via} for a in h.arms},
                  "attainable_estimate": reachable,
                  "arm_wall_s": {a.name: a.wall_s for a in h.arms}, "wall_s": time.monotonic() - started}
    report = build_report({a.name: a.results for a in h.arms}, title="switchyard bench: headline (a day on fixed "
                          "capacity)", workload=workload, parameters=parameters,
                          seeds={"day": ctx.options.seed, "capacity": ctx.options.seed + 1,
                                 "backlog": ctx.options.seed + 2},
                          slo=figures.slo_spec(), groups=("class", "tenant"), baseline=ROUND_ROBIN, tables=tables,
                          goals=goals, notes=notes)
    # Each arm's engines per second of the day (None: no engine answered), beside the load generator's series.
    report["engines"] = {a.name: {"bin_s": SAMPLE_BIN_S, "in_use": a.in_use, "utilisation": a.occupancy,
                                  "busy": a.busy, "lag_s": a.lag_s} for a in h.arms}
    write_report(report, ctx.out_dir)
    figures.write_day_plot(measured, workload, capacity, ctx.out_dir / "headline_day.png")
    report["plots"] = sorted({*report["plots"], "headline_day.png"})
    (ctx.out_dir / "report.md").write_text(render_markdown(report), encoding="utf-8")
    (ctx.out_dir / "report.json").write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=1) + b"\n")
    return Outcome("headline", "ok", figures.summary(measured), goals, tables[:2], "headline/report.md",
                   notes=notes[:1])


__all__ = ["ArmRun", "Headline", "run"]
