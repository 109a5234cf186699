"""PNG plots of a bench report, drawn from the report structure alone (``report.build_report``).

Figures are made with ``matplotlib.figure.Figure`` and saved through the Agg canvas, never
through ``pyplot``: no global figure state, no GUI backend, safe in any process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

_STYLES = ("-", "--", ":", "-.")
_DPI = 110
# Fixed margins: a layout engine would draw every figure twice.
_GRID = {"left": 0.1, "right": 0.97, "top": 0.95, "bottom": 0.07, "hspace": 0.12}


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=_DPI)
    return path


def _shade_bursts(ax: Axes, phases: Sequence[Sequence[Any]]) -> None:
    for start, end, state in phases:
        if state == "burst":
            ax.axvspan(float(start), float(end), color="0.9", zorder=0)


def ttft_cdf(report: Mapping[str, Any], path: Path) -> Path:
    """TTFT CDF, one line per arm x class (colour per class, line style per arm)."""
    fig = Figure(figsize=(8, 5))
    fig.subplots_adjust(left=0.1, right=0.97, top=0.93, bottom=0.11)
    ax = fig.add_subplot()
    classes = sorted({c for arm in report["arms"] for c in report["ttft_cdf"][arm]})
    colours = {c: f"C{i % 10}" for i, c in enumerate(classes)}
    drawn = False
    for a, arm in enumerate(report["arms"]):
        for cls, curve in report["ttft_cdf"][arm].items():
            if curve["x_s"]:
                ax.step([x * 1000 for x in curve["x_s"]], curve["y"], where="post", color=colours[cls],
                        linestyle=_STYLES[a % len(_STYLES)], label=f"{arm} · {cls}")
                drawn = True
    if drawn:
        ax.set_xscale("log")
        ax.legend(fontsize="small", loc="upper left")
    ax.set_xlabel("time to first token (ms, from the scheduled time)")
    ax.set_ylabel("fraction of requests (failures never arrive)")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title("TTFT CDF per class")
    return _save(fig, path)


def load_over_time(report: Mapping[str, Any], path: Path) -> Path:
    """Throughput (requests and output tokens per second) and requests in flight, per arm."""
    fig = Figure(figsize=(9, 8))
    axes = fig.subplots(3, 1, sharex=True, gridspec_kw=_GRID)
    for a, arm in enumerate(report["arms"]):
        ts = report["timeseries"][arm]
        style = _STYLES[a % len(_STYLES)]
        axes[0].plot(ts["t_s"], ts["throughput_rps"], style, label=arm, drawstyle="steps-post")
        axes[1].plot(ts["t_s"], ts["output_tps"], style, label=arm, drawstyle="steps-post")
        axes[2].plot(ts["t_s"], ts["in_flight"], style, label=f"{arm} in flight", drawstyle="steps-post")
        for name, values in ts["extra"].items():
            axes[2].plot(ts["t_s"][:len(values)], values, style, alpha=0.7, label=f"{arm} {name}")
    for ax, label in zip(axes, ("ok requests/s", "output tokens/s", "requests"), strict=True):
        _shade_bursts(ax, report["phases"])
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="upper left")
    axes[0].set_title("Throughput and load over time")
    axes[2].set_xlabel("time since start (s)")
    return _save(fig, path)


def shed_over_time(report: Mapping[str, Any], path: Path) -> Path:
    """Requests shed (429/503), served by a fallback, and otherwise failed, per bin and arm."""
    fig = Figure(figsize=(9, 7))
    axes = fig.subplots(3, 1, sharex=True, gridspec_kw=_GRID)
    for a, arm in enumerate(report["arms"]):
        ts = report["timeseries"][arm]
        style = _STYLES[a % len(_STYLES)]
        axes[0].plot(ts["t_s"], ts["shed"], style, label=arm, drawstyle="steps-post")
        axes[1].plot(ts["t_s"], ts["fallback"], style, label=arm, drawstyle="steps-post")
        other = [0] * len(ts["t_s"])
        for status, counts in ts["failed_by_status"].items():
            if status not in ("429", "503"):
                other = [x + y for x, y in zip(other, counts, strict=True)]
        axes[2].plot(ts["t_s"], other, style, label=arm, drawstyle="steps-post")
    bin_s = report["timeseries"][report["arms"][0]]["bin_s"]
    titles = (f"shed (429/503) per {bin_s:g} s", f"fallbacks per {bin_s:g} s", f"other failures per {bin_s:g} s")
    for ax, label in zip(axes, titles, strict=True):
        _shade_bursts(ax, report["phases"])
        ax.set_ylabel(label, fontsize="small")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="upper left")
    axes[0].set_title("Shedding and fallback over time")
    axes[2].set_xlabel("time since start (s)")
    return _save(fig, path)


def memory_over_time(report: Mapping[str, Any], path: Path) -> Path:
    """A soak's resource readings (``report["samples"]``): the gateway's RSS with its fitted trend, the engines'
    RSS, and the gateway's open file descriptors and threads."""
    samples = report["samples"]
    t = [s["t_s"] for s in samples]
    fig = Figure(figsize=(9, 7))
    axes = fig.subplots(2, 1, sharex=True, gridspec_kw=_GRID)
    axes[0].plot(t, [s["rss_mib"] for s in samples], "-", label="gateway RSS")
    axes[0].plot(t, [s["engines_rss_mib"] for s in samples], ":", label="simulated engines' RSS")
    trend = report.get("trend") or {}
    if trend.get("slope_mib_per_h") is not None:
        t0, t1 = trend["steady_from_s"], trend["steady_to_s"]
        slope = trend["slope_mib_per_h"] / 3600
        mid = (t0 + t1) / 2
        steady = [s["rss_mib"] for s in samples if s["t_s"] >= t0]
        centre = sum(steady) / len(steady)
        axes[0].plot([t0, t1], [centre + slope * (t0 - mid), centre + slope * (t1 - mid)], "--",
                     label=f"gateway trend ({trend['slope_mib_per_h']:+.2f} MiB/h)")
        axes[0].axvspan(0, t0, color="0.93", zorder=0)
    axes[0].set_ylabel("MiB")
    axes[1].plot(t, [s["fds"] for s in samples], "-", label="gateway open file descriptors")
    axes[1].plot(t, [s["threads"] for s in samples], "--", label="gateway threads")
    axes[1].set_ylabel("count")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="upper left")
    axes[0].set_title("Soak: memory and descriptors over time (shaded: warm-up, outside the trend)")
    axes[1].set_xlabel("time since start (s)")
    return _save(fig, path)


def write_plots(report: Mapping[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write every plot into ``out_dir`` (a soak's readings too, when the report has them); returns plot
    name -> path."""
    plots = {
        "ttft_cdf": ttft_cdf(report, out_dir / "ttft_cdf.png"),
        "load": load_over_time(report, out_dir / "load_over_time.png"),
        "shed": shed_over_time(report, out_dir / "shed_fallback.png"),
    }
    if report.get("samples"):
        plots["memory"] = memory_over_time(report, out_dir / "memory_over_time.png")
    return plots
