"""The calibration report: a Markdown page of what was measured, fitted and compared."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from switchyard.figures import significant_ms
from switchyard.sim.calibrate.fit import GroupQuality, busy_ttft
from switchyard.sim.calibrate.probe import BusyProbe
from switchyard.sim.calibrate.replay import QUANTILES, LatencySummary
from switchyard.sim.calibrate.run import CalibrationResult


def rel(sim: float, real: float) -> str:
    """(sim - real) / real as a signed percentage."""
    if not (math.isfinite(sim) and math.isfinite(real)) or real == 0:
        return "n/a"
    return f"{(sim - real) / real * 100:+.1f}%"


def comparison_rows(real: LatencySummary, sim: LatencySummary) -> list[tuple[str, float, float]]:
    """(metric, real seconds, sim seconds) for the side-by-side table."""
    rows = [(f"TTFT p{q}", real.ttft[q], sim.ttft[q]) for q in QUANTILES]
    rows += [(f"ITL p{q}", real.itl[q], sim.itl[q]) for q in QUANTILES]
    rows.append(("mean TPOT", real.mean_tpot, sim.mean_tpot))
    rows.append(("replay duration", real.duration_s, sim.duration_s))
    return rows


def _quality_row(label: str, q: GroupQuality, memory: int) -> str:
    r2 = f"{q.r2:.4f}" if math.isfinite(q.r2) else "n/a"
    return (f"| {label} | {q.samples} | {r2} | {significant_ms(q.rms_s)} | {q.max_rel_error * 100:.1f}% | "
            f"{memory} |")


def render_report(result: CalibrationResult) -> str:
    """The whole report."""
    r, facts, fit, prof, m = (result, result.facts, result.fit, result.profile,
                              result.measurements)
    sources = prof.provenance.get("sources", {})
    lines = [
        f"# Calibration of `{facts.model}` at {facts.url}",
        "",
        f"- Engine: {'vLLM ' + facts.version if facts.version else 'version unknown'}, "
        f"model root `{facts.root}`",
        f"- Measured {r.started.isoformat(timespec='seconds')}"
        f"{' (--quick)' if r.options.quick else ''}: {m.requests} requests in "
        f"{r.calibration_s:.1f} s" + (f"; comparison {r.comparison_s:.1f} s"
                                      if r.comparison else ""),
        f"- Profile `{prof.name}` written to `{r.options.out}`",
        "",
        "## Engine limits",
        "",
        "| setting | value | source |",
        "|---|---|---|",
    ]
    for key in ("max_model_len", "block_size", "kv_cache_tokens", "max_num_seqs",
                "max_num_batched_tokens", "vocab_size"):
        lines.append(f"| {key} | {getattr(prof, key)} | {sources.get(key, '')} |")
    lines += [
        "",
        "## Fitted step-time model",
        "",
        "`step = step_s + per_seq_s*seqs + max(per_token_s*tokens + per_attn_pair_s*pairs, "
        "weights_s + per_kv_token_s*kv_read_tokens)`; TTFT on an idle engine = "
        "`frontend_overhead_s` + one prefill step.",
        "",
        "| coefficient | value | source |",
        "|---|---|---|",
    ]
    for key, value in [*prof.step_time.as_dict().items(),
                       ("frontend_overhead_s", prof.frontend_overhead_s),
                       ("idle_wakeup_s", prof.idle_wakeup_s)]:
        lines.append(f"| {key} | {value:.4g} s | {sources.get(key, '')} |")
    lines += [
        "",
        f"Samples: {sources.get('step_time', '')}.",
        "",
        "## Fit quality",
        "",
        "| samples | n | R² | RMS residual | max relative error | on the memory side |",
        "|---|---|---|---|---|---|",
        _quality_row("prefill TTFT", fit.prefill, fit.memory_bound_prefill),
        _quality_row("decode ITL", fit.decode, fit.memory_bound_decode),
        "",
        "R² compares the residuals with the spread of the measurements themselves: it is near 0 "
        "(or below) when they hardly vary over the range measured, as a flat TTFT does; the RMS "
        "residual and the largest relative error are the absolute check.",
        "",
        "### TTFT against prompt length (idle engine, no cache hits)",
        "",
        "| prompt tokens | measured (median) | model | error |",
        "|---|---|---|---|",
    ]
    by_len: dict[int, list[float]] = defaultdict(list)
    for p in m.prefill:
        if not p.cached_tokens:
            by_len[p.new_tokens].append(p.ttft_s)
    for n in sorted(by_len):
        meas, model = statistics.median(by_len[n]), fit.predict_ttft(n)
        lines.append(f"| {n} | {significant_ms(meas)} | {significant_ms(model)} | {rel(model, meas)} |")
    lines += [
        "",
        "### ITL against batch size",
        "",
        "| batch | KV tokens read | measured | model | error |",
        "|---|---|---|---|---|",
    ]
    for d in sorted(m.decode, key=lambda d: (d.batch, d.kv_tokens)):
        model = fit.predict_itl(d.batch, d.kv_tokens)
        lines.append(f"| {d.batch} | {d.kv_tokens:.0f} | {significant_ms(d.itl_s)} | {significant_ms(model)} | "
                     f"{rel(model, d.itl_s)} |")
    if m.busy:
        lines += [
            "",
            "### TTFT on a busy engine (probes while others decode)",
            "",
            "| decoding | probes | prompt tokens | measured (median) | model | error |",
            "|---|---|---|---|---|---|",
        ]
        by_batch: dict[int, list[BusyProbe]] = defaultdict(list)
        for probe in m.busy:
            by_batch[probe.batch].append(probe)
        for batch, probes in sorted(by_batch.items()):
            meas = statistics.median(q.ttft_s for q in probes)
            model = statistics.median(busy_ttft(prof.step_time, prof.frontend_overhead_s, q.batch,
                                                q.kv_tokens, q.prompt_tokens) for q in probes)
            lines.append(f"| {batch} | {len(probes)} | {probes[0].prompt_tokens} | {significant_ms(meas)} | "
                         f"{significant_ms(model)} | {rel(model, meas)} |")
    if m.prefix_hits:
        lines += [
            "",
            "### Prefix-cache hits",
            "",
            f"Medians of {r.plan.prefix_reps} cold/warm pairs per size, each on a fresh prefix.",
            "",
            "| prompt tokens | cached | cold TTFT | warm TTFT | speed-up | model speed-up |",
            "|---|---|---|---|---|---|",
        ]
        for h in m.prefix_hits:
            model = (fit.predict_ttft(h.prompt_tokens)
                     / fit.predict_ttft(h.prompt_tokens - h.cached_tokens, h.cached_tokens))
            lines.append(f"| {h.prompt_tokens} | {h.cached_tokens} | {significant_ms(h.cold_ttft_s)} | "
                         f"{significant_ms(h.warm_ttft_s)} | {h.cold_ttft_s / h.warm_ttft_s:.2f}x | "
                         f"{model:.2f}x |")
    if r.comparison is not None:
        c = r.comparison
        lines += [
            "",
            "## Real engine against the simulator with this profile",
            "",
            f"Workload: {c.workload.describe()}. Client-side figures; ITL is the gap between "
            "streamed chunks, spread over the tokens a chunk carries.",
            "",
            "| metric | real | sim | sim vs real |",
            "|---|---|---|---|",
        ]
        for label, real, sim in comparison_rows(c.real, c.sim):
            lines.append(f"| {label} | {significant_ms(real)} | {significant_ms(sim)} | {rel(sim, real)} |")
        lines.append(f"| output tokens | {c.real.output_tokens} | {c.sim.output_tokens} | |")
    return "\n".join(lines) + "\n"
