"""``batch``: the Batch API filling the capacity interactive traffic leaves idle, without hurting it.

One pool of ``REPLICAS`` simulated replicas (``--max-num-seqs`` ``MAX_NUM_SEQS``, declared as the
pool's ``max_num_seqs``, priority scheduling on) serves two model names: ``chat`` (the interactive
traffic) and ``chat-batch`` (the batch's lines; the same pool and engines, a name of its own only so
that the gateway's ``switchyard_tokens_total`` counts the two apart). The policy has an interactive
class and a batch-lane class ``batch: {lane: batch}`` (the lane's default utilisation ceiling); the
gateway's own batch worker (every ``switchyard serve`` runs one, ``SWITCHYARD_BATCH_CONCURRENCY``
lines at a time) sends the lines in that class.

1. **Arms.** ``without-batch`` (the baseline: interactive load alone) and ``with-batch`` (the same
   interactive schedule while a large batch runs), one after the other, each on fresh engines and a
   fresh gateway (one database: the keys outlive the gateways). Fresh engines keep the arms apart:
   the second arm replays the same prompts, which the first arm's engines would have in their
   prefix caches.
2. **Capacity.** Before each arm's load its engines are called directly by a closed loop of
   ``MAX_NUM_SEQS`` clients per replica (every sequence slot busy) sending requests of the
   workload's lengths back to back (``arms.measure_capacity``); output tokens (and requests) per
   second after a warm-up are the pool's capacity. The first arm's sets the interactive rate and is
   the capacity the batch's share is computed from; the second's is a check.
3. **Interactive load.** One seeded open-loop Poisson schedule of streaming requests at ``LOAD``
   times the capacity (in requests per second, so about that share of its tokens per second) for the
   arm's duration, the same for both arms; TTFT counts from each request's scheduled time.
4. **Batch.** In ``with-batch``, a JSONL file of chat lines of the same lengths (other prompts: a
   seed of their own) is uploaded (``POST /v1/files``) and a batch made of it (``POST
   /v1/batches``) before the interactive schedule starts, which starts once the batch's first line
   is answered (the worker polls for work once a second). The batch has enough lines to keep the
   whole pool busy ``BATCH_MARGIN_S`` longer than the window, so it outlasts it. After the window
   the batch is cancelled; its output file is read back.
5. **Window figures.** Every ``POLL_S`` the gateway's ``/metrics`` (completion tokens by model) and
   ``GET /v1/batches/{id}`` (lines completed, failed) are read; the figures over the window
   ``[0, duration)`` are those cumulative counts interpolated at its ends. Idle capacity = capacity
   - interactive output tokens/s; the batch lane's share of it = batch output tokens/s ÷ idle
   capacity.

Interactive requests that find the pool full preempt batch lines in flight (the gateway cancels the
youngest; it queues again): :mod:`switchyard.gateway.flow`. The report counts the preemptions.

Goals: the batch lane's share of the idle capacity at least ``GOAL_SHARE``; interactive TTFT p99 with
the batch within ``GOAL_P99_RATIO`` of the same run without it; every interactive request answered
while the batch runs.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from switchyard.bench.loadgen import Target, run_open_loop
from switchyard.bench.procs import free_ports
from switchyard.bench.report import build_report, render_markdown, write_report
from switchyard.bench.results import Result
from switchyard.bench.sampler import by_label, samples
from switchyard.bench.scenarios.arms import Arm, EngineShape, FreshArms, Stack, capacity_table
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.spec import Workload
from switchyard.bench.stats import summarize
from switchyard.bench.synthetic import RequestTemplate, poisson
from switchyard.bench.tables import goal, ms, num, pct, ratio, table, text
from switchyard.figures import fixed, percent

ARMS = ("without-batch", "with-batch")
BASELINE = "without-batch"
WITH = "with-batch"
REPLICAS = 2
#: Sequence slots per replica, and the profile: a 32B model's step takes about twice an 8B model's, so
#: 16 slots a replica turn over at the rate 8 slots of ``h100-8b`` would (what two cores can drive), and
#: half the capacity (16 of 32 slots on average) seldom fills every slot in a Poisson burst: the
#: baseline's p99 is then not a few requests queued for a slot (as with 8 slots of ``h100-8b``: 1-2%
#: of them, and the p99 moved 34-96 ms from run to run) but the engines' and the gateway's latency.
MAX_NUM_SEQS = 16
PROFILE = "h100-32b"
#: Sequence slots of the pool the batch lane leaves free (the schema's default ``batch_reserve_slots``;
#: a test checks they agree).
DEFAULT_BATCH_RESERVE = 1
MODEL = "chat"
BATCH_MODEL = "chat-batch"
SERVED = "sim-32b"
KV_TOKENS = 100_000
CONTEXT = 8192
PROMPT_TOKENS = (100, 400)
OUTPUT_TOKENS = (32, 96)
TIER = "standard"
INTERACTIVE_CLASS = "interactive"
BATCH_CLASS = "batch"
INTERACTIVE_TENANT = "interactive"
BATCH_TENANT = "batch"
MAX_QUEUE_MS = 5000
#: The batch lane's utilisation ceiling: the policy here sets no ``max_utilisation``, so it is the
#: schema's default ``BATCH_MAX_UTILISATION`` (bench code imports no policy code; a test checks they agree).
DEFAULT_BATCH_CEILING = 0.95
#: The interactive load, as a share of the measured capacity.
LOAD = 0.5
#: Seconds per arm: long enough for a steady interactive TTFT p99 (about 1,900 requests: the p99 is the
#: 19th slowest; at 60 s, the 9th of 940, the baseline's p99 moved 55-64 ms between identical runs).
DURATION_S = 120.0
#: Seconds per arm with ``--quick`` (the other timings are ``arms``'s).
QUICK_DURATION_S = 6.0
#: The batch has enough lines to keep the whole pool busy this much longer than the window.
BATCH_MARGIN_S = 10.0
#: How often the gateway's counters and the batch's progress are read.
POLL_S = 0.5
#: Longest wait for the batch's first answered line, and for the cancelled batch to end.
BATCH_START_TIMEOUT_S = 60.0
BATCH_END_TIMEOUT_S = 60.0
GOAL_SHARE = 0.8
GOAL_P99_RATIO = 1.10
TOKENS = "switchyard_tokens_total"


def batch_policy(ports: Sequence[int]) -> str:
    """The policy document: one pool, ``chat`` and ``chat-batch`` on it, an interactive and a batch-lane class."""
    urls = "[" + ", ".join(f"http://127.0.0.1:{p}" for p in ports) + "]"
    price = "{input_per_mtok: 3, output_per_mtok: 15}"
    return f"""\
schema: 1
regions: [local]
pools:
  - {{name: main, region: local, served_model: {SERVED}, endpoints: {urls},
      kv_cache_tokens: {KV_TOKENS}, sim_profile: {PROFILE}, max_num_seqs: {MAX_NUM_SEQS},
      priority_scheduling: true}}
models:
  - {{name: {MODEL}, pools: [main], context_window: {CONTEXT}, price: {price}}}
  - {{name: {BATCH_MODEL}, pools: [main], context_window: {CONTEXT}, price: {price}}}
priorities:
  {INTERACTIVE_CLASS}: {{max_queue_ms: {MAX_QUEUE_MS}}}
  {BATCH_CLASS}: {{lane: batch}}
tiers:
  - {{name: {TIER}, priority: {INTERACTIVE_CLASS}, models: ["*"]}}
"""


def interactive_mix(model: str = MODEL) -> list[RequestTemplate]:
    """The interactive requests: one tenant, streaming."""
    return [RequestTemplate(tenant=INTERACTIVE_TENANT, request_class=INTERACTIVE_CLASS, model=model,
                            prompt_tokens=PROMPT_TOKENS, output_tokens=OUTPUT_TOKENS, stream=True,
                            name=INTERACTIVE_TENANT)]


def batch_lines(count: int, seed: int) -> bytes:
    """The batch's input file: ``count`` chat lines (about: a Poisson draw) of the interactive lengths."""
    template = RequestTemplate(tenant=BATCH_TENANT, request_class=BATCH_CLASS, model=BATCH_MODEL,
                               prompt_tokens=PROMPT_TOKENS, output_tokens=OUTPUT_TOKENS, stream=False,
                               name=BATCH_TENANT)
    specs = poisson(count / 10.0, 10.0, [template], seed, max_model_len=CONTEXT).specs
    encode = msgspec.json.Encoder().encode
    return b"".join(encode({"custom_id": f"line-{s.index}", "method": "POST", "url": "/v1/chat/completions",
                            "body": s.body()}) + b"\n" for s in specs)


# --- reading the gateway ----------------------------------------------------------------------


def completion_tokens(metrics_text: str) -> dict[str, float]:
    """Completion tokens the gateway counted, by model (``switchyard_tokens_total{kind="completion"}``)."""
    out: dict[str, float] = {}
    for labels, value in samples(metrics_text, TOKENS):
        if labels.get("kind") == "completion" and "model" in labels:
            out[labels["model"]] = out.get(labels["model"], 0.0) + value
    return out


def queue_waits(metrics_text: str) -> dict[str, tuple[int, float]]:
    """Per class: requests that waited in the gateway's queue before dispatch, and their total wait (s)."""
    counts = by_label(metrics_text, "switchyard_queue_wait_seconds_count", "class")
    sums = by_label(metrics_text, "switchyard_queue_wait_seconds_sum", "class")
    return {cls: (int(n), sums.get(cls, 0.0)) for cls, n in counts.items()}


def interpolate(points: Sequence[tuple[float, float]], t: float) -> float | None:
    """A cumulative count sampled at ``points`` ((time, value), time ascending) at time ``t``.

    Linear between the samples around ``t``; None if ``t`` is outside them.
    """
    for (t0, v0), (t1, v1) in itertools.pairwise(points):
        if t0 <= t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    if points and points[-1][0] == t:
        return points[-1][1]
    return None


@dataclass(slots=True)
class Sample:
    """One reading: the time on the run's clock, completion tokens by model, the batch's counts."""

    t_s: float
    tokens: dict[str, float]
    completed: int | None = None
    failed: int | None = None


@dataclass
class Progress:
    """Readings of the gateway's counters (and the batch's progress) while an arm runs."""

    samples: list[Sample] = field(default_factory=list)

    def series(self, model: str) -> list[tuple[float, float]]:
        return [(s.t_s, s.tokens.get(model, 0.0)) for s in self.samples]

    def lines(self, key: str) -> list[tuple[float, float]]:
        return [(s.t_s, float(getattr(s, key))) for s in self.samples if getattr(s, key) is not None]

    def over(self, points: Sequence[tuple[float, float]], start: float, end: float) -> float | None:
        """How much a cumulative count grew over ``[start, end]`` (None: not read at both ends)."""
        a, b = interpolate(points, start), interpolate(points, end)
        return None if a is None or b is None else b - a

    def as_dict(self) -> dict[str, Any]:
        return {"t_s": [s.t_s for s in self.samples],
                "interactive_completion_tokens": [s.tokens.get(MODEL, 0.0) for s in self.samples],
                "batch_completion_tokens": [s.tokens.get(BATCH_MODEL, 0.0) for s in self.samples],
                "batch_completed": [s.completed for s in self.samples],
                "batch_failed": [s.failed for s in self.samples]}


async def _answer(response: aiohttp.ClientResponse, what: str) -> dict[str, Any]:
    """The JSON object of a 200 answer to ``what`` (``GET <url>``); anything else raises."""
    body = await response.read()
    if response.status != 200:
        raise RuntimeError(f"{what} answered {response.status}: {body[:300].decode('utf-8', 'replace')}")
    data: dict[str, Any] = json.loads(body)
    return data


async def _get_json(session: aiohttp.ClientSession, url: str, headers: Mapping[str, str]) -> dict[str, Any]:
    async with session.get(url, headers=headers) as response:
        return await _answer(response, f"GET {url}")


async def _post_json(session: aiohttp.ClientSession, url: str, headers: Mapping[str, str],
                     payload: Mapping[str, Any] | None = None) -> dict[str, Any]:
    async with session.post(url, headers=headers, json=payload) as response:
        return await _answer(response, f"POST {url}")


async def _read(session: aiohttp.ClientSession, base_url: str, headers: Mapping[str, str],
                batch_id: str | None, start: float) -> Sample | None:
    """One reading, timed on the run's clock (``start``: its zero); None if the gateway did not answer."""
    at = asyncio.get_running_loop().time()
    try:
        async with session.get(f"{base_url}/metrics") as response:
            metrics = await response.text()
        # The reading's time: when it was asked for (the answers come within milliseconds).
        sample = Sample(at - start, completion_tokens(metrics))
        if batch_id is not None:
            counts = (await _get_json(session, f"{base_url}/v1/batches/{batch_id}", headers))["request_counts"]
            sample.completed, sample.failed = int(counts["completed"]), int(counts["failed"])
    except (aiohttp.ClientError, TimeoutError, RuntimeError, KeyError, ValueError):
        return None  # a missed reading: the interpolation spans the gap
    return sample


async def _poll(session: aiohttp.ClientSession, base_url: str, headers: Mapping[str, str], batch_id: str | None,
                start: float, progress: Progress) -> None:
    """Read the counters every ``POLL_S`` (on the run's clock, from ``start``) until cancelled."""
    loop = asyncio.get_running_loop()
    index = 1  # the reading at the start was taken before it
    while True:
        await asyncio.sleep(max(0.0, start + index * POLL_S - loop.time()))
        sample = await _read(session, base_url, headers, batch_id, start)
        if sample is not None:
            progress.samples.append(sample)
        index = max(index + 1, math.floor((loop.time() - start) / POLL_S) + 1)


# --- the run ----------------------------------------------------------------------------------


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
    key_workers = 2

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
            first = await _read(session, base, auth, batch_id, 0.0)
            if first is None:
                raise RuntimeError(f"{arm.name}: the gateway's /metrics did not answer")

            def started(at: float) -> None:
                nonlocal poller
                assert first is not None
                first.t_s -= at
                arm.progress.samples.append(first)
                poller = loop.create_task(_poll(session, base, auth, batch_id, at, arm.progress))

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
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", self.batch_file(), filename="bench-batch.jsonl", content_type="application/jsonl")
        async with session.post(f"{base}/v1/files", headers=auth, data=form) as response:
            body = await response.read()
            if response.status != 200:
                raise RuntimeError(f"POST /v1/files answered {response.status}: {body[:300]!r}")
            file_id = json.loads(body)["id"]
        batch = await _post_json(session, f"{base}/v1/batches", auth,
                                 {"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                  "completion_window": "24h", "metadata": {"bench": "batch"}})
        batch_id: str = batch["id"]
        if batch["status"] == "failed":
            raise RuntimeError(f"the batch was refused: {batch['errors']}")
        self.job.batch_id = batch_id
        self.ctx.say(f"batch: {WITH}: batch {batch_id} of {self.job.lines} lines submitted; waiting for its first line")
        started = time.monotonic()
        while time.monotonic() - started < BATCH_START_TIMEOUT_S:
            batch = await _get_json(session, f"{base}/v1/batches/{batch_id}", auth)
            if batch["request_counts"]["completed"] + batch["request_counts"]["failed"] > 0:
                self.job.first_line_s = time.monotonic() - started
                return batch_id
            await asyncio.sleep(0.1)
        raise RuntimeError(f"the batch answered no line within {BATCH_START_TIMEOUT_S:g} s")

    async def finish(self, session: aiohttp.ClientSession, base: str, auth: Mapping[str, str], batch_id: str) -> None:
        """Cancel the batch (it outlasted the window), wait for it to end, read its output back."""
        job = self.job
        batch = await _get_json(session, f"{base}/v1/batches/{batch_id}", auth)
        if batch["status"] in ("in_progress", "validating"):
            batch = await _post_json(session, f"{base}/v1/batches/{batch_id}/cancel", auth)
        started = time.monotonic()
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            if time.monotonic() - started > BATCH_END_TIMEOUT_S:
                break
            await asyncio.sleep(0.2)
            batch = await _get_json(session, f"{base}/v1/batches/{batch_id}", auth)
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


# --- figures ----------------------------------------------------------------------------------


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def arm_rows(b: BatchRun) -> list[dict[str, Any]]:
    """Per arm: the interactive requests' outcome, TTFT and throughput; the batch's tokens and lines."""
    window = b.duration_s
    rows = []
    for arm in b.arms:
        s = summarize(arm.results, window_s=window)
        p = arm.progress
        interactive = p.over(p.series(MODEL), 0.0, window)
        batch = p.over(p.series(BATCH_MODEL), 0.0, window)
        completed = p.over(p.lines("completed"), 0.0, window)
        failed = p.over(p.lines("failed"), 0.0, window)
        waited = arm.queued.get(INTERACTIVE_CLASS, (0, 0.0)) if arm.queued is not None else None
        rows.append({
            "arm": arm.name, "requests": s.count, "answered": s.ok, "failed": s.count - s.ok,
            "ttft_p50_s": s.ttft_p50_s, "ttft_p90_s": s.ttft_p90_s, "ttft_p99_s": s.ttft_p99_s,
            "failures": _failures(arm.results),
            "queued": waited[0] if waited is not None else None,
            "queue_wait_mean_s": _div(waited[1], waited[0]) if waited is not None else None,
            "client_output_tps": s.output_tps,
            "interactive_tps": None if interactive is None else interactive / window,
            "batch_tps": (None if batch is None else batch / window) if arm.name == WITH else 0.0,
            "batch_lines_completed": completed if arm.name == WITH else 0,
            "batch_lines_failed": failed if arm.name == WITH else 0,
            "preempted": arm.preempted,
        })
    return rows


def _failures(results: Sequence[Result]) -> str:
    """The failed requests by HTTP status and error code (``-``: none failed)."""
    counts: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = f"{r.status or r.outcome.value} {r.error_code or r.error_type or ''}".strip()
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k}: {n}" for k, n in sorted(counts.items())) or "-"


def share_row(b: BatchRun, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The batch lane's share of the idle capacity, in the ``with-batch`` arm."""
    assert b.capacity is not None
    with_batch = next(r for r in rows if r["arm"] == WITH)
    capacity = b.capacity.output_tps
    interactive, batch = with_batch["interactive_tps"], with_batch["batch_tps"]
    idle = None if interactive is None else capacity - interactive
    total = None if interactive is None or batch is None else interactive + batch
    return {"capacity_tps": capacity, "interactive_tps": interactive, "idle_tps": idle, "batch_tps": batch,
            "share": _div(batch, idle) if idle is not None and idle > 0 else None, "pool_tps": total,
            "pool_of_capacity": _div(total, capacity),
            "lines_per_s": _div(with_batch["batch_lines_completed"], b.duration_s)}


def _arm_table(rows: Sequence[Mapping[str, Any]], b: BatchRun) -> dict[str, Any]:
    assert b.workload is not None
    return table(
        "Interactive traffic without and with the batch",
        [text("arm", "arm"), num("requests", "interactive requests", 0), num("answered", "answered", 0),
         num("failed", "failed", 0), text("failures", "failures by status and code"),
         ms("ttft_p50_s", "TTFT p50 ms", 0), ms("ttft_p90_s", "TTFT p90 ms", 0),
         ms("ttft_p99_s", "TTFT p99 ms", 0), num("queued", "queued in the gateway", 0),
         ms("queue_wait_mean_s", "their mean queue wait ms", 1),
         num("client_output_tps", "interactive tok/s (client)", 0),
         num("interactive_tps", "interactive tok/s (gateway)", 0), num("batch_tps", "batch tok/s", 0),
         num("batch_lines_completed", "batch lines completed", 0), num("batch_lines_failed", "batch lines failed", 0),
         num("preempted", "batch requests preempted", 0)],
        rows,
        f"The same {len(b.workload)} streaming requests ({b.workload.offered_rate_per_s:.2f}/s, Poisson, "
        f"{LOAD:g}x the measured capacity) over {b.duration_s:g} s in both arms; TTFT from each request's scheduled "
        "time. Tokens per second are output (completion) tokens over the window: *client* from the answers the load "
        "generator got (all of them, the tail past the window included), *gateway* from its "
        f"`{TOKENS}{{kind=\"completion\"}}` by model (`{MODEL}`, `{BATCH_MODEL}`), read every {POLL_S:g} s and "
        "interpolated at the window's ends; batch lines likewise from `GET /v1/batches/{id}`. Queued: interactive "
        "requests that waited in the gateway's queue before dispatch (the pool at utilisation 1, every sequence slot "
        "of its least-loaded replica taken, or another grant in transit), and their mean wait, from "
        "`switchyard_queue_wait_seconds` at the end of the arm. Preempted: batch requests in flight that the gateway "
        "cancelled for an interactive request, to make room or because they were still waiting for their first engine "
        "step (each queued again), from `switchyard_preemptions_total`.")


def _ratio_table(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    by = {r["arm"]: r for r in rows}
    a, b = by[BASELINE], by[WITH]
    row = {"ratio": f"{WITH} ÷ {BASELINE}",
           **{k: _div(b[k], a[k]) for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "client_output_tps",
                                            "interactive_tps")}}
    return table("Interactive traffic: with the batch ÷ without",
                 [text("ratio", "ratio"), ratio("ttft_p50_s", "TTFT p50 ÷"), ratio("ttft_p90_s", "TTFT p90 ÷"),
                  ratio("ttft_p99_s", "TTFT p99 ÷"), ratio("client_output_tps", "interactive tok/s (client) ÷"),
                  ratio("interactive_tps", "interactive tok/s (gateway) ÷")],
                 [row], "'-' where a figure is missing or the baseline's is 0.")


def _share_table(row: Mapping[str, Any], b: BatchRun) -> dict[str, Any]:
    return table(
        "The batch lane's share of the idle capacity",
        [num("capacity_tps", "capacity tok/s", 0), num("interactive_tps", "interactive tok/s", 0),
         num("idle_tps", "idle capacity tok/s", 0), num("batch_tps", "batch tok/s", 0),
         pct("share", "batch share of idle %"), num("pool_tps", "pool tok/s (both)", 0),
         pct("pool_of_capacity", "pool tok/s of capacity %"), num("lines_per_s", "batch lines/s", 2)],
        [row],
        f"In `{WITH}`, over the {b.duration_s:g} s window. Capacity: the first arm's closed-loop measurement (below). "
        "Idle capacity = capacity - interactive output tokens/s (gateway); the share = batch output tokens/s ÷ idle "
        f"capacity. The lane dispatches while the pool's utilisation (its least-loaded replica's, sequence slots "
        f"included) is under {DEFAULT_BATCH_CEILING:g}, no interactive request waits, and at least "
        f"{DEFAULT_BATCH_RESERVE} of the pool's {REPLICAS * MAX_NUM_SEQS} slots stay free (`batch_reserve_slots`, "
        "the default) for interactive arrivals; no line goes to a replica while an interactive stream there waits "
        "for its first byte, or within a usual interactive time to first byte of the last line sent there (batch "
        "prefills one at a time). An interactive request that finds no free slot preempts the youngest batch "
        "request (its tokens so far are lost, and it runs again), and any sent to its replica less than half a "
        "usual interactive time to first byte ago (still waiting for their first engine step). The gap between the "
        "share and 100% is the kept slot, that lost work, and the moments a free slot waits for the next line.")


def _capacity_table(b: BatchRun) -> dict[str, Any]:
    assert b.workload is not None
    return capacity_table(
        b.arms, title="Capacity of the pool (closed loop, before each arm's load)", tps_label="capacity tok/s",
        first_use=f"sets the interactive rate ({LOAD:g}x) and the idle capacity",
        note=f"{REPLICAS} replicas x --max-num-seqs {MAX_NUM_SEQS}: one client per sequence slot, calling the engines "
        f"directly (no gateway), for {b.capacity_s:g} s after a {b.capacity_warmup_s:g} s warm-up, with requests of "
        f"the workload's lengths (prompt {PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]}, output {OUTPUT_TOKENS[0]}-"
        f"{OUTPUT_TOKENS[1]} tokens, exact): the most the pool serves with every slot busy.")


def _job_table(b: BatchRun) -> dict[str, Any]:
    j = b.job
    row = {"lines": j.lines, "file_kib": j.file_bytes / 1024, "first_line_s": j.first_line_s, "status": j.status,
           "completed": j.completed, "failed": j.failed, "output_ok": j.output_ok,
           "output_tokens": j.output_completion_tokens, "error_lines": j.error_lines,
           "error_codes": ", ".join(f"{k} {v}" for k, v in sorted(j.error_codes.items())) or "-"}
    return table(
        "The batch job",
        [num("lines", "lines submitted", 0), num("file_kib", "file KiB", 0),
         ms("first_line_s", "submit to first answered line ms", 0), text("status", "final status"),
         num("completed", "completed", 0), num("failed", "failed", 0), num("output_ok", "output file: 200s", 0),
         num("output_tokens", "output file: completion tokens", 0), num("error_lines", "error file lines", 0),
         text("error_codes", "error codes")],
        [row],
        f"Lines sized to keep the whole pool busy {BATCH_MARGIN_S:g} s longer than the window; the interactive "
        "schedule starts once the first line is answered; after the window the batch is cancelled (lines still "
        "running finish; those not started end as `batch_cancelled` in the error file, outside `request_counts`).")


def write_progress_plot(b: BatchRun, path: Path) -> Path:
    """Output tokens/s over time by arm and traffic, and the batch's lines completed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 7))
    axes = fig.subplots(2, 1, sharex=True, gridspec_kw={"left": 0.1, "right": 0.97, "top": 0.95,
                                                        "bottom": 0.08, "hspace": 0.12})
    for a, arm in enumerate(b.arms):
        style = "-" if a == 0 else "--"
        for model, label in ((MODEL, "interactive"), (BATCH_MODEL, "batch")):
            points = arm.progress.series(model)
            if model == BATCH_MODEL and arm.name != WITH:
                continue
            t, rate = _rates(points)
            if t:
                axes[0].plot(t, rate, style, label=f"{arm.name} · {label}", drawstyle="steps-post")
        if arm.name == WITH:
            lines = arm.progress.lines("completed")
            axes[1].plot([x for x, _ in lines], [y for _, y in lines], label="batch lines completed")
            failed = arm.progress.lines("failed")
            if any(y for _, y in failed):
                axes[1].plot([x for x, _ in failed], [y for _, y in failed], label="batch lines failed")
    if b.capacity is not None:
        axes[0].axhline(b.capacity.output_tps, color="0.4", linewidth=1, label="capacity")
    for ax in axes:
        ax.axvspan(0, b.duration_s, color="0.93", zorder=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="upper left")
    axes[0].set_ylabel("output tokens/s (gateway)")
    axes[1].set_ylabel("batch lines")
    axes[1].set_xlabel("time since the interactive schedule's start (s; the window shaded)")
    axes[0].set_title("Interactive and batch throughput, and the batch's progress")
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    return path


def _rates(points: Sequence[tuple[float, float]], bin_s: float = 1.0) -> tuple[list[float], list[float]]:
    """Per-second rates of a cumulative count, in bins of ``bin_s`` from time 0."""
    if len(points) < 2:
        return [], []
    end = points[-1][0]
    t, rates = [], []
    start = 0.0 if points[0][0] <= 0 else math.ceil(points[0][0] / bin_s) * bin_s
    while start + bin_s <= end:
        a, c = interpolate(points, start), interpolate(points, start + bin_s)
        if a is not None and c is not None:
            t.append(start)
            rates.append((c - a) / bin_s)
        start += bin_s
    return t, rates


def run(ctx: ScenarioContext) -> Outcome:
    """Run the batch scenario and write its report into ``ctx.out_dir``."""
    b = BatchRun(ctx)
    started = time.monotonic()
    b.run()
    assert b.workload is not None
    assert b.capacity is not None
    rows = arm_rows(b)
    share = share_row(b, rows)
    tables = [_share_table(share, b), _arm_table(rows, b), _ratio_table(rows), _capacity_table(b), _job_table(b)]
    by = {r["arm"]: r for r in rows}
    p99 = _div(by[WITH]["ttft_p99_s"], by[BASELINE]["ttft_p99_s"])
    value = share["share"]
    failed = by[WITH]["failed"]

    def whole_ms(seconds: float | None) -> str:
        return fixed(seconds, scale=1000, decimals=0, unit=" ms")

    goals = [
        goal("the batch lane's share of the idle capacity (batch tok/s ÷ (capacity - interactive tok/s))",
             f"≥ {GOAL_SHARE * 100:g}%", value, None if value is None else value >= GOAL_SHARE, unit="%",
             multiplier=100, decimals=1,
             note=_tps_note(share)),
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
               + (f"{p99:.2f}x" if p99 is not None else "-") + f" without the batch (goal ≤ {GOAL_P99_RATIO:.2f}x); "
               f"{b.job.completed if b.job.completed is not None else '-'} batch lines completed")
    return Outcome("batch", "ok", summary, goals, tables[:3], "batch/report.md", notes=notes[:1])


def _tps_note(share: Mapping[str, Any]) -> str:
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"
    return (f"batch {fmt(share['batch_tps'])} tok/s of {fmt(share['idle_tps'])} idle (capacity "
            f"{fmt(share['capacity_tps'])}, interactive {fmt(share['interactive_tps'])})")
