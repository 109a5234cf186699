"""Hand-made results for the stats and report tests."""

from __future__ import annotations

from array import array

from switchyard.bench.results import Result


def result(index: int = 0, *, arm: str = "a", cls: str = "standard", tenant: str = "t", status: int = 200,
           scheduled: float = 0.0, late: float = 0.0, ttft: float | None = 0.1, e2e: float = 0.5,
           tokens: int | None = 10, itl: tuple[float, ...] = (), route: str | None = None,
           timed_out: bool = False, error_type: str | None = None, prompt_tokens: int | None = None,
           cached_tokens: int | None = None) -> Result:
    """A result with times relative to ``scheduled`` (``ttft`` and ``e2e`` from the scheduled time)."""
    failed = status >= 300 or status == 0 or timed_out
    r = Result(index, arm, tenant, cls, "m", "chat", True, 100, 50, None, scheduled)
    r.sent_s = scheduled + late
    r.status = status
    r.first_token_s = None if ttft is None or failed else scheduled + ttft
    r.done_s = scheduled + e2e
    r.completion_tokens = tokens if not failed else None
    r.chunks = tokens or 0 if not failed else 0
    r.itl_s = array("d", itl)
    r.route = route
    r.timed_out = timed_out
    r.error_type = error_type if error_type or not failed else ("timeout" if timed_out else "http_error")
    r.prompt_tokens = prompt_tokens
    r.cached_tokens = cached_tokens
    return r
