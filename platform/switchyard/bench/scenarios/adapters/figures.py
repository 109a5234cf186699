"""The ``adapters`` scenario's figures: per arm, the engines' adapter loads per 1,000 requests, requests deferred
for an adapter slot, TTFT and throughput as the clients saw them, how many replicas each adapter was spread over
and how far the simulators lagged; the adapter-aware arm against the baseline; per popularity band; the goals."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from switchyard.bench.results import Result
from switchyard.bench.scenarios.adapters.workload import (
    ADAPTER_AWARE,
    ADAPTERS,
    BANDS,
    BASELINE,
    MAX_LORAS,
    OUTPUT_TOKENS,
    PROFILE,
    PROMPT_TOKENS,
    REPLICAS,
    ZIPF_S,
    band_shares,
)
from switchyard.bench.spec import Workload
from switchyard.bench.stats import summarize
from switchyard.bench.tables import goal, ms, num, pct, ratio, table, text
from switchyard.figures import fixed, percent

if TYPE_CHECKING:
    from switchyard.bench.scenarios.adapters.scenario import AdaptersBench, ArmRun

#: The ratios (adapter-aware ÷ least-loaded) the report shows.
RATIO_KEYS = ("loads_per_1k", "load_seconds", "deferred_mean", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
              "itl_p99_s", "throughput_rps", "replicas_per_adapter")


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if values else None


def spread(results: Sequence[Result]) -> dict[str, int]:
    """Per adapter (model requested): how many replicas served its answered requests (the route header's
    ``endpoint``)."""
    seen: dict[str, set[str]] = {}
    for r in results:
        endpoint = r.route_fields.get("endpoint")
        if r.ok and endpoint:
            seen.setdefault(r.model, set()).add(endpoint)
    return {model: len(endpoints) for model, endpoints in seen.items()}


def arm_rows(arms: Sequence[ArmRun], workload: Workload) -> list[dict[str, Any]]:
    """One row per arm: the engines' adapter counters over the load, deferred requests, the clients' figures, the
    spread of adapters over replicas and the simulators' lag."""
    rows = []
    for arm in arms:
        s = summarize(arm.results, window_s=workload.duration_s)
        counted = arm.counted
        per = spread(arm.results)
        lags = arm.series.get("lag_s", [])
        deferred = arm.series.get("deferred", [])
        waiting = arm.series.get("waiting", [])
        rows.append({
            "arm": arm.name, "requests": s.count, "ok_rate": s.ok_rate, "failed": s.count - s.ok,
            "loads": counted.loads, "loads_per_1k": _div(1000.0 * counted.loads, s.count),
            "activations": counted.activations, "load_seconds": counted.load_seconds,
            "deferred_mean": _mean(deferred), "deferred_max": max(deferred, default=None),
            "waiting_mean": _mean(waiting),
            "ttft_p50_s": s.ttft_p50_s, "ttft_p90_s": s.ttft_p90_s, "ttft_p99_s": s.ttft_p99_s,
            "itl_p99_s": s.itl_p99_s, "throughput_rps": s.throughput_rps, "output_tps": s.output_tps,
            "replicas_per_adapter": _mean(list(per.values())),
            "lag_p99_s": float(np.percentile(lags, 99)) if lags else None, "lag_max_s": max(lags, default=None),
            "lateness_p99_s": s.lateness_p99_s,
            "gateway_cpu": _div(arm.gateway_cpu_s, arm.wall_s), "sims_cpu": _div(arm.sims_cpu_s, arm.wall_s),
        })
    return rows


def ratio_row(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The adapter-aware arm ÷ the baseline, for each of ``RATIO_KEYS``."""
    by = {r["arm"]: r for r in rows}
    a, b = by.get(ADAPTER_AWARE), by.get(BASELINE)
    return {"ratio": f"{ADAPTER_AWARE} ÷ {BASELINE}",
            **{key: _div(a[key], b[key]) if a and b else None for key in RATIO_KEYS}}


def band_rows(arms: Sequence[ArmRun], window_s: float) -> list[dict[str, Any]]:
    """Per popularity band and arm: requests, TTFT, and the replicas its adapters were spread over."""
    shares = band_shares()
    rows = []
    for name, low, high in BANDS:
        for arm in arms:
            rs = [r for r in arm.results if r.request_class == name]
            s = summarize(rs, window_s=window_s)
            per = spread(rs)
            rows.append({"band": name, "ranks": f"{low}-{high}", "share": shares[name], "arm": arm.name,
                         "requests": s.count, "ok_rate": s.ok_rate, "ttft_p50_s": s.ttft_p50_s,
                         "ttft_p90_s": s.ttft_p90_s, "ttft_p99_s": s.ttft_p99_s,
                         "replicas_per_adapter": _mean(list(per.values()))})
    return rows


def tables_of(arms: Sequence[ArmRun], rows: Sequence[Mapping[str, Any]], workload: Workload,
              load_s: float | None) -> list[dict[str, Any]]:
    """The report's tables: per arm, the ratios, per band, and the engines' side (lag, CPU); ``load_s``: what one
    adapter load costs the engines, as they report it."""
    arm_table = table(
        "Adapter loads, deferred requests and latency by picker",
        [text("arm", "picker"), num("requests", "requests", 0), pct("ok_rate", "ok %"), num("failed", "failed", 0),
         num("loads", "adapter loads", 0), num("loads_per_1k", "loads per 1,000 requests", 1),
         num("activations", "GPU slot copies", 0), ms("load_seconds", "engine ms loading", 0),
         num("deferred_mean", "deferred (mean)", 2), num("deferred_max", "deferred (max)", 0),
         num("waiting_mean", "waiting (mean)", 2),
         ms("ttft_p50_s", "TTFT p50 ms", 1), ms("ttft_p90_s", "TTFT p90 ms", 1), ms("ttft_p99_s", "TTFT p99 ms", 1),
         ms("itl_p99_s", "ITL p99 ms", 1), num("throughput_rps", "ok req/s", 2), num("output_tps", "output tok/s", 0),
         num("replicas_per_adapter", "replicas per adapter", 2)],
        rows,
        "Adapter loads: the engines' own count (`/sim/state` `lora.loads`, summed over the replicas, after the load "
        "less before it): an adapter read into the CPU cache, which here holds as many as the GPU slots "
        f"({MAX_LORAS}, vLLM's default --max-cpu-loras), so every load is a full one "
        f"({fixed(load_s, scale=1000, decimals=1)} ms simulated on the `{PROFILE}` profile, added to the step that "
        "needs it, which every request running on that replica waits for). GPU "
        "slot copies count loads too. Engine ms loading: simulated. Deferred: requests waiting in an engine because "
        f"their adapter would exceed the batch's {MAX_LORAS} adapters (`lora.deferred`), summed over the replicas, "
        "sampled every second; waiting: all requests waiting there. TTFT and ITL: as the client saw them, from the "
        "scheduled time. Replicas per adapter: the mean over adapters of the replicas that answered its requests.")
    ratio_table = table(
        f"{ADAPTER_AWARE} against {BASELINE} (÷; below 1x is fewer or faster, except throughput)",
        [text("ratio", "arms"), ratio("loads_per_1k", "loads per 1,000"), ratio("load_seconds", "engine time loading"),
         ratio("deferred_mean", "deferred (mean)"), ratio("ttft_p50_s", "TTFT p50"), ratio("ttft_p90_s", "TTFT p90"),
         ratio("ttft_p99_s", "TTFT p99"), ratio("itl_p99_s", "ITL p99"), ratio("throughput_rps", "throughput"),
         ratio("replicas_per_adapter", "replicas per adapter")],
        [ratio_row(rows)])
    band_table = table(
        "By popularity band (the request's class)",
        [text("band", "band"), text("ranks", "adapter ranks"), pct("share", "share of requests"), text("arm", "picker"),
         num("requests", "requests", 0), pct("ok_rate", "ok %"), ms("ttft_p50_s", "TTFT p50 ms", 1),
         ms("ttft_p90_s", "TTFT p90 ms", 1), ms("ttft_p99_s", "TTFT p99 ms", 1),
         num("replicas_per_adapter", "replicas per adapter", 2)],
        band_rows(arms, workload.duration_s))
    engine_table = table(
        "The machine: the simulators' lag behind the wall clock, CPU, the load generator",
        [text("arm", "picker"), ms("lag_p99_s", "sim lag p99 ms", 1), ms("lag_max_s", "sim lag max ms", 1),
         pct("sims_cpu", "engines' process CPU % of a core", 1), pct("gateway_cpu", "gateway CPU % of a core", 1),
         ms("lateness_p99_s", "send lateness p99 ms", 2)],
        rows,
        f"Lag: how far a simulated engine ran behind its wall clock (`/sim/state` `lag_s`, the largest of the "
        f"{REPLICAS}, sampled every second); a simulator that lags delays every answer of its engine, so the "
        "latencies then include the machine's own shortfall. The engines' process runs all the replicas.")
    return [arm_table, ratio_table, band_table, engine_table]


def goals_of(rows: Sequence[Mapping[str, Any]], arms: Sequence[ArmRun]) -> list[dict[str, Any]]:
    """The scenario's claims: fewer adapter loads than the baseline, first tokens no later at p90, no failures."""
    r = ratio_row(rows)
    by = {row["arm"]: row for row in rows}
    aware, base = by[ADAPTER_AWARE], by[BASELINE]
    loads, p90 = r["loads_per_1k"], r["ttft_p90_s"]
    failed = aware["failed"]
    return [
        goal(f"adapter loads per 1,000 requests, {ADAPTER_AWARE} ÷ {BASELINE}", "< 1x", loads,
             None if loads is None else loads < 1.0, unit="x",
             note=f"{fixed(aware['loads_per_1k'], decimals=1)} vs {fixed(base['loads_per_1k'], decimals=1)}"),
        goal(f"TTFT p90, {ADAPTER_AWARE} ÷ {BASELINE}", "≤ 1x", p90, None if p90 is None else p90 <= 1.0, unit="x",
             note=f"{fixed(aware['ttft_p90_s'], scale=1000, decimals=1)} vs "
             f"{fixed(base['ttft_p90_s'], scale=1000, decimals=1)} ms"),
        goal(f"failed requests, {ADAPTER_AWARE}", "0", float(failed), failed == 0, decimals=0,
             note=f"of {aware['requests']}; {BASELINE}: {base['failed']}"),
    ]


def notes_of(bench: AdaptersBench, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The report's notes: the setup and workload, and what limits the figures."""
    shares = band_shares()
    lag = max((r["lag_max_s"] for r in rows if r["lag_max_s"] is not None), default=None)
    return [
        f"One pool of {REPLICAS} simulated `{PROFILE}` replicas (time scale {bench.time_scale:g}), {ADAPTERS} LoRA "
        f"adapters of its base model, each a model of the policy (`adapter_of`), registered on every replica at "
        f"start-up (`--lora-modules`; no runtime loading), `max_loras: {MAX_LORAS}` (GPU slots and the most "
        "adapters in one batch; the CPU cache as many). Each arm on fresh engines and a fresh gateway with the same "
        f"requests at the same times: `{BASELINE}` (`SWITCHYARD_PICKER=least-loaded`) and `{ADAPTER_AWARE}` (the "
        "built-in default profile, with its `lora-affinity` scorer).",
        f"Workload: seeded Poisson arrivals at {bench.rate:g} requests/s for {bench.duration_s:g} s "
        f"({len(bench.workload)} requests), all streamed, prompts of {PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} tokens, "
        f"{OUTPUT_TOKENS[0]}-{OUTPUT_TOKENS[1]} output tokens; the adapter of each drawn by Zipf popularity "
        f"(exponent {ZIPF_S:g}): " + ", ".join(f"{name} (ranks {low}-{high}) {percent(shares[name])}"
                                                for name, low, high in BANDS) + " of the requests.",
        f"At time scale {bench.time_scale:g} the engines' share of every latency is {1 / bench.time_scale:g} times "
        "the simulated hardware's"
        + (f" (an adapter load of {fixed(bench.load_s, scale=1000, decimals=1)} ms simulated takes "
           f"{fixed(bench.load_s / bench.time_scale, scale=1000, decimals=1)} ms of wall clock)"
           if bench.load_s is not None else "")
        + "; the offered rate is per wall-clock second. Compare arms, not absolute values. "
        + (f"The simulators lagged at most {fixed(lag, scale=1000, decimals=1)} ms (simulated) behind the wall clock."
           if lag is not None else "The simulators' lag was not read."),
    ]


def summary_of(rows: Sequence[Mapping[str, Any]]) -> str:
    """One sentence for the run's index."""
    by = {r["arm"]: r for r in rows}
    a, b = by[ADAPTER_AWARE], by[BASELINE]
    r = ratio_row(rows)
    return (f"adapter loads per 1,000 requests {fixed(a['loads_per_1k'], decimals=1)} adapter-aware vs "
            f"{fixed(b['loads_per_1k'], decimals=1)} least-loaded ({fixed(r['loads_per_1k'], decimals=2, unit='x')}); "
            f"TTFT p50/p99 {fixed(a['ttft_p50_s'], scale=1000, decimals=0)}/"
            f"{fixed(a['ttft_p99_s'], scale=1000, decimals=0)} ms vs "
            f"{fixed(b['ttft_p50_s'], scale=1000, decimals=0)}/{fixed(b['ttft_p99_s'], scale=1000, decimals=0)} ms")
