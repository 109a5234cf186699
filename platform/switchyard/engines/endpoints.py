"""Per-endpoint observations that outlive policy reloads (keyed by URL).

Three sources feed an endpoint's state:

- the gateway's own accounting: requests this process has in flight there;
- the engine's ``/metrics`` (running and waiting requests, KV-cache usage, prefix-cache
  counters), scraped on an interval by :mod:`switchyard.engines.scrape`;
- health (:mod:`switchyard.engines.health`): active ``/health`` probes and refused connections take an
  endpoint out; only good probes in a row bring it back. Circuit breakers
  (:mod:`switchyard.engines.breakers`), one per endpoint and one per pool, stop requests where they
  keep failing.

The load estimate combines the first two so that a burst between two scrapes is not all sent to
one endpoint (see :meth:`EndpointState.load`); so does the utilisation that flow control queues and
sheds by (see :meth:`EndpointState.utilisation`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from switchyard.engines.breakers import CircuitBreaker, Listener
from switchyard.policy.resilience import Resilience

#: Weight of the newest first byte in an endpoint's moving average of interactive prefill times.
PREFILL_EMA = 0.1


@dataclass(frozen=True, slots=True)
class EngineSignals:
    """What one scrape of an engine's ``/metrics`` said (sums over its label sets)."""

    running: float
    waiting: float
    kv_usage: float
    prefix_queries: float
    prefix_hits: float
    #: The models the engine reports serving (``model_name`` labels; empty when it has none).
    models: frozenset[str] = frozenset()
    #: The sum of its progress counters (``scrape.PROGRESS``); None when it reports none of them.
    progress: float | None = None
    #: The LoRA adapters its engine runs or has waiting (``vllm:lora_requests_info``'s latest label set);
    #: None when it reports none (LoRA off, or an engine that does not say).
    adapters: frozenset[str] | None = None
    #: Its ``--max-loras`` as it reports it (``max_lora``), when it does.
    max_loras: int | None = None
    #: Of ``waiting``, requests deferred by a transient constraint rather than for capacity (a LoRA adapter
    #: waiting for a free adapter slot: ``vllm:num_requests_waiting_by_reason{reason="deferred"}``).
    deferred: float = 0.0


class EndpointState:
    """Everything the gateway knows about one engine URL."""

    __slots__ = ("adapter_flight", "adapter_used", "adapters_loaded", "alive_at", "alive_busy", "batch_sent_at",
                 "breaker", "completed_since_scrape",
                 "dispatched_since_scrape", "down_since", "failure", "heard_at", "hung_at", "moved_at", "outstanding",
                 "outstanding_at_scrape", "prefill_s", "prefilling", "probe_streak", "probed_at", "reserved",
                 "reserved_at_scrape", "scrape_error", "scraped_at", "signals", "silent_timeouts", "up", "url",
                 "yielding", "yielding_reserved")

    def __init__(self, url: str, breaker: CircuitBreaker) -> None:
        self.url = url
        self.outstanding = 0
        #: Tokens (prompt + expected output) of this process's in-flight requests here.
        self.reserved = 0
        #: Of those, requests that give way to interactive ones (batch lane, preemptible), and their tokens.
        self.yielding = 0
        self.yielding_reserved = 0
        #: Interactive streams sent here whose first byte has not come yet (in their prefill).
        self.prefilling = 0
        #: Moving average of their time to first byte here, in seconds (None until one came).
        self.prefill_s: float | None = None
        #: When this process last sent a yielding (batch) request here (monotonic seconds).
        self.batch_sent_at = -math.inf
        self.reserved_at_scrape = 0
        self.dispatched_since_scrape = 0
        self.completed_since_scrape = 0
        self.signals: EngineSignals | None = None
        self.scraped_at = 0.0
        self.outstanding_at_scrape = 0
        self.scrape_error: str | None = None
        #: In service by health: no refused connection and no failed probes since the last good streak.
        self.up = True
        #: Good probes in a row (> 0) or failed probes in a row (< 0).
        self.probe_streak = 0
        self.probed_at: float | None = None
        self.down_since: float | None = None
        #: Why the endpoint was last taken out (kept after it came back, for the admin API).
        self.failure: str | None = None
        self.breaker = breaker
        #: The scrape that last saw the engine make progress (its progress counters moved) or idle (nothing
        #: running), and whether it was busy then (monotonic seconds; -inf before any scrape).
        self.alive_at = -math.inf
        self.alive_busy = False
        #: The scrape that last saw it make progress while busy.
        self.moved_at = -math.inf
        #: When a byte last came from the engine to a request of this process (a first byte, an answer).
        self.heard_at = -math.inf
        #: Tries of this process here that reached their first-token deadline with nothing heard from the
        #: engine since they were sent (reset by the next byte heard).
        self.silent_timeouts = 0
        #: When it was last found hung (-inf: never).
        self.hung_at = -math.inf
        #: LoRA adapters: this process's requests in flight here per adapter, when it last sent each one here
        #: (monotonic seconds), and the adapters it loaded here at run time (forgotten when the endpoint goes
        #: down: a restarted engine has none).
        self.adapter_flight: dict[str, int] = {}
        self.adapter_used: dict[str, float] = {}
        self.adapters_loaded: set[str] = set()

    def adapters(self, now: float, max_age: float) -> frozenset[str]:
        """The LoRA adapters active here: the engine's running and waiting ones at the last fresh scrape, and
        those this process has in flight here now."""
        signals = self.signals
        flying = frozenset(name for name, count in self.adapter_flight.items() if count > 0)
        if signals is None or signals.adapters is None or now - self.scraped_at > max_age:
            return flying
        return signals.adapters | flying

    def recent_adapters(self, now: float, within: float) -> frozenset[str]:
        """The adapters this process sent here within the last ``within`` seconds (likely still in its
        engine's adapter cache)."""
        return frozenset(name for name, at in self.adapter_used.items() if now - at <= within)

    def max_loras(self, declared: int | None) -> int:
        """How many adapters its engine runs at once: the pool's ``max_loras``, else what the engine reports,
        else vLLM's default (1)."""
        if declared is not None:
            return declared
        signals = self.signals
        return signals.max_loras if signals is not None and signals.max_loras else 1

    def adapter_sent(self, name: str, now: float) -> None:
        """A request for adapter ``name`` was sent here."""
        self.adapter_flight[name] = self.adapter_flight.get(name, 0) + 1
        self.adapter_used[name] = now

    def adapter_done(self, name: str, now: float) -> None:
        """A request for adapter ``name`` here ended."""
        left = self.adapter_flight.get(name, 0) - 1
        if left > 0:
            self.adapter_flight[name] = left
        else:
            self.adapter_flight.pop(name, None)
        self.adapter_used[name] = now

    def load(self, now: float, max_age: float, preempting: bool = False) -> float:
        """Requests the engine is estimated to hold (running + waiting), from every gateway.

        With a scrape younger than ``max_age``: the engine's running + waiting at scrape time,
        plus what this process dispatched there since (its in-flight count now minus then),
        never less than this process's own in-flight count. Otherwise only the own count.

        ``preempting``: as an interactive request weighs it (see :meth:`utilisation`): without this
        process's yielders (they give way, and a decode step hardly grows with its batch), and with the
        interactive streams still in their prefill counted twice (the newcomer's first engine step would
        carry their prefills too, and an engine step takes about as long as all the prefills it carries).
        """
        signals = self.signals
        load = float(self.outstanding)
        if signals is not None and now - self.scraped_at <= max_age:
            load = max(load, signals.running + signals.waiting + (self.outstanding - self.outstanding_at_scrape))
        if preempting:
            load = max(0.0, load - self.yielding) + self.prefilling
        return load

    def utilisation(self, now: float, max_age: float, kv_cache_tokens: int, max_num_seqs: int | None,
                    preempting: bool = False, gone: int = 0, gone_tokens: int = 0) -> float:
        """How full the engine is, in [0, 1) while it has room and 1 or more when saturated.

        With ``C`` the replica's KV-cache tokens, ``R`` the tokens this process has reserved there
        (prompt + expected output of its in-flight requests), ``N`` its in-flight requests, ``S``
        the pool's ``max_num_seqs`` (when declared), and from a fresh scrape ``k`` (KV-cache usage),
        ``n`` running and ``w`` waiting requests, and ``R0``, ``N0`` the same own counts at that
        scrape, ``d`` / ``c`` the requests this process dispatched / finished there since::

            u = max( R / C,                         own reservations
                     k + (R - R0) / C,              the engine's KV usage + what was sent since
                     N / S,  (n + w + N - N0) / S,  sequence slots (only when S is declared)
                     1 + b / max(n, 1) if b > 0 )   the engine has a queue: saturated
            b = w + d - c  (when w > 0 at the scrape; each finished request lets a waiting one in)

        ``w`` leaves out the requests the engine defers for a free LoRA adapter slot: they wait for their
        adapter, not for capacity (the ``lora-affinity`` scorer weighs adapter slots).

        Without a fresh scrape only the own terms count. Reservations count the whole output
        budget, so ``R / C`` reaches 1 before the engine's KV cache is really full: the gateway
        queues a little early rather than letting the engine preempt.

        ``preempting``: as seen by a request that may preempt this process's *yielding* requests
        there (its batch-lane work, which gives way to interactive requests): their ``N_y``
        requests and ``R_y`` tokens are left out of every term but the engine's queue.
        ``gone``, ``gone_tokens``: as it would be once that many of this process's requests there,
        holding that many tokens, had finished (which yielders to preempt is decided on it).
        """
        capacity = float(max(1, kv_cache_tokens))
        r_y = (self.yielding_reserved if preempting else 0) + gone_tokens
        u = (self.reserved - r_y) / capacity
        if max_num_seqs:
            u = max(u, (self.slots_used(now, max_age, preempting) - gone) / max_num_seqs)
        signals = self.signals
        if signals is None or now - self.scraped_at > max_age:
            return u
        u = max(u, signals.kv_usage + (self.reserved - self.reserved_at_scrape - r_y) / capacity)
        waiting = signals.waiting - signals.deferred  # (requests deferred for an adapter slot wait for no capacity)
        if waiting > 0:
            backlog = waiting + self.dispatched_since_scrape - self.completed_since_scrape - gone
            if backlog > 0:
                u = max(u, 1.0 + backlog / max(signals.running, 1.0))
        return u

    def slots_used(self, now: float, max_age: float, preempting: bool = False) -> float:
        """Sequence slots taken: ``max(N, n + w + N - N0)`` (the second with a fresh scrape), less this
        process's yielders when ``preempting`` (see :meth:`utilisation`)."""
        n_y = self.yielding if preempting else 0
        used = float(self.outstanding - n_y)
        signals = self.signals
        if signals is not None and now - self.scraped_at <= max_age:
            used = max(used, signals.running + signals.waiting + self.outstanding - self.outstanding_at_scrape - n_y)
        return used

    def batch_prefilling(self, now: float) -> bool:
        """Whether the last batch request sent here is likely still in its prefill: sent less than the usual
        interactive time to first byte ago (never, before an interactive stream came here)."""
        return self.prefill_s is not None and now - self.batch_sent_at < self.prefill_s

    def queued(self, now: float, max_age: float) -> float:
        """Requests waiting inside the engine at the last fresh scrape (0 when unknown)."""
        signals = self.signals
        if signals is None or now - self.scraped_at > max_age:
            return 0.0
        return signals.waiting

    def served_models(self, now: float, max_age: float) -> frozenset[str] | None:
        """The models the engine reported serving at the last fresh scrape (None: unknown)."""
        signals = self.signals
        if signals is None or now - self.scraped_at > max_age or not signals.models:
            return None
        return signals.models

    def healthy(self, now: float) -> bool:
        """Whether requests may go here: up by health, and its breaker lets one through."""
        return self.up and self.breaker.allows(now)

    def record_progress(self, previous: EngineSignals | None, signals: EngineSignals, now: float) -> None:
        """Note from a new scrape whether the engine moved since the last one (see :meth:`stalled_for`)."""
        moved = (previous is None or previous.progress is None or signals.progress is None
                 or signals.progress != previous.progress)
        if moved or signals.running <= 0:
            self.alive_at, self.alive_busy = now, signals.running > 0
        if moved and signals.running > 0 and previous is not None and previous.progress is not None:
            self.moved_at = now

    def heard(self, now: float) -> None:
        """A byte came from the engine to a request of this process."""
        self.heard_at = now
        self.silent_timeouts = 0

    def alive_since(self, since: float) -> bool:
        """Whether the engine showed progress after ``since``: a byte came from it, or a scrape saw its progress
        counters move while it was busy."""
        return self.heard_at > since or self.moved_at > since

    def stalled_for(self, now: float, max_age: float) -> float:
        """How long the engine has reported work running without any of its progress counters moving, having
        been seen busy and moving before (0 when it is not stalled, or nothing fresh is known).

        An engine that went from idle to busy without moving is not counted: a lone long prefill moves none of
        vLLM's counters until it completes, and the request's own first-token deadline judges it.
        """
        signals = self.signals
        if (signals is None or signals.progress is None or signals.running <= 0 or not self.alive_busy
                or now - self.scraped_at > max_age):
            return 0.0
        return max(0.0, self.scraped_at - self.alive_at)


class EndpointRegistry:
    """The state of every endpoint (by URL) and every pool's breaker (by name) this process has seen.

    ``resilience`` is the active policy's section; :meth:`configure` hands a new one to every breaker.
    """

    __slots__ = ("_listener", "_pools", "_states", "resilience", "signal_max_age")

    def __init__(self, signal_max_age: float = 3.0, resilience: Resilience | None = None,
                 listener: Listener | None = None) -> None:
        self._states: dict[str, EndpointState] = {}
        self._pools: dict[str, CircuitBreaker] = {}
        #: Scrapes older than this are not trusted (the engine may have stopped answering them).
        self.signal_max_age = signal_max_age
        self.resilience = resilience or Resilience()
        self._listener = listener

    def configure(self, resilience: Resilience) -> None:
        """Use ``resilience``'s parameters from now on (a policy reload); breaker states are kept."""
        if resilience is self.resilience:
            return
        self.resilience = resilience
        for state in self._states.values():
            state.breaker.spec = resilience.breakers.endpoint
        for breaker in self._pools.values():
            breaker.spec = resilience.breakers.pool

    def state(self, url: str) -> EndpointState:
        """The state of ``url`` (created on first use)."""
        state = self._states.get(url)
        if state is None:
            breaker = CircuitBreaker("endpoint", url, self.resilience.breakers.endpoint, self._listener)
            state = self._states[url] = EndpointState(url, breaker)
        return state

    def pool_breaker(self, pool: str) -> CircuitBreaker:
        """The breaker of ``pool`` (created on first use)."""
        breaker = self._pools.get(pool)
        if breaker is None:
            breaker = self._pools[pool] = CircuitBreaker("pool", pool, self.resilience.breakers.pool, self._listener)
        return breaker

    def available(self, url: str, pool: str, now: float) -> bool:
        """Whether a request may go to ``url`` of ``pool`` now (health, its breaker and its pool's)."""
        return self.state(url).healthy(now) and self.pool_breaker(pool).allows(now)

    def outstanding(self, url: str) -> int:
        """In-flight requests at ``url`` from this process."""
        state = self._states.get(url)
        return state.outstanding if state is not None else 0

    def acquire(self, url: str, tokens: int = 0, yielding: bool = False) -> None:
        """Count a request of ``tokens`` (prompt + expected output) dispatched to ``url``.

        ``yielding``: it gives way to interactive requests (see :meth:`EndpointState.utilisation`).
        """
        state = self.state(url)
        state.outstanding += 1
        state.reserved += tokens
        state.dispatched_since_scrape += 1
        if yielding:
            state.yielding += 1
            state.yielding_reserved += tokens
            state.batch_sent_at = time.monotonic()

    def release(self, url: str, tokens: int = 0, yielding: bool = False) -> None:
        """Count a request of ``tokens`` at ``url`` as finished (``yielding`` as it was acquired)."""
        state = self.state(url)
        state.outstanding = max(0, state.outstanding - 1)
        state.reserved = max(0, state.reserved - tokens)
        state.completed_since_scrape += 1
        if yielding:
            state.yielding = max(0, state.yielding - 1)
            state.yielding_reserved = max(0, state.yielding_reserved - tokens)

    def prefill_started(self, url: str) -> None:
        """An interactive stream was sent to ``url``: it is in its prefill until :meth:`prefill_ended`."""
        self.state(url).prefilling += 1

    def prefill_ended(self, url: str, ttfb_s: float | None) -> None:
        """Its first byte came after ``ttfb_s`` (None: it ended without one)."""
        state = self.state(url)
        state.prefilling = max(0, state.prefilling - 1)
        if ttfb_s is not None:
            state.prefill_s = ttfb_s if state.prefill_s is None else state.prefill_s + PREFILL_EMA * (
                ttfb_s - state.prefill_s)

    def record_scrape(self, url: str, signals: EngineSignals, now: float | None = None) -> None:
        """Store a successful scrape."""
        state = self.state(url)
        at = time.monotonic() if now is None else now
        state.record_progress(state.signals, signals, at)
        state.signals = signals
        state.scraped_at = at
        state.outstanding_at_scrape = state.outstanding
        state.reserved_at_scrape = state.reserved
        state.dispatched_since_scrape = state.completed_since_scrape = 0
        state.scrape_error = None

    def record_scrape_error(self, url: str, error: str) -> None:
        """Note that ``url``'s metrics could not be read (its last signals age out)."""
        self.state(url).scrape_error = error

    def mark_down(self, url: str, reason: str, now: float | None = None) -> bool:
        """Take ``url`` out of service: it refused a connection. Only good probes bring it back.

        Returns whether it was up until now.
        """
        state = self.state(url)
        state.probe_streak = min(state.probe_streak, 0)
        state.failure = reason
        state.adapters_loaded.clear()  # (it may come back as a fresh engine, without them)
        if not state.up:
            return False
        state.up = False
        state.down_since = time.monotonic() if now is None else now
        return True

    def record_probe(self, url: str, ok: bool, reason: str | None = None, now: float | None = None) -> bool | None:
        """Count one health probe of ``url``; returns the new ``up`` when it changed, else None.

        ``healthy_after`` good probes in a row bring a down endpoint back; ``unhealthy_after`` failed
        ones in a row take an up endpoint out.
        """
        health = self.resilience.health
        state = self.state(url)
        state.probed_at = time.monotonic() if now is None else now
        if ok:
            state.probe_streak = max(state.probe_streak, 0) + 1
            if not state.up and state.probe_streak >= health.healthy_after:
                state.up = True
                state.down_since = None
                return True
            return None
        state.probe_streak = min(state.probe_streak, 0) - 1
        state.failure = reason
        if state.up and -state.probe_streak >= health.unhealthy_after:
            state.adapters_loaded.clear()
            state.up = False
            state.down_since = state.probed_at
            return False
        return None

    def urls(self) -> list[str]:
        """Every endpoint URL seen so far."""
        return list(self._states)
