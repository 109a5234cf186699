"""A policy canary's decisions: which requests its slice takes, how its figures compare with the rest's, and
when it steps up, promotes or rolls back.

Pure functions of their arguments: the gateway, ``switchyard policy canary status``, the console and the
what-if replay ask the same questions here.

**Slice.** A request is hashed by its tenant (default), key, session or request id, salted with the canary's
id (each canary picks a different slice, and no tenant is always the first to try a change): 64 bits of
BLAKE2b mapped onto [0, 100). It is in the slice when that point is below the current step's percentage, so
raising the percentage keeps everyone already in the slice, and every replica computes the same slice.
``session`` falls back to the key for a request that names no session.

**Comparison.** The slice (``canary``) is compared with the rest of the canary's scope (``control``) over a
sliding window, per priority class and over all classes (``*``), where both sides have ``min_requests``. The
window never reaches back before the current step began (``store.canary.read_window``): both sides are then
counted over the same time with the slice's share unchanged, so what changes with time (load, the fleet) weighs
on both alike; across a step's start most of a slice that just grew would be recent and most of the rest older.
Until the step's own span has ``min_requests`` on each side, the whole window is tested instead (``warming_up``):
a breach there still rolls back, so no step up goes unguarded, but the step passes only on its own span.

- *Rates* (errors, shed, 429): a one-sided test of "the slice's rate exceeds the rest's by more than the
  allowed increase", with the Agresti-Caffo adjusted Wald statistic (one success and one failure added to each
  side: sound at the low counts and zero rates these guards see, where the plain Wald test is not).
- *TTFT p99*: the rest's p99 times the allowed ratio is a threshold; if the slice's p99 were within it, at
  most 1% of the slice would be slower. The count of slower slice requests is tested against Binomial(n, 1%)
  with the exact tail: a quantile test that needs no assumption on the shape of latency distributions
  (heavy-tailed, multi-modal), unlike a t-test on means. The rest's p99 comes from the larger side, and is
  taken from a histogram of 5%-wide buckets (figures are merged across replicas).
- *Cost per 1,000 requests*: a one-sided large-sample (Welch) z-test of "the slice's mean cost exceeds the
  allowed ratio of the rest's", valid at the minimum sample sizes by the central limit theorem.

Each evaluation runs several tests; their shared false-breach chance is ``alpha``, split evenly among them
(Bonferroni). Evaluations repeat every few seconds, so over a long step the chance of one false breach
grows: ``alpha`` defaults to 0.001 for that reason.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from switchyard.decide.decision import Decision
from switchyard.policy.rollout import INCREASE_GUARDS, Rollout

Role = Literal["canary", "control"]
#: The class key of the figures over every class.
ALL = "*"
#: TTFT histogram: bucket b holds times in (FLOOR_MS * GROWTH**(b-1), FLOOR_MS * GROWTH**b].
FLOOR_MS = 0.01
GROWTH = 1.05
_LOG_GROWTH = math.log(GROWTH)
#: The quantile the TTFT guard compares.
QUANTILE = 0.99


# --- the slice ------------------------------------------------------------------------------------

def slice_point(salt: int, subject: str) -> float:
    """Where ``subject`` falls in [0, 100) for the canary salted ``salt``."""
    digest = hashlib.blake2b(f"{salt}\x00{subject}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64 * 100.0


def subject_of(by: str, tenant: str, key: str, session: str | None, request_id: str) -> str:
    """What a request is hashed by (``session`` without a session id: the key)."""
    if by == "tenant":
        return f"t:{tenant}"
    if by == "key":
        return f"k:{key}"
    if by == "session":
        return f"s:{tenant}:{session}" if session else f"k:{key}"
    return f"r:{request_id}"


#: The header a session is named by (then the body's ``user``).
SESSION_HEADER = "x-session-id"


def session_of(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """The session a request names: its ``x-session-id`` header (lower-case names), else the body's ``user``."""
    session = headers.get(SESSION_HEADER)
    if session is None:
        user = body.get("user")
        session = user if isinstance(user, str) else None
    return session


def in_scope(rollout: Rollout, tier: str, region: str | None, model: str | None) -> bool:
    """Whether a request may be taken by the canary at all (its ``only``)."""
    only = rollout.only
    return ((not only.tiers or tier in only.tiers) and (not only.regions or region in only.regions)
            and (not only.models or model in only.models))


def in_slice(salt: int, percent: float, subject: str) -> bool:
    """Whether ``subject`` is in the slice of ``percent`` percent."""
    return slice_point(salt, subject) < percent


# --- what the shadow compares ---------------------------------------------------------------------

#: The fields a shadow decision is compared on.
SHADOW_FIELDS = ("model", "class", "pool", "region", "admission", "cache")


def decided(d: Decision) -> dict[str, str | None]:
    """What a decision chose, as the shadow compares it (``admission``: the refusal, else the limits charged and
    their sizes)."""
    refusal = d.refusal
    if refusal is not None and refusal.status != 429:
        admission = f"refused {refusal.status} {refusal.code}"
    else:  # a 429 depends on the live buckets: what is compared is the limits the request is charged against
        admission = ",".join(sorted(f"{c.limit}={c.capacity:g}/{c.period_s:g}s" for c in d.charges)) or "none"
    choice = d.choice
    return {"model": d.model.model.name if d.model is not None else None,
            "class": d.cls.name if d.cls is not None else None,
            "pool": choice.pool.name if choice is not None else ("cache" if d.outcome == "cache_hit" else None),
            "region": choice.pool.region if choice is not None else None,
            "admission": admission,
            "cache": d.cache.label if d.cache is not None else None}


def differences(live: Mapping[str, str | None], shadow: Mapping[str, str | None]) -> dict[str, list[str | None]]:
    """The fields where the shadow decided otherwise: ``{field: [live, shadow]}``. Placement (pool, region) is
    only compared where both chose the same model: another model's pools differ anyway."""
    out: dict[str, list[str | None]] = {}
    for name in SHADOW_FIELDS:
        if name in ("pool", "region") and live.get("model") != shadow.get("model"):
            continue
        if live.get(name) != shadow.get(name):
            out[name] = [live.get(name), shadow.get(name)]
    return out


# --- figures --------------------------------------------------------------------------------------

def ttft_bucket(ms: float) -> int:
    """The histogram bucket of a time to first byte."""
    if ms <= FLOOR_MS:
        return 0
    return max(0, math.ceil(math.log(ms / FLOOR_MS) / _LOG_GROWTH - 1e-9))


def bucket_upper(bucket: int) -> float:
    """The largest time bucket ``bucket`` holds, in milliseconds."""
    return FLOOR_MS * GROWTH ** bucket


@dataclass(slots=True)
class Tally:
    """What one side of a canary did over some time, in one class: counts, a TTFT histogram and cost sums.

    ``errors``: answers with a 5xx that the gateway did not shed, or streams broken off; ``shed``: 503s of
    flow control; ``limited``: 429s. ``spend`` and ``spend_sq``: the sum of each request's cost and of its
    square (refused requests cost nothing and count).
    """

    requests: int = 0
    errors: int = 0
    shed: int = 0
    limited: int = 0
    spend: float = 0.0
    spend_sq: float = 0.0
    ttft: dict[int, int] = field(default_factory=dict)

    def count(self, outcome: str, ttft_ms: float | None, spend: float) -> None:
        """Add one finished request."""
        self.requests += 1
        if outcome == "error":
            self.errors += 1
        elif outcome == "shed":
            self.shed += 1
        elif outcome == "limited":
            self.limited += 1
        elif outcome == "ok" and ttft_ms is not None:
            b = ttft_bucket(ttft_ms)
            self.ttft[b] = self.ttft.get(b, 0) + 1
        self.charge(spend)

    def charge(self, spend: float) -> None:
        """Add one request's cost."""
        self.spend += spend
        self.spend_sq += spend * spend

    def merge(self, other: Tally) -> None:
        """Add ``other``'s figures to these."""
        self.requests += other.requests
        self.errors += other.errors
        self.shed += other.shed
        self.limited += other.limited
        self.spend += other.spend
        self.spend_sq += other.spend_sq
        for b, n in other.ttft.items():
            self.ttft[b] = self.ttft.get(b, 0) + n

    def quantile_ms(self, q: float) -> float | None:
        """The ``q`` quantile of TTFT (the upper edge of its bucket), None without samples."""
        total = sum(self.ttft.values())
        if not total:
            return None
        rank = math.ceil(q * total)
        seen = 0
        for b in sorted(self.ttft):
            seen += self.ttft[b]
            if seen >= rank:
                return bucket_upper(b)
        return bucket_upper(max(self.ttft))  # pragma: no cover - rank <= total

    def slower_than(self, ms: float) -> tuple[int, int]:
        """How many TTFT samples are certainly above ``ms`` (their whole bucket is), and how many there are."""
        above = sum(n for b, n in self.ttft.items() if bucket_upper(b - 1) >= ms)
        return above, sum(self.ttft.values())

    def rate(self, guard: str) -> tuple[int, int]:
        """The count a rate guard looks at, and the requests."""
        hits = {"error_rate": self.errors, "shed_rate": self.shed, "rate_limited_rate": self.limited}[guard]
        return hits, self.requests

    def cost_per_1k(self) -> float | None:
        """Cost per 1,000 requests."""
        return self.spend / self.requests * 1000 if self.requests else None

    def as_json(self) -> dict[str, Any]:
        """The figures as stored (histogram keys as strings)."""
        return {"requests": self.requests, "errors": self.errors, "shed": self.shed, "limited": self.limited,
                "spend": self.spend, "spend_sq": self.spend_sq, "ttft": {str(b): n for b, n in self.ttft.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Tally:
        """The inverse of :meth:`as_json`."""
        return cls(int(data.get("requests", 0)), int(data.get("errors", 0)), int(data.get("shed", 0)),
                   int(data.get("limited", 0)), float(data.get("spend", 0.0)), float(data.get("spend_sq", 0.0)),
                   {int(b): int(n) for b, n in dict(data.get("ttft", {})).items()})


#: Figures by side and class: ``{"canary": {"*": Tally, "standard": Tally}, "control": {...}}``.
Figures = dict[str, dict[str, Tally]]


def empty_figures() -> Figures:
    """No figures yet."""
    return {"canary": {}, "control": {}}


def _tallies(figures: Figures, role: str, cls: str | None) -> tuple[Tally, Tally]:
    """``role``'s tallies of :data:`ALL` and of ``cls``."""
    side = figures.setdefault(role, {})
    return side.setdefault(ALL, Tally()), side.setdefault(cls or "-", Tally())


def add_to(figures: Figures, role: str, cls: str | None, outcome: str, ttft_ms: float | None, spend: float) -> None:
    """Count one finished request of ``role`` in its class and in :data:`ALL`."""
    for tally in _tallies(figures, role, cls):
        tally.count(outcome, ttft_ms, spend)


def charge_to(figures: Figures, role: str, cls: str | None, spend: float) -> None:
    """Add what a request of ``role`` cost, once it is known (after it was counted, for a stream)."""
    for tally in _tallies(figures, role, cls):
        tally.charge(spend)


# --- the tests ------------------------------------------------------------------------------------

def _upper_tail_z(z: float) -> float:
    """P(Z >= z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def rate_p_value(hits_c: int, n_c: int, hits_r: int, n_r: int, increase: float) -> float:
    """One-sided p-value of "the slice's rate is at most the rest's plus ``increase``" (Agresti-Caffo)."""
    pc = (hits_c + 1) / (n_c + 2)
    pr = (hits_r + 1) / (n_r + 2)
    se = math.sqrt(pc * (1 - pc) / (n_c + 2) + pr * (1 - pr) / (n_r + 2))
    return _upper_tail_z((pc - pr - increase) / se)


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), exactly (summed in logs from the smaller side)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)

    def pmf(i: int) -> float:
        return math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p
                        + (n - i) * log_q)

    if k > n * p:  # the upper tail is the small side
        total, i = 0.0, k
        while i <= n:
            term = pmf(i)
            total += term
            if term < total * 1e-17 and i > k:
                break
            i += 1
        return min(1.0, total)
    return max(0.0, 1.0 - sum(pmf(i) for i in range(k)))


def quantile_p_value(slower: int, n: int, quantile: float = QUANTILE) -> float:
    """One-sided p-value of "the slice's ``quantile`` is within the threshold", given ``slower`` of ``n`` slice
    requests above it."""
    return binomial_tail(slower, n, 1.0 - quantile)


def mean_p_value(c: Tally, r: Tally, ratio: float) -> float:
    """One-sided p-value of "the slice's mean cost is at most ``ratio`` times the rest's" (Welch z)."""
    mc, mr = c.spend / c.requests, r.spend / r.requests
    vc = max(0.0, c.spend_sq / c.requests - mc * mc) * c.requests / max(1, c.requests - 1)
    vr = max(0.0, r.spend_sq / r.requests - mr * mr) * r.requests / max(1, r.requests - 1)
    se = math.sqrt(vc / c.requests + ratio * ratio * vr / r.requests)
    diff = mc - ratio * mr
    if se == 0:
        return 0.0 if diff > 0 else 1.0
    return _upper_tail_z(diff / se)


@dataclass(frozen=True, slots=True)
class GuardResult:
    """One guard tested in one class.

    Attributes:
        guard: Its name; ``cls``: the class (``*``: all).
        canary, rest: The figure on each side (a rate, TTFT p99 in ms, cost per 1,000 requests).
        limit: What the slice may reach: the rest's figure times the ratio, or plus the increase.
        p_value: Of "within the limit"; ``breached`` when below the evaluation's per-test alpha.
        n_canary, n_rest: Requests on each side (TTFT: samples).
    """

    guard: str
    cls: str
    canary: float | None
    rest: float | None
    limit: float | None
    p_value: float
    breached: bool
    n_canary: int
    n_rest: int

    def describe(self) -> str:
        """A sentence for the audit log and the status."""
        def fmt(v: float | None) -> str:
            return "-" if v is None else f"{v:.4g}"
        return (f"{self.guard} in class {self.cls}: canary {fmt(self.canary)} vs rest {fmt(self.rest)} (limit "
                f"{fmt(self.limit)}; p={self.p_value:.2g}; n={self.n_canary}/{self.n_rest})")


def _one(guard: str, bound: float, c: Tally, r: Tally) -> tuple[float | None, float | None, float | None,
                                                                            float, int, int] | None:
    """(canary, rest, limit, p-value, n canary, n rest), or None when this test cannot be made."""
    if guard in INCREASE_GUARDS:
        hc, nc = c.rate(guard)
        hr, nr = r.rate(guard)
        return hc / nc, hr / nr, hr / nr + bound, rate_p_value(hc, nc, hr, nr, bound), nc, nr
    if guard == "cost_per_1k":
        cc, cr = c.cost_per_1k(), r.cost_per_1k()
        assert cc is not None
        assert cr is not None
        return cc, cr, cr * bound, mean_p_value(c, r, bound), c.requests, r.requests
    rest_q = r.quantile_ms(QUANTILE)
    canary_q = c.quantile_ms(QUANTILE)
    if rest_q is None or canary_q is None:
        return None
    threshold = rest_q * bound
    slower, n = c.slower_than(threshold)
    _, n_r = r.slower_than(threshold)
    return canary_q, rest_q, threshold, quantile_p_value(slower, n), n, n_r


def evaluate(rollout: Rollout, figures: Figures) -> list[GuardResult]:
    """Every guard of ``rollout`` tested in every class with enough requests on both sides (see the module doc);
    an empty list when no side has enough yet."""
    minimum = rollout.min_requests
    canary, control = figures.get("canary", {}), figures.get("control", {})
    planned: list[tuple[str, str, tuple[float | None, float | None, float | None, float, int, int]]] = []
    for cls in sorted(canary, key=lambda k: (k != ALL, k)):
        c, r = canary[cls], control.get(cls)
        if r is None or c.requests < minimum or r.requests < minimum:
            continue
        for guard, bound in rollout.guards.items():
            if guard == "ttft_p99" and (sum(c.ttft.values()) < minimum or sum(r.ttft.values()) < minimum):
                continue
            made = _one(guard, bound, c, r)
            if made is not None:
                planned.append((guard, cls, made))
    if not planned:
        return []
    alpha = rollout.alpha / len(planned)
    return [GuardResult(guard, cls, v[0], v[1], v[2], v[3], v[3] < alpha, v[4], v[5]) for guard, cls, v in planned]


# --- the steps ------------------------------------------------------------------------------------

Action = Literal["hold", "advance", "promote", "rollback"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a running canary does next, and why (``wait_s``: until the step's hold ends, when holding)."""

    action: Action
    reason: str
    step: int
    wait_s: float | None = None
    results: tuple[GuardResult, ...] = ()


def verdict(rollout: Rollout, step: int, step_age_s: float, slice_in_step: int,
            results: Sequence[GuardResult], *, warming_up: bool = False) -> Verdict:
    """The next move of a canary at ``step`` (an index into :attr:`Rollout.stages`), held for ``step_age_s``,
    whose slice served ``slice_in_step`` requests since the step began, given the window's guard ``results``.

    A breach rolls back whatever the step; a step passes when its hold is over, its slice has had
    ``min_requests`` and the guards could be tested over the window (``results`` is not empty: a window too short
    for ``min_requests`` of a slow slice would otherwise let a step pass untested); passing the last step promotes,
    unless the canary holds a fixed percent. ``warming_up``: the results are over a window reaching back before the
    step (its own span has too few requests yet): they may roll back, but the step passes only on its own.
    """
    stages = rollout.stages
    breaches = [r for r in results if r.breached]
    if breaches:
        return Verdict("rollback", "; ".join(r.describe() for r in breaches), step, results=tuple(results))
    hold = stages[step].hold
    if step_age_s < hold:
        return Verdict("hold", f"step {step + 1} of {len(stages)} at {stages[step].percent:g}%", step,
                       wait_s=hold - step_age_s if math.isfinite(hold) else None, results=tuple(results))
    if slice_in_step < rollout.min_requests:
        return Verdict("hold", f"waiting for {rollout.min_requests} requests in the slice "
                       f"({slice_in_step} so far in this step)", step, results=tuple(results))
    if not rollout.automatic:
        return Verdict("hold", "held until promoted or aborted", step, results=tuple(results))
    if not results or warming_up:
        return Verdict("hold", f"waiting for {rollout.min_requests} requests on each side within the "
                       f"{rollout.window:g} s window in this step: "
                       + ("tested meanwhile over the window with the steps before" if results
                          else "no guard could be tested yet"), step, results=tuple(results))
    if step + 1 < len(stages):
        return Verdict("advance", f"step {step + 1} passed: to {stages[step + 1].percent:g}%", step + 1,
                       results=tuple(results))
    return Verdict("promote", f"all {len(stages)} steps passed", step, results=tuple(results))
