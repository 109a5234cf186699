"""Policy canaries in the database: start, step, promote, roll back, abort; the figures gateways flush; the status.

At most one canary runs (a unique index over running rows). Its candidate is a stored version that is not
active. Every change of a canary is one transaction that also writes its audit entry and, on PostgreSQL,
announces it on the policy channel (payload ``canary``), so every gateway process follows within a second
(the poll of the policy is the safety net, as for publishes). Steps and endings are compare-and-set updates
(``WHERE status = 'running' AND step = :seen``): every gateway process evaluates the canary, and exactly
one of them carries each transition out and audits it.

Publishing a version by any other way while a canary runs aborts the canary in the same transaction
(an operator's fix must never wait for a rollout): see :func:`supersede`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, update
from sqlalchemy import select as sa_select
from sqlalchemy import text as sql_text
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from switchyard.decide.canary import (
    ALL,
    Figures,
    GuardResult,
    Tally,
    Verdict,
    evaluate,
    verdict,
)
from switchyard.decide.policy_tests import compile_checked
from switchyard.policy.rollout import Rollout
from switchyard.store.audit import append_event
from switchyard.store.errors import Conflict, NotFound, StoreError
from switchyard.store.models import AuditEvent, CanaryFigures, PolicyCanary, PolicyVersion, utcnow
from switchyard.store.policy_versions import CHANNEL, MAX_AUTHOR, active_version, get_version

#: The announcement of a canary change on the policy channel.
NOTICE = "canary"


def running(session: Session) -> PolicyCanary | None:
    """The running canary, if any."""
    return session.exec(select(PolicyCanary).where(PolicyCanary.status == "running")).first()


def get_canary(session: Session, canary_id: int) -> PolicyCanary:
    """Canary ``canary_id``.

    Raises:
        NotFound: there is no such canary.
    """
    row = session.get(PolicyCanary, canary_id)
    if row is None:
        raise NotFound(f"no canary {canary_id}")
    return row


def latest(session: Session) -> PolicyCanary | None:
    """The running canary, else the last one that ended."""
    return running(session) or session.exec(select(PolicyCanary).order_by(col(PolicyCanary.id).desc())).first()


def rollout_of(row: PolicyCanary) -> Rollout:
    """The canary's rollout as declared."""
    return Rollout.model_validate_json(row.rollout)


def _announce(session: Session) -> None:
    if session.get_bind().dialect.name == "postgresql":
        session.execute(sql_text("SELECT pg_notify(:channel, :payload)"), {"channel": CHANNEL, "payload": NOTICE})


def start(session: Session, rollout: Rollout, *, author: str, origin: str, text: str | None = None,
          number: int | None = None, source: str = "api", message: str = "",
          document: str | None = None) -> PolicyCanary:
    """Start a canary of a new document ``text`` (stored as a version that is not active) or of stored version
    ``number``.

    Raises:
        PolicyError: ``text`` is invalid or its tests fail; nothing was written.
        Conflict: a canary is running already, there is no active version, or the candidate is the active one.
        NotFound: there is no version ``number``.
        StoreError: the author is too long.
    """
    if (text is None) == (number is None):
        raise ValueError("give the candidate's text or its version number")
    if not author or len(author) > MAX_AUTHOR:
        raise StoreError(f"the author must be 1 to {MAX_AUTHOR} characters")
    current = running(session)
    if current is not None:
        raise Conflict(f"canary {current.id} of v{current.version} is running: promote or abort it first")
    active = active_version(session)
    if active is None:
        raise Conflict("there is no active version to compare a canary with: publish one first")
    if text is not None:
        snapshot = compile_checked(text, document or f"<{source}>")
        if snapshot.sha256 == active.sha256:
            raise Conflict(f"the candidate is the active version's content (v{active.number}): nothing to roll out")
        new = (session.exec(select(func.max(PolicyVersion.number))).one() or 0) + 1
        candidate = PolicyVersion(number=new, yaml_text=snapshot.text, sha256=snapshot.sha256, source=source,
                                  author=author, message=message or "canary candidate", active=False,
                                  parent=active.number)
        session.add(candidate)
        session.flush()
    else:
        assert number is not None
        candidate = get_version(session, number)
        compile_checked(candidate.yaml_text, f"policy version {number}")
        if candidate.active or candidate.sha256 == active.sha256:
            raise Conflict(f"v{number} is the active version's content: nothing to roll out")
    first = rollout.stages[0]
    row = PolicyCanary(version=candidate.number, base=active.number, status="running",
                       rollout=rollout.model_dump_json(), step=0, percent=first.percent, author=author)
    try:
        with session.begin_nested():
            session.add(row)
            session.flush()
    except IntegrityError:
        raise Conflict("another canary started at the same moment") from None
    append_event(session, actor=author, origin=origin, action="policy.canary.start",
                 target=f"policy:v{candidate.number}",
                 detail={"canary": row.id, "version": candidate.number, "base": active.number,
                         "mode": "shadow" if rollout.shadow else "canary", "percent": first.percent,
                         "rollout": json.loads(row.rollout)})
    _announce(session)
    return row


def follow_file(session: Session, text: str, sha256: str, rollout: Rollout, *, author: str,
                document: str) -> tuple[str, PolicyCanary | None]:
    """A policy file whose document carries a ``rollout:`` stanza changed: roll it out as a canary.

    Returns what happened: ``active`` (it is the active content: nothing to do), ``running`` (its canary runs
    already: another process or an earlier check started it), ``started``, or ``refused`` (a canary of this
    very content was rolled back or aborted: it is not tried again until the file changes), with the canary.
    A canary of other content that runs is aborted (the file is the truth).

    Raises:
        PolicyError: the document is invalid (the caller checked it: only if it changed since).
    """
    active = active_version(session)
    if active is None or active.sha256 == sha256:
        return "active", None
    current = running(session)
    if current is not None:
        candidate = session.get(PolicyVersion, current.version)
        if candidate is not None and candidate.sha256 == sha256:
            return "running", current
        finish(session, current, "aborted", f"superseded by a new policy file ({document})", actor=author,
               origin="file")
    ended = session.exec(select(PolicyCanary).join(PolicyVersion, col(PolicyVersion.number) == PolicyCanary.version)
                         .where(col(PolicyVersion.sha256) == sha256)
                         .order_by(col(PolicyCanary.id).desc())).first()
    if ended is not None and ended.status in ("rolled_back", "aborted"):
        return "refused", ended
    try:
        row = start(session, rollout, author=author, origin="file", text=text, source="file",
                    message="the policy file changed (its rollout: stanza)", document=document)
    except Conflict:  # another process started it at the same moment
        return "running", running(session)
    return "started", row


def advance(session: Session, row: PolicyCanary, to_step: int, reason: str, *, actor: str,
            evidence: Sequence[Mapping[str, Any]] = ()) -> bool:
    """Move ``row`` from the step it was read at to ``to_step``; whether this call did it. ``evidence``: the guards
    the step passed on (:func:`tested`), kept in the audit log's entry (the next step's window starts afresh)."""
    percent = rollout_of(row).stages[to_step].percent
    was = row.percent  # (the update below refreshes ``row``)
    now = utcnow()
    done = session.execute(update(PolicyCanary)
                           .where(col(PolicyCanary.id) == row.id, col(PolicyCanary.status) == "running",
                                  col(PolicyCanary.step) == row.step)
                           .values(step=to_step, percent=percent, step_started_at=now))
    if done.rowcount != 1:  # type: ignore[attr-defined]
        return False
    append_event(session, actor=actor, origin="canary", action="policy.canary.step", target=f"policy:v{row.version}",
                 detail={"canary": row.id, "from_percent": was, "to_percent": percent, "step": to_step,
                         "reason": reason, "guards_tested": [dict(e) for e in evidence]})
    _announce(session)
    return True


_ACTIONS = {"promoted": "policy.canary.promote", "rolled_back": "policy.canary.rollback",
            "aborted": "policy.canary.abort"}


def finish(session: Session, row: PolicyCanary, status: str, reason: str, *, actor: str, origin: str,
           detail: dict[str, Any] | None = None) -> bool:
    """End ``row`` as ``status`` (``promoted`` makes its version active); whether this call did it."""
    now = utcnow()
    facts: dict[str, Any] = {"canary": row.id, "version": row.version, "base": row.base, "percent": row.percent,
                             "reason": reason, **(detail or {})}
    done = session.execute(update(PolicyCanary)
                           .where(col(PolicyCanary.id) == row.id, col(PolicyCanary.status) == "running")
                           .values(status=status, ended_at=now, reason=reason[:4000]))
    if done.rowcount != 1:  # type: ignore[attr-defined]
        return False
    if status == "promoted":
        session.execute(update(PolicyVersion).where(col(PolicyVersion.active).is_(True)).values(active=False))
        session.execute(update(PolicyVersion).where(col(PolicyVersion.number) == row.version).values(active=True))
        facts["from"] = row.base
    append_event(session, actor=actor, origin=origin, action=_ACTIONS[status], target=f"policy:v{row.version}",
                 detail=facts)
    _announce(session)
    session.execute(sql_text("DELETE FROM canary_figures WHERE canary_id = :id AND at < :before"),
                    {"id": row.id, "before": now - timedelta(days=7)})
    return True


def promote(session: Session, *, actor: str, origin: str, reason: str = "promoted by hand") -> PolicyCanary:
    """Promote the running canary's version to active.

    Raises:
        NotFound: no canary is running.
    """
    row = _must_run(session)
    finish(session, row, "promoted", reason, actor=actor, origin=origin)
    session.refresh(row)
    return row


def abort(session: Session, *, actor: str, origin: str, reason: str = "") -> PolicyCanary:
    """Stop the running canary; the active version serves everything again.

    Raises:
        NotFound: no canary is running.
    """
    row = _must_run(session)
    finish(session, row, "aborted", reason or f"aborted by {actor}", actor=actor, origin=origin)
    session.refresh(row)
    return row


def supersede(session: Session, published: int, actor: str, origin: str) -> None:
    """A version was published by other means: abort the running canary (the caller's transaction)."""
    row = running(session)
    if row is not None and row.version != published:
        finish(session, row, "aborted", f"superseded by the publish of v{published}", actor=actor, origin=origin)


def _must_run(session: Session) -> PolicyCanary:
    row = running(session)
    if row is None:
        raise NotFound("no canary is running")
    return row


# --- figures ----------------------------------------------------------------------------------

def record_figures(session: Session, canary_id: int, replica: str, rows: Iterable[tuple[str, str, dict[str, Any]]],
                   at: datetime | None = None) -> int:
    """Store what one process counted since its last flush (``(role, class, figures)`` each); rows written."""
    when = at or utcnow()
    n = 0
    for role, cls, figures in rows:
        session.add(CanaryFigures(canary_id=canary_id, at=when, replica=replica, role=role, priority=cls,
                                  figures=json.dumps(figures, separators=(",", ":"))))
        n += 1
    return n


@dataclass
class Window:
    """A canary's figures read back: over the span its guards compare, and the slice's requests in the current step.

    Attributes:
        figures: Over the last ``window`` of the current step (from ``since``).
        whole: Over the whole last ``window``, the steps before included (from ``whole_since``); None when the
            step is older than the window (the same span as ``figures``).
    """

    figures: Figures = field(default_factory=lambda: {"canary": {}, "control": {}})
    slice_in_step: int = 0
    shadowed: int = 0
    diffs: dict[str, int] = field(default_factory=dict)
    replicas: set[str] = field(default_factory=set)
    since: datetime | None = None
    whole: Figures | None = None
    whole_since: datetime | None = None


def read_window(session: Session, row: PolicyCanary, now: datetime, window_s: float) -> Window:
    """The figures of ``row`` over the last ``window_s`` of its current step, and over the whole last ``window_s``
    when the step is younger (and the slice's count in that step).

    The guards compare the step's span (see :func:`status`): the slice and the rest are then counted over the
    same time with the slice's share unchanged throughout. Over a span that reaches back before the step, a
    slice that just grew has most of its requests in the last seconds while most of the rest's came earlier: a
    load spike after the step falls on the slice's side alone, and a harmless candidate is rolled back for it
    (seen in ``bench canary``: both sides' TTFT rose tenfold in the new step's third second).
    """
    step_start = row.step_started_at
    whole_start = now - timedelta(seconds=window_s)
    window_start = max(whole_start, step_start)
    found = session.execute(sa_select(col(CanaryFigures.at), col(CanaryFigures.replica), col(CanaryFigures.role),
                                      col(CanaryFigures.priority), col(CanaryFigures.figures))
                            .where(col(CanaryFigures.canary_id) == row.id,
                                   col(CanaryFigures.at) >= min(whole_start, step_start))).all()
    out = Window(since=window_start)
    if whole_start < step_start:
        out.whole, out.whole_since = {"canary": {}, "control": {}}, whole_start
    for at, replica, role, cls, text in found:
        data = json.loads(text)
        out.replicas.add(replica)
        if role == "shadow":
            if at >= window_start:
                out.shadowed += int(data.get("requests", 0))
                for name, n in dict(data.get("diffs", {})).items():
                    out.diffs[name] = out.diffs.get(name, 0) + int(n)
            if cls == ALL and at >= step_start:
                out.slice_in_step += int(data.get("requests", 0))
            continue
        tally = Tally.from_json(data)
        if out.whole is not None and at >= whole_start:
            out.whole.setdefault(role, {}).setdefault(cls, Tally()).merge(tally)
        if at >= window_start:
            out.figures.setdefault(role, {}).setdefault(cls, Tally()).merge(tally)
        if role == "canary" and cls == ALL and at >= step_start:
            out.slice_in_step += tally.requests
    return out


# --- the status -------------------------------------------------------------------------------

def tested(r: GuardResult) -> dict[str, Any]:
    """One guard's test as the status and the audit log show it."""
    return {"guard": r.guard, "class": r.cls, "canary": r.canary, "rest": r.rest, "limit": r.limit,
            "p_value": r.p_value, "breached": r.breached, "n_canary": r.n_canary, "n_rest": r.n_rest}


def passed_steps(session: Session, row: PolicyCanary) -> list[dict[str, Any]]:
    """The steps ``row`` has passed, oldest first, from the audit log: each with when, who moved it on, and the
    guards it passed on (its window's evidence: the next step's compares afresh)."""
    found = session.exec(select(AuditEvent).where(col(AuditEvent.action) == "policy.canary.step",
                                                  col(AuditEvent.target) == f"policy:v{row.version}")
                         .order_by(col(AuditEvent.id))).all()
    out: list[dict[str, Any]] = []
    for event in found:
        detail = event.detail or {}
        if detail.get("canary") != row.id:
            continue
        out.append({"step": int(detail.get("step", 0)),  # (the index of the step moved to: the one passed, from 1)
                    "percent": detail.get("from_percent"),
                    "to_percent": detail.get("to_percent"), "at": event.at.isoformat(), "actor": event.actor,
                    "reason": detail.get("reason"), "guards_tested": list(detail.get("guards_tested") or [])})
    return out


@dataclass
class CanaryStatus:
    """A canary and its figures now: what ``canary status``, the admin API and the console show."""

    row: PolicyCanary
    rollout: Rollout
    window: Window
    results: list[GuardResult]
    verdict: Verdict | None
    #: The steps passed (:func:`passed_steps`; None: not read).
    passed: list[dict[str, Any]] | None = None
    #: The results are over the whole window, the steps before included: the current step has not yet had
    #: ``min_requests`` on each side (see :func:`status`).
    warming_up: bool = False

    @property
    def figures(self) -> Figures:
        """The figures the results compare."""
        return self.window.whole if self.warming_up and self.window.whole is not None else self.window.figures

    @property
    def compared_since(self) -> datetime | None:
        """Where the compared span begins."""
        return self.window.whole_since if self.warming_up else self.window.since

    def as_json(self) -> dict[str, Any]:
        """The status as the admin API answers it."""
        row, rollout = self.row, self.rollout
        stages = rollout.stages
        sides: dict[str, dict[str, dict[str, Any]]] = {}
        for role, by_cls in self.figures.items():
            for cls, t in sorted(by_cls.items()):
                sides.setdefault(cls, {})[role] = {
                    "requests": t.requests,
                    "error_rate": t.errors / t.requests if t.requests else None,
                    "shed_rate": t.shed / t.requests if t.requests else None,
                    "rate_limited_rate": t.limited / t.requests if t.requests else None,
                    "ttft_p99_ms": t.quantile_ms(0.99), "cost_per_1k": t.cost_per_1k()}
        out: dict[str, Any] = {
            "id": row.id, "version": row.version, "base": row.base, "status": row.status,
            "mode": "shadow" if rollout.shadow else "canary", "by": rollout.by, "percent": row.percent,
            "step": row.step + 1, "steps": [{"percent": s.percent, "hold_s": s.hold if s.hold != float("inf") else None}
                                            for s in stages],
            "automatic": rollout.automatic, "only": rollout.only.model_dump(), "guards": rollout.guards,
            "window_s": rollout.window, "min_requests": rollout.min_requests, "alpha": rollout.alpha,
            "compared_since": self.compared_since.isoformat() if self.compared_since else None,
            "warming_up": self.warming_up,
            "started_at": row.started_at.isoformat(), "step_started_at": row.step_started_at.isoformat(),
            "ended_at": row.ended_at.isoformat() if row.ended_at else None, "author": row.author,
            "reason": row.reason, "figures": sides, "slice_in_step": self.window.slice_in_step,
            "replicas": sorted(self.window.replicas),
            "guards_tested": [tested(r) for r in self.results],
        }
        if self.passed is not None:
            out["passed_steps"] = self.passed
        if rollout.shadow:
            out["shadow"] = {"decided": self.window.shadowed, "differences": dict(sorted(self.window.diffs.items()))}
        if self.verdict is not None:
            out["next"] = {"action": self.verdict.action, "reason": self.verdict.reason,
                           "in_s": self.verdict.wait_s}
        return out


def status(session: Session, row: PolicyCanary | None = None, now: datetime | None = None, *,
           with_passed: bool = True) -> CanaryStatus | None:
    """The latest canary (or ``row``) with its window's figures and, while it runs, its next move (and, unless
    ``with_passed`` is false, the steps it has passed).

    The guards compare the last ``window`` of the current step. Until that span has ``min_requests`` on each
    side, they compare the whole last ``window`` instead, the steps before included (``warming_up``): a step up
    is never left unguarded while its own evidence gathers, but those results can only roll back, never pass
    the step (:func:`~switchyard.decide.canary.verdict`).
    """
    row = row or latest(session)
    if row is None:
        return None
    rollout = rollout_of(row)
    now = now or utcnow()
    until = row.ended_at or now
    window = read_window(session, row, until, rollout.window)
    passed = passed_steps(session, row) if with_passed else None
    if rollout.shadow:
        return CanaryStatus(row, rollout, window, [], None, passed)
    results = evaluate(rollout, window.figures)
    warming_up = False
    if not results and window.whole is not None:
        results = evaluate(rollout, window.whole)
        warming_up = bool(results)
    step_age = (now - row.step_started_at).total_seconds()
    found = (verdict(rollout, row.step, step_age, window.slice_in_step, results, warming_up=warming_up)
             if row.status == "running" else None)
    return CanaryStatus(row, rollout, window, results, found, passed, warming_up)


def carry_out(session: Session, found: CanaryStatus, actor: str) -> str | None:
    """Carry ``found``'s verdict out, if it moves the canary; the action taken (None: holding, or another process
    took it first)."""
    v = found.verdict
    if v is None or v.action == "hold":
        return None
    row = found.row
    evidence = [tested(r) for r in v.results]
    if v.action == "advance":
        return "advance" if advance(session, row, v.step, v.reason, actor=actor, evidence=evidence) else None
    detail: dict[str, Any] = {"guards_tested": evidence}
    if v.action == "rollback":
        detail["guards"] = [r.describe() for r in v.results if r.breached]
    status_ = "promoted" if v.action == "promote" else "rolled_back"
    return v.action if finish(session, row, status_, v.reason, actor=actor, origin="canary", detail=detail) else None


def history(session: Session, limit: int = 20) -> Sequence[PolicyCanary]:
    """The newest canaries first."""
    return session.exec(select(PolicyCanary).order_by(col(PolicyCanary.id).desc()).limit(limit)).all()
