"""The prefix scenario's figures: per workload, every arm against the oracle and the unbounded bound, the
precise arm's events and their CPU, and the goals."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from switchyard.bench.scenarios.prefix.arms import ARMS, ArmRun
from switchyard.bench.scenarios.prefix.oracle import OfflineRun
from switchyard.bench.spec import Workload
from switchyard.bench.stats import summarize
from switchyard.bench.tables import goal, ms, num, pct, ratio, table, text

#: The goals (the issue's): precise against the oracle, TTFT p90 against the baselines, events CPU.
OF_ORACLE_GOAL = 0.9
LEAST_LOADED_GOAL = 2.0
ROUND_ROBIN_GOAL = 5.0
EVENTS_CPU_GOAL = 0.05


@dataclass
class WorkloadRun:
    """One workload's arms, its oracle and its bound."""

    name: str
    workload: Workload
    arms: list[ArmRun] = field(default_factory=list)
    oracle: OfflineRun | None = None
    #: Offline runs of the baselines' placements (how close to capacity the rate is).
    offline: dict[str, OfflineRun] = field(default_factory=dict)
    bound_hits: int = 0
    bound_total: int = 0

    @property
    def bound(self) -> float | None:
        return self.bound_hits / self.bound_total if self.bound_total else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _balance(counts: Sequence[int]) -> float | None:
    """Requests at the busiest replica over those at the idlest (None: one got none)."""
    return max(counts) / min(counts) if counts and min(counts) else None


def rows(run: WorkloadRun) -> list[dict[str, Any]]:
    """One row per arm, then the oracle's."""
    out = []
    oracle = run.oracle.hit_ratio if run.oracle else None
    bound = run.bound
    for arm in run.arms:
        s = summarize(arm.results, window_s=run.workload.duration_s)
        served = list(arm.per_endpoint.values())
        out.append({
            "workload": run.name, "arm": arm.name, "hit_ratio": arm.hit_ratio,
            "of_oracle": _div(arm.hit_ratio, oracle), "of_bound": _div(arm.hit_ratio, bound),
            "ttft_p50_s": s.ttft_p50_s, "ttft_p90_s": s.ttft_p90_s, "ttft_p99_s": s.ttft_p99_s,
            "throughput_rps": s.throughput_rps, "output_tps": s.output_tps, "ok_rate": s.ok_rate, "busy": arm.busy,
            "evictions": arm.evictions,
            "balance": _balance(served),
            "gateway_cpu": arm.gateway_cpu, "events_per_s": arm.events_per_s, "events_cpu": arm.events_cpu,
        })
    if run.oracle is not None:
        o = run.oracle
        t = np.array(o.ttft_s) if o.ttft_s else None
        out.append({"workload": run.name, "arm": "oracle (offline)", "hit_ratio": o.hit_ratio, "of_oracle": 1.0,
                    "of_bound": _div(o.hit_ratio, bound),
                    "ttft_p50_s": float(np.percentile(t, 50)) if t is not None else None,
                    "ttft_p90_s": float(np.percentile(t, 90)) if t is not None else None,
                    "ttft_p99_s": float(np.percentile(t, 99)) if t is not None else None,
                    "balance": _balance(o.per_engine)})
    return out


def arms_table(run: WorkloadRun, replicas: int, kv_tokens: int, time_scale: float) -> dict[str, Any]:
    """The workload's headline table."""
    bound = run.bound
    offline = "; ".join(f"{name} {100 * (r.hit_ratio or 0):.1f}% hits, TTFT p90 "
                        f"{1000 * float(np.percentile(r.ttft_s, 90)):.0f} ms" for name, r in run.offline.items()
                        if r.ttft_s)
    note = (f"Unbounded-cache bound on these requests: {100 * bound:.1f}% of prompt tokens (prompt segments; "
            "the engines count 16-token blocks and the chat template's tokens). The oracle knows every engine's "
            "cache and places each request where its cached prefix is longest within the herding margin (4 "
            "requests above the least loaded), offline on the simulator's own engine cores; its TTFT is "
            f"simulated (no gateway, no network). Offline, the baselines' placements give: {offline or '-'}. "
            f"{replicas} replicas, KV {kv_tokens} tokens each, time scale {time_scale:g}: TTFT is wall-clock, "
            f"{1 / time_scale:.2f}x the simulated hardware's." if bound is not None else "No bound: no requests.")
    return table(
        f"Prefix-cache reuse and latency by picker: {run.name}",
        [text("arm", "picker"), pct("hit_ratio", "engine hit ratio %"), pct("of_oracle", "of the oracle %"),
         pct("of_bound", "of the unbounded bound %"), ms("ttft_p50_s", "TTFT p50 ms", 0),
         ms("ttft_p90_s", "TTFT p90 ms", 0), ms("ttft_p99_s", "TTFT p99 ms", 0),
         num("throughput_rps", "ok req/s", 2), num("output_tps", "output tok/s", 0), pct("ok_rate", "ok %"),
         pct("busy", "engines busy %", 0), num("evictions", "KV evictions", 0),
         num("balance", "busiest/idlest replica", 2)],
        rows(run), note)


def events_table(runs: Sequence[WorkloadRun]) -> dict[str, Any]:
    """The precise arm's events against the approximate arm's gateway CPU, per workload."""
    out = []
    for run in runs:
        by = {a.name: a for a in run.arms}
        p, a = by.get("precise"), by.get("approximate")
        if p is None:
            continue
        live = sum(1 for s in p.streams or () if s.get("state") == "live")
        out.append({"workload": run.name, "live": f"{live} of {len(p.streams)}" if p.streams else None,
                    "events_per_s": p.events_per_s,
                    "batches_per_s": _div(p.event_batches, p.elapsed_s), "events_cpu": p.events_cpu,
                    "gateway_cpu": p.gateway_cpu, "approximate_cpu": a.gateway_cpu if a else None,
                    "sims_cpu": p.sims_cpu, "sims_approximate_cpu": a.sims_cpu if a else None,
                    "difference": (p.gateway_cpu - a.gateway_cpu)
                    if a and p.gateway_cpu is not None and a.gateway_cpu is not None else None})
    return table(
        "KV-cache events at the gateway (precise arm)",
        [text("workload", "workload"), text("live", "streams live at the end"),
         num("events_per_s", "events/s", 0), num("batches_per_s", "batches/s", 0),
         pct("events_cpu", "events CPU % of a core", 2), pct("gateway_cpu", "gateway CPU % (precise)", 1),
         pct("approximate_cpu", "gateway CPU % (approximate)", 1), pct("difference", "difference %", 1),
         pct("sims_cpu", "engines' process CPU % (precise)", 1),
         pct("sims_approximate_cpu", "engines' process CPU % (approximate)", 1)],
        out,
        "Events CPU: the gateway's own count of seconds spent decoding and applying event batches "
        "(`switchyard_kv_events_processing_seconds_total`) per second of the replay; events and batches: what its "
        "admin API counts over every endpoint. Gateway CPU: the whole process over the "
        "replay (both arms route the same requests; the difference also holds tokenizing prompts for the precise "
        "scorer and the noise of a shared 2-core machine). The engines' process: all eight simulated engines, "
        "which publish the events in the precise arm.")


def _with_precise(runs: Sequence[WorkloadRun]) -> Iterator[tuple[WorkloadRun, dict[str, Any], dict[str, Any]]]:
    """Each run that has a precise arm, its rows by arm, and the precise arm's row."""
    for run in runs:
        by = {r["arm"]: r for r in rows(run)}
        if "precise" in by:
            yield run, by, by["precise"]


def goals(runs: Sequence[WorkloadRun]) -> list[dict[str, Any]]:
    """The issue's goals, per workload."""
    out = []
    for run, by, p in _with_precise(runs):
        of = p["of_oracle"]
        out.append(goal(f"{run.name}: precise hits as a share of the oracle's", f">= {OF_ORACLE_GOAL:.0%}", of,
                        None if of is None else of >= OF_ORACLE_GOAL, unit="%", multiplier=100, decimals=1))
        for base, want in (("least-loaded", LEAST_LOADED_GOAL), ("round-robin", ROUND_ROBIN_GOAL)):
            value = _div(by[base]["ttft_p90_s"], p["ttft_p90_s"]) if base in by else None
            out.append(goal(f"{run.name}: TTFT p90, {base} / precise", f">= {want:g}x", value,
                            None if value is None else value >= want, unit="x"))
        cpu = p["events_cpu"]
        out.append(goal(f"{run.name}: gateway CPU spent on KV events", f"<= {EVENTS_CPU_GOAL:.0%} of one core", cpu,
                        None if cpu is None else cpu <= EVENTS_CPU_GOAL, unit="% of a core", multiplier=100,
                        decimals=2))
    return out


def ratios_table(runs: Sequence[WorkloadRun]) -> dict[str, Any]:
    """Precise against every other arm, per workload."""
    out = []
    for run, by, p in _with_precise(runs):
        for b in ARMS[1:]:
            if b in by:
                out.append({"workload": run.name, "baseline": b, "hit": _div(p["hit_ratio"], by[b]["hit_ratio"]),
                            "ttft_p50": _div(by[b]["ttft_p50_s"], p["ttft_p50_s"]),
                            "ttft_p90": _div(by[b]["ttft_p90_s"], p["ttft_p90_s"]),
                            "ttft_p99": _div(by[b]["ttft_p99_s"], p["ttft_p99_s"]),
                            "throughput": _div(p["throughput_rps"], by[b]["throughput_rps"])})
    return table("Precise against the other pickers (hit ratio and throughput: precise ÷ other; TTFT: other ÷ "
                 "precise, so above 1x is better for precise)",
                 [text("workload", "workload"), text("baseline", "other picker"), ratio("hit", "hit ratio"),
                  ratio("ttft_p50", "TTFT p50"), ratio("ttft_p90", "TTFT p90"), ratio("ttft_p99", "TTFT p99"),
                  ratio("throughput", "throughput")], out)
