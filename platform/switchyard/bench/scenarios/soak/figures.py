"""What the ``soak`` scenario reads and makes of it: the processes' resident memory, threads and open file
descriptors from ``/proc``, the gateway's cache hits, the RSS trend after the warm-up, and what each kind of
request got."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

#: Share of the run left out of the trend, while state that is bounded by age fills to its bound: the prefix
#: index remembers 10 minutes of traffic (``decide.prefix``), the response cache 2 (this policy's TTL), and
#: connection pools and the request log's buffer fill too. A third of a 30-minute run covers the longest.
WARMUP_SHARE = 1 / 3
#: The goal: the RSS trend's rise over the steady part at most this share of the median RSS ...
GROWTH_SHARE = 0.03
#: ... or this many MiB, whichever is larger (allocator noise on a small process).
GROWTH_FLOOR_MIB = 4.0


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading of the processes' resources.

    Attributes:
        t_s: Seconds since the load began.
        rss_mib: The gateway's resident memory.
        threads: The gateway's threads.
        fds: The gateway's open file descriptors.
        engines_rss_mib: The simulated engines' process's resident memory.
        requests: Requests finished so far.
        unexpected: Unexpected errors so far.
    """

    t_s: float
    rss_mib: float
    threads: int
    fds: int
    engines_rss_mib: float
    requests: int
    unexpected: int


def cache_hits(exposition: str) -> float:
    """The gateway's response-cache hits so far, from its ``/metrics``."""
    return sum(sample.value for family in text_string_to_metric_families(exposition)
               if family.name == "switchyard_cache_lookups" for sample in family.samples
               if sample.name.endswith("_total") and sample.labels.get("result") == "hit")


def proc_status(pid: int) -> tuple[float, int]:
    """``(VmRSS in MiB, threads)`` of a process, from ``/proc``."""
    rss_kib, threads = 0.0, 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = float(line.split()[1])
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return rss_kib / 1024, threads


def open_fds(pid: int) -> int:
    """A process's open file descriptors, from ``/proc``."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def trend(samples: Sequence[Sample], warmup_s: float) -> dict[str, Any]:
    """The gateway's RSS trend after the warm-up: slope, rise over the steady part, and the goal's verdict."""
    steady = [s for s in samples if s.t_s >= warmup_s]
    if len(steady) < 3:
        return {"samples": len(steady), "slope_mib_per_h": None, "rise_mib": None, "median_mib": None,
                "allowed_mib": None, "met": None, "first_mib": None, "last_mib": None, "max_mib": None}
    t = np.array([s.t_s for s in steady])
    rss = np.array([s.rss_mib for s in steady])
    slope, _ = np.polyfit(t, rss, 1)
    span = float(t[-1] - t[0])
    rise = float(slope) * span
    median = float(np.median(rss))
    allowed = max(GROWTH_SHARE * median, GROWTH_FLOOR_MIB)
    third = max(1, len(steady) // 3)
    return {"samples": len(steady), "steady_from_s": float(t[0]), "steady_to_s": float(t[-1]),
            "slope_mib_per_h": float(slope) * 3600, "rise_mib": rise, "median_mib": median,
            "allowed_mib": allowed, "met": rise <= allowed, "first_mib": float(np.mean(rss[:third])),
            "last_mib": float(np.mean(rss[-third:])), "max_mib": float(rss.max()),
            "fds_first": steady[0].fds, "fds_last": steady[-1].fds, "fds_max": max(s.fds for s in steady),
            "threads_first": steady[0].threads, "threads_last": steady[-1].threads}


@dataclass
class Tally:
    """What each kind of request got."""

    sent: Counter[str] = field(default_factory=Counter)
    expected: Counter[str] = field(default_factory=Counter)
    unexpected: Counter[tuple[str, str]] = field(default_factory=Counter)
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)

    @property
    def finished(self) -> int:
        return sum(self.expected.values()) + sum(self.unexpected.values())

    @property
    def unexpected_total(self) -> int:
        return sum(self.unexpected.values())
