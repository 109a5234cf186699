"""The ``adapters`` scenario's plot: per arm, the engines' adapter loads over time, the requests deferred for an
adapter slot, and the TTFT CDF of every request."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from switchyard.bench.scenarios.adapters.engines import SAMPLE_S

if TYPE_CHECKING:
    from switchyard.bench.scenarios.adapters.scenario import ArmRun

_STYLES = ("-", "--", ":", "-.")


def write_adapter_plot(report: Mapping[str, Any], arms: Sequence[ArmRun], path: Path) -> Path:
    """Three panels, one line per arm: adapter loads since the load began, deferred requests, TTFT CDF."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 10))
    axes = fig.subplots(3, 1, gridspec_kw={"left": 0.1, "right": 0.97, "top": 0.95, "bottom": 0.06, "hspace": 0.3})
    for a, arm in enumerate(arms):
        style = _STYLES[a % len(_STYLES)]
        loads = arm.series.get("loads", [])
        t = [(i + 0.5) * SAMPLE_S for i in range(len(loads))]
        axes[0].plot(t, [x - arm.before.loads for x in loads], style, label=arm.name, drawstyle="steps-post")
        deferred = arm.series.get("deferred", [])
        axes[1].plot([(i + 0.5) * SAMPLE_S for i in range(len(deferred))], deferred, style, label=arm.name,
                     drawstyle="steps-post")
        ttft = np.sort(np.array([r.ttft_s for r in arm.results if r.ok and r.ttft_s is not None], dtype=np.float64))
        if len(ttft):
            n = len(arm.results)
            axes[2].step(ttft * 1000, np.arange(1, len(ttft) + 1) / n, style, where="post", label=arm.name)
    axes[0].set_ylabel("adapter loads so far")
    axes[0].set_title("Adapter loads (all replicas), requests deferred for an adapter slot, TTFT")
    axes[1].set_ylabel("requests deferred")
    axes[1].set_xlabel("time since the schedule's start (s)")
    axes[2].set_xscale("log")
    axes[2].set_xlabel("time to first token (ms, from the scheduled time)")
    axes[2].set_ylabel("fraction of requests")
    axes[2].set_ylim(0, 1.02)
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small", loc="upper left")
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    return path
