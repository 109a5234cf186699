"""A policy canary's pure decisions: the slice, the guardrails' statistics and the step machine."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from switchyard.decide import canary as c
from switchyard.policy.rollout import DEFAULT_GUARDS, Rollout, parse_guard, parse_step, rollout_from_flags

# --- the slice --------------------------------------------------------------------------------------


def test_the_slice_takes_its_share_of_many_subjects() -> None:
    subjects = [f"t:{i}" for i in range(20_000)]
    for percent in (1, 10, 50):
        share = sum(c.in_slice(7, percent, s) for s in subjects) / len(subjects)
        assert abs(share - percent / 100) < 0.01, (percent, share)


def test_the_slice_is_stable_and_grows_without_dropping_anyone() -> None:
    subjects = [f"t:{i}" for i in range(2_000)]
    at_10 = {s for s in subjects if c.in_slice(3, 10, s)}
    at_50 = {s for s in subjects if c.in_slice(3, 50, s)}
    assert at_10 <= at_50
    assert at_10 == {s for s in subjects if c.in_slice(3, 10, s)}  # the same answer each time (every replica's)


def test_each_canary_picks_another_slice() -> None:
    subjects = [f"t:{i}" for i in range(2_000)]
    first = {s for s in subjects if c.in_slice(1, 10, s)}
    second = {s for s in subjects if c.in_slice(2, 10, s)}
    assert len(first & second) < len(first) / 2


def test_a_request_is_hashed_by_what_the_rollout_says() -> None:
    assert c.subject_of("tenant", "42", "7", "s1", "r1") == "t:42"
    assert c.subject_of("key", "42", "7", "s1", "r1") == "k:7"
    assert c.subject_of("session", "42", "7", "s1", "r1") == "s:42:s1"
    assert c.subject_of("session", "42", "7", None, "r1") == "k:7"  # no session: the key keeps it consistent
    assert c.subject_of("request", "42", "7", "s1", "r1") == "r:r1"


def test_the_scope_limits_the_canary() -> None:
    rollout = Rollout(percent=10, only={"tiers": ["pro"], "models": ["auto"]})
    assert c.in_scope(rollout, "pro", "us-east", "auto")
    assert not c.in_scope(rollout, "free", "us-east", "auto")
    assert not c.in_scope(rollout, "pro", "us-east", "small")
    assert c.in_scope(Rollout(percent=10), "free", None, None)


# --- the rollout ------------------------------------------------------------------------------------


def test_rollout_flags_are_parsed_and_checked() -> None:
    rollout = rollout_from_flags(steps=["1:30s", "10:2m", "50:5m", "100"], guards=["ttft_p99=1.5x",
                                                                                 "error_rate=+1%"])
    assert [s.percent for s in rollout.stages] == [1, 10, 50]  # 100% is the promotion
    assert rollout.stages[1].hold == 120
    assert rollout.guards == {"ttft_p99": 1.5, "error_rate": 0.01}
    assert rollout_from_flags(percent=5).guards == DEFAULT_GUARDS
    assert not rollout_from_flags(percent=5).automatic
    assert parse_step("10") == {"percent": 10.0}
    assert parse_guard("shed_rate=+0.02") == ("shed_rate", 0.02)
    assert parse_guard("ttft_p99=+50%") == ("ttft_p99", 1.5)
    assert parse_guard("ttft<=2") == ("ttft_p99", 2.0)
    assert parse_guard("429:1%") == ("rate_limited_rate", 0.01)
    for bad in ("ttft_p99=+1x", "error_rate=1.5x", "nonsense=1"):
        with pytest.raises(ValueError, match="guard"):
            parse_guard(bad)
    one_flag = rollout_from_flags(steps=["1:1m,10%@2m"], percent=0.5)  # --percent: where it starts
    assert [(st.percent, st.hold) for st in one_flag.stages] == [(0.5, 60), (1, 60), (10, 120)]
    assert [st.percent for st in rollout_from_flags(steps=["5", "20"], percent=5).stages] == [5, 20]
    with pytest.raises(ValueError, match="above the first step"):
        rollout_from_flags(steps=["5"], percent=10)
    with pytest.raises(ValidationError, match="increase strictly"):
        rollout_from_flags(steps=["10", "5"])
    with pytest.raises(ValidationError, match="steps, or a percent"):
        Rollout()
    with pytest.raises(ValidationError, match="nothing to compare"):
        Rollout(percent=100)
    assert Rollout(percent=100, shadow=True).percent == 100


# --- the statistics ---------------------------------------------------------------------------------


def test_the_binomial_tail_is_exact() -> None:
    # P(X >= 1), X ~ Bin(10, 0.1) = 1 - 0.9^10
    assert c.binomial_tail(1, 10, 0.1) == pytest.approx(1 - 0.9 ** 10)
    assert c.binomial_tail(0, 10, 0.1) == 1.0
    assert c.binomial_tail(11, 10, 0.1) == 0.0
    # upper side: P(X >= 9) of Bin(10, 0.5) = 11/1024
    assert c.binomial_tail(9, 10, 0.5) == pytest.approx(11 / 1024)


def _side(rng: random.Random, n: int, error_rate: float, ttft_scale: float, cost: float) -> c.Tally:
    t = c.Tally()
    for _ in range(n):
        outcome = "error" if rng.random() < error_rate else "ok"
        t.count(outcome, rng.lognormvariate(0, 0.5) * 100 * ttft_scale, cost * rng.uniform(0.5, 1.5))
    return t


def _figures(canary: c.Tally, control: c.Tally) -> c.Figures:
    return {"canary": {c.ALL: canary}, "control": {c.ALL: control}}


def test_equal_sides_do_not_breach_in_many_trials() -> None:
    rollout = Rollout(percent=10, min_requests=100)
    rng = random.Random(1)
    breaches = 0
    for _ in range(200):
        results = c.evaluate(rollout, _figures(_side(rng, 300, 0.01, 1.0, 1.0), _side(rng, 3000, 0.01, 1.0, 1.0)))
        assert len(results) == len(DEFAULT_GUARDS)
        breaches += any(r.breached for r in results)
    assert breaches <= 2  # alpha 0.001 per evaluation: a false breach in 200 is already unlikely


@pytest.mark.parametrize(("guard", "canary"), [
    ("error_rate", {"error_rate": 0.08, "ttft_scale": 1.0, "cost": 1.0}),
    ("ttft_p99", {"error_rate": 0.01, "ttft_scale": 3.0, "cost": 1.0}),
    ("cost_per_1k", {"error_rate": 0.01, "ttft_scale": 1.0, "cost": 2.0}),
])
def test_a_real_regression_breaches_its_guard(guard: str, canary: dict[str, float]) -> None:
    rng = random.Random(2)
    rollout = Rollout(percent=10, min_requests=100)
    results = c.evaluate(rollout, _figures(_side(rng, 400, **canary), _side(rng, 4000, 0.01, 1.0, 1.0)))
    breached = {r.guard for r in results if r.breached}
    assert guard in breached


def test_no_test_below_the_minimum_sample_size() -> None:
    rng = random.Random(3)
    rollout = Rollout(percent=10, min_requests=200)
    assert c.evaluate(rollout, _figures(_side(rng, 150, 0.5, 5, 5), _side(rng, 3000, 0.0, 1, 1))) == []


def test_shed_and_429_rates_are_compared_per_class() -> None:
    canary, control = c.empty_figures(), c.empty_figures()
    figures = {"canary": canary["canary"], "control": control["control"]}
    for i in range(300):
        c.add_to(figures, "canary", "standard", "limited" if i % 4 == 0 else "ok", 50.0, 0.0)
        c.add_to(figures, "control", "standard", "ok", 50.0, 0.0)
    results = c.evaluate(Rollout(percent=10, min_requests=100, guards={"rate_limited_rate": 0.02}), figures)
    assert {(r.cls, r.breached) for r in results} == {(c.ALL, True), ("standard", True)}


def test_figures_survive_their_json_round_trip_and_merge() -> None:
    t = c.Tally()
    t.count("ok", 12.5, 0.3)
    t.count("shed", None, 0.0)
    back = c.Tally.from_json(t.as_json())
    assert back == t
    back.merge(t)
    assert back.requests == 4 and back.shed == 2
    assert back.quantile_ms(0.5) == pytest.approx(12.5, rel=0.05)


# --- the steps --------------------------------------------------------------------------------------


def _passing() -> list[c.GuardResult]:
    return [c.GuardResult("error_rate", c.ALL, 0.01, 0.01, 0.02, 0.9, False, 300, 3000)]


def test_a_step_holds_then_advances_then_promotes() -> None:
    rollout = rollout_from_flags(steps=["1:60s", "10:60s"], min_requests=50)
    assert c.verdict(rollout, 0, 30, 500, _passing()).action == "hold"
    assert c.verdict(rollout, 0, 30, 500, _passing()).wait_s == pytest.approx(30)
    held = c.verdict(rollout, 0, 61, 10, _passing())
    assert held.action == "hold" and "waiting for 50 requests" in held.reason
    moved = c.verdict(rollout, 0, 61, 60, _passing())
    assert (moved.action, moved.step) == ("advance", 1)
    assert c.verdict(rollout, 1, 61, 60, _passing()).action == "promote"


def test_a_breach_rolls_back_in_any_step() -> None:
    rollout = rollout_from_flags(steps=["1:60s", "10:60s"])
    bad = [c.GuardResult("ttft_p99", "standard", 900.0, 300.0, 450.0, 1e-9, True, 300, 3000)]
    v = c.verdict(rollout, 0, 1, 0, bad)
    assert v.action == "rollback" and "ttft_p99 in class standard" in v.reason


def test_results_over_a_window_reaching_before_the_step_roll_back_but_never_pass_it() -> None:
    """While the step's own span gathers ``min_requests``, the whole window is tested (``warming_up``)."""
    rollout = rollout_from_flags(steps=["1:60s", "10:60s"], min_requests=50)
    held = c.verdict(rollout, 0, 61, 60, _passing(), warming_up=True)
    assert held.action == "hold" and "tested meanwhile over the window with the steps before" in held.reason
    assert c.verdict(rollout, 1, 61, 60, _passing(), warming_up=True).action == "hold"  # nor promote
    bad = [c.GuardResult("error_rate", c.ALL, 0.3, 0.01, 0.02, 1e-9, True, 60, 3000)]
    assert c.verdict(rollout, 1, 1, 0, bad, warming_up=True).action == "rollback"


def test_a_canary_at_a_fixed_percent_waits_for_a_person() -> None:
    rollout = rollout_from_flags(percent=5, min_requests=20)
    v = c.verdict(rollout, 0, 10_000, 10_000, _passing())
    assert v.action == "hold" and v.wait_s is None


def test_every_process_computes_the_same_slice() -> None:
    """Another interpreter (another hash seed, as another replica would have) puts the same subjects in the slice."""
    import subprocess
    import sys

    code = ("from switchyard.decide.canary import in_slice\n"
            "print(''.join('1' if in_slice(11, 25, f't:{i}') else '0' for i in range(500)))")
    here = "".join("1" if c.in_slice(11, 25, f"t:{i}") else "0" for i in range(500))
    for seed in ("1", "2"):
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip()
        assert other == here
