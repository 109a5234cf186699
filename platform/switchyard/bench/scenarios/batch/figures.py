"""The ``batch`` scenario's figures: per arm, the interactive requests' outcome, TTFT and throughput and the
batch's tokens and lines; the batch lane's share of the idle capacity; the report's tables and its progress plot."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from switchyard.bench.results import Result
from switchyard.bench.scenarios.arms import capacity_table
from switchyard.bench.scenarios.batch.progress import POLL_S, TOKENS, interpolate
from switchyard.bench.scenarios.batch.workload import (
    BASELINE,
    BATCH_MARGIN_S,
    BATCH_MODEL,
    DEFAULT_BATCH_CEILING,
    DEFAULT_BATCH_RESERVE,
    INTERACTIVE_CLASS,
    LOAD,
    MAX_NUM_SEQS,
    MODEL,
    OUTPUT_TOKENS,
    PROMPT_TOKENS,
    REPLICAS,
    WITH,
)
from switchyard.bench.stats import summarize
from switchyard.bench.tables import ms, num, pct, ratio, table, text
from switchyard.figures import fixed

if TYPE_CHECKING:
    from switchyard.bench.scenarios.batch.scenario import BatchRun

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


def tables_of(b: BatchRun, rows: Sequence[Mapping[str, Any]], share: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The report's tables: the batch lane's share (``share``, from :func:`share_row`), the interactive traffic per
    arm (``rows``, from :func:`arm_rows`) and its ratios, the capacity, the batch job."""
    return [_share_table(share, b), _arm_table(rows, b), _ratio_table(rows), _capacity_table(b), _job_table(b)]


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


def tps_note(share: Mapping[str, Any]) -> str:
    """The share goal's note: the batch's and the idle, capacity and interactive output tokens/s."""
    return (f"batch {fixed(share['batch_tps'], decimals=0)} tok/s of {fixed(share['idle_tps'], decimals=0)} idle "
            f"(capacity {fixed(share['capacity_tps'], decimals=0)}, interactive "
            f"{fixed(share['interactive_tps'], decimals=0)})")
