"""A workload from the request log: arrivals, tiers, lengths and shared prefixes as logged."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from switchyard.bench.spec import WorkloadError
from switchyard.simtext.chat import render_chat
from switchyard.whatif import replay_policy
from switchyard.whatif.logged import DEFAULT_OUTPUT, LogEntry, log_workload
from switchyard.whatif.outcomes import prompt_ids
from tests.unit.policy.base import base
from tests.unit.whatif.test_replay import snap

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def entry(second: float, **fields: object) -> LogEntry:
    values: dict[str, object] = {"kind": "chat", "tier": "pro", "model": "small", "stream": False, "status": 200,
                                 "prompt_tokens": 300, "completion_tokens": 40}
    values.update(fields)
    return LogEntry(at=T0 + timedelta(seconds=second), **values)  # type: ignore[arg-type]


def test_arrivals_tiers_and_lengths_are_the_logs() -> None:
    entries = [entry(3.0, tier="free", prompt_tokens=120, completion_tokens=9),
               entry(1.0, kind="completion", prompt_tokens=50, completion_tokens=5, stream=True),
               entry(2.5, model="auto", prompt_tokens=800, completion_tokens=200)]
    wl = log_workload(entries, rate_multiplier=2.0)
    assert [s.arrival_s for s in wl.specs] == [0.0, 0.75, 1.0]
    assert [(s.tenant, s.model, s.kind, s.stream) for s in wl.specs] == [
        ("pro", "small", "completion", True), ("pro", "auto", "chat", False), ("free", "small", "chat", False)]
    # The engine sees exactly the logged prompt tokens (template included) and generates the logged output.
    assert [len(prompt_ids(s.body())) for s in wl.specs] == [50, 800, 120]
    assert [s.max_tokens for s in wl.specs] == [5, 200, 9]
    assert all(s.body()["ignore_eos"] is True for s in wl.specs)
    assert wl.describe()["entries"] == 3 and wl.duration_s == 1.0


def test_prefix_sharing_is_rebuilt_from_the_prefix_cache_hits() -> None:
    overhead = len(render_chat([{"role": "user", "content": ""}]))
    entries = [entry(0, cached_tokens=0), entry(1, cached_tokens=200), entry(2, cached_tokens=200, prompt_tokens=900),
               entry(3, cached_tokens=200, tier="free")]
    wl = log_workload(entries)
    texts = [s.prompt.text() for s in wl.specs]
    shared = 200 - overhead
    a, b, c = (wl.specs[i].prompt for i in (1, 2, 3))
    assert a.truncated(shared).text() == b.truncated(shared).text()  # same tier and model: one shared prefix
    assert a.truncated(shared).text() != c.truncated(shared).text()  # another tier's prompt is its own
    assert texts[0] != texts[1] and wl.specs[1].prefix_group == "log:pro:small"
    assert wl.specs[0].prefix_group is None


def test_requests_that_never_ran_generate_their_budget_or_the_median() -> None:
    entries = [entry(0, completion_tokens=10), entry(1, completion_tokens=30), entry(2, completion_tokens=50),
               entry(3, status=429, completion_tokens=None, max_tokens=700),
               entry(4, status=503, completion_tokens=None, max_tokens=None)]
    wl = log_workload(entries)
    assert [s.max_tokens for s in wl.specs] == [10, 30, 50, 700, 30]
    assert wl.describe()["refused_in_log"] == 2 and wl.describe()["filled_output_tokens"] == 30
    only_refused = log_workload([entry(0, status=429, completion_tokens=None)])
    assert only_refused.specs[0].max_tokens == DEFAULT_OUTPUT


def test_entries_that_cannot_be_replayed_are_counted_not_guessed() -> None:
    entries = [entry(0, tier=None), entry(1, prompt_tokens=None), entry(2, model=None), entry(3),
               entry(4, kind="embedding"), entry(5, kind="tokenize"), entry(6, kind="responses")]
    wl = log_workload(entries)
    assert len(wl.specs) == 2  # (a Responses API request is replayed as the chat it is rendered into)
    assert wl.describe()["skipped"] == {"no_tier": 1, "no_prompt_count": 1, "no_model": 1, "not_generation": 2}
    assert len(log_workload(entries, default_model="auto").specs) == 3
    assert log_workload([]).specs == ()
    with pytest.raises(WorkloadError, match="rate_multiplier"):
        log_workload(entries, rate_multiplier=0)


def test_repeated_requests_are_one_request_and_hit_a_candidates_response_cache() -> None:
    """Three asks of one deterministic question (a fingerprint), one other: a candidate that adds an exact
    cache rule answers the two repeats from the cache."""
    entries = [entry(0, digest="aaaa", deterministic=True, prompt_tokens=300, completion_tokens=20),
               entry(2, digest="aaaa", deterministic=True, prompt_tokens=300, completion_tokens=20, cached_tokens=300,
                     cache="hit"),
               entry(3, digest="bbbb", deterministic=True, prompt_tokens=300, completion_tokens=25),
               entry(5, digest="aaaa", deterministic=True, prompt_tokens=300, completion_tokens=20)]
    wl = log_workload(entries)
    bodies = [s.body() for s in wl.specs]
    assert bodies[0] == bodies[1] == bodies[3] != bodies[2]
    assert bodies[0]["temperature"] == 0 and wl.describe()["repeats"] == 2
    uncached, cached = base(), base()
    uncached["cache"] = []
    cached["cache"] = [{"match": {"models": ["small"]}, "mode": "exact", "ttl": "1m"}]
    assert not any(o.cache_hit for o in replay_policy(snap(uncached), wl).outcomes)
    assert [o.cache_hit for o in replay_policy(snap(cached), wl).outcomes] == [False, True, False, True]
    # Not deterministic: a rule without nondeterministic: true does not cache them.
    loose = log_workload([replace(e, deterministic=False) for e in entries])
    assert not any(o.cache_hit for o in replay_policy(snap(cached), loose).outcomes)
