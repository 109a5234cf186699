"""The ``batch`` scenario's run: each arm on fresh engines and a fresh gateway, the batch submitted before the
interactive load of ``with-batch`` and cancelled and read back after it, then the goals and the report (what
the scenario registry calls is :func:`run`)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from switchyard.bench.loadgen import run_open_loop
from switchyard.bench.procs import free_ports
from switchyard.bench.report import build_report, render_markdown, write_report
from switchyard.bench.sampler import by_label
from switchyard.bench.scenarios.arms import Arm, EngineShape, FreshArms, Stack
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.scenarios.batch.figures import arm_rows, share_row, tables_of, tps_note, write_progress_plot
from switchyard.bench.scenarios.batch.progress import (
    POLL_S,
    Progress,
    get_json,
    poll,
    post_json,
    queue_waits,
    read_sample,
    submit_batch,
)
from switchyard.bench.scenarios.batch.workload import (
    ARMS,
    BASELINE,
    BATCH_CLASS,
    BATCH_MARGIN_S,
    BATCH_MODEL,
    BATCH_TENANT,
    CONTEXT,
    DEFAULT_BATCH_CEILING,
    INTERACTIVE_CLASS,
    INTERACTIVE_TENANT,
    KV_TOKENS,
    LOAD,
    MAX_NUM_SEQS,
    MAX_QUEUE_MS,
    MODEL,
    OUTPUT_TOKENS,
    PROFILE,
    PROMPT_TOKENS,
    REPLICAS,
    SERVED,
    TIER,
    WITH,
    batch_lines,
    batch_policy,
    interactive_mix,
)
from switchyard.bench.sender import Target
from switchyard.bench.spec import Workload
from switchyard.bench.stats import ratio
from switchyard.bench.synthetic import RequestTemplate
from switchyard.bench.tables import goal
from switchyard.figures import fixed, percent

#: Seconds per arm: long enough for a steady interactive TTFT p99 (about 1,900 requests: the p99 is the
#: 19th slowest; at 60 s, the 9th of 940, the baseline's p99 moved 55-64 ms between identical runs).
DURATION_S = 120.0
#: Seconds per arm with ``--quick`` (the other timings are ``arms``'s).
QUICK_DURATION_S = 6.0
#: Longest wait for the batch's first answered line, and for the cancelled batch to end.
BATCH_START_TIMEOUT_S = 60.0
BATCH_END_TIMEOUT_S = 60.0
GOAL_SHARE = 0.8
GOAL_P99_RATIO = 1.10


@dataclass
class BatchJob:
    """What became of the batch of the ``with-batch`` arm."""

    lines: int = 0
    file_bytes: int = 0
    batch_id: str | None = None
    first_line_s: float | None = None
    status: str | None = None
    completed: int | None = None
    failed: int | None = None
    output_lines: int | None = None
    output_ok: int | None = None
    output_completion_tokens: int | None = None
    error_lines: int | None = None
    error_codes: dict[str, int] = field(default_factory=dict)


@dataclass
class ArmRun(Arm):
    """What one arm measured."""

    progress: Progress = field(default_factory=Progress)
    #: Requests that waited in the gateway's queue and their total wait, per class (None: /metrics not read).
    queued: dict[str, tuple[int, float]] | None = None
    #: Batch requests in flight preempted for interactive ones (None: /metrics not read).
    preempted: int | None = None


class BatchRun(FreshArms[ArmRun]):
    """The batch scenario's run."""

    scenario = "batch"
    arm_names = ARMS
    arm_type = ArmRun
    pool = "pool"
    model = MODEL
    served = SERVED
    shape = EngineShape(PROFILE, MAX_NUM_SEQS, KV_TOKENS, CONTEXT)
    load_factor = LOAD
    quick_duration_s = QUICK_DURATION_S
    duration_default_s = DURATION_S

    def __init__(self, ctx: ScenarioContext) -> None:
        super().__init__(ctx)
        self.job = BatchJob()

    def start_engines(self, name: str) -> Stack:
        ctx = self.ctx
        ports = free_ports(REPLICAS)
        self.policy_path(name).write_text(batch_policy(ports))
        ctx.say(f"batch: {name}: starting {REPLICAS} simulated replicas and the gateway")
        engines = {p: self.engine(f"batch-{name}-{i}", p, SERVED) for i, p in enumerate(ports)}
        return Stack(name, ports, engines)

    def tenants(self) -> list[tuple[str, str]]:
        """A key for the interactive tenant and one for the batch's."""
        return [(INTERACTIVE_TENANT, TIER), (BATCH_TENANT, TIER)]

    def mix(self, model: str) -> list[RequestTemplate]:
        return interactive_mix(model)

    def load(self, stack: Stack, arm: ArmRun, workload: Workload) -> None:
        self.ctx.say(f"batch: {arm.name}: {len(workload)} interactive requests over "
                     f"{workload.duration_s:g} s" + (" with a batch running" if arm.name == WITH else ""))
        wall = time.monotonic()
        asyncio.run(self.drive(stack, arm, workload))
        arm.wall_s = time.monotonic() - wall

    def batch_file(self) -> bytes:
        """The batch's input: lines enough to keep the whole pool busy past the window."""
        assert self.capacity is not None
        count = max(10, math.ceil(self.capacity.rps * (self.duration_s + BATCH_MARGIN_S)))
        content = batch_lines(count, self.ctx.options.seed + 2)
        self.job.lines = content.count(b"\n")
        self.job.file_bytes = len(content)
        return content

    async def drive(self, stack: Stack, arm: ArmRun, workload: Workload) -> None:
        """The arm's interactive load (after submitting the batch, in ``with-batch``), reading the counters."""
        gateway = stack.gateway
        assert gateway is not None
        base = gateway.base_url
        auth = {"Authorization": f"Bearer {self.keys[BATCH_TENANT]}"}
        loop = asyncio.get_running_loop()
        poller: asyncio.Task[None] | None = None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            batch_id = None
            if arm.name == WITH:
                batch_id = await self.submit(session, base, auth)

            # A reading just before the schedule's start (its time is fixed once the start is known).
            first = await read_sample(session, base, auth, batch_id, 0.0)
            if first is None:
                raise RuntimeError(f"{arm.name}: the gateway's /metrics did not answer")

            def started(at: float) -> None:
                nonlocal poller
                assert first is not None
                first.t_s -= at
                arm.progress.samples.append(first)
                poller = loop.create_task(poll(session, base, auth, batch_id, at, arm.progress))

            try:
                arm.results = await run_open_loop(workload, Target(base, arm.name, api_keys=self.keys),
                                                  progress=self.ctx.options.progress, timeout_s=self.timeout_s,
                                                  on_start=started)
                await asyncio.sleep(POLL_S)  # one more reading after the last answer
            finally:
                if poller is not None:
                    poller.cancel()
                    await asyncio.gather(poller, return_exceptions=True)
            async with session.get(f"{base}/metrics") as response:
                metrics = await response.text()
            arm.queued = queue_waits(metrics)
            arm.preempted = round(sum(by_label(metrics, "switchyard_preemptions_total", "pool").values()))
            if batch_id is not None:
                await self.finish(session, base, auth, batch_id)

    async def submit(self, session: aiohttp.ClientSession, base: str, auth: Mapping[str, str]) -> str:
        """Upload the batch's file, make the batch, and wait for its first answered line."""
        batch_id = await submit_batch(session, base, auth, self.batch_file(), "batch")
        self.job.batch_id = batch_id
        self.ctx.say(f"batch: {WITH}: batch {batch_id} of {self.job.lines} lines submitted; waiting for its first line")
        started = time.monotonic()
        while time.monotonic() - started < BATCH_START_TIMEOUT_S:
            batch = await get_json(session, f"{base}/v1/batches/{batch_id}", auth)
            if batch["request_counts"]["completed"] + batch["request_counts"]["failed"] > 0:
                self.job.first_line_s = time.monotonic() - started
                return batch_id
            await asyncio.sleep(0.1)
        raise RuntimeError(f"the batch answered no line within {BATCH_START_TIMEOUT_S:g} s")

    async def finish(self, session: aiohttp.ClientSession, base: str, auth: Mapping[str, str], batch_id: str) -> None:
        """Cancel the batch (it outlasted the window), wait for it to end, read its output back."""
        job = self.job
        batch = await get_json(session, f"{base}/v1/batches/{batch_id}", auth)
        if batch["status"] in ("in_progress", "validating"):
            batch = await post_json(session, f"{base}/v1/batches/{batch_id}/cancel", auth)
        started = time.monotonic()
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            if time.monotonic() - started > BATCH_END_TIMEOUT_S:
                break
            await asyncio.sleep(0.2)
            batch = await get_json(session, f"{base}/v1/batches/{batch_id}", auth)
        job.status = batch["status"]
        job.completed = int(batch["request_counts"]["completed"])
        job.failed = int(batch["request_counts"]["failed"])
        if batch.get("output_file_id"):
            lines = await self.file_lines(session, base, auth, batch["output_file_id"])
            ok = [x for x in lines if (x.get("response") or {}).get("status_code") == 200]
            job.output_lines, job.output_ok = len(lines), len(ok)
            job.output_completion_tokens = sum(int(((x["response"].get("body") or {}).get("usage") or {})
                                                   .get("completion_tokens") or 0) for x in ok)
        elif job.status is not None:
            job.output_lines = job.output_ok = job.output_completion_tokens = 0
        if batch.get("error_file_id"):
            errors = await self.file_lines(session, base, auth, batch["error_file_id"])
            job.error_lines = len(errors)
            for x in errors:
                code = str((x.get("error") or {}).get("code") or (x.get("response") or {}).get("status_code"))
                job.error_codes[code] = job.error_codes.get(code, 0) + 1
        else:
            job.error_lines = 0

    @staticmethod
    async def file_lines(session: aiohttp.ClientSession, base: str, auth: Mapping[str, str],
                         file_id: str) -> list[dict[str, Any]]:
        async with session.get(f"{base}/v1/files/{file_id}/content", headers=auth) as response:
            body = await response.read()
            if response.status != 200:
                raise RuntimeError(f"GET /v1/files/{file_id}/content answered {response.status}")
        return [json.loads(line) for line in body.splitlines() if line.strip()]


def run(ctx: ScenarioContext) -> Outcome:
    """Run the batch scenario and write its report into ``ctx.out_dir``."""
    b = BatchRun(ctx)
    started = time.monotonic()
    b.run()
    assert b.workload is not None
    assert b.capacity is not None
    rows = arm_rows(b)
    share = share_row(b, rows)
    tables = tables_of(b, rows, share)
    by = {r["arm"]: r for r in rows}
    p99 = ratio(by[WITH]["ttft_p99_s"], by[BASELINE]["ttft_p99_s"])
    value = share["share"]
    failed = by[WITH]["failed"]

    def whole_ms(seconds: float | None) -> str:
        return fixed(seconds, scale=1000, decimals=0, unit=" ms")

    goals = [
        goal("the batch lane's share of the idle capacity (batch tok/s ÷ (capacity - interactive tok/s))",
             f"≥ {GOAL_SHARE * 100:g}%", value, None if value is None else value >= GOAL_SHARE, unit="%",
             multiplier=100, decimals=1,
             note=tps_note(share)),
        goal("interactive TTFT p99 with the batch ÷ without", f"≤ {GOAL_P99_RATIO:.2f}x", p99,
             None if p99 is None else p99 <= GOAL_P99_RATIO, unit="x",
             note=f"{whole_ms(by[WITH]['ttft_p99_s'])} vs {whole_ms(by[BASELINE]['ttft_p99_s'])}; p50 "
                  f"{whole_ms(by[WITH]['ttft_p50_s'])} vs {whole_ms(by[BASELINE]['ttft_p50_s'])}"),
        goal("interactive requests not answered while the batch ran", "0", float(failed), failed == 0, decimals=0,
             note=f"of {by[WITH]['requests']}; without the batch: {by[BASELINE]['failed']}"),
    ]
    notes = [
        f"Pool: {REPLICAS} replicas of `{PROFILE}`, --max-num-seqs {MAX_NUM_SEQS} (declared as the pool's "
        f"max_num_seqs), priority scheduling on (the batch class's engine priority is below the interactive one's: "
        f"an engine's waiting queue serves interactive requests first; vLLM never preempts a running request for a "
        f"waiting one, so the gateway does); time scale {b.time_scale:g}. Classes: `{INTERACTIVE_CLASS}` "
        f"(max_queue_ms {MAX_QUEUE_MS}) and `{BATCH_CLASS}: {{lane: batch}}` (ceiling {DEFAULT_BATCH_CEILING:g}, "
        "the default); gateway defaults otherwise, its own batch worker included.",
        f"The batch's lines call `{BATCH_MODEL}`, a second model name on the same pool and engines as `{MODEL}`, "
        "only so that the gateway's token counter tells batch from interactive tokens.",
        "Each arm ran on fresh engines and a fresh gateway with the same interactive requests at the same times.",
    ]
    if b.ctx.options.quick:
        notes.append("Quick run: a few seconds per arm; the TTFT p99 of so few requests, and the window's figures, "
                     "are indicative only.")
    parameters = {"scenario": "batch", "load": LOAD, "duration_s": b.duration_s, "time_scale": b.time_scale,
                  "client_timeout_s": b.timeout_s, "capacity_rps": b.capacity.rps,
                  "capacity_output_tps": b.capacity.output_tps, "capacity_clients": b.capacity.clients,
                  "capacity_output_tps_by_arm": {a.name: a.capacity.output_tps if a.capacity else None
                                                 for a in b.arms},
                  "offered_rps": b.workload.offered_rate_per_s, "replicas": REPLICAS, "max_num_seqs": MAX_NUM_SEQS,
                  "profile": PROFILE, "batch_ceiling": DEFAULT_BATCH_CEILING, "batch_lines": b.job.lines,
                  "batch_margin_s": BATCH_MARGIN_S, "poll_s": POLL_S, "prompt_tokens": list(PROMPT_TOKENS),
                  "output_tokens": list(OUTPUT_TOKENS), "goal_share": GOAL_SHARE, "goal_p99_ratio": GOAL_P99_RATIO,
                  "arm_wall_s": {a.name: a.wall_s for a in b.arms}, "wall_s": time.monotonic() - started}
    report = build_report({a.name: a.results for a in b.arms}, title="switchyard bench: batch (idle capacity)",
                          workload=b.workload, parameters=parameters,
                          seeds={"engines": ctx.options.seed, "capacity_workload": ctx.options.seed + 1,
                                 "batch_lines": ctx.options.seed + 2},
                          baseline=BASELINE, tables=tables, goals=goals, notes=notes)
    report["batch_progress"] = {a.name: a.progress.as_dict() for a in b.arms}
    write_report(report, ctx.out_dir)
    # The scenario's own plot, then the report again so that both files list it.
    write_progress_plot(b, ctx.out_dir / "batch_progress.png")
    report["plots"] = sorted({*report["plots"], "batch_progress.png"})
    (ctx.out_dir / "report.md").write_text(render_markdown(report), encoding="utf-8")
    (ctx.out_dir / "report.json").write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=1) + b"\n")
    summary = (f"batch share of idle capacity {percent(value)} (goal ≥ {GOAL_SHARE * 100:g}%); interactive TTFT p99 "
               + fixed(p99, decimals=2, unit="x") + f" without the batch (goal ≤ {GOAL_P99_RATIO:.2f}x); "
               f"{b.job.completed if b.job.completed is not None else '-'} batch lines completed")
    return Outcome("batch", "ok", summary, goals, tables[:3], "batch/report.md", notes=notes[:1])
