"""A canary's guards compare the slice with the rest over the same time: never across a step's start, where the
slice's share changed (on SQLite and the real PostgreSQL server)."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import Engine
from sqlmodel import Session

from switchyard.decide.canary import Tally, evaluate
from switchyard.policy.rollout import Rollout, Step
from switchyard.store import canary as canary_store
from switchyard.store import db
from switchyard.store.models import PolicyCanary, utcnow
from switchyard.store.policy_versions import publish
from tests.unit.policy.base import base, to_yaml

ROLLOUT = Rollout(steps=[Step(percent=5, hold=1), Step(percent=50, hold=60)], window=120, min_requests=20)


def _tally(requests: int, ttft_ms: float, slow: int = 0, slow_ms: float = 0.0) -> dict[str, object]:
    """``requests`` ok answers, ``slow`` of them at ``slow_ms`` to the first token and the rest at ``ttft_ms``."""
    t = Tally()
    for i in range(requests):
        t.count("ok", slow_ms if i < slow else ttft_ms, 0.001)
    return t.as_json()


def _record(engine: Engine, canary_id: int, at_s: float, canary: dict[str, object],
            control: dict[str, object]) -> None:
    """One flush of a replica, ``at_s`` seconds from now."""
    with db.session_scope(engine) as session:
        canary_store.record_figures(session, canary_id, "gw-a", [("canary", "*", canary), ("control", "*", control)],
                                    at=utcnow() + timedelta(seconds=at_s))


def _started(engine: Engine, rollout: Rollout, step_age_s: float | None = None) -> int:
    """A canary of a candidate next to the published base; its id. ``step_age_s``: its step began that long ago."""
    with db.session_scope(engine) as session:
        publish(session, to_yaml(base()), source="api", author="test")
        row = canary_store.start(session, rollout, author="test", origin="test",
                                 text=to_yaml(base()) + "\n# the candidate\n")
        assert row.id is not None
        if step_age_s is not None:
            _set_step_start(session, row.id, step_age_s)
        return row.id


def _set_step_start(session: Session, canary_id: int, age_s: float) -> None:
    session.execute(PolicyCanary.__table__.update().where(PolicyCanary.__table__.c.id == canary_id)  # type: ignore[attr-defined]
                    .values(step_started_at=utcnow() - timedelta(seconds=age_s)))


def test_a_load_spike_after_a_step_up_falls_on_both_sides_and_rolls_nothing_back(engine: Engine) -> None:
    """The slice grows from 5% to 50% and, a second later, 8% of every side's requests wait 15 times longer for
    their first token (the whole fleet's doing, not the candidate's). Counted over the whole window, the slice's
    requests are mostly the new step's and the rest's mostly the calm step's before: the spike is 5% of the
    slice and under 1% of the rest, and the TTFT guard breaches. Over the step alone both sides hold it in the
    same proportion, and the canary holds (a step younger than the window compares from its start)."""
    canary_id = _started(engine, ROLLOUT)
    # Step 1 (5%): 60 s of calm traffic, 50 slice requests against 950 of the rest.
    for k in range(10):
        _record(engine, canary_id, -60 + 6 * k, _tally(5, 40), _tally(95, 40))
    with db.session_scope(engine) as session:
        running = canary_store.running(session)
        assert running is not None and running.step == 0
        _set_step_start(session, canary_id, 70)
    with db.session_scope(engine) as session:
        running = canary_store.running(session)
        assert running is not None
        assert canary_store.advance(session, running, 1, "step 1 passed", actor="test")
    # Step 2 (50%): a spike on both sides alike, 8 of each side's 100 requests at 600 ms.
    _record(engine, canary_id, 1, _tally(100, 40, slow=8, slow_ms=600), _tally(100, 40, slow=8, slow_ms=600))

    with db.session_scope(engine) as session:
        found = canary_store.status(session)
        assert found is not None
        answer = found.as_json()
    sides = answer["figures"]["*"]
    assert (sides["canary"]["requests"], sides["control"]["requests"]) == (100, 100)  # the step's flush alone
    assert answer["slice_in_step"] == 100
    assert answer["compared_since"] == found.row.step_started_at.isoformat()
    ttft = next(g for g in answer["guards_tested"] if g["guard"] == "ttft_p99" and g["class"] == "*")
    assert not ttft["breached"] and (ttft["n_canary"], ttft["n_rest"]) == (100, 100)
    assert found.verdict is not None and found.verdict.action == "hold"  # its hold of 60 s has not passed

    # What the guard would have said over the whole window: the slice's slow requests against a calm rest.
    with db.session_scope(engine) as session:
        row = canary_store.running(session)
        assert row is not None
        row.step_started_at = utcnow() - timedelta(seconds=200)  # (as if the step had begun before the window)
        whole = canary_store.read_window(session, row, utcnow(), ROLLOUT.window)
        session.rollback()
    breached = [r for r in evaluate(ROLLOUT, whole.figures) if r.breached]
    assert [(r.guard, r.cls) for r in breached] == [("ttft_p99", "*")]


def test_the_compared_span_is_the_last_window_of_a_long_step(engine: Engine) -> None:
    """A step older than the window compares its last ``window`` seconds only; the slice's count in the step
    still reaches back to the step's start."""
    canary_id = _started(engine, Rollout(percent=10, window=30, min_requests=20), step_age_s=300)
    _record(engine, canary_id, -100, _tally(7, 40), _tally(70, 40))  # in the step, before the window
    _record(engine, canary_id, -10, _tally(3, 40), _tally(30, 40))
    with db.session_scope(engine) as session:
        found = canary_store.status(session)
        assert found is not None
        answer = found.as_json()
    assert answer["figures"]["*"]["canary"]["requests"] == 3 and answer["figures"]["*"]["control"]["requests"] == 30
    assert answer["slice_in_step"] == 10  # the step's count reaches back to its start


def test_a_passed_step_keeps_the_evidence_it_passed_on(engine: Engine) -> None:
    """The next step's own span starts afresh, so what a step passed on is kept with its audit entry and shown in
    the status' ``passed_steps`` (and by ``canary status``)."""
    canary_id = _started(engine, ROLLOUT, step_age_s=10)
    _record(engine, canary_id, -5, _tally(30, 40), _tally(300, 40))
    with db.session_scope(engine) as session:
        found = canary_store.status(session)
        assert found is not None and found.verdict is not None and found.verdict.action == "advance"
        before = found.as_json()
        assert before["passed_steps"] == [] and before["guards_tested"]
        assert canary_store.carry_out(session, found, actor="canary@gw-a") == "advance"
    with db.session_scope(engine) as session:
        found = canary_store.status(session)
        assert found is not None
        after = found.as_json()
    # The new step has no request of its own yet: meanwhile the whole window is tested (step 1's included), which
    # can roll back but cannot pass the step.
    assert after["step"] == 2 and after["warming_up"] is True and after["guards_tested"] == before["guards_tested"]
    assert after["compared_since"] < after["step_started_at"]
    assert after["next"]["action"] == "hold"
    [passed] = after["passed_steps"]
    assert (passed["step"], passed["percent"], passed["to_percent"], passed["actor"]) == (1, 5.0, 50.0, "canary@gw-a")
    assert passed["guards_tested"] == before["guards_tested"]
    assert passed["reason"] == "step 1 passed: to 50%"


def test_a_step_up_is_guarded_while_its_own_span_gathers(engine: Engine) -> None:
    """Right after a step up the step's own span has too few requests: the whole window is tested meanwhile, so a
    candidate that fails at the new step's share is rolled back at once, not after ``min_requests`` more."""
    canary_id = _started(engine, ROLLOUT, step_age_s=70)
    _record(engine, canary_id, -30, _tally(40, 40), _tally(400, 40))
    with db.session_scope(engine) as session:
        running = canary_store.running(session)
        assert running is not None
        assert canary_store.advance(session, running, 1, "step 1 passed", actor="test")
    failing = Tally()
    for i in range(16):  # the step's first 16 slice requests (fewer than min_requests): 12 of them errors
        failing.count("error" if i < 12 else "ok", 40, 0.001)
    _record(engine, canary_id, 1, failing.as_json(), _tally(16, 40))
    with db.session_scope(engine) as session:
        found = canary_store.status(session)
        assert found is not None and found.warming_up
        assert found.verdict is not None and found.verdict.action == "rollback", found.verdict
        assert "error_rate in class *" in found.verdict.reason
        assert found.as_json()["figures"]["*"]["canary"]["requests"] == 56  # step 1's and the step's
