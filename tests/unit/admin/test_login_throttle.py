"""Failed-login throttling: per username and per address, over a sliding window."""

from __future__ import annotations

from switchyard.admin.session import LoginThrottle

KEYS = ("user:ada", "addr:10.0.0.7")


def test_the_limit_counts_failures_in_the_window_only() -> None:
    throttle = LoginThrottle(attempts=3, window_s=60)
    for t in (0.0, 10.0, 20.0):
        assert throttle.retry_after(KEYS, now=t) == 0
        throttle.failed(KEYS, now=t)
    assert throttle.retry_after(KEYS, now=30.0) == 30.0  # until the first failure is 60 s old
    assert throttle.retry_after(KEYS, now=60.0) == 0  # it left the window


def test_either_key_throttles() -> None:
    throttle = LoginThrottle(attempts=2, window_s=60)
    throttle.failed(("user:ada", "addr:1"), now=0)
    throttle.failed(("user:bob", "addr:1"), now=1)
    assert throttle.retry_after(("user:cy", "addr:1"), now=2) == 58  # one address spraying names
    assert throttle.retry_after(("user:ada", "addr:2"), now=2) == 0


def test_success_clears_only_what_it_is_given() -> None:
    throttle = LoginThrottle(attempts=1, window_s=60)
    throttle.failed(KEYS, now=0)
    throttle.succeeded(KEYS[:1])
    assert throttle.retry_after(KEYS[:1], now=1) == 0
    assert throttle.retry_after(KEYS[1:], now=1) == 59


def test_memory_is_bounded() -> None:
    throttle = LoginThrottle(attempts=5, window_s=60, max_keys=10)
    for i in range(100):
        throttle.failed((f"user:{i}",), now=i * 0.01)
    assert len(throttle._failures) <= 10
