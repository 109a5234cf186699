"""The console's replay says when the request log holds no request of what a change touches."""

from __future__ import annotations

from datetime import UTC, datetime

from switchyard.admin.pages.policy_replay import touched, unseen_by_the_log
from switchyard.policy import compile_policy
from switchyard.whatif.logged import LogEntry
from tests.unit.policy.base import base, to_yaml


def _entry(tier: str, model: str) -> LogEntry:
    return LogEntry(at=datetime.now(UTC), kind="chat", tier=tier, model=model, stream=False, status=200,
                    prompt_tokens=10)


def test_a_new_tier_and_a_changed_model_no_request_reached_are_named() -> None:
    active = compile_policy(to_yaml(base()))
    doc = base()
    doc["tiers"].append({"name": "trial", "priority": doc["tiers"][0]["priority"], "models": ["small"]})
    doc["models"][1]["context_window"] = 16384  # large
    candidate = compile_policy(to_yaml(doc))
    assert touched(active, candidate) == (["trial"], ["large"])
    # Only small was asked for directly: nothing reached the trial tier, nor large.
    assert unseen_by_the_log(active, candidate, [_entry("free", "small")]) == ["tier trial", "model large"]
    # A request to the route auto may end on large: large counts as reached.
    assert unseen_by_the_log(active, candidate, [_entry("pro", "auto"), _entry("trial", "small")]) == []
    assert unseen_by_the_log(active, active, []) == []  # no change, nothing to miss
