"""This gateway process's part in a policy canary: which snapshot decides each request, the figures it counts,
and the running of the canary's steps.

- **Following**: the running canary is read from the database when the policy channel announces a change
  (``store.canary``), and by the policy poll as a safety net; its candidate is compiled (off the event loop)
  and kept with its token counters, like the active snapshot. A replica that restarts in the middle of a
  canary reads it at start-up and serves the same slice.
- **Choosing**: per request, in one step of the event loop: outside the canary's scope the active snapshot
  decides; inside, the slice (:mod:`switchyard.decide.canary`) is decided by the candidate and the rest by
  the active version (``control``). In shadow mode the active version decides every request and, for the
  slice, the candidate decides alongside on the live fleet view, read only (the dry-run's executor); what
  differs is counted and kept on the request's record (the request log).
- **Counting**: each finished request of the canary's scope is counted on its side and class; every
  :data:`TICK_S` the counts go to the database (one row per side and class), then the canary is evaluated
  from every replica's rows and its verdict carried out (a compare-and-set: one process wins each step).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from switchyard.decide import canary as rules
from switchyard.decide.decision import Ask, Decision
from switchyard.decide.dryrun import Looking, run_idle
from switchyard.decide.picking import PromptRenderer
from switchyard.decide.policy_tests import compile_checked
from switchyard.decide.tokens import TokenCounter
from switchyard.policy import PolicyError, PolicySnapshot
from switchyard.policy.rollout import Rollout
from switchyard.store import canary as store
from switchyard.store.db import session_scope
from switchyard.store.models import PolicyVersion
from switchyard.store.request_log import replica_name

if TYPE_CHECKING:
    from switchyard.decide.views import FleetView
    from switchyard.gateway.activity import RequestRecord
    from switchyard.gateway.metrics import GatewayMetrics
    from switchyard.gateway.model_tokens import ModelTokens

log = logging.getLogger("switchyard.canary")

#: Seconds between flushes of this process's counts and evaluations of the canary.
TICK_S = 2.0


@dataclass(frozen=True, slots=True)
class LiveCanary:
    """The running canary as this process serves it."""

    id: int
    version: int
    percent: float
    step: int
    rollout: Rollout
    snapshot: PolicySnapshot
    counters: Mapping[str, TokenCounter]
    renderers: Mapping[str, PromptRenderer]

    @property
    def shadow(self) -> bool:
        return self.rollout.shadow


@dataclass(slots=True)
class Chosen:
    """What decides one request: the snapshot (and its counters), and the request's part in the canary."""

    snapshot: PolicySnapshot
    counters: Mapping[str, TokenCounter]
    renderers: Mapping[str, PromptRenderer]
    role: str | None = None


class CanaryFollower:
    """The running canary in this process (see the module doc)."""

    def __init__(self, engine_of: Any, load_tokens: Any, fleet: FleetView, metrics: GatewayMetrics) -> None:
        self._metrics = metrics
        self._engine_of = engine_of  # () -> Engine (the database opens with the lifespan)
        self._load_tokens = load_tokens  # (PolicySnapshot) -> ModelTokens
        self._fleet = fleet
        self.live: LiveCanary | None = None
        self.replica = replica_name()
        self._figures: rules.Figures = rules.empty_figures()
        self._shadow_requests = 0
        self._diffs: dict[str, int] = {}
        self._lock = asyncio.Lock()
        #: The last evaluation's outcome, for ``/readyz``.
        self.last: str | None = None

    # --- following ---------------------------------------------------------------------------------

    def _read(self) -> tuple[int, int, float, int, str] | None:
        with session_scope(self._engine_of()) as session:
            row = store.running(session)
            if row is None:
                return None
            assert row.id is not None
            return row.id, row.version, row.percent, row.step, row.rollout

    def _text(self, version: int) -> str:
        with session_scope(self._engine_of()) as session:
            found = session.get(PolicyVersion, version)
            assert found is not None
            return found.yaml_text

    async def check(self) -> bool:
        """Follow the database's running canary (none, another, or a new step); whether anything changed."""
        found = await anyio.to_thread.run_sync(self._read)
        live = self.live
        if found is None:
            if live is None:
                return False
            log.info("canary %d of v%d ended: the active version decides every request", live.id, live.version)
            self.live = None
            self._reset()
            self._metrics.canary_percent.set(0)
            return True
        cid, version, percent, step, rollout_json = found
        if live is not None and live.id == cid:
            if live.percent == percent and live.step == step:
                return False
            self.live = LiveCanary(cid, version, percent, step, live.rollout, live.snapshot, live.counters,
                                   live.renderers)
            self._metrics.canary_percent.set(percent / 100)
            log.info("canary %d of v%d at %g%%", cid, version, percent)
            return True
        async with self._lock:
            if self.live is not None and self.live.id == cid:
                return False  # a concurrent check (the poll, a notification) loaded it meanwhile: keep its counts
            try:  # (the candidate's text is read once, when the canary is new to this process)
                text = await anyio.to_thread.run_sync(self._text, version)
                snapshot = await anyio.to_thread.run_sync(compile_checked, text, f"policy version {version}", version)
                tokens: ModelTokens = await anyio.to_thread.run_sync(self._load_tokens, snapshot)
            except PolicyError as error:
                log.error("canary %d's candidate v%d cannot be served here: %s", cid, version, error)
                return False
            self._reset()
            self.live = LiveCanary(cid, version, percent, step, Rollout.model_validate_json(rollout_json), snapshot,
                                   *tokens)
            self._metrics.canary_percent.set(percent / 100)
        log.info("canary %d of v%d (%s) at %g%%", cid, version, "shadow" if self.live.shadow else "live", percent)
        return True

    def _reset(self) -> None:
        self._figures = rules.empty_figures()
        self._shadow_requests = 0
        self._diffs = {}

    # --- choosing ----------------------------------------------------------------------------------

    def choose(self, active: PolicySnapshot, counters: Mapping[str, TokenCounter],
               renderers: Mapping[str, PromptRenderer], *, tier: str, tenant: str, key: str, region: str | None,
               headers: Mapping[str, str], body: Mapping[str, Any], request_id: str) -> Chosen:
        """Which snapshot decides a request (call in the same step of the event loop as reading ``active``)."""
        live = self.live
        model = body.get("model")
        if live is None or not rules.in_scope(live.rollout, tier, region, model if isinstance(model, str) else None):
            return Chosen(active, counters, renderers)
        subject = rules.subject_of(live.rollout.by, tenant, key, rules.session_of(headers, body), request_id)
        inside = rules.in_slice(live.id, live.percent, subject)
        if live.shadow:
            return Chosen(active, counters, renderers, "shadow" if inside else None)
        if inside:
            return Chosen(live.snapshot, live.counters, live.renderers, "canary")
        return Chosen(active, counters, renderers, "control")

    def shadow_decide(self, ask: Ask) -> Decision | None:
        """The candidate's decision for ``ask`` on the live fleet, read only (None: the canary ended)."""
        live = self.live
        if live is None:
            return None
        shadow_ask = Ask(ask.kind, ask.body, ask.features, ask.caller, ask.gateway_region, ask.strategy,
                         ask.flow_control, live.counters, live.renderers, ask.canonical)
        return run_idle(Decision(live.snapshot, shadow_ask), Looking(self._fleet))

    # --- counting ----------------------------------------------------------------------------------

    def compare(self, record: RequestRecord, live: Decision, shadow: Decision) -> None:
        """Keep on ``record`` where the shadow decided otherwise than the active version."""
        diff = rules.differences(rules.decided(live), rules.decided(shadow))
        record.shadow = diff or None

    def observe(self, record: RequestRecord) -> None:
        """Count a finished request of the canary's scope (the activity's ``canary_sink``)."""
        role = record.canary
        if role is None or self.live is None or record.canary_id != self.live.id:
            return  # (a request that began under a canary that has ended since is not this one's)
        self._metrics.canary_requests.labels(role).inc()
        if role == "shadow":
            self._shadow_requests += 1
            for name in record.shadow or ():
                self._diffs[name] = self._diffs.get(name, 0) + 1
                self._metrics.canary_differences.labels(name).inc()
            return
        rules.add_to(self._figures, role, record.priority, record.outcome or "error", _ms(record.ttft_s), 0.0)

    def spent(self, record: RequestRecord, spend: float) -> None:
        """Count what a request of the canary's scope cost (accounted after it finished, for a stream)."""
        role = record.canary
        if role not in ("canary", "control") or self.live is None or record.canary_id != self.live.id or not spend:
            return
        rules.charge_to(self._figures, role, record.priority, spend)

    def _take(self) -> tuple[int, list[tuple[str, str, dict[str, Any]]]] | None:
        live = self.live
        if live is None:
            return None
        rows: list[tuple[str, str, dict[str, Any]]] = []
        for role, by_cls in self._figures.items():
            rows += [(role, cls, t.as_json()) for cls, t in by_cls.items()]
        if self._shadow_requests:
            rows.append(("shadow", rules.ALL, {"requests": self._shadow_requests, "diffs": dict(self._diffs)}))
        self._reset()
        return live.id, rows

    # --- the steps ---------------------------------------------------------------------------------

    def _flush_and_evaluate(self, taken: tuple[int, list[tuple[str, str, dict[str, Any]]]]) -> str | None:
        cid, rows = taken
        with session_scope(self._engine_of()) as session:
            if rows:
                store.record_figures(session, cid, self.replica, rows)
        with session_scope(self._engine_of()) as session:
            row = store.running(session)
            if row is None or row.id != cid:
                return None
            found = store.status(session, row, with_passed=False)
            if found is None or found.verdict is None:
                return None
            done = store.carry_out(session, found, actor=f"canary@{self.replica}")
            if done is not None:
                log.warning("canary %d of v%d: %s (%s)", cid, row.version, done, found.verdict.reason)
            return done

    async def tick(self) -> str | None:
        """Flush this process's counts and carry out the canary's verdict; the action taken, if any."""
        taken = self._take()
        if taken is None:
            return None
        done = await anyio.to_thread.run_sync(self._flush_and_evaluate, taken)
        self.last = done or self.last
        if done is not None:
            await self.check()
        return done

    async def run(self, interval_s: float = TICK_S) -> None:
        """Tick until cancelled (a failed tick is logged; the counts of a failed flush are lost)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.tick()
            except Exception:
                log.exception("canary tick failed")

    def describe(self) -> dict[str, Any] | None:
        """For ``/readyz``: the canary this process serves."""
        live = self.live
        if live is None:
            return None
        return {"id": live.id, "version": live.version, "percent": live.percent, "step": live.step + 1,
                "mode": "shadow" if live.shadow else "canary", "by": live.rollout.by}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None or math.isnan(seconds) else seconds * 1000
