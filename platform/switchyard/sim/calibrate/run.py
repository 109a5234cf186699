"""One calibration run: measure, fit, write the profile, compare, write the report."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from switchyard.sim.calibrate.client import EngineClient
from switchyard.sim.calibrate.facts import EngineFacts, engine_facts
from switchyard.sim.calibrate.fit import PARAMS, GroupQuality, StepFit, busy_frontend, fit_step_time
from switchyard.sim.calibrate.probe import Measurements, Plan, Prompts, make_plan, measure
from switchyard.sim.calibrate.replay import (
    LatencySummary,
    Workload,
    closed_loop_rate,
    make_workload,
    replay,
    simulated_engine,
    summarize,
    within_capacity,
)
from switchyard.sim.measured import MeasuredProfile, StepTimeModel, save_profile_file

#: vLLM's ``max_num_batched_tokens`` for the OpenAI server on CPU (engine/arg_utils.py);
#: a client cannot see it, and with prompts under it a calibration does not depend on it.
DEFAULT_BATCHED_TOKENS = 2048

#: The comparison's pilot: this many requests in flight (or the engine's ``max_num_seqs``, if fewer),
#: closed loop, three rounds of them, before the replay.
PILOT_IN_FLIGHT = 8
PILOT_ROUNDS = 3


@dataclass(frozen=True)
class CalibrationOptions:
    """What ``switchyard sim calibrate`` was asked to do."""

    url: str
    out: Path
    model: str | None = None
    report: Path | None = None
    quick: bool = False
    compare: bool = True
    name: str | None = None
    hardware: str | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    replay_requests: int | None = None
    seed: int = 0


@dataclass(frozen=True)
class Comparison:
    """The same workload on the real engine and on the simulator with the fitted profile."""

    workload: Workload
    real: LatencySummary
    sim: LatencySummary


@dataclass
class CalibrationResult:
    """Everything a calibration produced (the report is rendered from this)."""

    options: CalibrationOptions
    started: datetime
    facts: EngineFacts
    plan: Plan
    measurements: Measurements
    fit: StepFit
    profile: MeasuredProfile
    comparison: Comparison | None = None
    calibration_s: float = 0.0
    comparison_s: float = 0.0


def _max_num_seqs(opts: CalibrationOptions, m: Measurements) -> tuple[int, str]:
    if opts.max_num_seqs is not None:
        return opts.max_num_seqs, "given (--max-num-seqs)"
    if m.saturated_at is not None:
        return m.saturated_at, (f"measured: at most {m.saturated_at} requests decoded at once "
                                "while more were in flight")
    return m.max_concurrency, (f"lower bound: {m.max_concurrency} requests decoded at once and "
                               "the engine was not saturated (pass --max-num-seqs)")


def _split_frontend(fit: StepFit, m: Measurements, sources: dict[str, str]) -> tuple[float, float]:
    """(frontend overhead, idle wake-up): the idle TTFT intercept, split by the busy probes."""
    idle = fit.frontend_overhead_s
    busy = busy_frontend(fit.step_time, [(p.batch, p.kv_tokens, p.prompt_tokens, p.ttft_s)
                                         for p in m.busy])
    if busy is None:
        sources["frontend_overhead_s"] = "fitted: TTFT intercept beyond one prefill step (idle engine)"
        sources["idle_wakeup_s"] = "not measured (no busy-engine probes)"
        return idle, 0.0
    frontend = min(idle, max(0.0, busy))
    sources["frontend_overhead_s"] = (
        f"measured: median over {len(m.busy)} busy-engine TTFT probes of TTFT - half a decode step "
        f"- the mixed prefill step ({busy * 1000:.2f} ms), capped by the idle fit's intercept "
        f"({idle * 1000:.2f} ms)")
    sources["idle_wakeup_s"] = ("fitted idle-engine TTFT intercept minus frontend_overhead_s: "
                                "what starting from idle adds")
    return frontend, idle - frontend


def _quality(q: GroupQuality, memory_bound: int) -> dict[str, Any]:
    return {"samples": q.samples, "r2": _round(q.r2), "rms_residual_s": _round(q.rms_s),
            "max_relative_error": _round(q.max_rel_error), "memory_bound_samples": memory_bound}


def _round(v: float) -> float | None:
    return float(f"{v:.6g}") if math.isfinite(v) else None


def _provenance(opts: CalibrationOptions, started: datetime, facts: EngineFacts, plan: Plan,
                m: Measurements, fit: StepFit, sources: dict[str, str]) -> dict[str, Any]:
    n_pre, n_dec = len(m.prefill), len(m.decode)
    fitted = (f"fitted to {n_pre} median TTFTs ({m.raw_prefill} requests on the idle engine, "
              f"max_tokens=1, no cache hits: {len(plan.prefill_lengths)} prompt lengths x "
              f"{plan.prefill_reps} and {len(m.prefix_hits) * plan.prefix_reps} cold prefix-cache prompts) and "
              f"{n_dec} "
              f"median mean-ITLs ({m.raw_decode} windows: batches "
              f"{sorted({d.batch for d in m.decode})}, prompts of {plan.short_prompt} and "
              f"{plan.long_prompt} tokens, x {plan.decode_reps}); non-negative least squares on "
              "relative residuals")
    return {
        "method": "measured by `switchyard sim calibrate`" + (" --quick" if opts.quick else ""),
        "engine_url": facts.url,
        "served_model": facts.model,
        "engine_root": facts.root,
        "engine_version": facts.version,
        "date": started.isoformat(timespec="seconds"),
        "seed": opts.seed,
        "requests_sent": m.requests,
        "sources": {
            "step_time": fitted,
            "step_s": "fitted: fixed cost of every step",
            "per_seq_s": "fitted: slope of ITL against batch size",
            "per_token_s": "fitted: slope of TTFT against uncached prompt tokens (compute side)",
            "per_attn_pair_s": "fitted: curvature of TTFT against prompt length, and ITL against "
                               "context (compute side)",
            "weights_s": "fitted: memory-side constant (0 when the memory side never binds)",
            "per_kv_token_s": "fitted: memory-side slope of ITL against context tokens",
            **sources,
        },
        "fit": {
            "formula": "step = step_s + per_seq_s*seqs + max(per_token_s*tokens + "
                       "per_attn_pair_s*pairs, weights_s + per_kv_token_s*kv_read_tokens)",
            "prefill_ttft": _quality(fit.prefill, fit.memory_bound_prefill),
            "decode_itl": _quality(fit.decode, fit.memory_bound_decode),
        },
        "busy_ttft_probes": len(m.busy),
        "prefix_cache": [
            {"prompt_tokens": h.prompt_tokens, "cached_tokens": h.cached_tokens,
             "cold_ttft_s": _round(h.cold_ttft_s), "warm_ttft_s": _round(h.warm_ttft_s),
             "speedup": _round(h.cold_ttft_s / h.warm_ttft_s),
             "model_speedup": _round(fit.predict_ttft(h.prompt_tokens)
                                     / fit.predict_ttft(h.prompt_tokens - h.cached_tokens,
                                                        h.cached_tokens))}
            for h in m.prefix_hits],
    }


def _comparison_record(c: Comparison) -> dict[str, Any]:
    def pct(s: LatencySummary) -> dict[str, float | None]:
        out = {f"ttft_p{q}_s": _round(v) for q, v in s.ttft.items()}
        out.update({f"itl_p{q}_s": _round(v) for q, v in s.itl.items()})
        return out

    return {"workload": c.workload.describe(), "rate": _round(c.workload.rate),
            "pilot_rate": _round(c.workload.capacity or math.nan), "real": pct(c.real), "sim": pct(c.sim)}


async def calibrate(opts: CalibrationOptions, log: Callable[[str], None]) -> CalibrationResult:
    """Measure the engine at ``opts.url``, fit a profile, write it (and compare, report).

    Raises:
        EngineError: The engine (or the simulator started for the comparison) failed.
        ValueError: The engine's limits or the measurements do not allow a fit.
    """
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        client = EngineClient(session, opts.url, opts.model)
        facts = await engine_facts(client, log)
        budget = opts.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS
        plan = make_plan(facts.max_model_len, facts.block_size, budget, opts.quick)
        m = await measure(client, plan, Prompts(facts.vocab_size, opts.seed), facts.block_size, log)
        fit = fit_step_time(m.prefill, m.decode)
        sources = dict(facts.sources)
        frontend, wakeup = _split_frontend(fit, m, sources)
        seqs, sources["max_num_seqs"] = _max_num_seqs(opts, m)
        sources["max_num_batched_tokens"] = (
            "given (--max-num-batched-tokens)" if opts.max_num_batched_tokens else
            f"assumed: vLLM's default for the OpenAI server on CPU ({DEFAULT_BATCHED_TOKENS}); "
            "not visible to a client")
        kv = facts.kv_cache_tokens
        if kv is None:
            kv = facts.max_model_len * max(1, seqs)
            sources["kv_cache_tokens"] = "not reported; assumed max_model_len x max_num_seqs"
        profile = MeasuredProfile(
            name=opts.name or opts.out.stem,
            model=facts.model if facts.root.startswith("/") else facts.root,
            hardware=opts.hardware or (f"measured: vLLM {facts.version} at {facts.url}"
                                       if facts.version else f"measured at {facts.url}"),
            step_time=StepTimeModel(**{k: _round(getattr(fit.step_time, k)) or 0.0
                                       for k in PARAMS if k != "frontend_overhead_s"}),
            frontend_overhead_s=_round(frontend) or 0.0, idle_wakeup_s=_round(wakeup) or 0.0,
            vocab_size=facts.vocab_size, kv_cache_tokens=max(kv, facts.max_model_len),
            max_model_len=facts.max_model_len, max_num_seqs=seqs,
            max_num_batched_tokens=budget, block_size=facts.block_size,
            provenance=_provenance(opts, started, facts, plan, m, fit, sources))
        save_profile_file(profile, opts.out)
        result = CalibrationResult(options=opts, started=started, facts=facts, plan=plan,
                                   measurements=m, fit=fit, profile=profile,
                                   calibration_s=time.perf_counter() - t0)
        log(f"calibrate: profile {profile.name} written to {opts.out} "
            f"({result.calibration_s:.1f} s, {m.requests} requests)")
        if opts.compare:
            t1 = time.perf_counter()
            result.comparison = await _compare(session, client, facts, profile, fit, opts, log)
            result.comparison_s = time.perf_counter() - t1
            provenance = dict(profile.provenance)
            provenance["comparison"] = _comparison_record(result.comparison)
            profile = dataclasses.replace(profile, provenance=provenance)
            result.profile = profile
            save_profile_file(profile, opts.out)
    return result


async def _compare(session: aiohttp.ClientSession, client: EngineClient, facts: EngineFacts,
                   profile: MeasuredProfile, fit: StepFit, opts: CalibrationOptions,
                   log: Callable[[str], None]) -> Comparison:
    n = opts.replay_requests or (40 if opts.quick else 120)
    limits = {"max_model_len": facts.max_model_len, "block_size": facts.block_size,
              "max_num_seqs": profile.max_num_seqs, "vocab_size": facts.vocab_size}
    workload = make_workload(fit, requests=n, seed=opts.seed + 1, **limits)
    # The pilot's requests are drawn with another seed: other shared prefixes, so the replay starts
    # with the real engine's prefix cache as cold for its prompts as the simulator's.
    in_flight = min(PILOT_IN_FLIGHT, profile.max_num_seqs)
    pilot = make_workload(fit, requests=PILOT_ROUNDS * in_flight, seed=opts.seed + 2, **limits)
    capacity = await closed_loop_rate(client, pilot.requests, in_flight)
    workload = within_capacity(workload, capacity, in_flight)
    log(f"calibrate: the engine completed {capacity:.2f} requests/s with {in_flight} in flight; "
        f"replaying {n} requests at {workload.rate:.2f}/s against it")
    real = summarize(await replay(client, workload))
    log("calibrate: and against the simulator with the fitted profile")
    async with simulated_engine(session, opts.out, facts.model) as sim_url:
        sim_client = EngineClient(session, sim_url, facts.model)
        await sim_client.discover()
        for _ in range(2):  # the first requests of a fresh process pay one-off costs
            await sim_client.complete([facts.vocab_size // 2] * 16, 4)
        sim = summarize(await replay(sim_client, workload))
    return Comparison(workload=workload, real=real, sim=sim)
