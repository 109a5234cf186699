"""What this gateway process did over the last minutes, in memory: the records and the time series behind the
console's Overview and Requests pages.

Two bounded structures, both written on the request path (a deque append and a few integer
increments per finished request; one event loop, so no locks):

- **Per-pool time series**: one bucket per second for the last :data:`HORIZON_S` seconds (a ring
  of slots reused as time moves on; a slot older than the horizon is reset before it is reused and
  never read). Each bucket counts finished requests by outcome, fallbacks, cache hits and misses,
  and keeps at most :data:`TTFT_SAMPLES` time-to-first-byte samples (a uniform reservoir), so
  percentiles over a window are exact over those samples.
- **Recent requests**: the last :data:`RECENT` finished requests as :class:`RequestRecord`\\ s, and apart
  from them the last :data:`RECENT` batch lines (a batch of thousands would otherwise push every
  interactive request out).

Batch lines are counted apart in the series too (``batch``, ``batch_ok``): the interactive figures
(requests, outcomes, TTFT) are interactive traffic's. TTFT samples come from streamed requests only
(a non-streamed answer's first byte is the whole answer).

Series keys ("pools"): the engine pool that answered (for a failure, the last one tried);
``"cache"`` for an answer served from the response cache (as the ``pool`` label of
``switchyard_requests`` says); ``"-"`` for a request refused before any pool was picked. A cache
miss counts in the row of the pool that then served (or refused) it, so a pool row's cache hit
rate is 0 and only the total row's is meaningful.

Outcomes: ``ok`` (2xx), ``shed`` (503 from flow control), ``limited`` (429: a limit or budget),
``error`` (any other status >= 500, or a stream its engine broke off), ``client_closed`` (499) and
``refused`` (any other 4xx). Rates are fractions of the window's requests.

A record never holds the ``Authorization`` header, an API key, or prompt or answer text: only
ids, names, numbers and the decision trace's sentences.

What people are shown of them (the summary's rows and rates, sparklines, status filters) is
the console's (``admin.overview``): this module keeps the counts and hands them out.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from switchyard.figures import to_ms, utc_iso

if TYPE_CHECKING:
    from switchyard.decide.decision import Line
    from switchyard.store.keys import KeyIdentity

#: Seconds of per-second buckets kept (and the longest window a summary covers).
HORIZON_S = 900
#: Time-to-first-byte samples kept per bucket (a uniform reservoir beyond that).
TTFT_SAMPLES = 128
#: Finished requests kept for the Requests page.
RECENT = 500
#: The series key of answers from the response cache, and of requests refused before a pool was picked.
CACHE_POOL = "cache"
NO_POOL = "-"
#: What a finished request's log line carries (``SWITCHYARD_LOG_REQUESTS``): no key, text or trace.
LOGGED = ("request_id", "kind", "tenant", "tier", "model", "served_model", "pool", "region", "status", "outcome",
          "error_code", "stream", "priority", "queue_ms", "attempts", "ttft_ms", "duration_ms", "cache")

log = logging.getLogger("switchyard.requests")

#: Every outcome a finished request can have (see the module doc).
OUTCOMES = frozenset({"ok", "error", "shed", "limited", "refused", "client_closed"})


@dataclass(slots=True, eq=False)
class RequestRecord:
    """One finished request as the Requests page shows it (filled in as the request goes along).

    Attributes:
        at: Arrival, seconds since the epoch (``time`` in JSON: UTC ISO 8601).
        request_id: The ``x-request-id`` the gateway answered with.
        kind: ``chat`` or ``completion``.
        tenant, tenant_id, key_id, tier: Who sent it (None when the key was not accepted).
        model: What the client asked for (a model or a route).
        resolved_model: What the policy resolved that to.
        served_model: The model that answered (after a downgrade or fallback); None if none did.
        pool, region, endpoint: Where it was served (``pool`` is ``"cache"`` for a cache hit); for a
            failure, the last endpoint tried.
        status: The HTTP status answered (None until finished).
        outcome: See the module doc.
        error_code: The error's ``code`` when it failed.
        stream: Whether the client asked for a stream.
        priority: The priority class it was served in.
        queue_ms: Time spent in the gateway's queue.
        attempts: Endpoints tried.
        moved_on: Every endpoint or stage it moved on from, and why (``"<url or stage> <why>"``).
        ttft_ms: Time from arrival to the first byte of the answer.
        duration_ms: Time from arrival to the end (of the stream, for a stream).
        prompt_tokens, completion_tokens, cached_tokens: Usage, when known (a request refused before it
            ran keeps the prompt tokens counted at admission, and no completion).
        max_tokens: The output budget the client asked for (None when it set none).
        digest: The request's fingerprint (``decide.cache.request_digest``), when the request log keeps it.
        deterministic: Whether it asked for a reproducible answer (temperature 0 or a seed).
        cache: ``hit``, ``miss``, ``error`` (counted as a miss), ``bypass``, ``off`` or ``none`` (no rule).
        cache_rule: The cache rule that applied.
        trace: The decision trace: the decision procedure's lines (model, placement, class, cache plan,
            flow control, fallback plan, each endpoint chosen and why: what the dry-run shows), and this
            gateway's own (the cache's answer, failed tries, the ``x-switchyard-route`` value).
    """

    request_id: str
    kind: str
    at: float
    started: float
    tenant: str | None = None
    tenant_id: int | None = None
    key_id: int | None = None
    tier: str | None = None
    model: str | None = None
    resolved_model: str | None = None
    served_model: str | None = None
    pool: str | None = None
    region: str | None = None
    endpoint: str | None = None
    status: int | None = None
    outcome: str | None = None
    error_code: str | None = None
    stream: bool = False
    #: A batch job's line (counted apart from interactive traffic; kept in a memory of its own).
    batch: bool = False
    priority: str | None = None
    queue_ms: float | None = None
    attempts: int = 0
    moved_on: list[str] = field(default_factory=list)
    ttft_s: float | None = None
    duration_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    max_tokens: int | None = None
    digest: str | None = None
    deterministic: bool | None = None
    cache: str = "none"
    cache_rule: str | None = None
    trace: list[Line] = field(default_factory=list)
    #: The engine broke the stream off after its first byte and it was not continued (counted as an error).
    broken: bool = False
    #: Times its stream was continued on another endpoint after its engine broke it off.
    resumes: int = 0
    #: Hedges sent for it (a second endpoint asked while its first token was late).
    hedges: int = 0
    #: Called once when the request is finished (its trace span ends there).
    on_finish: Callable[[RequestRecord], None] | None = None
    #: Set where flow control refused it (a 503 that is a shed, not a failure).
    shed: bool = False
    #: The policy version that decided it.
    policy_version: int | None = None
    #: Its part in a policy canary (``canary``, ``control``, ``shadow``; None: outside any canary), and which.
    canary: str | None = None
    canary_id: int | None = None
    #: Where a shadow candidate decided otherwise: ``{field: [active, candidate]}``.
    shadow: dict[str, list[str | None]] | None = None
    #: What it cost (the usage ledger's spend), once accounted.
    spend: float = 0.0

    def identified(self, identity: KeyIdentity) -> None:
        """Who sent it (never the key itself)."""
        self.tenant, self.tenant_id, self.key_id, self.tier = (identity.tenant, identity.tenant_id,
                                                                identity.key_id, identity.tier)

    def settle(self) -> None:
        """Put the trace's lines into words now and let go of what they refer to (a :class:`Later` line holds the
        decision's objects it describes: the endpoint chosen and its scores, the class, the stages).

        For a record the request log keeps: its buffer holds a second or more of requests, long enough for each
        record to reach the garbage collector's oldest generation, and every object there is walked again at
        each full collection. A record whose lines still held their objects took a dozen objects there with it
        (`switchyard bench --scenario overhead`: full collections were about half the collector's time).
        """
        trace = self.trace
        for i, line in enumerate(trace):
            if line.__class__ is not str:
                try:
                    trace[i] = str(line)
                except Exception:  # a bug in a line's wording: the request and the rest of its trace are kept
                    log.exception("request %s: a trace line could not be put into words", self.request_id)
                    trace[i] = "(a trace line could not be put into words)"

    def as_dict(self) -> dict[str, Any]:
        """The record as JSON-ready data."""
        return {
            "time": utc_iso(self.at), "request_id": self.request_id, "kind": self.kind,
            "tenant": self.tenant, "tenant_id": self.tenant_id, "key_id": self.key_id, "tier": self.tier,
            "model": self.model, "resolved_model": self.resolved_model, "served_model": self.served_model,
            "pool": self.pool, "region": self.region, "endpoint": self.endpoint,
            "status": self.status, "outcome": self.outcome, "error_code": self.error_code,
            "stream": self.stream, "batch": self.batch, "priority": self.priority, "queue_ms": self.queue_ms,
            "attempts": self.attempts, "moved_on": list(self.moved_on), "resumes": self.resumes,
            "hedges": self.hedges,
            "ttft_ms": to_ms(self.ttft_s), "duration_ms": to_ms(self.duration_s),
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens, "max_tokens": self.max_tokens,
            "digest": self.digest, "deterministic": self.deterministic, "cache": self.cache,
            "cache_rule": self.cache_rule, "policy_version": self.policy_version, "canary": self.canary,
            "shadow": self.shadow, "trace": [str(line) for line in self.trace],
        }


def outcome_of(status: int, *, shed: bool = False, broken: bool = False) -> str:
    """The outcome a status stands for (see the module doc)."""
    if shed:
        return "shed"
    if status == 429:
        return "limited"
    if status >= 500 or broken:
        return "error"
    if 200 <= status < 300:
        return "ok"
    return "client_closed" if status == 499 else "refused"


class _Bucket:
    """One second of one pool."""

    __slots__ = ("batch", "batch_ok", "errors", "fallbacks", "hits", "limited", "misses", "ok", "requests", "second",
                 "shed", "ttft", "ttft_seen")

    def __init__(self, second: int) -> None:
        self.ttft: list[float] = []
        self.reset(second)

    def reset(self, second: int) -> None:
        self.second = second
        self.requests = self.ok = self.errors = self.shed = self.limited = 0
        self.fallbacks = self.hits = self.misses = self.batch = self.batch_ok = 0
        self.ttft.clear()
        self.ttft_seen = 0


class _Series:
    """A pool's buckets: slot ``second % HORIZON_S`` holds that second while it is within the horizon."""

    __slots__ = ("slots",)

    def __init__(self) -> None:
        self.slots: list[_Bucket | None] = [None] * HORIZON_S

    def bucket(self, second: int) -> _Bucket:
        index = second % HORIZON_S
        found = self.slots[index]
        if found is None:
            found = self.slots[index] = _Bucket(second)
        elif found.second != second:
            found.reset(second)  # what it held is a horizon old (or the clock went back)
        return found

    def within(self, first: int, last: int) -> Iterator[_Bucket]:
        """The buckets of seconds ``first`` to ``last`` (inclusive) that saw a request."""
        return (b for b in self.slots if b is not None and first <= b.second <= last)


class Tally:
    """Counts and TTFT samples summed over some buckets (or tallies): what :meth:`Activity.window` hands out.

    Attributes:
        requests, ok, errors, shed, limited: Finished interactive requests (batch lines are not among them),
            and those of each outcome counted apart.
        fallbacks: Requests that moved on from an endpoint or stage.
        hits, misses: Response-cache lookups that hit, and that missed (or failed).
        ttft: Time-to-first-byte samples of streamed requests, seconds, in no order (a non-streamed answer's
            first byte is its whole body: its time is not a TTFT).
        batch, batch_ok: Finished batch lines, and those that succeeded.
    """

    __slots__ = ("batch", "batch_ok", "errors", "fallbacks", "hits", "limited", "misses", "ok", "requests", "shed",
                 "ttft")

    def __init__(self) -> None:
        self.requests = self.ok = self.errors = self.shed = self.limited = 0
        self.fallbacks = self.hits = self.misses = self.batch = self.batch_ok = 0
        self.ttft: list[float] = []

    def add(self, b: _Bucket | Tally) -> None:
        """Add ``b``'s counts and samples to these."""
        self.batch += b.batch
        self.batch_ok += b.batch_ok
        self.requests += b.requests
        self.ok += b.ok
        self.errors += b.errors
        self.shed += b.shed
        self.limited += b.limited
        self.fallbacks += b.fallbacks
        self.hits += b.hits
        self.misses += b.misses
        self.ttft.extend(b.ttft)


@dataclass(frozen=True, slots=True)
class Window:
    """The counts of the last seconds, per series key and per point (what :meth:`Activity.window` returns).

    Attributes:
        seconds: The window's length (at most :data:`HORIZON_S`).
        point_s: The length of one point (the oldest point may be shorter: see ``lengths``).
        first: The window's first second (epoch seconds, whole); the last is ``int(now)``.
        now: When the window was read (epoch seconds).
        span: Seconds of the window this process has lived through (at least 1): what a rate divides by.
        lengths: Seconds per point, oldest first.
        pools: Per series key with requests in the window, by name: its tally over the window and per point.
    """

    seconds: int
    point_s: int
    first: int
    now: float
    span: float
    lengths: list[int]
    pools: dict[str, tuple[Tally, list[Tally]]]


class Activity:
    """This process's recent activity (see the module doc); ``runtime.activity``."""

    def __init__(self, *, recent: int = RECENT, clock: Callable[[], float] = time.time,
                 started: float | None = None, seed: int | None = None, log_requests: bool = False) -> None:
        self._clock = clock
        #: Log one line per finished request (logger ``switchyard.requests``, level INFO).
        self.log_requests = log_requests
        #: Also hands each finished record to this (the request log's writer), when set.
        self.sink: Callable[[RequestRecord], object] | None = None
        #: Counts the finished requests of a policy canary's scope (``gateway.canary``).
        self.canary_sink: Callable[[RequestRecord], object] | None = None
        self.started = clock() if started is None else started
        self._recent: deque[RequestRecord] = deque(maxlen=recent)
        #: Batch lines have their own memory, so that a batch does not push interactive requests out.
        self._batch_recent: deque[RequestRecord] = deque(maxlen=recent)
        self._series: dict[str, _Series] = {}
        self._rng = random.Random(seed)

    # --- the request path -------------------------------------------------------------------------

    def begin(self, request_id: str, kind: str, started: float | None = None,
              now: float | None = None) -> RequestRecord:
        """A record for a request that arrived now (``started``: its ``time.perf_counter()`` arrival)."""
        return RequestRecord(request_id, kind, self._clock() if now is None else now,
                             time.perf_counter() if started is None else started)

    def finish(self, record: RequestRecord, status: int, now: float | None = None) -> None:
        """Count ``record`` as answered with ``status`` and keep it (a second call does nothing)."""
        if record.status is not None:
            return
        now = self._clock() if now is None else now
        record.status = status
        if record.duration_s is None:
            record.duration_s = time.perf_counter() - record.started
        outcome = record.outcome = outcome_of(status, shed=record.shed, broken=record.broken)
        (self._batch_recent if record.batch else self._recent).append(record)
        if record.on_finish is not None:
            record.on_finish(record)
        if self.sink is not None:
            record.settle()  # (the request log reads every line: their objects need not wait for it)
            self.sink(record)
        if record.canary is not None and self.canary_sink is not None:
            self.canary_sink(record)
        if self.log_requests:
            data = record.as_dict()
            log.info("%s %s %s %d %s", record.request_id, record.kind, record.served_model or record.model or "-",
                     status, outcome, extra={name: data[name] for name in LOGGED})
        key = record.pool or NO_POOL
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Series()
        b = series.bucket(int(now))
        if record.batch:  # a batch line: counted apart, out of the interactive figures
            b.batch += 1
            b.batch_ok += outcome == "ok"
            return
        b.requests += 1
        if outcome == "ok":
            b.ok += 1
        elif outcome == "error":
            b.errors += 1
        elif outcome == "shed":
            b.shed += 1
        elif outcome == "limited":
            b.limited += 1
        if record.moved_on:
            b.fallbacks += 1
        if record.cache == "hit":
            b.hits += 1
        elif record.cache in ("miss", "error"):
            b.misses += 1
        ttft = record.ttft_s if record.stream else None
        if ttft is not None:
            b.ttft_seen += 1
            if len(b.ttft) < TTFT_SAMPLES:
                b.ttft.append(ttft)
            else:
                slot = self._rng.randrange(b.ttft_seen)
                if slot < TTFT_SAMPLES:
                    b.ttft[slot] = ttft

    # --- reading ------------------------------------------------------------------------------------

    def recent(self, tenant: str | None = None, model: str | None = None,
               where: Callable[[RequestRecord], bool] | None = None, limit: int = 100,
               lane: str | None = None) -> list[RequestRecord]:
        """The finished requests, the latest to arrive first (the time the console shows is the arrival), at
        most ``limit``.

        Args:
            tenant: A tenant's name or id.
            model: The model asked for, resolved to or served by.
            where: A further test a record must pass (the console's status filter).
            limit: At most this many.
            lane: ``interactive`` or ``batch`` (lines of batch jobs) only; None: both.
        """
        found: list[RequestRecord] = []
        kept = {"interactive": [self._recent], "batch": [self._batch_recent],
                None: [self._recent, self._batch_recent]}[lane]
        # Kept in the order they finished; a long request that arrived first finishes last, so sort by arrival
        # (at most twice the ring's size of records, on a console read).
        for record in sorted(itertools.chain(*map(reversed, kept)), key=lambda r: -r.at):  # ties: last finished first
            if len(found) >= limit:
                break
            if tenant is not None and tenant != record.tenant and tenant != str(record.tenant_id):
                continue
            if model is not None and model not in (record.model, record.resolved_model, record.served_model):
                continue
            if where is not None and not where(record):
                continue
            found.append(record)
        return found

    def get(self, request_id: str) -> RequestRecord | None:
        """The newest kept request with ``request_id`` (clients may reuse their ids)."""
        return next((r for kept in (self._recent, self._batch_recent) for r in reversed(kept)
                     if r.request_id == request_id), None)

    def window(self, window_s: float = 300, now: float | None = None, point_s: int = 10) -> Window:
        """The counts of the last ``window_s`` seconds (at most :data:`HORIZON_S`), per series key and per point
        of ``point_s`` seconds (the newest point includes the current second).

        A series with no request for a whole horizon is dropped here (a pool gone quiet, or gone from the
        policy), so the keys do not grow without bound.
        """
        now = self._clock() if now is None else now
        window = max(1, min(HORIZON_S, math.ceil(window_s)))
        point_s = max(1, min(point_s, window))
        last = int(now)
        first = last - window + 1
        points = math.ceil(window / point_s)
        # A process younger than the window has not seen all of it.
        span = max(1.0, min(float(window), now - self.started))
        lengths = [point_s] * points
        lengths[0] = window - (points - 1) * point_s
        pools: dict[str, tuple[Tally, list[Tally]]] = {}
        for name in sorted(self._series):
            series = self._series[name]
            tally, per_point = Tally(), [Tally() for _ in range(points)]
            for b in series.within(first, last):
                tally.add(b)
                per_point[points - 1 - (last - b.second) // point_s].add(b)
            if not tally.requests:
                if not any(series.within(last - HORIZON_S + 1, last)):
                    del self._series[name]  # a pool gone quiet for the horizon (or gone from the policy)
                continue
            pools[name] = (tally, per_point)
        return Window(window, point_s, first, now, span, lengths, pools)
