"""``overload``: flow control against plain FCFS, at twice what the engines can serve.

A main pool of ``MAIN_REPLICAS`` simulated replicas (``--max-num-seqs`` ``MAX_NUM_SEQS``, declared
as the pool's ``max_num_seqs``, priority scheduling on) serves model ``chat``; a small pool of one
replica serves ``chat-lite``, which ``chat`` downgrades its ``standard`` requests to when its own
pool is saturated (``on_saturation``). Three priority classes, best first: ``critical``,
``standard`` and ``sheddable`` (shed above a utilisation of ``SHED_ABOVE``), one tier each; in
every class a *noisy* tenant sends three requests out of four and a *quiet* one the fourth.

1. **Arms.** ``flow-control-on`` (the gateway's queues, deadlines, shedding, downgrades and engine
   priorities) and ``flow-control-off`` (``SWITCHYARD_FLOW_CONTROL=false`` and pools without
   ``priority_scheduling``: every request goes straight to the engines, which serve it first come,
   first served), one after the other, each on fresh engines and a fresh gateway (one database:
   the keys outlive the gateways). Each replica is its own ``switchyard sim --model`` process,
   started with the pool's ``--max-num-seqs``.
2. **Capacity.** Before each arm's load, its main pool's engines are called directly by a closed
   loop of ``MAX_NUM_SEQS`` clients per replica (every sequence slot busy, none waiting) sending
   requests of the workload's lengths back to back; completions per second after a warm-up are
   the pool's capacity. The first arm's sets the offered rate; the second's is a check, and gives
   both arms' engines the same warm-up.
3. **Load.** One seeded open-loop Poisson schedule of streaming requests at ``OVERLOAD`` times that
   capacity for the arm's duration, classes 20/40/40, the same for both arms. A request still
   unanswered after the client timeout is given up and counted as an error: nothing hangs.

Figures per arm and class: TTFT SLO attainment (``SLO_TTFT_S``; a failed request misses it),
goodput (requests and output tokens per second of the offered window that met it), shed,
downgraded and error rates, TTFT p50/p99, the noisy and the quiet tenant's attainment; the sheds
by reason (the error ``code``); the gateway's own counters and queue waits from its ``/metrics``.
A downgraded answer (``downgraded_from`` in ``x-switchyard-route``) counts as served: it met the
SLO if its first token came in time. Goals: critical attainment at least 99% with flow control
on; more goodput with flow control on than off; no error or hung request with flow control on
(a 503 with ``Retry-After`` is a clear, fast refusal, not an error).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from switchyard.bench.loadgen import Target, run_open_loop, send_one
from switchyard.bench.procs import (
    GatewayHandle,
    Proc,
    Processes,
    free_ports,
    http_get,
    run_cli,
    start_gateway,
    state_env,
    switchyard_command,
    wait_http,
)
from switchyard.bench.report import build_report, write_report
from switchyard.bench.results import Outcome as RequestOutcome
from switchyard.bench.results import Result
from switchyard.bench.sampler import MetricsSampler
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.spec import RequestSpec, Workload
from switchyard.bench.stats import Slo, slo_attainment, summarize
from switchyard.bench.synthetic import RequestTemplate, poisson
from switchyard.bench.tables import goal, ms, num, pct, ratio, table, text

ARMS = ("flow-control-on", "flow-control-off")
BASELINE = "flow-control-off"
CLASSES = ("critical", "standard", "sheddable")
#: Each class's share of the requests.
CLASS_SHARE = {"critical": 0.2, "standard": 0.4, "sheddable": 0.4}
#: Within each class: the tenants and their shares of the class's requests.
TENANTS = (("noisy", 0.75), ("quiet", 0.25))
#: The TTFT each class is promised (from the scheduled time).
SLO_TTFT_S = {"critical": 1.0, "standard": 2.0, "sheddable": 4.0}
#: The policy's queue deadlines.
MAX_QUEUE_MS = {"critical": 5000, "standard": 1500, "sheddable": 500}
SHED_ABOVE = 0.8
DOWNGRADED_CLASSES = ("standard",)
OVERLOAD = 2.0
MAIN_REPLICAS = 2
SMALL_REPLICAS = 1
MAX_NUM_SEQS = 4
PROFILE = "h100-8b"
MODEL = "chat"
SMALL_MODEL = "chat-lite"
SERVED = "sim-8b"
SMALL_SERVED = "sim-8b-lite"
KV_TOKENS = 100_000
CONTEXT = 8192
PROMPT_TOKENS = (100, 400)
OUTPUT_TOKENS = (16, 48)
TIME_SCALE = 1.0
DURATION_S = 30.0
QUICK_DURATION_S = 5.0
CAPACITY_WARMUP_S = 1.0
CAPACITY_S = 4.0
QUICK_CAPACITY_WARMUP_S = 0.5
QUICK_CAPACITY_S = 2.0
#: A request unanswered after this long is given up (an error): a user has left by then.
CLIENT_TIMEOUT_S = 15.0
QUICK_CLIENT_TIMEOUT_S = 10.0
GOAL_CRITICAL = 0.99
#: Key creations run at once (each is a ``switchyard keys create`` process).
KEY_WORKERS = 3
SHED_CODES = ("shed_utilisation", "queue_deadline_exceeded", "queue_wait_too_long")
ENGINE_SERIES = ("vllm:num_requests_waiting", "vllm:num_requests_running")
QUEUE_DEPTH = "switchyard_queue_depth"


def tenant_name(cls: str, kind: str) -> str:
    """The tenant label (and database tenant) of ``kind`` (noisy, quiet) in class ``cls``."""
    return f"{cls}-{kind}"


def slo_spec() -> dict[str, Slo]:
    """The SLO of each class."""
    return {cls: Slo(ttft_s=SLO_TTFT_S[cls]) for cls in CLASSES}


def mix(model: str = MODEL) -> list[RequestTemplate]:
    """The request mix: every class and tenant, streaming, the same lengths."""
    return [RequestTemplate(tenant=tenant_name(cls, kind), request_class=cls, model=model,
                            weight=CLASS_SHARE[cls] * share, prompt_tokens=PROMPT_TOKENS, output_tokens=OUTPUT_TOKENS,
                            stream=True, name=tenant_name(cls, kind))
            for cls in CLASSES for kind, share in TENANTS]


def overload_policy(main_ports: Sequence[int], small_ports: Sequence[int],
                    priority_scheduling: bool = True) -> str:
    """The policy document: two pools, ``chat`` downgrading to ``chat-lite``, three classes and tiers.

    Without ``priority_scheduling`` the engines get no ``priority`` and serve first come, first served.
    """
    scheduling = "true" if priority_scheduling else "false"
    def urls(ports: Sequence[int]) -> str:
        return "[" + ", ".join(f"http://127.0.0.1:{p}" for p in ports) + "]"

    classes = "\n".join(
        f"  {cls}: {{max_queue_ms: {MAX_QUEUE_MS[cls]}"
        + (f", shed_above_utilisation: {SHED_ABOVE:g}" if cls == "sheddable" else "") + "}" for cls in CLASSES)
    tiers = "\n".join(f"  - {{name: {cls}, priority: {cls}, models: [\"*\"]}}" for cls in CLASSES)
    downgraded = ", ".join(DOWNGRADED_CLASSES)
    return f"""\
schema: 1
regions: [local]
pools:
  - {{name: main, region: local, served_model: {SERVED}, endpoints: {urls(main_ports)},
      kv_cache_tokens: {KV_TOKENS}, sim_profile: {PROFILE}, max_num_seqs: {MAX_NUM_SEQS},
      priority_scheduling: {scheduling}}}
  - {{name: small, region: local, served_model: {SMALL_SERVED}, endpoints: {urls(small_ports)},
      kv_cache_tokens: {KV_TOKENS}, sim_profile: {PROFILE}, max_num_seqs: {MAX_NUM_SEQS},
      priority_scheduling: {scheduling}}}
models:
  - {{name: {MODEL}, pools: [main], context_window: {CONTEXT}, price: {{input_per_mtok: 3, output_per_mtok: 15}},
      on_saturation: {{downgrade_to: {SMALL_MODEL}, classes: [{downgraded}]}}}}
  - {{name: {SMALL_MODEL}, pools: [small], context_window: {CONTEXT},
      price: {{input_per_mtok: 0.2, output_per_mtok: 0.8}}}}
priorities:
{classes}
tiers:
{tiers}
"""


# --- reading results --------------------------------------------------------------------------


def downgraded(result: Result) -> bool:
    """Served by the downgrade model (the route header names the model it was downgraded from)."""
    return "downgraded_from" in result.route_fields


def shed_reason(result: Result) -> str | None:
    """Why a shed request (503) was refused: its error code (``503`` when it has none); None if not shed."""
    if result.outcome is not RequestOutcome.SHED:
        return None
    return result.error_code or "503"


def _rate(count: int, total: int) -> float | None:
    return count / total if total else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def class_rows(arms: Mapping[str, Sequence[Result]], slo: Mapping[str, Slo],
               window_s: float | None) -> list[dict[str, Any]]:
    """One row per class (and ``all``) and arm: attainment, goodput, shed/downgrade/error rates, TTFT."""
    rows = []
    for cls in (*CLASSES, "all"):
        for arm, results in arms.items():
            rs = [r for r in results if cls == "all" or r.request_class == cls]
            s = summarize(rs, slo=slo, window_s=window_s)
            n = len(rs)
            row: dict[str, Any] = {
                "class": cls, "arm": arm, "slo_ttft_s": slo[cls].ttft_s if cls in slo else None, "requests": n,
                "attainment": s.slo_attainment, "goodput_rps": s.goodput_rps, "goodput_tps": s.goodput_tps,
                "shed_rate": s.shed_rate, "downgrade_rate": _rate(sum(downgraded(r) for r in rs), n),
                "error_rate": _rate(s.errors + s.timeouts + s.limited, n), "timeout_rate": s.timeout_rate,
                "ttft_p50_s": s.ttft_p50_s, "ttft_p99_s": s.ttft_p99_s,
            }
            for kind, _ in TENANTS:
                mine = [r for r in rs if r.tenant.endswith(f"-{kind}")]
                row[f"{kind}_attainment"] = slo_attainment(mine, slo)
            rows.append(row)
    return rows


def ratio_rows(rows: Sequence[Mapping[str, Any]], arm: str = ARMS[0], baseline: str = BASELINE) -> list[dict[str, Any]]:
    """Per class: ``arm`` ÷ ``baseline`` of attainment, goodput and TTFT."""
    by = {(r["class"], r["arm"]): r for r in rows}
    out = []
    for cls in dict.fromkeys(r["class"] for r in rows):
        a, b = by.get((cls, arm)), by.get((cls, baseline))
        if a is None or b is None:
            continue
        out.append({"class": cls, **{key: _div(a[key], b[key]) for key in
                                     ("attainment", "goodput_rps", "goodput_tps", "ttft_p50_s", "ttft_p99_s")}})
    return out


def shed_rows(arms: Mapping[str, Sequence[Result]], gateway: Mapping[str, Mapping[str, Any]] | None = None
              ) -> list[dict[str, Any]]:
    """Per class and arm: sheds by reason, downgrades, and the gateway's own view (when scraped)."""
    rows = []
    for cls in CLASSES:
        for arm, results in arms.items():
            rs = [r for r in results if r.request_class == cls]
            reasons = Counter(shed_reason(r) for r in rs)
            seen = (gateway or {}).get(arm) or {}
            row: dict[str, Any] = {"class": cls, "arm": arm, "requests": len(rs),
                                   "shed": sum(n for reason, n in reasons.items() if reason is not None),
                                   "downgraded": sum(downgraded(r) for r in rs),
                                   "other_503": sum(n for reason, n in reasons.items()
                                                    if reason is not None and reason not in SHED_CODES),
                                   "gateway_shed": _counted(seen, "shed", cls),
                                   "gateway_downgrades": _counted(seen, "downgrades", cls),
                                   "queued": _counted(seen, "queued", cls),
                                   "queue_wait_mean_s": seen.get("queue_wait_mean_s", {}).get(cls)}
            for code in SHED_CODES:
                row[code] = reasons.get(code, 0)
            rows.append(row)
    return rows


def _counted(seen: Mapping[str, Any], key: str, cls: str) -> int | None:
    """A gateway counter of ``cls``: 0 when the gateway was read but never counted it, None when unread."""
    if not seen:
        return None
    value: int = seen.get(key, {}).get(cls, 0)
    return value


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(text_: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of series ``name`` (exactly) in a Prometheus text exposition, with its labels."""
    out = []
    for line in text_.splitlines():
        if not line.startswith(name):
            continue
        match = _SAMPLE.match(line)
        if match is None or match.group(1) != name:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        out.append((dict(_LABEL.findall(match.group(2) or "")), value))
    return out


def by_label(text_: str, name: str, label: str) -> dict[str, float]:
    """The samples of ``name`` summed per value of ``label``."""
    sums: dict[str, float] = {}
    for labels, value in samples(text_, name):
        key = labels.get(label)
        if key is not None:
            sums[key] = sums.get(key, 0.0) + value
    return sums


def gateway_view(metrics_text: str) -> dict[str, dict[str, Any]]:
    """What the gateway counted per class: sheds, downgrades, requests queued and their mean wait."""
    waited = by_label(metrics_text, "switchyard_queue_wait_seconds_sum", "class")
    queued = by_label(metrics_text, "switchyard_queue_wait_seconds_count", "class")
    return {"shed": {k: int(v) for k, v in by_label(metrics_text, "switchyard_shed_total", "class").items()},
            "downgrades": {k: int(v) for k, v in
                           by_label(metrics_text, "switchyard_downgrades_total", "class").items()},
            "queued": {k: int(v) for k, v in queued.items()},
            "queue_wait_mean_s": {k: waited.get(k, 0.0) / v for k, v in queued.items() if v}}


# --- capacity ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Capacity:
    """What the closed loop measured on the main pool.

    Attributes:
        clients: Clients sending back to back (every sequence slot of the pool).
        window_s: The measuring window (after the warm-up).
        completed: Successful requests that ended in the window.
        failed: Failed requests that ended in the window.
        rps: Successful completions per second of the window: the capacity.
        output_tps: Output tokens per second of those.
        e2e_mean_s: Their mean end-to-end time.
    """

    clients: int
    window_s: float
    completed: int
    failed: int
    rps: float
    output_tps: float
    e2e_mean_s: float | None


async def measure_capacity(ports: Sequence[int], specs: Sequence[RequestSpec], *, clients_per_engine: int,
                           warmup_s: float, duration_s: float, timeout_s: float) -> Capacity:
    """``clients_per_engine`` clients per engine, each sending the next of ``specs`` when its last ends.

    Requests that end inside ``[warmup_s, warmup_s + duration_s)`` are counted.
    """
    loop = asyncio.get_running_loop()
    now = loop.time
    order = itertools.count()
    window: list[Result] = []
    clients = clients_per_engine * len(ports)
    connector = aiohttp.TCPConnector(limit=clients, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        start = now()
        begin, end = warmup_s, warmup_s + duration_s

        async def client(port: int) -> None:
            target = Target(f"http://127.0.0.1:{port}", "capacity")
            while now() - start < end:
                spec = specs[next(order) % len(specs)]
                result = Result(spec.index, target.name, spec.tenant, spec.request_class, spec.model, spec.kind,
                                spec.stream, spec.prompt_tokens, spec.max_tokens, spec.prefix_group, now() - start)
                await send_one(session, spec.encode(), target.url(spec.kind), target.headers_for(spec.tenant),
                               result, now, start)
                if begin <= result.done_s < end:
                    window.append(result)

        await asyncio.gather(*(client(port) for port in ports for _ in range(clients_per_engine)))
    ok = [r for r in window if r.ok]
    return Capacity(clients, duration_s, len(ok), len(window) - len(ok), len(ok) / duration_s,
                    sum(r.output_tokens for r in ok) / duration_s,
                    sum(r.e2e_s for r in ok) / len(ok) if ok else None)


# --- the run ----------------------------------------------------------------------------------


@dataclass
class ArmRun:
    """What one arm measured."""

    name: str
    capacity: Capacity | None = None
    results: list[Result] = field(default_factory=list)
    gateway: dict[str, dict[str, Any]] = field(default_factory=dict)
    series: dict[str, list[float]] = field(default_factory=dict)
    wall_s: float = 0.0


@dataclass
class Stack:
    """One arm's processes: its engines (by port) and its gateway."""

    name: str
    main: list[int]
    engines: dict[int, Proc]
    gateway: GatewayHandle | None = None


def start_engine(procs: Processes, name: str, port: int, served: str, *, seed: int, time_scale: float) -> Proc:
    """Start one simulated replica (``switchyard sim --model``: ``--max-num-seqs`` is the pool's)."""
    return procs.start(name, [*switchyard_command(), "sim", "--model", served, "--port", str(port),
                              "--profile", PROFILE, "--max-num-seqs", str(MAX_NUM_SEQS),
                              "--kv-cache-tokens", str(KV_TOKENS), "--max-model-len", str(CONTEXT),
                              "--time-scale", f"{time_scale:g}", "--seed", str(seed)])


def wait_engines(engines: Mapping[int, Proc]) -> None:
    """Wait until every engine answers ``/health``."""
    for port, proc in engines.items():
        wait_http(f"http://127.0.0.1:{port}/health", proc, 60)


class Overload:
    """The overload scenario's run."""

    def __init__(self, ctx: ScenarioContext) -> None:
        self.ctx = ctx
        opts = ctx.options
        self.duration_s = opts.duration_s or (QUICK_DURATION_S if opts.quick else DURATION_S)
        self.time_scale = opts.time_scale or TIME_SCALE
        self.timeout_s = QUICK_CLIENT_TIMEOUT_S if opts.quick else CLIENT_TIMEOUT_S
        self.capacity_warmup_s = QUICK_CAPACITY_WARMUP_S if opts.quick else CAPACITY_WARMUP_S
        self.capacity_s = QUICK_CAPACITY_S if opts.quick else CAPACITY_S
        self.workload: Workload | None = None
        self.keys: dict[str, str] = {}
        self.arms: list[ArmRun] = []

    @property
    def capacity(self) -> Capacity | None:
        """The capacity the offered rate is set from (measured on the first arm's engines)."""
        return self.arms[0].capacity if self.arms else None

    def start_engines(self, name: str) -> Stack:
        """Start an arm's engines (fresh ones, on new ports) and write its policy; nothing waited for."""
        ctx = self.ctx
        ports = free_ports(MAIN_REPLICAS + SMALL_REPLICAS)
        main, small = ports[:MAIN_REPLICAS], ports[MAIN_REPLICAS:]
        (ctx.state_dir / f"policies-{name}.yaml").write_text(
            overload_policy(main, small, priority_scheduling=name == "flow-control-on"))
        ctx.say(f"overload: {name}: starting {MAIN_REPLICAS}+{SMALL_REPLICAS} simulated replicas and the gateway")
        engines = {p: start_engine(ctx.procs, f"overload-{name}-{'main' if p in main else 'small'}-{i}", p,
                                   SERVED if p in main else SMALL_SERVED, seed=ctx.options.seed,
                                   time_scale=self.time_scale)
                   for i, p in enumerate(ports)}
        return Stack(name, main, engines)

    def env(self, name: str) -> dict[str, str]:
        """The settings of an arm's Switchyard processes (one database for all: the keys outlive gateways)."""
        return {**state_env(self.ctx.state_dir / "switchyard", self.ctx.state_dir / f"policies-{name}.yaml"),
                "SWITCHYARD_FLOW_CONTROL": "true" if name == "flow-control-on" else "false"}

    def start_gateway(self, stack: Stack) -> None:
        stack.gateway = start_gateway(self.ctx.procs, f"overload-gateway-{stack.name}", self.env(stack.name))

    def create_keys(self, stack: Stack) -> None:
        """A key per tenant, a few ``keys create`` at a time, while the first arm's processes start."""
        env = self.env(stack.name)
        run_cli(["db", "upgrade"], env)
        tenants = [(tenant_name(cls, kind), cls) for cls in CLASSES for kind, _ in TENANTS]

        def create(tenant: str, tier: str) -> str:
            return run_cli(["keys", "create", "--tenant", tenant, "--tier", tier, "--name", "bench"], env).strip()

        with ThreadPoolExecutor(KEY_WORKERS) as pool:
            made = {tenant: pool.submit(create, tenant, tier) for tenant, tier in tenants}
            self.start_gateway(stack)
            self.keys = {tenant: future.result() for tenant, future in made.items()}

    def measure(self, stack: Stack) -> Capacity:
        """The main pool's capacity: its engines called directly by a closed loop over every sequence slot."""
        specs = poisson(100.0, 10.0, mix(SERVED), self.ctx.options.seed + 1, max_model_len=CONTEXT).specs
        self.ctx.say(f"overload: {stack.name}: measuring the main pool's capacity "
                     f"({MAX_NUM_SEQS * MAIN_REPLICAS} clients, {self.capacity_s:g} s)")
        capacity = asyncio.run(measure_capacity(stack.main, specs, clients_per_engine=MAX_NUM_SEQS,
                                                warmup_s=self.capacity_warmup_s, duration_s=self.capacity_s,
                                                timeout_s=self.timeout_s))
        if capacity.completed == 0:
            raise RuntimeError(f"{stack.name}: the capacity measurement completed no request")
        return capacity

    def load(self, stack: Stack, arm: ArmRun, workload: Workload) -> None:
        """Offer ``workload`` to the arm's gateway, sampling its queue and the main pool's engines."""
        ctx = self.ctx
        gateway = stack.gateway
        assert gateway is not None
        engine_sampler = MetricsSampler([f"http://127.0.0.1:{p}/metrics" for p in stack.main], ENGINE_SERIES)
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

    def stop(self, stack: Stack) -> None:
        if stack.gateway is not None:
            self.ctx.procs.stop(stack.gateway.proc)
        for proc in stack.engines.values():
            self.ctx.procs.stop(proc)

    def run(self) -> None:
        for name in ARMS:
            stack = self.start_engines(name)
            if not self.keys:
                self.create_keys(stack)  # and the gateway, meanwhile
            else:
                self.start_gateway(stack)
            wait_engines(stack.engines)
            arm = ArmRun(name)
            self.arms.append(arm)
            # Every arm's engines get the same closed loop first; the first arm's sets the offered rate.
            arm.capacity = self.measure(stack)
            if self.workload is None:
                self.workload = poisson(OVERLOAD * arm.capacity.rps, self.duration_s, mix(), self.ctx.options.seed,
                                        max_model_len=CONTEXT)
            self.load(stack, arm, self.workload)
            self.stop(stack)


def _class_table(rows: Sequence[Mapping[str, Any]], o: Overload) -> dict[str, Any]:
    assert o.capacity is not None
    assert o.workload is not None
    return table(
        f"Per class at {OVERLOAD:g}x capacity: flow control on vs off",
        [text("class", "class"), text("arm", "arm"), ms("slo_ttft_s", "TTFT SLO ms", 0),
         num("requests", "requests", 0), pct("attainment", "SLO attainment %"),
         num("goodput_rps", "goodput req/s", 2), num("goodput_tps", "goodput tok/s", 0),
         pct("shed_rate", "shed %"), pct("downgrade_rate", "downgraded %"), pct("error_rate", "errors %"),
         pct("timeout_rate", "of which timeouts %"), ms("ttft_p50_s", "TTFT p50 ms", 0),
         ms("ttft_p99_s", "TTFT p99 ms", 0), pct("noisy_attainment", "noisy tenant attainment %"),
         pct("quiet_attainment", "quiet tenant attainment %")],
        rows,
        f"Offered {o.workload.offered_rate_per_s:.1f} requests/s for {o.duration_s:g} s ({OVERLOAD:g}x the measured "
        f"capacity of {o.capacity.rps:.1f} requests/s), classes "
        + "/".join(f"{100 * CLASS_SHARE[c]:g}" for c in CLASSES) + " %, each class's tenants noisy 75% / quiet 25%. "
        "Attainment: the share of *all* requests of the class that succeeded with their first token within the SLO "
        "(shed and failed requests miss it); goodput: those per second of the offered window. Errors: failures "
        f"other than a 503 shed, client timeouts ({o.timeout_s:g} s) included.")


def _ratio_table(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return table(
        "Flow control on ÷ off",
        [text("class", "class"), ratio("attainment", "SLO attainment ÷"), ratio("goodput_rps", "goodput req/s ÷"),
         ratio("goodput_tps", "goodput tok/s ÷"), ratio("ttft_p50_s", "TTFT p50 ÷"),
         ratio("ttft_p99_s", "TTFT p99 ÷")],
        rows, "Ratios of the figures above; '-' where the off arm's figure is 0 or missing.")


def _shed_table(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return table(
        "Shed and downgraded requests by reason",
        [text("class", "class"), text("arm", "arm"), num("requests", "requests", 0), num("shed", "shed (503)", 0),
         num("shed_utilisation", "above the threshold", 0), num("queue_deadline_exceeded", "queue deadline passed", 0),
         num("queue_wait_too_long", "predicted wait too long", 0), num("other_503", "other 503", 0),
         num("downgraded", "downgraded", 0), num("gateway_shed", "gateway: shed", 0),
         num("gateway_downgrades", "gateway: downgrades", 0), num("queued", "gateway: waited in queue", 0),
         ms("queue_wait_mean_s", "gateway: mean queue wait ms", 0)],
        rows, "Client side: the 503s by their error code, and the answers whose route header names "
        "`downgraded_from`. Gateway side: its `/metrics` at the end of the arm (`switchyard_shed`, "
        "`switchyard_downgrades`, `switchyard_queue_wait_seconds`).")


def _capacity_table(o: Overload) -> dict[str, Any]:
    assert o.workload is not None
    rows = []
    for i, arm in enumerate(o.arms):
        c = arm.capacity
        if c is None:
            continue
        rows.append({"arm": arm.name, "clients": c.clients, "completed": c.completed, "failed": c.failed,
                     "rps": c.rps, "output_tps": c.output_tps, "e2e_mean_s": c.e2e_mean_s,
                     "use": f"sets the offered rate ({OVERLOAD:g}x)" if i == 0 else "a check (and the same warm-up)"})
    return table(
        "Capacity of the main pool (closed loop, before each arm's load)",
        [text("arm", "engines of"), num("clients", "clients", 0), num("completed", "completed", 0),
         num("failed", "failed", 0), num("rps", "capacity req/s", 2), num("output_tps", "output tok/s", 0),
         ms("e2e_mean_s", "mean request ms", 0), text("use", "use")],
        rows,
        f"{MAIN_REPLICAS} replicas x --max-num-seqs {MAX_NUM_SEQS}: one client per sequence slot, calling the "
        f"engines directly, for {o.capacity_s:g} s after a {o.capacity_warmup_s:g} s warm-up, with requests of the "
        f"workload's lengths. Offered: {o.workload.offered_rate_per_s:.2f} requests/s ({len(o.workload)} requests, "
        f"Poisson, seed {o.ctx.options.seed}).")


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
    tables = [_class_table(rows, o), _ratio_table(ratios),
              _shed_table(shed_rows(arms, {a.name: a.gateway for a in o.arms})), _capacity_table(o)]
    by = {(r["class"], r["arm"]): r for r in rows}
    on, off = ARMS[0], BASELINE
    critical = by[("critical", on)]["attainment"]
    good = _div(by[("all", on)]["goodput_rps"], by[("all", off)]["goodput_rps"])
    errors = sum(1 for r in arms[on] if r.outcome in (RequestOutcome.ERROR, RequestOutcome.TIMEOUT))
    goals = [
        goal(f"critical TTFT SLO attainment at {OVERLOAD:g}x capacity, flow control on",
             f"≥ {GOAL_CRITICAL * 100:g}%", critical, None if critical is None else critical >= GOAL_CRITICAL,
             unit="%", multiplier=100, decimals=1,
             note=f"off (FCFS): {_pct(by[('critical', off)]['attainment'])}"),
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
    summary = (f"critical SLO attainment {_pct(critical)} with flow control vs "
               f"{_pct(by[('critical', off)]['attainment'])} FCFS; goodput "
               + (f"{good:.2f}x" if good is not None else "-") + f"; sheddable shed {_pct(sheddable_shed)}")
    return Outcome("overload", "ok", summary, goals, tables[:2], "overload/report.md", notes=notes[:1])


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
