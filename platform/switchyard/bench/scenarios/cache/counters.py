"""What the ``cache`` scenario reads besides its answers: each response's ``x-switchyard-cache`` header,
the cache's counters on the gateway's ``/metrics`` and the engines' finished requests, and what one
arm measured (:class:`ArmRun`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from switchyard.bench.results import Result
from switchyard.bench.sampler import samples, sum_series
from switchyard.bench.scenarios.cache.workload import CacheWorkload

#: The arms, in the order they run: the cache first, then the same gateway told to skip it.
ARMS = ("cache", "no-cache")
BASELINE = "no-cache"
#: The gateway copies the cache's entry and byte counts into its gauges this often (``CACHE_GAUGES_INTERVAL_S``).
GAUGE_REFRESH_S = 5.0

LOOKUPS = "switchyard_cache_lookups_total"
STORES = "switchyard_cache_stores_total"
ENTRIES = "switchyard_cache_entries"
BYTES = "switchyard_cache_bytes"
FINISHED = "vllm:request_success_total"


@dataclass(frozen=True, slots=True)
class Seen:
    """The ``x-switchyard-cache`` header of one response.

    Attributes:
        result: ``hit``, ``miss``, ``error`` (the cache or the embedding failed: served as a miss),
            ``bypass`` (the client did not let it read), or ``none`` (no header: no rule applied).
        rule: The rule's name ('' without a header).
        mode: ``exact`` or ``semantic`` ('' without a header).
        similarity: A semantic hit's similarity.
    """

    result: str = "none"
    rule: str = ""
    mode: str = ""
    similarity: float | None = None

    @property
    def hit(self) -> bool:
        """Answered from the cache."""
        return self.result == "hit"


def parse_cache_header(value: str | None) -> Seen:
    """A :class:`Seen` from ``hit; rule=faq; mode=semantic; similarity=0.930`` (None: no header)."""
    if not value:
        return Seen()
    head, *parts = [p.strip() for p in value.split(";")]
    fields = dict(p.partition("=")[::2] for p in parts if "=" in p)
    try:
        similarity = float(fields["similarity"]) if "similarity" in fields else None
    except ValueError:
        similarity = None
    return Seen(head or "none", fields.get("rule", ""), fields.get("mode", ""), similarity)


# --- the gateway's and the engines' counters ---------------------------------------------------------------


@dataclass
class Counters:
    """The cache's counters on the gateway's ``/metrics``, and the engines' finished requests, at one time.

    Attributes:
        lookups: ``(rule, mode, result)`` -> lookups.
        stores: ``(rule, mode, result)`` -> answers offered to the cache.
        entries: Entries in the cache (the gateway's gauge).
        bytes: Bytes of the entries.
        engine_finished: ``vllm:request_success_total`` summed over the generating engines (None: not read).
    """

    lookups: dict[tuple[str, str, str], float] = field(default_factory=dict)
    stores: dict[tuple[str, str, str], float] = field(default_factory=dict)
    entries: float | None = None
    bytes: float | None = None
    engine_finished: float | None = None


def _by_labels(text_: str, name: str) -> dict[tuple[str, str, str], float]:
    out: dict[tuple[str, str, str], float] = {}
    for labels, value in samples(text_, name):
        key = (labels.get("rule", "-"), labels.get("mode", "-"), labels.get("result", "-"))
        out[key] = out.get(key, 0.0) + value
    return out


def read_counters(gateway: str | None, engines: Sequence[str | None]) -> Counters:
    """:class:`Counters` from the gateway's ``/metrics`` text and the engines' (None: not read)."""
    out = Counters()
    if gateway is not None:
        out.lookups = _by_labels(gateway, LOOKUPS)
        out.stores = _by_labels(gateway, STORES)
        if f"# TYPE {ENTRIES} " in gateway:
            out.entries = sum_series(gateway, ENTRIES)
            out.bytes = sum_series(gateway, BYTES)
    if engines and all(t is not None for t in engines):
        out.engine_finished = sum(sum_series(t, FINISHED) for t in engines if t is not None)
    return out


def grown(lo: Mapping[tuple[str, str, str], float], hi: Mapping[tuple[str, str, str], float]) -> dict[
        tuple[str, str, str], float]:
    """What each labelled counter grew by from ``lo`` to ``hi`` (only those that grew)."""
    return {k: v - lo.get(k, 0.0) for k, v in hi.items() if v - lo.get(k, 0.0)}


def count(deltas: Mapping[tuple[str, str, str], float], *, rule: str | None = None,
          result: str | None = None) -> float:
    """The sum of ``deltas`` for one rule (None: all) and one result (None: all)."""
    return sum(v for (r, _, res), v in deltas.items() if (rule is None or r == rule)
               and (result is None or res == result))


@dataclass
class ArmRun:
    """What one arm measured.

    Attributes:
        name: ``cache`` or ``no-cache``.
        plan: The workload it ran.
        results: One result per request, in the workload's order.
        seen: Per request (by index), its ``x-switchyard-cache`` header.
        before: Counters just before its load.
        after: Counters once every request had ended.
        series: Engine series sampled during it.
    """

    name: str
    plan: CacheWorkload
    results: list[Result] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    before: Counters = field(default_factory=Counters)
    after: Counters = field(default_factory=Counters)
    series: dict[str, list[float]] = field(default_factory=dict)

    @property
    def lookups(self) -> dict[tuple[str, str, str], float]:
        """The gateway's cache lookups during the arm."""
        return grown(self.before.lookups, self.after.lookups)

    @property
    def stores(self) -> dict[tuple[str, str, str], float]:
        """The gateway's cache stores during the arm."""
        return grown(self.before.stores, self.after.stores)

    @property
    def engine_requests(self) -> float | None:
        """Requests the generating engines finished during the arm."""
        lo, hi = self.before.engine_finished, self.after.engine_finished
        return None if lo is None or hi is None else hi - lo
