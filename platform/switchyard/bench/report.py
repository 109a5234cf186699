"""The bench report: one computed structure, written as Markdown, JSON and PNG plots.

:func:`build_report` computes everything once into a plain dict (the content of
``report.json``); :func:`render_markdown` and :mod:`switchyard.bench.plots` only read that
dict, so the numbers in ``report.md``, ``report.json`` and the plots cannot disagree.
:func:`write_report` writes the three. Arms are compared side by side; the first arm (or
``baseline``) is the reference that ratios divide by.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import shlex
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from switchyard.bench.results import Result
from switchyard.bench.spec import Workload
from switchyard.bench.stats import SloSpec, Summary, compare, group_by, summarize, time_series
from switchyard.figures import NO_VALUE, fixed, ratio

SCHEMA = 1
#: A table cell with no value (no sample, no baseline to divide by): the figures' plain mark.
MISSING = NO_VALUE
#: Points kept per CDF curve in the report (evenly spaced in rank).
CDF_POINTS = 200
#: A p99 send lateness above this means the load generator could not keep its schedule.
LATENESS_WARN_S = 0.010
#: What the Markdown tables show: (summary field, label, multiplier, decimals).
TABLE_METRICS: tuple[tuple[str, str, float, int], ...] = (
    ("count", "requests", 1, 0),
    ("ok_rate", "ok %", 100, 1),
    ("shed_rate", "shed (503) %", 100, 1),
    ("limited_rate", "limited (429) %", 100, 1),
    ("error_rate", "errors %", 100, 1),
    ("timeout_rate", "timeouts %", 100, 1),
    ("fallback_rate", "fallback %", 100, 1),
    ("ttft_p50_s", "TTFT p50 ms", 1000, 1),
    ("ttft_p90_s", "TTFT p90 ms", 1000, 1),
    ("ttft_p99_s", "TTFT p99 ms", 1000, 1),
    ("itl_p50_s", "ITL p50 ms", 1000, 2),
    ("itl_p99_s", "ITL p99 ms", 1000, 2),
    ("e2e_p50_s", "E2E p50 s", 1, 3),
    ("e2e_p99_s", "E2E p99 s", 1, 3),
    ("slo_attainment", "SLO attainment %", 100, 1),
    ("goodput_rps", "goodput req/s", 1, 3),
    ("goodput_tps", "goodput tok/s", 1, 1),
    ("throughput_rps", "throughput req/s", 1, 3),
    ("output_tps", "output tok/s", 1, 1),
    ("cached_fraction", "prompt tokens cached %", 100, 1),
    ("lateness_p99_s", "send lateness p99 ms", 1000, 2),
)
_PACKAGES = ("switchyard", "aiohttp", "numpy", "matplotlib", "msgspec", "litestar", "uvicorn", "tqdm")


#: The configure options of CPython's build that change how fast it runs Python code.
_SPEED_OPTIONS = ("--enable-optimizations", "--with-lto", "--enable-shared")


def interpreter_build() -> dict[str, Any]:
    """How this Python was built, as far as it says: its executable (links resolved), the shared ``libpython`` it
    runs from (None: the interpreter is one executable, or this is not Linux) and which of :data:`_SPEED_OPTIONS`
    its ``configure`` was given.

    The processes a bench starts run this same interpreter, and its build moves a run's figures: the gateway's CPU a
    request differed by 7-21% between two builds of CPython 3.11 on one host (the README, `overhead`: "what the
    interpreter itself costs").
    A distribution may optimise its build by means these options do not show (Debian's runs its profile-guided and
    link-time optimised build through its own rules and keeps those flags out of ``sysconfig``), so they tell what
    was asked of ``configure``, not all that was done.
    """
    libpython = None
    with contextlib.suppress(OSError):  # (no /proc: not Linux)
        mapped = (fields[5] for line in Path("/proc/self/maps").read_text().splitlines()
                  if len(fields := line.split(maxsplit=5)) == 6)
        libpython = next((path for path in mapped if Path(path).name.startswith("libpython")), None)
    configured = shlex.split(str(sysconfig.get_config_var("CONFIG_ARGS") or ""))  # (shell-quoted, as given)
    return {"python_executable": os.path.realpath(sys.executable), "libpython": libpython,
            "python_configured": [option for option in _SPEED_OPTIONS if option in configured]}


def python_build(machine: Mapping[str, Any]) -> str:
    """:func:`interpreter_build`'s facts in words (a report's machine line)."""
    executable = machine.get("python_executable") or "?"
    libpython = machine.get("libpython")
    runs = f"libpython shared ({Path(libpython).name})" if libpython else "no shared libpython"
    configured = machine.get("python_configured") or []
    options = ", ".join(configured) if configured else "none"
    return f"{executable}, {runs}; configure options among {', '.join(_SPEED_OPTIONS)}: {options}"


def machine_info() -> dict[str, Any]:
    """Where the run happened: CPUs, memory, OS, Python (version and build) and package versions."""
    cpu_model = memory = None
    try:
        cpu_model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                          if line.startswith("model name")), None)
        mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal:"))
        memory = round(mem_kb / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    versions: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"cpu_count": os.cpu_count(), "cpus_usable": affinity, "cpu_model": cpu_model, "memory_gib": memory,
            "platform": platform.platform(), "python": sys.version.split()[0],
            "implementation": platform.python_implementation(), **interpreter_build(), "packages": versions}


def _cdf(results: Sequence[Result], points: int = CDF_POINTS) -> dict[str, Any]:
    """TTFT CDF over *all* requests: failures never arrive, so the curve tops out at the ok rate."""
    ttft = np.sort(np.array([r.ttft_s for r in results if r.ok and r.ttft_s is not None], dtype=np.float64))
    n = len(results)
    if not len(ttft):
        return {"x_s": [], "y": [], "requests": n}
    ranks = np.unique(np.linspace(0, len(ttft) - 1, min(points, len(ttft))).round().astype(np.int64))
    return {"x_s": ttft[ranks].tolist(), "y": ((ranks + 1) / n).tolist(), "requests": n}


def _ratios(summaries: Mapping[str, Summary], baseline: str) -> dict[str, dict[str, float | None]]:
    base = summaries.get(baseline)
    return {arm: compare(s, base) for arm, s in summaries.items() if arm != baseline and base is not None}


def build_report(arms: Mapping[str, Sequence[Result]], *, title: str = "switchyard bench",
                 workload: Workload | None = None, parameters: Mapping[str, Any] | None = None,
                 seeds: Mapping[str, int] | None = None, slo: SloSpec = None, window_s: float | None = None,
                 groups: Sequence[str] = ("class",), baseline: str | None = None, notes: Sequence[str] = (),
                 not_landed: Sequence[str] = (), bin_s: float = 1.0,
                 extra_series: Mapping[str, Mapping[str, Sequence[float]]] | None = None,
                 include_requests: bool = False, tables: Sequence[Mapping[str, Any]] = (),
                 goals: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """Compute the whole report as plain data (what ``report.json`` holds).

    Args:
        arms: Arm name -> its results, in display order; every arm ran the same workload.
        title: The report's title.
        workload: The workload run (its parameters, size and phases are recorded).
        parameters: The run's parameters (scenario, rates, policies, ...), as the caller names them.
        seeds: Every seed used, by name (the workload's own seed is added when known).
        slo: The SLO per class used for attainment and goodput.
        window_s: The window every rate is per; default: the workload's duration, else the
            longest arm's makespan (one window for all arms and groups, so rates compare).
        groups: Labels to break results down by (see ``stats.GROUP_KEYS``).
        baseline: The arm ratios divide by (default: the first).
        notes: Free-text notes (caveats, anomalies).
        not_landed: Scenarios that could not run, each with its reason.
        bin_s: Time-series bin width.
        extra_series: Arm -> series name -> per-bin values sampled elsewhere (queue depth).
        include_requests: Add every request's row (``Result.row``).
        tables: A scenario's own tables (``bench.tables.table``), shown before the summary.
        goals: A scenario's goals (``bench.tables.goal``), shown first.

    Raises:
        ValueError: No arms, or an unknown baseline.
    """
    if not arms:
        raise ValueError("a report needs at least one arm")
    names = list(arms)
    base = baseline or names[0]
    if base not in arms:
        raise ValueError(f"baseline {base!r} is not an arm ({', '.join(names)})")
    end = max((max((r.done_s for r in res), default=0.0) for res in arms.values()), default=0.0)
    window = window_s if window_s is not None else (workload.duration_s if workload is not None else end)
    overall = {arm: summarize(res, slo=slo, window_s=window) for arm, res in arms.items()}
    series: dict[str, Any] = {}
    for arm, res in arms.items():
        ts = time_series(res, bin_s=bin_s, end_s=end).as_dict()
        ts["extra"] = {k: list(v) for k, v in ((extra_series or {}).get(arm) or {}).items()}
        series[arm] = ts
    group_tables: dict[str, Any] = {}
    for key in groups:
        table: dict[str, Any] = {}
        per_arm = {arm: group_by(res, key) for arm, res in arms.items()}
        for value in sorted({g[0] for parts in per_arm.values() for g in parts}):
            cells = {arm: summarize(parts.get((value,), []), slo=slo, window_s=window)
                     for arm, parts in per_arm.items()}
            table[value] = {"arms": {a: s.as_dict() for a, s in cells.items()}, "ratios": _ratios(cells, base)}
        group_tables[key] = table
    cdf = {arm: {cls[0]: _cdf(rs) for cls, rs in group_by(res, "class").items()} for arm, res in arms.items()}
    all_seeds = dict(seeds or {})
    if workload is not None and "seed" in workload.source:
        all_seeds.setdefault("workload", workload.source["seed"])
    health = {}
    for arm, s in overall.items():
        late = s.lateness_p99_s
        health[arm] = {"lateness_p99_s": late, "lateness_max_s": s.lateness_max_s,
                       "behind_schedule": late is not None and late > LATENESS_WARN_S}
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "title": title,
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "arms": names,
        "baseline": base,
        "parameters": dict(parameters or {}),
        "seeds": all_seeds,
        "workload": workload.describe() if workload is not None else None,
        "phases": [list(p) for p in workload.phases] if workload is not None else [],
        "slo": _slo_dict(slo),
        "machine": machine_info(),
        "overall": {arm: s.as_dict() for arm, s in overall.items()},
        "ratios": _ratios(overall, base),
        "groups": group_tables,
        "generator_health": health,
        "timeseries": series,
        "ttft_cdf": cdf,
        "notes": list(notes),
        "not_landed": list(not_landed),
        "goals": [dict(g) for g in goals],
        "tables": [dict(t) for t in tables],
        "plots": [],
    }
    if include_requests:
        report["requests"] = {arm: [r.row() for r in res] for arm, res in arms.items()}
    return report


def _slo_dict(slo: SloSpec) -> dict[str, Any]:
    if slo is None:
        return {}
    if isinstance(slo, Mapping):
        return {cls: asdict(s) for cls, s in slo.items()}
    return {"*": asdict(slo)}


# --- Markdown ------------------------------------------------------------------------------


def format_value(value: Any, multiplier: float = 1, decimals: int = 3) -> str:
    """A table cell: the value times ``multiplier`` with ``decimals`` decimals; ``MISSING`` if None."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        return str(value)
    return fixed(value, scale=multiplier, decimals=decimals, missing=MISSING)


def _escape(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(arms: Sequence[str], cells: Mapping[str, Mapping[str, Any]],
           ratios: Mapping[str, Mapping[str, float | None]], baseline: str) -> list[str]:
    """Rows = metrics, columns = arms then one ratio column per non-baseline arm."""
    others = [a for a in arms if a != baseline and a in ratios]
    head = ["metric", *[_escape(a) for a in arms], *[f"{_escape(a)} / {_escape(baseline)}" for a in others]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label, mult, dec in TABLE_METRICS:
        row = [label, *[format_value(cells[a][key], mult, dec) if a in cells else MISSING for a in arms],
               *[ratio(ratios[a].get(key), missing=MISSING) for a in others]]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _key_values(title: str, data: Mapping[str, Any]) -> list[str]:
    if not data:
        return []
    lines = [f"## {title}", "", "| key | value |", "|---|---|"]
    lines += [f"| {_escape(k)} | {_escape(msgspec.json.encode(v).decode() if isinstance(v, dict | list) else v)} |"
              for k, v in data.items()]
    return [*lines, ""]


def render_markdown(report: Mapping[str, Any]) -> str:
    """``report.md`` from the structure :func:`build_report` made."""
    arms, base = report["arms"], report["baseline"]
    from switchyard.bench.tables import render_goals, render_table  # tables imports this module

    out = [f"# {report['title']}", "", f"Created {report['created_utc']}. Arms: "
           + ", ".join(f"`{a}`" for a in arms) + f"; ratios are against `{base}`.", ""]
    out += render_goals(report.get("goals", ()))
    if report.get("tables"):
        out += ["## Figures", ""]
        for data in report["tables"]:
            out += render_table(data)
    out += ["## Summary", "", *_table(arms, report["overall"], report["ratios"], base), ""]
    for key, table in report["groups"].items():
        out += [f"## By {key}", ""]
        for value, group in table.items():
            out += [f"### {key} = {_escape(value)}", "", *_table(arms, group["arms"], group["ratios"], base), ""]
    behind = [a for a, h in report["generator_health"].items() if h["behind_schedule"]]
    out += ["## Load generator", ""]
    for arm, h in report["generator_health"].items():
        out.append(f"- `{arm}`: send lateness p99 {format_value(h['lateness_p99_s'], 1000, 2)} ms, "
                   f"max {format_value(h['lateness_max_s'], 1000, 2)} ms")
    if behind:
        out.append(f"- **Behind schedule** (p99 lateness > {LATENESS_WARN_S * 1000:.0f} ms) in "
                   + ", ".join(f"`{a}`" for a in behind) + ": latencies there include the generator's own delay.")
    out.append("")
    if report["plots"]:
        out += ["## Plots", "", *[f"![{Path(p).stem}]({p})" for p in report["plots"]], ""]
    if report["notes"]:
        out += ["## Notes", "", *[f"- {_escape(n)}" for n in report["notes"]], ""]
    if report["not_landed"]:
        out += ["## Not landed", "", *[f"- {_escape(n)}" for n in report["not_landed"]], ""]
    out += _key_values("Parameters", report["parameters"])
    out += _key_values("Seeds", report["seeds"])
    out += _key_values("Workload", report["workload"] or {})
    out += _key_values("SLO", report["slo"])
    machine = {k: v for k, v in report["machine"].items() if k != "packages"}
    out += _key_values("Machine", {**machine, **{f"version {k}": v for k, v in report["machine"]["packages"].items()}})
    if "requests" in report:
        counts = ", ".join(f"`{a}` {len(rows)}" for a, rows in report["requests"].items())
        out += [f"Per-request rows are in `report.json` (`requests`): {counts}.", ""]
    return "\n".join(out)


def write_report(report: dict[str, Any], out_dir: str | Path, *, plots: bool = True) -> dict[str, Path]:
    """Write ``report.md``, ``report.json`` and the plots into ``out_dir`` (created if needed).

    The plot file names are recorded in ``report["plots"]`` before the Markdown and JSON are
    written, so both list them.

    Returns:
        File role (``markdown``, ``json``, and one per plot) -> path.
    """
    from switchyard.bench.plots import write_plots  # matplotlib loads only when plots are written

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    if plots:
        files.update(write_plots(report, out))
        report["plots"] = sorted(p.name for p in files.values())
    files["markdown"] = out / "report.md"
    files["markdown"].write_text(render_markdown(report), encoding="utf-8")
    files["json"] = out / "report.json"
    files["json"].write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=1) + b"\n")
    return files
