"""One ``switchyard bench`` run: each chosen scenario in turn, then the run's index report.

Every scenario writes its own folder (``<out>/<scenario>/report.md``, ``report.json``, plots);
the run writes ``<out>/report.md`` and ``<out>/report.json``: each scenario's status, goals and
headline tables (copied from what the scenario reported, rendered from the JSON), and the
scenarios that have not landed, named with their issue. Processes of a scenario are stopped
before the next one starts; logs of all of them are in ``<out>/logs``.

A scenario that raises is recorded as ``failed`` with its error (the traceback goes to
``logs/<scenario>-error.log``) and the run goes on; :attr:`BenchRun.failed` tells the CLI to
exit non-zero. A missed goal is not a failure: it is a finding, in the report.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from switchyard.bench.procs import CpuMeter, Processes
from switchyard.bench.report import machine_info, python_build
from switchyard.bench.scenarios import SCENARIOS, BenchOptions, Outcome, Scenario, ScenarioContext
from switchyard.bench.tables import render_goals, render_table

SCHEMA = 1
#: Other processes using more than this share of the machine's CPU make a scenario's figures suspect.
BUSY_MACHINE = 0.10


@dataclass
class BenchRun:
    """What a run did."""

    out_dir: Path
    outcomes: list[Outcome]
    report: dict[str, Any]

    @property
    def failed(self) -> list[Outcome]:
        """Scenarios that could not run to the end."""
        return [o for o in self.outcomes if o.status == "failed"]


def not_landed_lines() -> list[str]:
    """One line per scenario that has not landed (all of them, chosen or not)."""
    return [s.not_landed_line() for s in SCENARIOS.values() if not s.landed]


def run_bench(options: BenchOptions, names: Sequence[str], say: Callable[[str], None]) -> BenchRun:
    """Run the scenarios ``names`` in order and write the index report.

    Raises:
        KeyError: An unknown scenario name.
        KeyboardInterrupt: The run was interrupted (every process is stopped first).
    """
    scenarios = [SCENARIOS[n] for n in names]
    out = options.out_dir.resolve()  # processes run in other folders (LiteLLM in its state folder)
    out.mkdir(parents=True, exist_ok=True)
    outcomes: list[Outcome] = []
    started = datetime.now(UTC)
    try:
        _run(scenarios, options, out, outcomes, say)
    except KeyboardInterrupt:
        write_index(index_report(options, outcomes, started, interrupted=True), out)
        raise
    report = index_report(options, outcomes, started)
    write_index(report, out)
    return BenchRun(out, outcomes, report)


def _run(scenarios: Sequence[Scenario], options: BenchOptions, out: Path, outcomes: list[Outcome],
         say: Callable[[str], None]) -> None:
    with Processes(out / "logs") as procs:
        for scenario in scenarios:
            if not scenario.landed or scenario.run is None:
                say(f"{scenario.name}: not landed yet (issue {scenario.issue})")
                outcomes.append(Outcome(scenario.name, "not_landed", scenario.not_landed_line()))
                continue
            say(f"{scenario.name}: {scenario.measures}")
            ctx = ScenarioContext(options, out / scenario.name, procs, say)
            ctx.out_dir.mkdir(parents=True, exist_ok=True)
            meter = CpuMeter(procs)
            meter.start()
            try:
                outcome = scenario.run(ctx)
            except Exception as exc:  # a scenario's failure is reported; the run goes on
                (out / "logs").mkdir(parents=True, exist_ok=True)
                (out / "logs" / f"{scenario.name}-error.log").write_text(traceback.format_exc(), encoding="utf-8")
                say(f"{scenario.name}: FAILED: {type(exc).__name__}: {exc}")
                outcome = Outcome(scenario.name, "failed", "could not run to the end",
                                  error=f"{type(exc).__name__}: {exc}")
            finally:
                procs.stop_all()
            outcome.plots = sorted(str(p.relative_to(out)) for p in ctx.out_dir.glob("*.png"))
            outcome.cpu = meter.stop()
            if outcome.cpu and outcome.cpu["others_share"] > BUSY_MACHINE:
                outcome.notes.append(f"Other processes used {100 * outcome.cpu['others_share']:.0f}% of the machine's "
                                     "CPU while this scenario ran: its figures are not the system's own; run again "
                                     "on a quiet machine.")
            outcomes.append(outcome)


def index_report(options: BenchOptions, outcomes: Sequence[Outcome], started: datetime, *,
                 interrupted: bool = False) -> dict[str, Any]:
    """The run's index as plain data (``report.json``)."""
    return {
        "schema": SCHEMA,
        "title": "switchyard bench",
        "created_utc": started.isoformat(timespec="seconds"),
        "finished_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "options": options.describe(),
        "seeds": {"seed": options.seed},
        "scenarios": [o.as_dict() for o in outcomes],
        "not_landed": not_landed_lines(),
        "failed": [o.name for o in outcomes if o.status == "failed"],
        "interrupted": interrupted,
        "machine": machine_info(),
    }


def render_index(report: dict[str, Any]) -> str:
    """``report.md`` of the run, from :func:`index_report`'s data alone."""
    opts = report["options"]
    out = ["# switchyard bench", "",
           f"Started {report['created_utc']}, finished {report['finished_utc']}. Seed {opts['seed']}"
           + (", **quick run** (a few seconds per arm: figures are indicative only)" if opts["quick"] else "") + "."
           + (" **Interrupted**: only the scenarios listed below finished." if report.get("interrupted") else ""),
           "", "| scenario | status | summary | report |", "|---|---|---|---|"]
    for s in report["scenarios"]:
        link = f"[{s['report']}]({s['report']})" if s["report"] else "-"
        out.append(f"| {s['name']} | {s['status']} | {s['summary'] or s['error'] or ''} | {link} |")
    out.append("")
    for s in report["scenarios"]:
        out += [f"## {s['name']}", ""]
        if s["status"] == "failed":
            out += [f"**Failed:** {s['error']}", ""]
        elif s["status"] == "not_landed":
            out += [s["summary"], ""]
        out += render_goals(s["goals"], level=3)
        for data in s["tables"]:
            out += render_table(data)
        cpu = s.get("cpu")
        if cpu:
            out += [f"CPU while it ran ({cpu['seconds']:.0f} s): this bench {100 * cpu['bench_share']:.0f}% of the "
                    f"machine, other processes {100 * cpu['others_share']:.0f}%.", ""]
        if s["notes"]:
            out += [*[f"- {n}" for n in s["notes"]], ""]
        if s.get("plots"):
            out += [*[f"![{Path(p).stem}]({p})" for p in s["plots"]], ""]
    out += ["## Not landed yet", "", *[f"- {line}" for line in report["not_landed"]], ""]
    out += ["## Run", "", "| option | value |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in opts.items()]
    machine = report["machine"]
    out += ["", f"Machine: {machine['cpu_count']} CPUs ({machine['cpus_usable']} usable), {machine['cpu_model']}, "
            f"{machine['memory_gib']} GiB, {machine['platform']}, Python {machine['python']} "
            f"({python_build(machine)}).", ""]
    return "\n".join(out)


def write_index(report: dict[str, Any], out: Path) -> None:
    """Write ``report.md`` and ``report.json`` of the run."""
    (out / "report.md").write_text(render_index(report), encoding="utf-8")
    (out / "report.json").write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=1) + b"\n")
