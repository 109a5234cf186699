"""What every scenario gets (:class:`BenchOptions`, :class:`ScenarioContext`) and gives back (:class:`Outcome`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from switchyard.bench.procs import Processes

Status = Literal["ok", "failed", "not_landed"]


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """The run's options, as ``switchyard bench`` was given them.

    Attributes:
        out_dir: The report folder.
        seed: Seeds every workload and simulated engine.
        quick: A few seconds per arm (smoke tests); figures are indicative only.
        trace: The Mooncake trace the prefix scenario replays (None: the default path).
        rate_multiplier: Trace replay speed-up (None: the scenario's default).
        time_scale: Simulated engines' time scale (None: the scenario's default).
        duration_s: Seconds per arm (None: the scenario's default).
        litellm: Include the LiteLLM arm in the overhead scenario.
        profile: Record a py-spy profile of the gateway in the overhead scenario.
        progress: Show progress bars (on a terminal).
        workload: The prefix scenario's workload, ``mooncake`` or ``agents`` (None: both; ``--quick``: the first).
    """

    out_dir: Path
    seed: int = 0
    quick: bool = False
    trace: Path | None = None
    rate_multiplier: float | None = None
    time_scale: float | None = None
    duration_s: float | None = None
    litellm: bool = True
    profile: bool = False
    progress: bool = True
    workload: str | None = None

    def describe(self) -> dict[str, Any]:
        """The options as JSON-ready data."""
        return {"out_dir": str(self.out_dir), "seed": self.seed, "quick": self.quick,
                "trace": str(self.trace) if self.trace else None, "rate_multiplier": self.rate_multiplier,
                "time_scale": self.time_scale, "duration_s": self.duration_s, "litellm": self.litellm,
                "profile": self.profile, "workload": self.workload}


@dataclass
class ScenarioContext:
    """A running scenario's surroundings.

    Attributes:
        options: The run's options.
        out_dir: This scenario's folder (``<report>/<scenario>``).
        procs: The process set; everything started through it is stopped when the run ends.
        say: Prints one progress line (stderr).
    """

    options: BenchOptions
    out_dir: Path
    procs: Processes
    say: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))

    @property
    def state_dir(self) -> Path:
        """Scratch space (databases, policy files) of this scenario."""
        path = self.out_dir / "state"
        path.mkdir(parents=True, exist_ok=True)
        return path


@dataclass
class Outcome:
    """What a scenario reports back to the run's index.

    Attributes:
        name: The scenario.
        status: ``ok`` (it ran; goals may still be missed), ``failed`` (it could not run to the
            end: the error says why), ``not_landed`` (its feature has not landed).
        summary: One sentence for the index.
        goals: Goals (``bench.tables.goal``).
        tables: Headline tables (``bench.tables.table``).
        report: The scenario's ``report.md``, relative to the run's folder (None: none written).
        error: Why it failed.
        notes: Caveats worth repeating in the index.
        plots: The scenario's PNG plots, relative to the run's folder (filled in by the runner).
        cpu: The machine's CPU share used by the bench and by other processes while it ran
            (``procs.CpuMeter``; filled in by the runner).
    """

    name: str
    status: Status
    summary: str = ""
    goals: list[dict[str, Any]] = field(default_factory=list)
    tables: list[dict[str, Any]] = field(default_factory=list)
    report: str | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    cpu: dict[str, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready data."""
        return {"name": self.name, "status": self.status, "summary": self.summary, "goals": self.goals,
                "tables": self.tables, "report": self.report, "error": self.error, "notes": self.notes,
                "plots": self.plots, "cpu": self.cpu}


ScenarioRun = Callable[[ScenarioContext], Outcome]


@dataclass(frozen=True, slots=True)
class Scenario:
    """A scenario: its flag name, what it measures, and how to run it (or why it cannot yet).

    Attributes:
        name: The ``--scenario`` value.
        measures: What it measures, in a phrase.
        run: Runs it (None: not landed).
        issue: The issue whose feature it needs, when not landed.
        missing: What has not landed.
    """

    name: str
    measures: str
    run: ScenarioRun | None = None
    issue: int | None = None
    missing: str = ""

    @property
    def landed(self) -> bool:
        """Whether it can run."""
        return self.run is not None

    def not_landed_line(self) -> str:
        """The line a report shows for a scenario that cannot run yet."""
        return (f"{self.name} ({self.measures}): not landed yet (issue {self.issue}: {self.missing}); "
                "no figure is reported")


def cpu_plan() -> dict[str, tuple[int, ...]]:
    """Which CPUs the measured proxy, the engine and the load generator get.

    With two or more CPUs the proxy gets one to itself (the last); with three or more the engine
    gets another; the load generator (this process) keeps the rest. With one CPU nothing is pinned.
    """
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        return {"proxy": (), "engine": (), "loadgen": ()}
    if len(cpus) == 2:
        return {"proxy": (cpus[1],), "engine": (cpus[0],), "loadgen": (cpus[0],)}
    return {"proxy": (cpus[-1],), "engine": (cpus[-2],), "loadgen": tuple(cpus[:-2])}


def describe_plan(plan: Mapping[str, Sequence[int]]) -> str:
    """The CPU plan in words."""
    if not any(plan.values()):
        return "one CPU: nothing pinned (the load generator, engine and proxy share it)"
    return "; ".join(f"{role} on CPU {','.join(map(str, cpus))}" for role, cpus in plan.items())
