"""The ``headline`` scenario's figures: goodput at SLO per arm and class, attainment through the peak and the
outage, engine utilisation, the batch backlog's progress, and the day's plot."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from switchyard.bench.results import Result
from switchyard.bench.scenarios.arms import Arm, Capacity
from switchyard.bench.scenarios.headline.day import PEAK, TROUGH, arrival_curve, load_at, load_shape
from switchyard.bench.scenarios.headline.fleet import (
    ARMS,
    BASELINES,
    CLASSES,
    LEAST_LOADED,
    MAX_NUM_SEQS,
    NO_BACKLOG,
    OUTAGE,
    OUTAGE_REGION,
    PRICE,
    PROFILE,
    REGIONS,
    REPLICAS,
    ROUND_ROBIN,
    SLO_TTFT_S,
    SWITCHYARD,
    TENANTS,
    TOKEN_SCALE,
)
from switchyard.bench.spec import Workload
from switchyard.bench.stats import Slo, goodput, slo_attainment
from switchyard.bench.tables import goal, ms, num, pct, table, text
from switchyard.figures import fixed, percent

if TYPE_CHECKING:
    from switchyard.bench.scenarios.headline.scenario import Headline

GOAL_VS_ROUND_ROBIN = 2.0
GOAL_VS_LEAST_LOADED = 1.5
GOAL_CRITICAL = 0.99
GOAL_STANDARD = 0.90
GOAL_UTILISATION = 0.85
GOAL_BACKLOG_POINTS = 0.01
#: Bins of the day plot's offered load and goodput.
DAY_BINS = 48


def slo_spec() -> dict[str, Slo]:
    """Each class's TTFT objective."""
    return {cls: Slo(ttft_s=SLO_TTFT_S[cls]) for cls in CLASSES}


def _attainment(results: Sequence[Result]) -> float | None:
    return slo_attainment(results, slo_spec())


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if known else None


def measure(arms: Sequence[Arm], workload: Workload) -> dict[str, dict[str, Any]]:
    """Every arm's figures, by arm name."""
    spec = slo_spec()
    duration = workload.duration_s
    shape = load_shape(arrival_curve())
    peak = [t for t in range(int(duration)) if load_at(shape, t + 0.5, duration) >= 1.0]
    peak_window = (min(peak), max(peak) + 1.0) if peak else None
    out: dict[str, dict[str, Any]] = {}
    for arm in arms:
        results = arm.results
        down = (OUTAGE[0] * duration, OUTAGE[1] * duration)
        in_outage = [r for r in results if down[0] <= r.scheduled_s < down[1]]
        in_peak = [r for r in results if peak_window and peak_window[0] <= r.scheduled_s < peak_window[1]]
        bins = int(duration)
        busy: list[float | None] = list(getattr(arm, "busy", []))[:bins]
        in_use: list[float | None] = list(getattr(arm, "in_use", []))[:bins]
        occupancy: list[float | None] = list(getattr(arm, "occupancy", []))[:bins]
        lags = [v for v in list(getattr(arm, "lag_s", []))[:bins] if v is not None]
        row: dict[str, Any] = {
            "arm": arm.name, "requests": len(results), "ok": sum(r.ok for r in results),
            "goodput_rps": goodput(results, spec, duration)[0], "attainment": _attainment(results),
            "outage_requests": len(in_outage), "outage_failed": sum(not r.ok for r in in_outage),
            "outage_attainment": _attainment(in_outage),
            "offered_rps": len(results) / duration,
            "utilisation": _mean(occupancy), "utilisation_series": occupancy,
            "busy": _mean(busy), "busy_series": busy,
            "in_use": _mean(in_use), "in_use_series": in_use,
            "lag_max_s": max(lags) if lags else None,
            "lag_p99_s": float(np.percentile(lags, 99)) if lags else None,
            "goodput_series": goodput_series(results, duration),
            "attainment_series": attainment_series(results, duration),
            "batch_lines": getattr(arm, "batch_lines", 0), "batch_done": getattr(arm, "batch_done", 0),
            "batch_failed": getattr(arm, "batch_failed", 0), "batch_via": getattr(arm, "batch_via", ""),
            "peak_window_s": peak_window,
            "cost_per_1k": cost_per_1k(results),
        }
        for cls in CLASSES:
            mine = [r for r in results if r.request_class == cls]
            row[f"{cls}_goodput_rps"] = goodput(mine, spec, duration)[0]
            row[f"{cls}_attainment"] = _attainment(mine)
            row[f"{cls}_peak_attainment"] = _attainment([r for r in in_peak if r.request_class == cls])
            row[f"{cls}_outage_attainment"] = _attainment([r for r in in_outage if r.request_class == cls])
        for tenant in TENANTS:
            row[f"tenant_{tenant.name}_attainment"] = _attainment([r for r in results if r.tenant == tenant.name])
        out[arm.name] = row
    return out


def served_model(result: Result) -> str | None:
    """The model that answered, from the route header (``model=small; route=auto; ...``)."""
    for part in (result.route or "").split("; "):
        if part.startswith("model="):
            return part[len("model="):]
    return None


def cost_per_1k(results: Sequence[Result]) -> float | None:
    """Dollars per 1,000 answered requests at the policy's prices, from each answer's usage and the model that
    served it (None: nothing answered)."""
    ok = [r for r in results if r.ok]
    if not ok:
        return None
    total = 0.0
    for r in ok:
        inp, out = PRICE.get(served_model(r) or "", (0.0, 0.0))
        total += ((r.prompt_tokens or 0) * inp + (r.completion_tokens or 0) * out) / 1e6
    return total / len(ok) * 1000


def _ratio(measured: Mapping[str, Mapping[str, Any]], arm: str, base: str) -> float | None:
    if arm not in measured or base not in measured or not measured[base]["goodput_rps"]:
        return None
    return float(measured[arm]["goodput_rps"] / measured[base]["goodput_rps"])


def bound(measured: Mapping[str, Mapping[str, Any]], base: str) -> float | None:
    """The highest ratio any arm could reach against ``base``: every request the day offered served within its
    objective, over ``base``'s goodput."""
    row = measured.get(base)
    if row is None or not row["goodput_rps"]:
        return None
    return float(row["offered_rps"] / row["goodput_rps"])


def _bound_note(measured: Mapping[str, Mapping[str, Any]], base: str) -> str:
    most = bound(measured, base)
    return "" if most is None else f"at most {most:.2f}x: every offered request within its objective"


#: Steps of the fluid estimate of what was attainable (seconds).
FLUID_STEP_S = 0.1


def attainable(workload: Workload, capacity_rps: float, down_s: tuple[float, float] | None,
               alive_while_down: float) -> dict[str, float | None]:
    """The share of each class's requests that any router could have served within its objective: an estimate.

    A fluid model of the day: the fleet turns over ``capacity_rps`` requests a second (``alive_while_down`` of
    it while the outage region is down, ``down_s``); each step's capacity goes to the waiting requests of the
    best class first, oldest first; a request still waiting when its class's TTFT objective has passed is lost.
    It gives the classes above their share before the classes below, as the policy asks, and is generous
    elsewhere: a request costs the day's average (the capacity was measured with the whole mix on every engine,
    whichever model ``auto`` would pick), and its prefill takes no time. The exact cache and downgrades to a
    cheaper model can add a little to it.
    """
    spec = slo_spec()
    arrivals = sorted((s.arrival_s, s.request_class) for s in workload.specs if s.request_class in spec)
    offered = dict.fromkeys(CLASSES, 0)
    for _, cls in arrivals:
        offered[cls] += 1
    waiting: dict[str, deque[list[float]]] = {cls: deque() for cls in CLASSES}  # [arrival, amount waiting]
    met = dict.fromkeys(CLASSES, 0.0)
    i, t = 0, 0.0
    end = workload.duration_s + max(spec[c].ttft_s or 0.0 for c in CLASSES)
    while t < end:
        t += FLUID_STEP_S
        while i < len(arrivals) and arrivals[i][0] < t:
            waiting[arrivals[i][1]].append([arrivals[i][0], 1.0])
            i += 1
        down = down_s is not None and down_s[0] <= t < down_s[1]
        room = capacity_rps * FLUID_STEP_S * (alive_while_down if down else 1.0)
        for cls in CLASSES:
            queue, objective = waiting[cls], spec[cls].ttft_s or math.inf
            while queue and t - queue[0][0] > objective:
                queue.popleft()
            while queue and room > 0:
                served = min(room, queue[0][1])
                met[cls] += served
                room -= served
                queue[0][1] -= served
                if queue[0][1] <= 0:
                    queue.popleft()
    return {cls: (met[cls] / offered[cls] if offered[cls] else None) for cls in CLASSES}


def tables_of(measured: Mapping[str, Mapping[str, Any]], capacity: Capacity, workload: Workload,
              pool_capacity: Mapping[str, float] | None = None) -> list[dict[str, Any]]:
    """The scenario's tables: goodput and attainment per arm and class, per tenant, the outage, the backlog."""
    arms = [measured[a] for a in ARMS if a in measured]
    by_class = [{"arm": r["arm"], **{k: r[k] for k in r if k.startswith(CLASSES)}, "goodput_rps": r["goodput_rps"],
                 "attainment": r["attainment"]} for r in arms]
    columns = [text("arm", "arm"), num("goodput_rps", "goodput req/s", 2), pct("attainment", "attained")]
    for cls in CLASSES:
        columns += [num(f"{cls}_goodput_rps", f"{cls} req/s", 2), pct(f"{cls}_attainment", f"{cls} attained"),
                    pct(f"{cls}_peak_attainment", f"{cls} at peak")]
    tenants = [{"arm": r["arm"], **{t.name: r[f"tenant_{t.name}_attainment"] for t in TENANTS}} for r in arms]
    outage = [{"arm": r["arm"], "requests": r["outage_requests"], "failed": r["outage_failed"],
               "attainment": r["outage_attainment"],
               **{f"{c}_outage_attainment": r[f"{c}_outage_attainment"] for c in CLASSES}} for r in arms]
    fleet = [{"arm": r["arm"], "in_use": r["in_use"], "utilisation": r["utilisation"], "busy": r["busy"],
              "lag_p99_s": r["lag_p99_s"], "lag_max_s": r["lag_max_s"], "cost_per_1k": r["cost_per_1k"],
              "batch_lines": r["batch_lines"],
              "batch_done": r["batch_done"], "batch_failed": r["batch_failed"], "batch_via": r["batch_via"] or "-"}
             for r in arms]
    return [
        table("Goodput at SLO (interactive requests that met their class's TTFT objective, per second of the day) "
              "and SLO attainment, overall and per class", columns, by_class,
              f"Capacity {capacity.rps:.1f} requests/s: every sequence slot of the fleet busy with the day's kind of "
              f"requests, each engine called directly ({capacity.clients} clients"
              + "".join(f"; {m} pools {r:.1f}" for m, r in (pool_capacity or {}).items())
              + f"). The day offered {len(workload)} requests over {workload.duration_s:g} s "
              f"({len(workload) / workload.duration_s:.1f} requests/s): goodput can be no higher. 'at peak': "
              "requests scheduled while the offered load was at least 1x capacity."),
        table("SLO attainment per tenant", [text("arm", "arm"), *(pct(t.name, f"{t.name} ({t.tier})")
                                                                   for t in TENANTS)], tenants),
        table(f"The outage ({OUTAGE_REGION} down)", [text("arm", "arm"), num("requests", "requests", 0),
                                                     num("failed", "failed", 0), pct("attainment", "attained"),
                                                     *(pct(f"{c}_outage_attainment", f"{c} attained")
                                                       for c in CLASSES)], outage),
        table("Engine utilisation (the share of the engines' throughput in use, mean over the day), sequence slots "
              "taken, time busy, the simulators' lag, cost and the batch backlog",
              [text("arm", "arm"), pct("in_use", "utilisation (throughput in use)"),
               pct("utilisation", "slots taken"), pct("busy", "busy"),
               ms("lag_p99_s", "sim lag p99 ms", 1), ms("lag_max_s", "sim lag max ms", 1),
               num("cost_per_1k", "$ per 1,000 answers", 4), num("batch_lines", "backlog lines", 0),
               num("batch_done", "lines done", 0), num("batch_failed", "lines failed", 0),
               text("batch_via", "sent through")], fleet,
              "Utilisation is the share of the engines' throughput their steps used, from the simulators' own cost "
              "model: each step counts the larger of its sequence slots taken (a step bound by reading weights and "
              "KV gains throughput with every sequence it batches, up to --max-num-seqs) and its compute's share of "
              "the roofline (a compute-bound step, a long prefill, turns over all the engine can: more sequences "
              "would only lengthen it); idle time counts nothing. Slots taken (sequences running over "
              "--max-num-seqs, sampled each second) undercounts an engine busy with long prefills and short "
              "answers, the backlog's kind of work. Busy is the share of time an engine computed steps, what a "
              "GPU's utilisation counter reports: an engine running one sequence is busy, so it is high whenever "
              "work trickles in and says little about capacity left. All three count the engines that were up "
              "(eu-west's are out of the fleet while down). The "
              "lag is how far a simulated engine ran behind its wall clock (sampled each second): the two cores "
              "kept up with the simulation when it stays small against the TTFT objectives."),
    ]


def utilisation_of(row: Mapping[str, Any]) -> float | None:
    """An arm's engine utilisation: the throughput in use where the engines reported it (the simulators' cost
    model), else the sequence slots taken."""
    in_use = row.get("in_use")
    return in_use if in_use is not None else row.get("utilisation")


def goals_of(measured: Mapping[str, Mapping[str, Any]],
             reachable: Mapping[str, float | None] | None = None) -> list[dict[str, Any]]:
    """The issue's goals, met or missed, from the figures (``reachable``: :func:`attainable`'s estimate per class,
    quoted beside the attainment goals)."""
    def most(cls: str) -> str:
        share = (reachable or {}).get(cls)
        return "" if share is None else f"; at most about {percent(share)} attainable (a fluid estimate)"

    sy = measured.get(SWITCHYARD)
    vs_rr, vs_ll = _ratio(measured, SWITCHYARD, ROUND_ROBIN), _ratio(measured, SWITCHYARD, LEAST_LOADED)
    goals = [
        goal("goodput at SLO, Switchyard ÷ round-robin", f"≥ {GOAL_VS_ROUND_ROBIN:g}x", vs_rr,
             None if vs_rr is None else vs_rr >= GOAL_VS_ROUND_ROBIN, unit="x",
             note=_bound_note(measured, ROUND_ROBIN)),
        goal("goodput at SLO, Switchyard ÷ least-loaded", f"≥ {GOAL_VS_LEAST_LOADED:g}x", vs_ll,
             None if vs_ll is None else vs_ll >= GOAL_VS_LEAST_LOADED, unit="x",
             note=_bound_note(measured, LEAST_LOADED)),
    ]
    if sy is None:
        return goals
    critical = [v for v in (sy["critical_peak_attainment"], sy["critical_outage_attainment"]) if v is not None]
    worst = min(critical) if critical else None
    goals.append(goal("critical attainment through the peak and the outage (the lower)", f"≥ {GOAL_CRITICAL:.0%}",
                      worst, None if worst is None else worst >= GOAL_CRITICAL, unit="%", multiplier=100,
                      decimals=1, note=f"peak {percent(sy['critical_peak_attainment'])}, outage "
                                       f"{percent(sy['critical_outage_attainment'])}" + most("critical")))
    std = sy["standard_attainment"]
    goals.append(goal("standard attainment over the day", f"≥ {GOAL_STANDARD:.0%}", std,
                      None if std is None else std >= GOAL_STANDARD, unit="%", multiplier=100, decimals=1,
                      note=most("standard").removeprefix("; ")))
    use = utilisation_of(sy)
    goals.append(goal("engine utilisation over the day, with the backlog", f"≥ {GOAL_UTILISATION:.0%}", use,
                      None if use is None else use >= GOAL_UTILISATION, unit="%", multiplier=100, decimals=1,
                      note=("throughput in use; " if sy["in_use"] is not None else "")
                      + f"slots taken {percent(sy['utilisation'])}, busy {percent(sy['busy'])}"))
    without = measured.get(NO_BACKLOG)
    if without is not None and sy["attainment"] is not None and without["attainment"] is not None:
        drop = without["attainment"] - sy["attainment"]
        goals.append(goal("interactive attainment lost to the backlog (without - with)",
                          f"≤ {GOAL_BACKLOG_POINTS * 100:g} point", drop, drop <= GOAL_BACKLOG_POINTS, unit="points",
                          multiplier=100, decimals=1,
                          note=f"{percent(sy['attainment'])} with, {percent(without['attainment'])} without"))
    return goals


def notes_of(h: Headline, capacity: Capacity) -> list[str]:
    """What the figures rest on."""
    return [
        f"Fleet: {len(REGIONS)} regions ({', '.join(REGIONS)}), each {REPLICAS} replicas of the small model "
        f"(`{PROFILE['small']}`) and {REPLICAS} of the large one (`{PROFILE['large']}`), --max-num-seqs "
        f"{MAX_NUM_SEQS}, time scale {h.time_scale:g}. The engines are simulated on the built-in H100 profiles: "
        "roofline step times from published datasheet and model figures, not calibrated against a GPU (the only "
        "calibrated profile, `cpu-tiny-llama`, is a CPU's). Every arm ran on fresh engines and a fresh gateway with "
        "the same requests at the same times.",
        f"Capacity: {capacity.rps:.1f} requests/s, every sequence slot of every engine busy with the day's kind of "
        "requests (each engine called directly, whatever model `auto` would pick): the most any router could get "
        "from the fleet. The day's load is a multiple of it.",
        "Arms: round-robin and least-loaded are the gateway with its baseline picker (SWITCHYARD_PICKER), flow "
        "control off, no priority scheduling, no limits, no shedding, no downgrade and no batch lane: the backlog "
        "is sent by a batch script as ordinary requests. Both keep the same models, `auto` route, fallbacks, "
        "health probes and breakers as Switchyard (what a load balancer with health checks also has). "
        "switchyard-no-backlog is the full policy without the backlog. The classes' TTFT objectives are declared "
        "in the Switchyard policy (`ttft_objective`) and measured the same way for every arm. No LiteLLM arm: "
        "on this machine its proxy sustains some 60-80 streamed requests/s on one worker (the overhead scenario), "
        "against a day that peaks near 1.5x the fleet's capacity, so it would measure its own CPU, not its "
        "routing.",
        f"The day: the Azure conversation trace's arrivals per minute (smoothed) mapped onto {TROUGH:g}x-{PEAK:g}x "
        f"the measured capacity, stretched over {h.duration_s:g} s; lengths and shared prefixes from the Mooncake "
        f"conversation trace (scaled by {TOKEN_SCALE:g}); {OUTAGE_REGION} killed from {OUTAGE[0]:.0%} to "
        f"{OUTAGE[1]:.0%} of the day and started again. The backlog: the Mooncake synthetic trace's rows (scaled "
        "alike), as many as the idle capacity calls for, at most the trace's.",
        "Cost per 1,000 answers: each interactive answer's usage at the policy's prices of the model that served it "
        "(its route header).",
    ]


def summary(measured: Mapping[str, Mapping[str, Any]]) -> str:
    """One sentence for the run's index."""
    vs_rr, vs_ll = _ratio(measured, SWITCHYARD, ROUND_ROBIN), _ratio(measured, SWITCHYARD, LEAST_LOADED)
    sy = measured.get(SWITCHYARD, {})
    use = utilisation_of(sy)
    return (f"goodput at SLO {fixed(vs_rr, decimals=2, unit='x')} round-robin's and "
            f"{fixed(vs_ll, decimals=2, unit='x')} least-loaded's; critical attainment "
            f"{percent(sy.get('critical_attainment'))}, utilisation {percent(use)}")


def write_day_plot(measured: Mapping[str, Mapping[str, Any]], workload: Workload, capacity: Capacity,
                   path: Path) -> Path:
    """Offered load against capacity, goodput at SLO, each class's SLO attainment (Switchyard's, and round-robin's
    beside it) and engine utilisation over the day, per arm."""
    duration = workload.duration_s
    width = duration / DAY_BINS
    edges = np.arange(DAY_BINS + 1) * width
    fig = Figure(figsize=(9, 12))
    axes = fig.subplots(4, 1, sharex=True)
    arrivals = np.histogram([s.arrival_s for s in workload.specs], bins=edges)[0] / width / capacity.rps
    axes[0].stairs(arrivals, edges, label="offered load")
    axes[0].axhline(1.0, color="0.4", linestyle="--", label="capacity")
    for ax in axes:
        ax.axvspan(OUTAGE[0] * duration, OUTAGE[1] * duration, color="0.9", zorder=0)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("load (x capacity)")
    axes[0].legend(fontsize="small", loc="upper left")
    axes[0].set_title(f"The day (grey: {OUTAGE_REGION} down)")
    axes[1].set_ylabel("goodput at SLO (req/s)")
    axes[2].set_ylabel("SLO attainment per class\n(solid: switchyard,\ndotted: round-robin)")
    axes[3].set_ylabel("engine utilisation\n(throughput in use)")
    axes[3].set_xlabel("time of the day (s)")
    for name, row in measured.items():
        series = row.get("goodput_series") or []
        if len(series) == DAY_BINS:
            axes[1].stairs(series, edges, label=name)
        use = [np.nan if v is None else v for v in row.get("in_use_series") or row.get("utilisation_series") or []]
        axes[3].plot(np.arange(len(use)) + 0.5, use, label=name)
    for name, style in ((SWITCHYARD, "-"), (ROUND_ROBIN, ":")):
        by_class = (measured.get(name) or {}).get("attainment_series") or {}
        for color, cls in zip(("tab:red", "tab:blue", "tab:green"), CLASSES, strict=False):
            shares = [np.nan if v is None else v for v in by_class.get(cls) or []]
            if len(shares) == DAY_BINS:
                axes[2].stairs(shares, edges, linestyle=style, color=color, baseline=None,
                               label=cls if name == SWITCHYARD else None)
    axes[2].set_ylim(-0.02, 1.02)
    axes[1].legend(fontsize="small", loc="upper left")
    axes[2].legend(fontsize="small", loc="lower left")
    axes[3].legend(fontsize="small", loc="lower left")
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    return path


def goodput_series(results: Sequence[Result], duration_s: float, bins: int = DAY_BINS) -> list[float]:
    """Requests that met their SLO per second, in ``bins`` bins of the day by their scheduled time."""
    spec = slo_spec()
    bin_s = duration_s / bins
    counts = [0] * bins
    for r in results:
        if spec[r.request_class].met(r):
            i = min(bins - 1, int(r.scheduled_s // bin_s))
            if i >= 0:
                counts[i] += 1
    return [c / bin_s for c in counts]


def attainment_series(results: Sequence[Result], duration_s: float,
                      bins: int = DAY_BINS) -> dict[str, list[float | None]]:
    """Each class's SLO attainment in ``bins`` bins of the day, by the requests' scheduled time (None: the class
    sent nothing then)."""
    spec = slo_spec()
    bin_s = duration_s / bins
    sent = {cls: [0] * bins for cls in CLASSES}
    met = {cls: [0] * bins for cls in CLASSES}
    for r in results:
        cls = r.request_class
        if cls not in spec:
            continue
        i = min(bins - 1, int(r.scheduled_s // bin_s))
        if i >= 0:
            sent[cls][i] += 1
            met[cls][i] += spec[cls].met(r)
    return {cls: [m / n if n else None for m, n in zip(met[cls], sent[cls], strict=True)] for cls in CLASSES}


__all__ = ["BASELINES", "attainment_series", "goals_of", "goodput_series", "measure", "notes_of", "summary",
           "tables_of", "write_day_plot"]
