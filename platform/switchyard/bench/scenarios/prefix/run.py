"""``prefix``: prefix-aware routing against least-loaded and round-robin, on a trace replay.

A replay of the Mooncake conversation trace (whose ``hash_ids`` say which prompts share which
prefix blocks) against eight simulated replicas of one pool, once per picker
(``SWITCHYARD_PICKER`` = ``prefix-aware``, ``least-loaded``, ``round-robin``), back to back. Each
arm gets fresh engine processes, so every cache starts empty, and the same requests at the same
times.

Figures per arm: the engines' own prefix-cache hit ratio (``vllm:prefix_cache_hits_total`` over
``vllm:prefix_cache_queries_total``, summed over the replicas), and that ratio as a fraction of the
*unbounded-cache bound*: the hit ratio one cache that never evicts would reach on the replayed
requests, computed from their ``hash_ids`` (a block hits when every block before it hit and an
earlier request had the same block). TTFT p50/p90, throughput, and how busy the engines were.

Scale: lengths are multiplied by ``token_scale`` (0.125: 12k-token prompts become 1.5k, 512-token
blocks become 64), and so is each replica's KV cache, so a replica holds as many conversations as
the real one would; the trace is replayed ``rate_multiplier`` times faster. The engines run at
``time_scale`` (below 1: slower than real time), chosen so that the replayed load keeps the
replicas busy without the machine running out of CPU for the simulation itself. The engine time
figures are simulated ones divided by the time scale: compare arms, not absolute values.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from switchyard.bench.loadgen import run_open_loop
from switchyard.bench.policies import PRIORITY, TENANT, TIER, replicas_policy
from switchyard.bench.procs import StartError, free_ports, http_get
from switchyard.bench.prompts import SynthText
from switchyard.bench.report import build_report, write_report
from switchyard.bench.results import Result
from switchyard.bench.sampler import MetricsSampler, sum_series
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.sender import Target
from switchyard.bench.spec import Labels, Workload
from switchyard.bench.stack import create_key, start_gateway, start_sims, state_env
from switchyard.bench.stats import summarize
from switchyard.bench.tables import goal, ms, num, pct, ratio, table, text
from switchyard.bench.traces import mooncake
from switchyard.figures import percent

ARMS = ("prefix-aware", "least-loaded", "round-robin")
REPLICAS = 8
PROFILE = "h100-8b"
#: KV-cache tokens of one replica of the profile at full scale (the profile's own default).
FULL_KV_TOKENS = 430_000
FULL_CONTEXT = 131_072
TOKEN_SCALE = 0.125
RATE_MULTIPLIER = 10.0
TIME_SCALE = 0.3
DURATION_S = 50.0
QUICK_DURATION_S = 4.0
MODEL = "chat"
SERVED = "sim-8b"
#: Where the default trace lives, relative to the repository (``../shared/data/traces``).
DEFAULT_TRACE = Path("..") / "shared" / "data" / "traces" / "mooncake_conversation.jsonl"
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
SERIES = ("vllm:num_requests_waiting", "vllm:num_requests_running")


def default_trace() -> Path:
    """The Mooncake conversation trace: beside the repository (``../shared``), from the working
    directory or from this source tree."""
    here = Path(__file__).resolve()
    candidates = [Path.cwd() / DEFAULT_TRACE, *[p / DEFAULT_TRACE for p in here.parents]]
    return next((c for c in candidates if c.exists()), Path.cwd() / DEFAULT_TRACE)


def unbounded_bound(workload: Workload) -> tuple[int, int]:
    """Prompt tokens one never-evicting cache would hit on ``workload``, and all prompt tokens.

    Requests are taken in arrival order. A request's leading segments (trace blocks) hit while
    each was in an earlier request at least as long (a shorter earlier copy hits its length and
    ends the run); the first block that was never seen ends it too.
    """
    seen: dict[int, int] = {}
    hits = total = 0
    for spec in workload.specs:
        prompt = spec.prompt
        if not isinstance(prompt, SynthText):
            total += prompt.tokens
            continue
        leading = True
        for key, tokens in prompt.segments:
            total += tokens
            if leading:
                known = seen.get(key, 0)
                hits += min(known, tokens)
                leading = known >= tokens
            seen[key] = max(seen.get(key, 0), tokens)
    return hits, total


@dataclass
class ArmRun:
    """What one arm measured."""

    name: str
    results: list[Result] = field(default_factory=list)
    hits: float = 0.0
    queries: float = 0.0
    busy: float | None = None
    lag_s: float | None = None
    evictions: int = 0
    preemptions: int = 0
    per_endpoint: Counter[str] = field(default_factory=Counter)
    series: dict[str, list[float]] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float | None:
        return self.hits / self.queries if self.queries else None


def _engine_state(ports: Sequence[int]) -> list[dict[str, Any]]:
    states = []
    for port in ports:
        try:
            states.append(msgspec.json.decode(http_get(f"http://127.0.0.1:{port}/sim/state")))
        except (OSError, msgspec.DecodeError):
            states.append({})
    return states


def _counters(ports: Sequence[int]) -> tuple[float, float]:
    hits = queries = 0.0
    for port in ports:
        text_ = http_get(f"http://127.0.0.1:{port}/metrics").decode()
        hits += sum_series(text_, HITS)
        queries += sum_series(text_, QUERIES)
    return hits, queries


class Prefix:
    """The prefix scenario's run."""

    def __init__(self, ctx: ScenarioContext) -> None:
        self.ctx = ctx
        opts = ctx.options
        self.trace = opts.trace or default_trace()
        self.rate_multiplier = opts.rate_multiplier or RATE_MULTIPLIER
        self.time_scale = opts.time_scale or TIME_SCALE
        self.duration_s = opts.duration_s or (QUICK_DURATION_S if opts.quick else DURATION_S)
        self.kv_tokens = max(4096, int(FULL_KV_TOKENS * TOKEN_SCALE) // 16 * 16)
        self.context = min(self.kv_tokens, int(FULL_CONTEXT * TOKEN_SCALE))
        self.arms: list[ArmRun] = []
        self.workload: Workload | None = None
        self.key: str | None = None

    def build_workload(self) -> Workload:
        if not self.trace.exists():
            raise StartError(f"the trace {self.trace} does not exist (give --trace)")
        labels = Labels(tenant=TENANT, request_class=PRIORITY, model=MODEL, stream=True)
        return mooncake(self.trace, rate_multiplier=self.rate_multiplier, duration_s=self.duration_s,
                        seed=self.ctx.options.seed, token_scale=TOKEN_SCALE, max_model_len=self.context,
                        labels=labels)

    def run_arm(self, name: str, workload: Workload) -> ArmRun:
        ctx = self.ctx
        procs = ctx.procs
        ports = free_ports(REPLICAS)
        policy = ctx.state_dir / f"policies-{name}.yaml"
        policy.write_text(replicas_policy(ports, model=MODEL, served_model=SERVED, profile=PROFILE,
                                          kv_cache_tokens=self.kv_tokens, context_window=self.context))
        ctx.say(f"prefix: {name}: starting {REPLICAS} simulated replicas and the gateway")
        sims = start_sims(procs, f"prefix-sims-{name}", policy, ports, time_scale=self.time_scale,
                          seed=ctx.options.seed)
        env = {**state_env(ctx.state_dir / "switchyard", policy), "SWITCHYARD_PICKER": name,
               "SWITCHYARD_UPSTREAM_READ_TIMEOUT_S": "300"}
        if self.key is None:  # one database for every arm: the key outlives the gateways
            self.key = create_key(env, TENANT, TIER)
        key = self.key
        gateway = start_gateway(procs, f"prefix-gateway-{name}", env)
        arm = ArmRun(name)
        before = _engine_state(ports)
        sampler = MetricsSampler([f"http://127.0.0.1:{p}/metrics" for p in ports], SERIES)
        wall = time.monotonic()

        async def drive() -> list[Result]:
            try:
                return await run_open_loop(workload, Target(gateway.base_url, name, default_api_key=key),
                                           progress=ctx.options.progress, timeout_s=300.0, on_start=sampler.start)
            finally:
                await sampler.stop()

        ctx.say(f"prefix: {name}: replaying {len(workload)} requests over {workload.duration_s:.0f} s")
        arm.results = asyncio.run(drive())
        elapsed = time.monotonic() - wall
        arm.hits, arm.queries = _counters(ports)
        after = _engine_state(ports)
        busy = [a.get("busy_s", 0.0) - b.get("busy_s", 0.0) for a, b in zip(after, before, strict=True)]
        arm.busy = sum(busy) / (len(ports) * elapsed * self.time_scale) if elapsed > 0 else None
        arm.lag_s = max((a.get("lag_s") or 0.0 for a in after), default=None)
        arm.evictions = sum(int(a.get("kv_evictions", 0)) for a in after)
        arm.preemptions = sum(int(a.get("preemptions", 0)) for a in after)
        arm.per_endpoint = Counter(r.route_fields.get("endpoint", "-") for r in arm.results if r.ok)
        arm.series = {"engine queue (waiting)": sampler.series[SERIES[0]],
                      "engine running": sampler.series[SERIES[1]]}
        procs.stop(gateway.proc)
        procs.stop(sims)
        return arm

    def run(self) -> None:
        workload = self.build_workload()
        self.workload = workload
        for name in ARMS:
            self.arms.append(self.run_arm(name, workload))

    def rows(self, bound: float | None) -> list[dict[str, Any]]:
        rows = []
        window = self.workload.duration_s if self.workload else None
        for arm in self.arms:
            s = summarize(arm.results, window_s=window)
            spread = arm.per_endpoint.values()
            rows.append({
                "arm": arm.name, "hit_ratio": arm.hit_ratio,
                "of_bound": arm.hit_ratio / bound if arm.hit_ratio is not None and bound else None,
                "cached_fraction": s.cached_fraction, "ttft_p50_s": s.ttft_p50_s, "ttft_p90_s": s.ttft_p90_s,
                "ttft_p99_s": s.ttft_p99_s, "throughput_rps": s.throughput_rps, "output_tps": s.output_tps,
                "ok_rate": s.ok_rate, "busy": arm.busy, "evictions": arm.evictions,
                "balance": (max(spread) / min(spread)) if spread and min(spread) else None,
                "lateness_p99_s": s.lateness_p99_s,
            })
        return rows


def _table(rows: Sequence[dict[str, Any]], bound: float | None, p: Prefix) -> dict[str, Any]:
    return table(
        "Prefix-cache reuse and latency by picker",
        [text("arm", "picker"), pct("hit_ratio", "engine hit ratio %"), pct("of_bound", "of the bound %"),
         pct("cached_fraction", "cached tokens (usage) %"), ms("ttft_p50_s", "TTFT p50 ms", 0),
         ms("ttft_p90_s", "TTFT p90 ms", 0), ms("ttft_p99_s", "TTFT p99 ms", 0),
         num("throughput_rps", "ok req/s", 2), num("output_tps", "output tok/s", 0), pct("ok_rate", "ok %"),
         pct("busy", "engines busy %", 0), num("evictions", "KV evictions", 0),
         num("balance", "busiest/idlest replica", 2), ms("lateness_p99_s", "send lateness p99 ms", 1)],
        rows,
        f"Unbounded-cache bound on these requests: {100 * bound:.1f}% of prompt tokens (trace blocks; the engines "
        "count 16-token KV blocks and the chat template's tokens, so even one unbounded engine would land slightly "
        f"below it). {REPLICAS} replicas of `{PROFILE}`, KV {p.kv_tokens} tokens each, time scale "
        f"{p.time_scale:g}: TTFT is wall-clock, {1 / p.time_scale:.2f}x the simulated hardware's."
        if bound is not None else "No bound: the workload is empty.")


def run(ctx: ScenarioContext) -> Outcome:
    """Run the prefix scenario and write its report into ``ctx.out_dir``."""
    p = Prefix(ctx)
    p.run()
    assert p.workload is not None
    hits, total = unbounded_bound(p.workload)
    bound = hits / total if total else None
    rows = p.rows(bound)
    tables = [_table(rows, bound, p)]
    by = {r["arm"]: r for r in rows}
    cand = by["prefix-aware"]
    goals = []
    for base in ARMS[1:]:
        value = (cand["hit_ratio"] / by[base]["hit_ratio"]) if cand["hit_ratio"] and by[base]["hit_ratio"] else None
        goals.append(goal(f"prefix-cache hit ratio, prefix-aware vs {base}", "> 1x (repeated work not repeated)",
                          value, None if value is None else value > 1.0, unit="x"))
    ratios = table("Prefix-aware against the baselines",
                   [text("baseline", "baseline"), ratio("hit", "hit ratio ÷"), ratio("ttft_p50", "TTFT p50 ÷"),
                    ratio("ttft_p90", "TTFT p90 ÷"), ratio("throughput", "throughput ÷")],
                   [{"baseline": b,
                     "hit": _div(cand["hit_ratio"], by[b]["hit_ratio"]),
                     "ttft_p50": _div(cand["ttft_p50_s"], by[b]["ttft_p50_s"]),
                     "ttft_p90": _div(cand["ttft_p90_s"], by[b]["ttft_p90_s"]),
                     "throughput": _div(cand["throughput_rps"], by[b]["throughput_rps"])} for b in ARMS[1:]])
    tables.append(ratios)
    notes = [f"Trace {p.trace}: {len(p.workload)} requests, {p.workload.duration_s:.0f} s after a rate multiplier of "
             f"{p.rate_multiplier:g}, token scale {TOKEN_SCALE:g}.",
             "Each arm ran on fresh engine processes (empty caches) with the same requests at the same times."]
    lagging = [a.name for a in p.arms if (a.lag_s or 0) > 0.5]
    if lagging:
        notes.append("The simulator fell behind real time (lag > 0.5 s) in " + ", ".join(lagging)
                     + ": the machine ran out of CPU; lower the rate multiplier or the time scale.")
    extra = {a.name: a.series for a in p.arms}
    parameters = {"scenario": "prefix", "trace": str(p.trace), "rate_multiplier": p.rate_multiplier,
                  "token_scale": TOKEN_SCALE, "time_scale": p.time_scale, "duration_s": p.duration_s,
                  "replicas": REPLICAS, "profile": PROFILE, "kv_cache_tokens": p.kv_tokens,
                  "context_window": p.context, "unbounded_bound": bound, "bound_hit_tokens": hits,
                  "bound_prompt_tokens": total}
    report = build_report({a.name: a.results for a in p.arms}, title="switchyard bench: prefix (routing)",
                          workload=p.workload, parameters=parameters, seeds={"engines": ctx.options.seed},
                          baseline="prefix-aware", tables=tables, goals=goals, notes=notes, extra_series=extra)
    write_report(report, ctx.out_dir)
    summary = ", ".join(f"{r['arm']} {percent(r['hit_ratio'])} hits ({percent(r['of_bound'])} of the bound)"
                        for r in rows)
    return Outcome("prefix", "ok", summary, goals, tables, "prefix/report.md", notes=notes[:1])


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
