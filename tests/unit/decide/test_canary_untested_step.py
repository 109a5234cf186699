"""A canary's step never passes on guards that could not be tested: a slice too slow to put ``min_requests`` in
the window (whatever it served since the step began) holds its step instead of stepping up or promoting."""

from __future__ import annotations

from switchyard.decide import canary as c
from switchyard.policy.rollout import rollout_from_flags


def _figures(canary: int, control: int) -> c.Figures:
    figures = c.empty_figures()
    for role, n in (("canary", canary), ("control", control)):
        for i in range(n):
            c.add_to(figures, role, "standard", "ok", 20.0 + i % 7, 0.001)
    return figures


def test_a_step_whose_window_holds_too_few_slice_requests_holds() -> None:
    # The defaults (a 2-minute window, 200 requests) and a slice of 0.6 requests/s: after 6 minutes the step's
    # slice served 216 requests, the window holds 72 of them, and no guard can be tested.
    rollout = rollout_from_flags(steps=["1:1m", "10:1m"])
    results = c.evaluate(rollout, _figures(72, 7000))
    assert results == []
    v = c.verdict(rollout, 0, 360, 216, results)
    assert v.action == "hold" and "no guard could be tested yet" in v.reason
    last = c.verdict(rollout, 1, 360, 216, results)
    assert last.action == "hold"  # nor is the last step promoted untested


def test_the_step_passes_once_the_window_holds_enough() -> None:
    rollout = rollout_from_flags(steps=["1:1m", "10:1m"])
    results = c.evaluate(rollout, _figures(216, 7000))
    assert results and not any(r.breached for r in results)
    assert c.verdict(rollout, 0, 360, 216, results).action == "advance"
    assert c.verdict(rollout, 1, 360, 216, results).action == "promote"
