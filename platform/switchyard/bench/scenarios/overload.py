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
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from switchyard.bench.loadgen import Target, run_open_loop
from switchyard.bench.procs import free_ports, http_get
from switchyard.bench.report import build_report, write_report
from switchyard.bench.results import Outcome as RequestOutcome
from switchyard.bench.results import Result
from switchyard.bench.sampler import MetricsSampler, by_label
from switchyard.bench.scenarios.arms import Arm, EngineShape, FreshArms, Stack, capacity_table
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.spec import Workload
from switchyard.bench.stats import Slo, slo_attainment, summarize
from switchyard.bench.synthetic import RequestTemplate
from switchyard.bench.tables import goal, ms, num, pct, ratio, table, text
from switchyard.figures import fixed, percent

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
#: Seconds per arm with ``--quick`` (``arms.DURATION_S`` without; the other timings are ``arms``'s).
QUICK_DURATION_S = 5.0
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


def gateway_view(metrics_text: str) -> dict[str, dict[str, Any]]:
    """What the gateway counted per class: sheds, downgrades, requests queued and their mean wait."""
    waited = by_label(metrics_text, "switchyard_queue_wait_seconds_sum", "class")
    queued = by_label(metrics_text, "switchyard_queue_wait_seconds_count", "class")
    return {"shed": {k: int(v) for k, v in by_label(metrics_text, "switchyard_shed_total", "class").items()},
            "downgrades": {k: int(v) for k, v in
                           by_label(metrics_text, "switchyard_downgrades_total", "class").items()},
            "queued": {k: int(v) for k, v in queued.items()},
            "queue_wait_mean_s": {k: waited.get(k, 0.0) / v for k, v in queued.items() if v}}


# --- the run ----------------------------------------------------------------------------------


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
    key_workers = KEY_WORKERS

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
    return capacity_table(
        o.arms, title="Capacity of the main pool (closed loop, before each arm's load)", tps_label="output tok/s",
        first_use=f"sets the offered rate ({OVERLOAD:g}x)",
        note=f"{MAIN_REPLICAS} replicas x --max-num-seqs {MAX_NUM_SEQS}: one client per sequence slot, calling the "
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
