"""``prefix``: precise KV-event routing against the approximate index, least-loaded and round-robin, an
oracle and the unbounded bound, on two workloads of very different prefix structure.

Workloads (:mod:`~switchyard.bench.scenarios.prefix.workloads`; ``--workload`` picks one, the full
scenario runs both, ``--quick`` the first): a replay of the Mooncake conversation trace (whose
``hash_ids`` say which prompts share which prefix blocks), and agent sessions whose context grows turn
by turn over a system prompt many tenants share. Each goes to eight simulated replicas of one pool,
once per arm (:mod:`~switchyard.bench.scenarios.prefix.arms`: ``precise``, ``approximate``,
``least-loaded``, ``round-robin``), each arm on fresh engine processes (every cache starts empty) with
the same requests at the same times.

Figures per arm: the engines' own prefix-cache hit ratio (``vllm:prefix_cache_hits_total`` over
``vllm:prefix_cache_queries_total``, summed over the replicas), that ratio as a fraction of the
*oracle*'s (:mod:`~switchyard.bench.scenarios.prefix.oracle`: every engine's cache known exactly,
each request placed where its cached prefix is longest within the herding margin, run offline on the
simulator's own engine cores) and of the *unbounded-cache bound* (one cache that never evicts);
TTFT p50/p90/p99, throughput, balance; for the precise arm the events the gateway applied per second
and the share of a core it spent on them.

Scale: lengths are multiplied by ``token_scale`` (0.125: 12k-token prompts become 1.5k, 512-token
blocks become 64), and so is each replica's KV cache, so a replica holds as many conversations as
the real one would; the trace is replayed ``rate_multiplier`` times faster. The engines run at
``time_scale`` (below 1: slower than real time), chosen so that the replayed load keeps the
replicas near capacity without the machine running out of CPU for the simulation itself. The engine
time figures are simulated ones divided by the time scale: compare arms, not absolute values.
"""

from __future__ import annotations

from switchyard.bench.policies import PRIORITY, TENANT
from switchyard.bench.procs import StartError
from switchyard.bench.report import build_report, write_report
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.scenarios.prefix import report as figures
from switchyard.bench.scenarios.prefix.arms import ARMS, PROFILE, REPLICAS, replica_config, run_arm
from switchyard.bench.scenarios.prefix.oracle import offline, unbounded_bound
from switchyard.bench.scenarios.prefix.workloads import WORKLOADS, AgentShape, agent_sessions, default_trace
from switchyard.bench.spec import Labels, Workload, WorkloadError
from switchyard.bench.traces import mooncake
from switchyard.figures import percent

MODEL = "chat"
#: KV-cache tokens of one replica of the profile at full scale (the profile's own default).
FULL_KV_TOKENS = 430_000
FULL_CONTEXT = 131_072
TOKEN_SCALE = 0.125
#: The Mooncake replay's speed-up, and the agents' sessions started per second: each near the capacity of
#: the eight replicas (the offline runs in the report say how the baselines' placements fare at it).
RATE_MULTIPLIER = 12.0
AGENT_SESSIONS_PER_S = 7.0
TIME_SCALE = 0.3
DURATION_S = 50.0
QUICK_DURATION_S = 3.0
HERD_MARGIN = 4.0


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
        chosen = opts.workload
        self.workloads: tuple[str, ...] = (chosen,) if chosen else WORKLOADS[:1] if opts.quick else WORKLOADS
        self.runs: list[figures.WorkloadRun] = []
        self.key: dict[str, str] = {}

    def labels(self) -> Labels:
        return Labels(tenant=TENANT, request_class=PRIORITY, model=MODEL, stream=True,
                      extra_body={"ignore_eos": True})

    def build_workload(self, name: str) -> Workload:
        if name == "agents":
            return agent_sessions(AgentShape(sessions_per_s=AGENT_SESSIONS_PER_S), self.duration_s,
                                  self.ctx.options.seed, labels=self.labels(), max_model_len=self.context)
        if name != "mooncake":
            raise WorkloadError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
        if not self.trace.exists():
            raise StartError(f"the trace {self.trace} does not exist (give --trace)")
        labels = Labels(tenant=TENANT, request_class=PRIORITY, model=MODEL, stream=True)
        return mooncake(self.trace, rate_multiplier=self.rate_multiplier, duration_s=self.duration_s,
                        seed=self.ctx.options.seed, token_scale=TOKEN_SCALE, max_model_len=self.context,
                        labels=labels)

    def run(self) -> None:
        for name in self.workloads:
            workload = self.build_workload(name)
            run = figures.WorkloadRun(name, workload)
            run.bound_hits, run.bound_total = unbounded_bound(workload)
            for arm in ARMS:
                run.arms.append(run_arm(self.ctx, arm, workload, label=name, kv_tokens=self.kv_tokens,
                                        context=self.context, time_scale=self.time_scale, key_box=self.key))
            self.ctx.say(f"prefix: {name}: the oracle, offline")
            config = replica_config(self.kv_tokens, self.context, self.ctx.options.seed)
            run.oracle = offline(config, REPLICAS, workload, time_scale=self.time_scale, herd_margin=HERD_MARGIN)
            for placement in () if self.ctx.options.quick else ("least-loaded", "round-robin"):
                run.offline[placement] = offline(config, REPLICAS, workload, time_scale=self.time_scale,
                                                 placement=placement)
            self.runs.append(run)


def run(ctx: ScenarioContext) -> Outcome:
    """Run the prefix scenario and write its report into ``ctx.out_dir``."""
    p = Prefix(ctx)
    p.run()
    tables = [figures.arms_table(r, REPLICAS, p.kv_tokens, p.time_scale) for r in p.runs]
    tables += [figures.ratios_table(p.runs), figures.events_table(p.runs)]
    goals = figures.goals(p.runs)
    notes = []
    for r in p.runs:
        w = r.workload
        where = (f"trace {p.trace}, rate multiplier {p.rate_multiplier:g}, token scale {TOKEN_SCALE:g}"
                 if r.name == "mooncake" else
                 f"{w.source.get('sessions')} sessions of {w.source.get('tenants')} tenants, "
                 f"{AGENT_SESSIONS_PER_S:g} started per second")
        notes.append(f"{r.name}: {len(w)} requests over {w.duration_s:.0f} s ({where}).")
    notes.append("Each arm ran on fresh engine processes (empty caches) with the same requests at the same times.")
    lagging = [f"{r.name}/{a.name}" for r in p.runs for a in r.arms if (a.lag_s or 0) > 0.5]
    if lagging:
        notes.append("The simulator fell behind real time (lag > 0.5 s) in " + ", ".join(lagging)
                     + ": the machine ran out of CPU; lower the rate or the time scale.")
    arms = {f"{r.name}/{a.name}": a.results for r in p.runs for a in r.arms}
    extra = {f"{r.name}/{a.name}": a.series for r in p.runs for a in r.arms}
    parameters = {"scenario": "prefix", "workloads": list(p.workloads), "trace": str(p.trace),
                  "rate_multiplier": p.rate_multiplier, "agent_sessions_per_s": AGENT_SESSIONS_PER_S,
                  "token_scale": TOKEN_SCALE, "time_scale": p.time_scale, "duration_s": p.duration_s,
                  "replicas": REPLICAS, "profile": PROFILE, "kv_cache_tokens": p.kv_tokens,
                  "context_window": p.context, "herd_margin": HERD_MARGIN,
                  "bounds": {r.name: {"unbounded_bound": r.bound, "bound_hit_tokens": r.bound_hits,
                                      "bound_prompt_tokens": r.bound_total,
                                      "oracle": r.oracle.hit_ratio if r.oracle else None} for r in p.runs},
                  "workload_sources": {r.name: r.workload.describe() for r in p.runs}}
    first = p.runs[0]
    report = build_report(arms, title="switchyard bench: prefix (routing)", workload=first.workload,
                          parameters=parameters, seeds={"engines": ctx.options.seed},
                          baseline=f"{first.name}/precise", tables=tables, goals=goals, notes=notes,
                          extra_series=extra)
    write_report(report, ctx.out_dir)
    summary = "; ".join(f"{r.name}: " + ", ".join(
        f"{row['arm']} {percent(row['hit_ratio'])} ({percent(row['of_oracle'])} of the oracle)"
        for row in figures.rows(r) if row["arm"] in ARMS) for r in p.runs)
    return Outcome("prefix", "ok", summary, goals, tables, "prefix/report.md", notes=notes[:len(p.runs)])
