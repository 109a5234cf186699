"""The overhead scenario's figures: its rows, goals and tables, and its report (see ``overhead``)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from switchyard.bench import litellm_env
from switchyard.bench.policies import HOT_PATH_FEATURES
from switchyard.bench.report import build_report, write_report
from switchyard.bench.results import Result
from switchyard.bench.sampler import bucket_quantile
from switchyard.bench.scenarios.base import Outcome, ScenarioContext, describe_plan
from switchyard.bench.stats import percentiles
from switchyard.bench.tables import goal, ms, num, pct, ratio, table, text

if TYPE_CHECKING:
    from switchyard.bench.scenarios.overhead import Overhead

# Issue #31's goals (one gateway process on one core).
GOAL_RATE = 500.0
GOAL_ADDED_P99_S = 0.002
GOAL_ADDED_P50_S = 0.0005
#: At the high rate, the non-streamed p99 added latency may be this much.
HIGH_RATE = 1000.0
GOAL_HIGH_ADDED_P99_S = 0.005
#: Max sustained requests/s, per mode.
GOAL_SUSTAINED = {"non-stream": 3000.0, "stream": 2000.0}
GOAL_RATIO = 25.0
CONCURRENCY = 32
MAX_ERROR_RATE = 0.001
MODES = ("non-stream", "stream")
#: The uncounted diagnostic step's stall threshold (the gateway's ``SWITCHYARD_STALL_SAMPLER_MS``).
STALL_SAMPLER_MS = 3.0


def service_latency(result: Result, stream: bool) -> float | None:
    """Seconds from send to the first content chunk (stream) or to the end of the body."""
    if not result.ok:
        return None
    if stream:
        return result.service_ttft_s
    return result.done_s - result.sent_s


def latency_percentiles(results: Sequence[Result], mode: str) -> dict[str, float | None]:
    """p50 and p99 of the service latency of ``results``."""
    return percentiles([v for r in results if (v := service_latency(r, mode == "stream")) is not None], (50, 99))


def latency_rows(run: Overhead) -> list[dict[str, Any]]:
    """One row per mode, rate and arm (added latency against ``direct``)."""
    rows: list[dict[str, Any]] = []
    for mode in MODES:
        for rate in run.rates:
            base = run.runs.get(("direct", rate, mode), [])
            for arm in run.arms:
                key = (arm.name, rate, mode)
                row: dict[str, Any] = {"mode": mode, "rate": rate, "arm": arm.name}
                if arm.target is None or key in run.skipped:
                    row["note"] = arm.unavailable if arm.target is None else run.skipped[key]
                    rows.append(row)
                    continue
                reps = run.runs.get(key, [])
                pooled = [r for rep in reps for r in rep]
                lat = latency_percentiles(pooled, mode)
                ok = sum(r.ok for r in pooled)
                row.update({
                    "p50_s": lat["p50"], "p99_s": lat["p99"],
                    "ok_rate": ok / len(pooled) if pooled else None,
                    "achieved_rps": ok / (run.step_s * len(reps)) if reps else None,
                    "lateness_p99_s": percentiles([r.lateness_s for r in pooled], (99,))["p99"],
                    "requests": len(pooled), "repeats": len(reps),
                    "note": "baseline" if arm.name == "direct" else "",
                })
                if arm.name != "direct":
                    # Paired by repeat: each repeat's arm ran right after its direct baseline.
                    diffs = [(latency_percentiles(a, mode), latency_percentiles(b, mode))
                             for a, b in zip(reps, base, strict=False)]
                    p50 = [x["p50"] - y["p50"] for x, y in diffs if x["p50"] is not None and y["p50"] is not None]
                    p99 = [x["p99"] - y["p99"] for x, y in diffs if x["p99"] is not None and y["p99"] is not None]
                    row["added_p50_s"] = statistics.median(p50) if p50 else None
                    row["added_p99_s"] = statistics.median(p99) if p99 else None
                    if len(p99) > 1:
                        row["added_p99_range"] = f"{min(p99) * 1000:.2f} to {max(p99) * 1000:.2f}"
                rows.append(row)
    return rows


def saturation_rows(run: Overhead) -> list[dict[str, Any]]:
    """One row per mode and arm (max sustained requests/s)."""
    rows: list[dict[str, Any]] = []
    for mode in MODES:
        lite = next((a for a in run.arms if a.name == "litellm"), None)
        lite_rps = run.sustained(lite, mode) if lite is not None else None
        for arm in run.arms:
            row: dict[str, Any] = {"mode": mode, "arm": arm.name}
            sat = arm.saturation.get(mode)
            if arm.target is None or sat is None:
                row["note"] = arm.unavailable or "not measured"
                rows.append(row)
                continue
            lat = latency_percentiles(sat.results, mode)
            rps = run.sustained(arm, mode)
            share = arm.cpu_share.get(mode)
            limit = ""
            if arm.name == "direct":
                limit = "load generator + engine ceiling"
            elif share is not None:
                limit = "proxy-bound" if share >= 0.85 else "load-generator-bound: the proxy had CPU to spare"
            row.update({
                "rps": rps, "error_rate": sat.error_rate, "p50_s": lat["p50"], "p99_s": lat["p99"],
                "proxy_cpu": share, "loadgen_cpu": arm.loadgen_cpu_share.get(mode),
                "vs_litellm": (rps / lite_rps) if arm.name == "switchyard" and rps is not None and lite_rps
                else None,
                "note": limit if rps is not None else f"failed: {100 * (sat.error_rate or 0):.1f}% errors",
            })
            rows.append(row)
    return rows


def lag_rows(run: Overhead) -> list[dict[str, Any]]:
    """Per mode: the gateway's event-loop lag during its steps at the goal rate (from its own histogram)."""
    rows = []
    for mode in MODES:
        pairs = run.lag.get(mode, [])
        if not pairs:
            continue
        before, after = _pooled(pairs, "lag")
        p99, checks = bucket_quantile(before, after, 0.99)
        p999, _ = bucket_quantile(before, after, 0.999)
        within = after.get(GOAL_ADDED_P99_S, 0.0) - before.get(GOAL_ADDED_P99_S, 0.0)
        row: dict[str, Any] = {"mode": mode, "checks": checks, "late_share": 1 - within / checks if checks else None,
                               "p99_bucket_s": p99, "p999_bucket_s": p999}
        for generation in range(3):
            gc_before, gc_after = _pooled(pairs, f"gc{generation}")
            worst, count = bucket_quantile(gc_before, gc_after, 1.0)
            row[f"gc{generation}"], row[f"gc{generation}_max_bucket_s"] = count, worst
        rows.append(row)
    return rows


def _pooled(pairs: Sequence[tuple[dict[str, dict[float, float]], dict[str, dict[float, float]]]],
            series: str) -> tuple[dict[float, float], dict[float, float]]:
    """One histogram series' buckets before and after, summed over the repeats (their observations pooled)."""
    before: dict[float, float] = {}
    after: dict[float, float] = {}
    for b, a in pairs:
        got, had = a.get(series, {}), b.get(series, {})
        for bound, count in got.items():
            before[bound] = before.get(bound, 0.0) + had.get(bound, 0.0)
            after[bound] = after.get(bound, 0.0) + count
    return before, after


#: Innermost frames that mean the loop thread was in the event loop's own code (uvloop's is C, so Python sees
#: only the runner), not in a callback.
LOOP_FRAMES = ("asyncio/runners.py:", "/selectors.py:")
_STALL = re.compile(r"event loop stalled ([0-9.]+) ms at (.*)$")
#: Places listed in the stall table.
TOP_STALLS = 8


def stall_rows(lines: Sequence[str]) -> list[dict[str, Any]]:
    """The diagnostic step's stalls by where the loop thread was (its innermost frame), most time first."""
    places: dict[str, dict[str, Any]] = {}
    for line in lines:
        found = _STALL.search(line)
        if found is None:
            continue
        ms_, stack = float(found.group(1)), found.group(2).strip()
        where = stack.split(" < ")[0]
        row = places.setdefault(where, {"where": where, "stalls": 0, "total_s": 0.0, "longest_s": 0.0, "stack": ""})
        row["stalls"] += 1
        row["total_s"] += ms_ / 1000
        if ms_ / 1000 >= row["longest_s"]:
            row["longest_s"], row["stack"] = ms_ / 1000, stack
    return sorted(places.values(), key=lambda r: -r["total_s"])[:TOP_STALLS]


def _in_the_way(mode: str, latency: list[dict[str, Any]], lag: list[dict[str, Any]],
                stalls: Sequence[dict[str, Any]] = ()) -> str:
    """What the run measured that stands between the gateway and the p99 goal in ``mode``."""
    parts = []
    lagged = next((r for r in lag if r["mode"] == mode), None)
    if lagged is not None and lagged["checks"]:
        parts.append(f"the gateway's event loop ran a 10 ms timer more than {GOAL_ADDED_P99_S * 1000:g} ms late in "
                     f"{100 * lagged['late_share']:.1f}% of {lagged['checks']} checks (p99 ≤ "
                     f"{1000 * lagged['p99_bucket_s']:g} ms, p99.9 ≤ {1000 * lagged['p999_bucket_s']:g} ms): a "
                     "request arriving then waits as long")
        collections = [f"{lagged[f'gc{g}']} of generation {g} (each ≤ {1000 * lagged[f'gc{g}_max_bucket_s']:g} ms)"
                       for g in range(3) if lagged.get(f"gc{g}")]
        if collections:
            parts.append("garbage collections stopped it meanwhile: " + ", ".join(collections))
    direct = next((r for r in latency if r["mode"] == mode and r["rate"] == GOAL_RATE and r["arm"] == "direct"), None)
    if direct is not None and direct.get("p50_s") is not None and direct.get("p99_s") is not None:
        parts.append(f"the engine called directly jitters too (p50 {1000 * direct['p50_s']:.2f} ms, p99 "
                     f"{1000 * direct['p99_s']:.2f} ms): the host's scheduling, which the gateway's process meets "
                     "as well")
    if stalls:
        top = stalls[0]
        inside = (" (inside the event loop itself: no Python callback was running, so the process was not scheduled "
                  "or was in C code)" if any(f in top["where"] for f in LOOP_FRAMES) else "")
        parts.append(f"a stall sampler in an uncounted step found the loop thread most often at {top['where']}{inside} "
                     f"({top['stalls']} stalls, {1000 * top['total_s']:.0f} ms; see the stall table)")
    return "In the way: " + "; ".join(parts) + "." if parts else ""


def goals(latency: list[dict[str, Any]], saturation: list[dict[str, Any]],
          lag: list[dict[str, Any]] | None = None, stalls: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The issue's goals: added latency, max sustained requests/s and the ratio to LiteLLM (a missed p99 goal at
    the goal rate says what the run saw in its way)."""
    goals = []
    for mode in MODES:
        row = next((r for r in latency if r["mode"] == mode and r["rate"] == GOAL_RATE
                    and r["arm"] == "switchyard"), None)
        value = row.get("added_p99_s") if row else None
        what = "first chunk" if mode == "stream" else "whole answer"
        met = None if value is None else value <= GOAL_ADDED_P99_S
        note = "" if row is None or value is not None else (row.get("note") or "")
        if met is False:
            note = _in_the_way(mode, latency, lag or [], stalls)
        goals.append(goal(f"gateway p99 added latency at {GOAL_RATE:.0f} requests/s ({mode}, {what})",
                          f"≤ {GOAL_ADDED_P99_S * 1000:g} ms", value, met, unit="ms", multiplier=1000, note=note))
    for rate, q, bound in ((GOAL_RATE, "p50", GOAL_ADDED_P50_S), (HIGH_RATE, "p99", GOAL_HIGH_ADDED_P99_S)):
        row = next((r for r in latency if r["mode"] == "non-stream" and r["rate"] == rate
                    and r["arm"] == "switchyard"), None)
        value = row.get(f"added_{q}_s") if row else None
        note = "" if row is None or value is not None else (row.get("note") or "")
        goals.append(goal(f"gateway {q} added latency at {rate:.0f} requests/s (non-stream, whole answer)",
                          f"≤ {bound * 1000:g} ms", value, None if value is None else value <= bound, unit="ms",
                          multiplier=1000, note=note))
    for mode in MODES:
        sy = next((r for r in saturation if r["mode"] == mode and r["arm"] == "switchyard"), None)
        value = sy.get("rps") if sy else None
        note = "" if sy is None else (sy.get("note") or "")
        if value is not None and not note.startswith("load-generator-bound"):
            note = ""  # the proxy was the limit: the figure is its own
        elif value is not None:
            note = "a lower bound: the load generator was the limit"
        goals.append(goal(f"max sustained requests/s ({mode})", f"≥ {GOAL_SUSTAINED[mode]:,.0f}", value,
                          None if value is None else value >= GOAL_SUSTAINED[mode], decimals=0, note=note))
    for mode in MODES:
        lite = next((r for r in saturation if r["mode"] == mode and r["arm"] == "litellm"), None)
        sy = next((r for r in saturation if r["mode"] == mode and r["arm"] == "switchyard"), None)
        value = sy.get("vs_litellm") if sy else None
        note = ""
        if value is None:
            note = (lite or {}).get("note") or "not measured"
        elif sy and sy.get("note", "").startswith("load-generator-bound"):
            note = "Switchyard's figure is a lower bound (the load generator was the limit)"
        goals.append(goal(f"max sustained requests/s vs LiteLLM ({mode})", f"≥ {GOAL_RATIO:g}x", value,
                          None if value is None else value >= GOAL_RATIO, unit="x", decimals=1, note=note))
    return goals


def _latency_table(rows: Sequence[dict[str, Any]], step_s: float, warmup_s: float, repeats: int) -> dict[str, Any]:
    return table(
        "Added latency (open loop, Poisson arrivals)",
        [text("mode", "mode"), num("rate", "offered req/s", 0), text("arm", "arm"), ms("p50_s", "p50 ms"),
         ms("p99_s", "p99 ms"), ms("added_p50_s", "added p50 ms"), ms("added_p99_s", "added p99 ms"),
         text("added_p99_range", "added p99 range ms"), pct("ok_rate", "ok %"), num("achieved_rps", "ok req/s", 0),
         ms("lateness_p99_s", "send lateness p99 ms"), num("requests", "requests", 0), num("repeats", "repeats", 0),
         text("note", "note")],
        rows,
        f"Latency from send: the whole answer (non-stream) or the first content chunk (stream); p50/p99 pool every "
        f"repeat. Added = the arm's percentile minus `direct`'s in the same repeat (they run back to back), the median "
        f"over repeats; the range shows every repeat's p99 difference. {step_s:g} s per step after a {warmup_s:g} s "
        f"warm-up (left out); {repeats} repeats at {GOAL_RATE:g} requests/s, arms interleaved. Send lateness is the "
        "load generator's own delay (it shares its CPU with the engine); `direct`'s p99 is the machine's own jitter.")


def _saturation_table(rows: Sequence[dict[str, Any]], seconds: float) -> dict[str, Any]:
    return table(
        "Max sustained requests/s (closed loop)",
        [text("mode", "mode"), text("arm", "arm"), num("rps", "max req/s", 0), pct("error_rate", "errors %", 2),
         ms("p50_s", "p50 ms"), ms("p99_s", "p99 ms"), pct("proxy_cpu", "proxy CPU %", 0),
         pct("loadgen_cpu", "load generator CPU %", 0), ratio("vs_litellm", "÷ LiteLLM"), text("note", "limit")],
        rows,
        f"{CONCURRENCY} connections sending back to back for {seconds:g} s after a warm-up; sustained means at most "
        f"{MAX_ERROR_RATE * 100:g}% failed. Proxy CPU is the share of one core the proxy process used; near 100% the "
        "proxy is the limit, lower means the load generator was.")


def scaling_rows(scaling: list[dict[str, Any]], on_redis: dict[str, Any]) -> list[dict[str, Any]]:
    """The scaling step's rows; those of more than one process also with their requests/s over ``on_redis``'s
    (one process on Redis)."""
    rows = []
    for row in scaling:
        row = dict(row)
        for mode in MODES:
            base, mine = on_redis.get(f"{mode}_rps"), row.get(f"{mode}_rps")
            row[f"{mode}_x"] = mine / base if row.get("workers", 1) > 1 and base and mine is not None else None
        rows.append(row)
    return rows


def _on_redis_note(on_redis: dict[str, Any]) -> str:
    """What one process on Redis carried, the base of the ``÷ one on Redis`` columns."""
    if not on_redis:
        return "One process on Redis was not measured."
    figures = " / ".join("-" if on_redis.get(f"{m}_rps") is None else f"{on_redis[f'{m}_rps']:,.0f}" for m in MODES)
    return (f"One process with its limits and cache on Redis (CPUs {on_redis.get('cpus', 'all')}) carried {figures} "
            "requests/s non-stream / stream; the rows of more processes are divided by it (what the processes add, "
            "Redis's own cost apart).")


def write(ctx: ScenarioContext, run_: Overhead) -> Outcome:
    """Write the scenario's report; its outcome for the run's index."""
    latency, saturation, lag = latency_rows(run_), saturation_rows(run_), lag_rows(run_)
    stalls = stall_rows(run_.stall_lines)
    goals_ = goals(latency, saturation, lag, stalls)
    tables = [_latency_table(latency, run_.step_s, run_.warmup_s, run_.repeats),
              _saturation_table(saturation, run_.saturation_s)]
    if run_.scaling:
        tables.append(table(
            "Max sustained requests/s against gateway processes (`switchyard serve --workers N`)",
            [num("workers", "processes", 0), text("cpus", "CPUs"), num("non-stream_rps", "non-stream req/s", 0),
             num("stream_rps", "stream req/s", 0), num("non-stream_x", "÷ one on Redis, non-stream", 2),
             num("stream_x", "÷ one on Redis, stream", 2), num("non-stream_cpu", "cores used, non-stream", 2),
             num("stream_cpu", "cores used, stream", 2), text("note", "note")],
            scaling_rows(run_.scaling, run_.on_redis),
            f"Closed loop as above ({CONCURRENCY} connections per process, {run_.saturation_s:g} s after a warm-up), "
            "the other proxies paused. More than one process shares limits and caches through Redis. "
            f"{_on_redis_note(run_.on_redis)} Cores used: the processes' CPU time over the window. Where the "
            "processes get every CPU, the load generator, the engine and Redis compete with them, and the figure is "
            "a lower bound."))
    if lag:
        tables.append(table(
            f"Gateway event-loop lag at {GOAL_RATE:g} requests/s", [
                text("mode", "mode"), num("checks", "timer checks", 0),
                pct("late_share", f"> {GOAL_ADDED_P99_S * 1000:g} ms late %", 1),
                ms("p99_bucket_s", "p99 ≤ ms"), ms("p999_bucket_s", "p99.9 ≤ ms"),
                num("gc0", "GC gen 0", 0), ms("gc0_max_bucket_s", "longest ≤ ms"),
                num("gc1", "GC gen 1", 0), ms("gc1_max_bucket_s", "longest ≤ ms"),
                num("gc2", "GC gen 2", 0), ms("gc2_max_bucket_s", "longest ≤ ms")], lag,
            "From the gateway's own `switchyard_event_loop_lag_seconds` (a 10 ms timer; its histogram scraped before "
            "and after each of its steps at the goal rate, warm-up included): how long the loop was busy or not "
            "scheduled before it could look; and its garbage collections (`switchyard_gc_pause_seconds`), each of "
            "which stops the loop. Bucket bounds, not exact values."))
    if run_.stall_lines or run_.gateway_env:
        tables.append(table(
            "Where the gateway's event loop stalled (diagnostic step, not counted)", [
                text("where", "loop thread at"), num("stalls", "stalls", 0), ms("total_s", "total ms"),
                ms("longest_s", "longest ms"), text("stack", "longest stall's stack (innermost first)")], stalls,
            f"A second gateway with `SWITCHYARD_STALL_SAMPLER_MS={STALL_SAMPLER_MS:g}` took {GOAL_RATE:g} requests/s "
            f"in each mode while the measured proxies were paused; {len(run_.stall_lines)} stalls of "
            f"{STALL_SAMPLER_MS:g} ms or more were logged. A stall inside one Python call is caught in that call; "
            "one of the whole process (not scheduled, or a garbage collection) is caught where the loop thread "
            "was when it ran again, often its poll for I/O."))
    notes = [f"CPU placement: {describe_plan(run_.plan)}.",
             f"Policy (`policy.yaml` beside this report; one gateway process, `switchyard serve`): "
             f"{HOT_PATH_FEATURES}.",
             "The gateway's exact-cache lookups over the run: " + (", ".join(
                 f"{n:,.0f} {result}" for result, n in sorted(run_.cache_lookups.items())) or "none counted") + ".",
             "The engine is `switchyard.bench.instant`: it answers every request at once from pre-encoded bytes "
             "(a measuring device, not a simulator).",
             "Open-loop p99 on a shared small machine jitters by milliseconds between runs (DESIGN.md says ±1.5 ms); "
             "read the range of the repeats before reading a difference of that size.",
             *run_.stalls]
    for name, peers in run_.outside.items():
        checks = run_.checks.get(name, 0)
        if peers:
            notes.append(f"{name} opened connections to non-loopback addresses: {', '.join(peers)} "
                         f"(seen in {checks} checks of its sockets)")
        else:
            notes.append(f"{name}: no connection to a non-loopback address in {checks} checks of its sockets "
                         "(/proc/PID/net/tcp, every process of its tree).")
    lite = next(a for a in run_.arms if a.name == "litellm")
    if lite.unavailable:
        notes.append(f"litellm: {lite.unavailable}")
    else:
        notes.append(f"litellm: litellm[proxy]=={litellm_env.LITELLM_VERSION}, one worker, "
                     f"venv {litellm_env.env_dir()}.")
    for mode, profile in run_.profiles.items():
        tables.append(profile.table(f"Gateway profile under saturation ({mode}, py-spy)"))
        notes.append(f"py-spy profile ({mode}): {profile.describe()}")
    # The representative run for the standard tables and plots: streaming at the lowest rate,
    # where every measured arm ran.
    rate = run_.rates[0]
    arms = {a.name: run_.runs[(a.name, rate, "stream")][0] for a in run_.arms if (a.name, rate, "stream") in run_.runs}
    parameters = {"scenario": "overhead", "rates": list(run_.rates), "step_s": run_.step_s,
                  "warmup_s": run_.warmup_s, "saturation_s": run_.saturation_s, "concurrency": CONCURRENCY,
                  "cpu_plan": {k: list(v) for k, v in run_.plan.items()}, "quick": ctx.options.quick,
                  "plots_show": f"stream at {rate:g} requests/s", "one_process_on_redis": run_.on_redis or None}
    report = build_report(arms or {"direct": []}, title="switchyard bench: overhead", parameters=parameters,
                          seeds={"workload": ctx.options.seed}, window_s=run_.step_s, tables=tables, goals=goals_,
                          notes=notes, baseline="direct")
    write_report(report, ctx.out_dir)
    met = [g for g in goals_ if g["met"] is not None]
    summary = (f"{sum(bool(g['met']) for g in met)} of {len(goals_)} goals met"
               + (f", {len(goals_) - len(met)} not measured" if len(met) < len(goals_) else ""))
    headline = [notes[0], notes[1], *[n for n in notes if n.startswith(("litellm", "py-spy"))]]
    return Outcome("overhead", "ok", summary, goals_, tables[:2], "overhead/report.md", notes=headline)

