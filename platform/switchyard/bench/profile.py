"""Where a process spends its time, by py-spy sampling: a flame graph and a summary table.

``py-spy record`` attaches to a running Python process (no restart, no code change) and samples
its stacks. :func:`record_profile` records twice in a row, once as collapsed stacks
(``<name>.txt``: one line per distinct stack with its sample count, readable by flamegraph.pl or
speedscope) and once as a flame graph (``<name>.svg``), then summarises the collapsed stacks:
the share of samples whose innermost frame is in each library (``aiohttp``, ``litestar``,
``uvicorn``, ``switchyard``, the standard library's ``asyncio``, ...) and the functions with
the most samples of their own. Only samples of busy threads are counted (py-spy's default), so
shares are of the CPU time the process used.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from switchyard.bench.tables import num, pct, table, text

RATE_HZ = 200
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>.*?)(?::\d+)?\)$")
#: Frames every sample of the process holds (the command line's entry points), left out of the
#: inclusive view.
_ENTRY = re.compile(r"^(<module>|main|serve|invoke|__call__)$")


def py_spy() -> str | None:
    """The py-spy executable next to this interpreter, or on ``PATH``."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def owner(path: str) -> str:
    """The library a source file belongs to (``aiohttp``, ``switchyard``, ``asyncio``, ...).

    py-spy names files relative to their ``sys.path`` entry (``aiohttp/client.py``), or absolute
    when it cannot; the first component of the relative name is the library.
    """
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    elif "/switchyard/" in path:
        return "switchyard"
    parts = Path(path).parts
    if path.startswith("/"):
        for i, part in enumerate(parts):
            if part.startswith("python3") and i + 1 < len(parts):
                return parts[i + 1].removesuffix(".py")
        return path
    if not parts:
        return "?"
    return parts[0].removesuffix(".py")


@dataclass
class ProfileSummary:
    """A summary of collapsed stacks.

    Attributes:
        samples: Samples of busy threads.
        by_library: Samples by the library of the innermost frame.
        by_function: Samples by innermost function (``func (file)``).
        switchyard_inclusive: Samples whose stack holds a Switchyard function, by function (its
            own time and everything it called; py-spy cannot always follow a stack through the
            event loop's C code, so these undercount).
        files: The files written (``raw``, ``svg``).
        error: Why there is no profile (py-spy missing or refused).
    """

    samples: int = 0
    by_library: Counter[str] = field(default_factory=Counter)
    by_function: Counter[str] = field(default_factory=Counter)
    switchyard_inclusive: Counter[str] = field(default_factory=Counter)
    files: dict[str, str] = field(default_factory=dict)
    error: str | None = None

    def describe(self, top: int = 5) -> str:
        """The summary in a sentence."""
        if self.error:
            return f"no profile: {self.error}"
        if not self.samples:
            return "no samples"
        libs = ", ".join(f"{lib} {100 * n / self.samples:.0f}%" for lib, n in self.by_library.most_common(top))
        return f"{self.samples} samples; innermost frame by library: {libs}; files {', '.join(self.files.values())}"

    def table(self, title: str, top: int = 12) -> dict[str, Any]:
        """The libraries and the busiest functions as a report table."""
        rows: list[dict[str, Any]] = []
        for lib, n in self.by_library.most_common(top):
            rows.append({"what": "library", "name": lib, "samples": n, "share": n / self.samples})
        for func, n in self.by_function.most_common(top):
            rows.append({"what": "function", "name": func, "samples": n, "share": n / self.samples})
        for func, n in self.switchyard_inclusive.most_common(top):
            rows.append({"what": "switchyard, inclusive", "name": func, "samples": n, "share": n / self.samples})
        note = self.error or (f"{self.samples} samples at {RATE_HZ} Hz of busy threads. Library and function rows: the "
                              "share of samples whose innermost frame is there (own time). Inclusive rows: samples "
                              "whose stack holds that Switchyard function (its time and its callees'; a lower bound, "
                              "py-spy cannot always walk through the event loop's C frames). "
                              f"Flame graph: {self.files.get('svg', '-')}; collapsed stacks: "
                              f"{self.files.get('raw', '-')}.")
        return table(title, [text("what", "kind"), text("name", "name"), num("samples", "samples", 0),
                             pct("share", "share %")], rows, note)


def _parse(frame: str) -> tuple[str, str]:
    match = _FRAME.match(frame)
    return (match["func"], match["file"]) if match else (frame, "")


def summarize_collapsed(lines: list[str]) -> ProfileSummary:
    """Summarise py-spy's raw output (``frame;frame;... count`` per line)."""
    summary = ProfileSummary()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_parse(f) for f in stack.split(";")]
        func, path = frames[-1]
        summary.samples += n
        summary.by_library[owner(path)] += n
        summary.by_function[f"{func} ({Path(path).name})"] += n
        ours = {f"{f} ({Path(p).name})" for f, p in frames if owner(p) == "switchyard" and not _ENTRY.match(f)}
        for name in ours:
            summary.switchyard_inclusive[name] += n
    return summary


async def _py_spy(exe: str, pid: int, seconds: float, fmt: str, out: Path) -> str | None:
    proc = await asyncio.create_subprocess_exec(
        exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(RATE_HZ),
        "--format", fmt, "--output", str(out), "--nonblocking",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    output, _ = await proc.communicate()
    if proc.returncode != 0 or not await asyncio.to_thread(out.exists):
        return f"py-spy exited {proc.returncode}: {output.decode(errors='replace').strip()[-500:]}"
    return None


async def record_profile(pid: int, base: Path, seconds: float) -> ProfileSummary:
    """Record ``pid`` for ``seconds`` as collapsed stacks, then as a flame graph; summarise.

    Files: ``<base>.txt`` and ``<base>.svg``.
    """
    exe = py_spy()
    if exe is None:
        return ProfileSummary(error="py-spy is not installed (pip install py-spy)")
    raw, svg = base.with_suffix(".txt"), base.with_suffix(".svg")
    error = await _py_spy(exe, pid, seconds, "raw", raw)
    if error is not None:
        return ProfileSummary(error=error)
    summary = summarize_collapsed(raw.read_text(encoding="utf-8", errors="replace").splitlines())
    summary.files["raw"] = raw.name
    if await _py_spy(exe, pid, seconds, "flamegraph", svg) is None:
        summary.files["svg"] = svg.name
    return summary
