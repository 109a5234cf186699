"""Circuit breakers and endpoint health, on an explicit clock (no sleeping)."""

from __future__ import annotations

from switchyard.engines.breakers import CircuitBreaker, State
from switchyard.engines.endpoints import EndpointRegistry
from switchyard.policy.resilience import BreakerSpec, HealthSpec, Resilience

SPEC = BreakerSpec(consecutive_failures=3, error_rate=0.5, min_requests=10, window=10, open_for=5,
                   half_open_requests=2)


def breaker(spec: BreakerSpec = SPEC) -> tuple[CircuitBreaker, list[tuple[State, str]]]:
    seen: list[tuple[State, str]] = []
    return CircuitBreaker("endpoint", "http://e", spec, lambda _b, state, why: seen.append((state, why))), seen


def test_consecutive_failures_open_the_breaker_and_a_success_resets_the_count() -> None:
    b, seen = breaker()
    b.failure(0, "refused")
    b.failure(0.1, "refused")
    b.success(0.2)
    b.failure(0.3, "503")
    b.failure(0.4, "503")
    assert b.state(0.4) == "closed" and b.allows(0.4)
    b.failure(0.5, "503")
    assert b.state(0.5) == "open" and not b.allows(0.5)
    assert seen == [("open", "3 failures in a row (last: 503)")]
    assert b.retry_in(1.5) == 4.0


def test_an_error_rate_over_the_window_opens_it_once_enough_requests_were_seen() -> None:
    b, _ = breaker()
    for i in range(4):  # 4 of 4 failed, but fewer than min_requests, and never 3 in a row
        b.success(i)
        b.failure(i + 0.5, "500")
    assert b.state(4) == "closed"
    b.success(5)
    b.failure(5.5, "500")  # 5 of 10 failed: the rate reaches 0.5
    assert b.state(5.5) == "open"


def test_outcomes_older_than_the_window_are_forgotten() -> None:
    b, _ = breaker()
    for i in range(4):
        b.success(i)
        b.failure(i + 0.5, "500")
    assert b.window_counts(4) == (4, 4)
    # 11 s on the first four pairs have left the window: two more outcomes do not reach min_requests.
    b.success(14.5)
    b.failure(15, "500")
    assert b.window_counts(15) == (1, 1) and b.state(15) == "closed"


def test_half_open_takes_a_few_trials_and_closes_when_they_succeed() -> None:
    b, seen = breaker()
    for t in range(3):
        b.failure(t, "timeout")
    assert b.state(6.9) == "open" and not b.allows(6.9) and not b.wants_trial(6.9)  # opened at 2 for 5 s
    assert b.state(8) == "half_open" and b.wants_trial(8)
    assert not b.allows(8)  # client requests are never trials
    first, second, third = b.attempt(8), b.attempt(8), b.attempt(8)
    assert first and second and not third and not b.wants_trial(8)  # both trial slots taken
    b.success(8.1, trial=True)
    assert b.state(8.1) == "half_open"
    b.success(8.2, trial=True)
    assert b.state(8.2) == "closed" and b.allows(8.2)
    assert [s for s, _ in seen] == ["open", "half_open", "closed"]
    # Closing forgets the window: one failure does not re-open it.
    b.failure(9, "500")
    assert b.state(9) == "closed"


def test_a_failed_trial_opens_it_again_for_open_for() -> None:
    b, seen = breaker()
    for t in range(3):
        b.failure(t, "timeout")  # open at 2 for 5 s
    now = 7.0
    for _ in range(3):
        assert b.state(now) == "half_open" and b.attempt(now)
        b.failure(now + 1, "timeout", trial=True)
        assert b.state(now + 1) == "open" and b.retry_in(now + 1) == 5.0
        assert b.last_reason == "trial failed: timeout"
        now += 6
    assert [s for s, _ in seen] == ["open", "half_open"] * 3 + ["open"]


def test_a_neutral_outcome_gives_the_trial_slot_back_without_deciding() -> None:
    b, _ = breaker()
    for t in range(3):
        b.failure(t, "refused")
    assert b.attempt(7) and b.attempt(7) and not b.wants_trial(7)
    b.neutral(trial=True)
    assert b.wants_trial(7) and b.state(7) == "half_open"


def test_health_takes_an_endpoint_out_on_a_refusal_or_failed_probes_and_back_on_good_ones() -> None:
    registry = EndpointRegistry(resilience=Resilience(health=HealthSpec(unhealthy_after=2, healthy_after=3)))
    url = "http://127.0.0.1:1"
    state = registry.state(url)
    assert state.up and state.healthy(0)
    assert registry.record_probe(url, False, "/health answered 500", now=1) is None  # one failure is not enough
    assert registry.record_probe(url, False, "/health answered 500", now=2) is False
    assert not state.healthy(2) and state.failure == "/health answered 500" and state.down_since == 2
    assert registry.record_probe(url, True, now=3) is None
    assert registry.record_probe(url, True, now=4) is None
    assert registry.record_probe(url, True, now=5) is True
    assert state.healthy(5) and state.down_since is None
    # A refused connection takes it out at once, and resets the good streak.
    assert registry.mark_down(url, "cannot connect", now=6) is True
    assert registry.mark_down(url, "cannot connect", now=6.5) is False  # already out
    assert registry.record_probe(url, True, now=7) is None
    assert registry.record_probe(url, True, now=8) is None
    assert not state.healthy(8)
    assert registry.record_probe(url, True, now=9) is True


def test_a_pool_breaker_takes_every_endpoint_of_the_pool_out_and_a_reload_keeps_breaker_states() -> None:
    registry = EndpointRegistry()
    pool = registry.pool_breaker("large-us")
    for t in range(10):
        pool.failure(t * 0.1, "503")
    assert not registry.available("http://a", "large-us", 1) and registry.available("http://b", "large-eu", 1)
    tighter = Resilience.model_validate({"breakers": {"pool": {"open_for": 1}}})
    registry.configure(tighter)
    assert registry.pool_breaker("large-us") is pool and pool.spec.open_for == 1
    assert pool.state(1) == "open"  # its state survives the reload; the new open_for applies to the next opening
