"""The procedure's answers to engine faults: first-token deadlines, hedged first tokens, and resuming a stream its
engine broke off (the order of those decisions, their safety rules and their trace).

A scripted executor answers each effect (as in ``test_procedure.py``); the fleet is an idle one, or an idle one
with a saturated pool or an observed time to first token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from switchyard.decide.deadlines import first_token_deadline, hedge_blocked, hedge_delay
from switchyard.decide.decision import (
    Ask,
    Attempt,
    Caller,
    Decision,
    Hedge,
    Raced,
    Tried,
)
from switchyard.decide.dryrun import IdleFleet
from switchyard.decide.features import chat_features, completion_features
from switchyard.decide.procedure import Steps, decide, resume
from switchyard.decide.resume import StreamSoFar, left_to_generate, resume_refusal
from switchyard.policy import PolicySnapshot, compile_policy
from switchyard.policy.errors import PolicyError
from switchyard.policy.fleet import Pool
from switchyard.policy.tiers import HedgeSpec, Lane
from tests.unit.decide import test_procedure as procedure_tests
from tests.unit.policy.base import base, to_yaml


def _policy(**classes: dict[str, Any]) -> PolicySnapshot:
    doc = base()
    doc["priorities"] = {"critical": {"max_queue_ms": 5000, "ttft_objective": 0.5},
                         "hedged": {"max_queue_ms": 5000, "first_token_deadline": "3s", "hedge": {"after": "p95"}},
                         "plain": {"max_queue_ms": 5000}, "sheddable": {"max_queue_ms": 200},
                         "batch": {"lane": "batch"}, **classes}
    doc["tiers"][1]["priority"] = "critical"  # pro
    doc["tiers"].append({"name": "hedger", "priority": "hedged", "models": ["*"]})
    doc["tiers"].append({"name": "plainer", "priority": "plain", "models": ["*"]})
    doc["models"][1]["first_token_timeout"] = 7
    return compile_policy(to_yaml(doc))


@pytest.fixture(scope="module")
def snapshot() -> PolicySnapshot:
    return _policy()


def ask(tier: str = "pro", model: str = "small", **body: Any) -> Ask:
    request = {"model": model, "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 50,
               **body}
    return Ask("chat", request, chat_features(request, {}), Caller(tier, "7", "9"), gateway_region="us-east")


class Fleet(IdleFleet):
    """An idle fleet with an observed time to first token, and pools as full as a test says."""

    def __init__(self, p95: float | None = 0.4, full: frozenset[str] = frozenset()) -> None:
        self.p95 = p95
        self.full_pools = full

    def ttft_quantile(self, pool: Pool, quantile: float, now: float) -> float | None:
        return self.p95

    def pool_utilisation(self, pool: Pool, lane: Lane, now: float) -> float:
        return 1.0 if pool.name in self.full_pools else 0.0


@dataclass
class Script(procedure_tests.Script):
    """Answers effects as ``test_procedure``'s script does; ``raced`` answers the hedges (``hedge``: the hedge
    wins, else the first try)."""

    raced: list[str] = field(default_factory=list)

    def answer(self, effect: Any) -> Any:
        if not isinstance(effect, Hedge):
            return super().answer(effect)
        self.asked.append(effect)
        if effect.choice is None:
            return Raced(Tried("ok"), effect.pending_url)
        winner = self.raced.pop(0)
        url = effect.choice.url if winner == "hedge" else effect.pending_url
        other = effect.pending_url if winner == "hedge" else effect.choice.url
        return Raced(Tried("ok"), url, Tried("cancelled"), other)


def drive(steps: Steps | Any, script: Script) -> Any:
    answer = None
    while True:
        try:
            effect = steps.send(answer)
        except StopIteration as done:
            return done.value
        answer = script.answer(effect)


def attempts(script: Script) -> list[Attempt]:
    return [e for e in script.asked if isinstance(e, Attempt)]


# --- deadlines ----------------------------------------------------------------------------------------------


def test_a_try_waits_its_class_deadline_else_twice_its_objective_else_the_models_timeout(
        snapshot: PolicySnapshot) -> None:
    critical = drive(decide(d := Decision(snapshot, ask()), IdleFleet()), s := Script())
    assert critical is d and attempts(s)[0].deadline_s == 1.0  # 2 x ttft_objective 0.5 s
    drive(decide(Decision(snapshot, ask(tier="hedger")), IdleFleet()), s := Script())
    assert attempts(s)[0].deadline_s == 3.0  # first_token_deadline
    drive(decide(Decision(snapshot, ask(tier="plainer", model="large")), IdleFleet()), s := Script())
    assert attempts(s)[0].deadline_s == 7.0  # the model's first_token_timeout
    drive(decide(Decision(snapshot, ask(tier="plainer")), IdleFleet()), s := Script())
    assert attempts(s)[0].deadline_s == 15.0  # resilience.first_token_timeout
    cls = snapshot.priorities["critical"]
    assert cls.deadline(15.0) == 1.0 and snapshot.priorities["plain"].deadline(4.0) == 4.0
    assert first_token_deadline.__name__  # (the procedure's figure is the function's)


def test_deadline_rules_reject_what_the_batch_lane_cannot_use() -> None:
    for cls, where in (({"lane": "batch", "hedge": {"after": 0.5}}, "hedge applies to interactive"),
                       ({"lane": "batch", "ttft_objective": 1}, "ttft_objective applies to interactive")):
        with pytest.raises(PolicyError, match=where):
            _policy(bulk=cls)
    with pytest.raises(PolicyError, match="after"):
        _policy(odd={"max_queue_ms": 10, "hedge": {"after": "p42"}})
    assert _policy(bulk={"lane": "batch", "first_token_deadline": "2m"}).priorities["bulk"].deadline(1) == 120


# --- hedges -------------------------------------------------------------------------------------------------


def test_the_hedge_delay_is_the_pools_quantile_or_the_fixed_delay_floored_and_before_the_deadline() -> None:
    pool = _policy().pools["small-us"]
    quantile = HedgeSpec(after="p95", min_delay=0.1)
    assert hedge_delay(quantile, pool, 3.0, Fleet(p95=0.4), 0.0) == 0.4
    assert hedge_delay(quantile, pool, 3.0, Fleet(p95=0.02), 0.0) == 0.1  # never sooner than min_delay
    assert hedge_delay(quantile, pool, 3.0, Fleet(p95=None), 0.0) is None  # nothing observed yet: no hedge
    assert hedge_delay(quantile, pool, 0.3, Fleet(p95=0.4), 0.0) is None  # the deadline comes first
    assert hedge_delay(HedgeSpec(after=0.25), pool, 3.0, Fleet(p95=None), 0.0) == 0.25
    assert hedge_delay(None, pool, 3.0, Fleet(), 0.0) is None
    spec = HedgeSpec()
    pools = [_policy().pools["small-us"], _policy().pools["small-eu"]]
    assert hedge_blocked(spec, pools, Fleet(full=frozenset({"small-us"})), 0.0) is None  # one has room
    blocked = hedge_blocked(spec, pools, Fleet(full=frozenset({"small-us", "small-eu"})), 0.0)
    assert blocked is not None and blocked.startswith("the fleet is saturated")


def test_a_late_first_token_is_hedged_on_another_endpoint_and_the_first_to_answer_serves(
        snapshot: PolicySnapshot) -> None:
    d = Decision(snapshot, ask(tier="hedger", stream=True))
    script = Script(tries=[Tried("slow")], raced=["hedge"])
    drive(decide(d, Fleet(p95=0.4)), script)
    first = attempts(script)[0]
    assert first.hedge_after == 0.4 and first.deadline_s == 3.0
    hedge = next(e for e in script.asked if isinstance(e, Hedge))
    assert hedge.choice is not None and hedge.choice.url != first.choice.url
    assert [type(e).__name__ for e in script.asked[-3:]] == ["Attempt", "Retry", "Hedge"]  # the budget has its say
    assert d.outcome == "served" and d.choice is hedge.choice and d.hedges == 1
    lines = [str(line) for line in d.trace]
    assert any(line.startswith(f"hedge: no first token from {first.choice.url} within 0.4 s; also sent to "
                               f"{hedge.choice.url}") for line in lines)
    assert f"hedge: {hedge.choice.url} answered first; {first.choice.url} aborted" in lines
    # The first try answering first keeps the first choice.
    kept = Decision(snapshot, ask(tier="hedger", stream=True))
    drive(decide(kept, Fleet(p95=0.4)), Script(tries=[Tried("slow")], raced=["first"]))
    assert kept.choice is not None and kept.choice.url == first.choice.url


def test_no_hedge_without_a_stream_a_hedging_class_budget_or_room(snapshot: PolicySnapshot) -> None:
    drive(decide(Decision(snapshot, ask(tier="hedger")), Fleet()), s := Script())
    assert attempts(s)[0].hedge_after is None  # a complete answer shows no first token
    drive(decide(Decision(snapshot, ask(tier="pro", stream=True)), Fleet()), s := Script())
    assert attempts(s)[0].hedge_after is None  # the class does not hedge
    for script, fleet, why in (
            (Script(tries=[Tried("slow")], retries=False), Fleet(), "the retry budget is spent"),
            (Script(tries=[Tried("slow")]), Fleet(full=frozenset({"small-us", "small-eu"})), "the fleet is saturated")):
        d = Decision(snapshot, ask(tier="hedger", stream=True))
        drive(decide(d, fleet), script)
        hedge = next(e for e in script.asked if isinstance(e, Hedge))
        assert hedge.choice is None and d.hedges == 0 and d.outcome == "served"
        assert any(f"not hedged: {why}" in str(line) for line in d.trace)


# --- resuming a broken stream -------------------------------------------------------------------------------


def _served(snapshot: PolicySnapshot, **body: Any) -> tuple[Decision, Script]:
    d = Decision(snapshot, ask(stream=True, **body))
    script = Script()
    drive(decide(d, IdleFleet()), script)
    assert d.outcome == "served"
    return d, script


def test_a_broken_stream_resumes_on_the_next_endpoint_of_its_plan_as_a_retry(snapshot: PolicySnapshot) -> None:
    d, script = _served(snapshot)
    assert d.choice is not None
    broken = d.choice.url
    tried = drive(resume(d, IdleFleet(), StreamSoFar(12, "broke off mid-stream", "broken")), script)
    assert tried is not None and tried.outcome == "ok"
    resumed = attempts(script)[-1]
    assert resumed.resuming and resumed.choice.url != broken and resumed.hedge_after is None
    assert type(script.asked[-2]).__name__ == "Retry"  # a resume is a retry for the budget
    assert d.resumes == 1 and d.choice is resumed.choice
    assert d.attempts is not None and f"{broken} broken" in d.attempts.moved_on
    assert any(str(line).startswith("stream: resuming after 12 tokens (1 of at most 2), from stage small")
               for line in d.trace)


def test_a_resume_is_refused_when_the_budget_says_no_or_nothing_is_left(snapshot: PolicySnapshot) -> None:
    d, script = _served(snapshot)
    script.retries = False
    assert drive(resume(d, IdleFleet(), StreamSoFar(3, "x", "broken")), script) is None
    assert "stream: not resumed: the retry budget is spent" in [str(line) for line in d.trace]
    d, script = _served(snapshot)
    for _ in range(2):  # max_resumes 2
        assert drive(resume(d, IdleFleet(), StreamSoFar(3, "x", "broken")), script) is not None
    assert drive(resume(d, IdleFleet(), StreamSoFar(3, "x", "broken")), script) is None
    assert "stream: not resumed: it was resumed 2 times already (max_resumes 2)" in [str(x) for x in d.trace]


@pytest.mark.parametrize(("body", "so_far", "why"), [
    ({"n": 2}, {}, "more than one answer"),
    ({"logprobs": True, "top_logprobs": 3}, {}, "log-probabilities"),
    ({}, {"tool_calls": True}, "a tool call was being streamed"),
    ({}, {"reasoning": True}, "reasoning was being streamed"),
    ({"response_format": {"type": "json_object"}}, {}, "the output is constrained (response_format)"),
    ({"stream_options": {"continuous_usage_stats": True}}, {}, "usage was asked for in every chunk"),
    ({"add_generation_prompt": False}, {}, "the request sets add_generation_prompt itself"),
])
def test_what_cannot_be_continued_safely_is_not(snapshot: PolicySnapshot, body: dict[str, Any],
                                                so_far: dict[str, bool], why: str) -> None:
    model = snapshot.models["small"]
    refusal = resume_refusal(model, "chat", {"model": "small", **body}, StreamSoFar(4, "x", "broken", **so_far), 0)
    assert refusal is not None and refusal.startswith(why)
    assert resume_refusal(model, "chat", {"model": "small", "tools": [{}]}, StreamSoFar(4, "x", "broken"), 0) is None


def test_completions_resume_only_from_one_text_prompt() -> None:
    doc = base()
    doc["models"][0]["resume_streams"] = False
    model = compile_policy(to_yaml(doc)).models["small"]
    assert resume_refusal(model, "completion", {"prompt": "a"}, StreamSoFar(1, "x", "broken"), 0) == \
        "resume_streams is off for model small"
    small = compile_policy(to_yaml(base())).models["small"]
    so_far = StreamSoFar(1, "x", "broken")
    assert resume_refusal(small, "completion", {"prompt": "a"}, so_far, 0) is None
    assert resume_refusal(small, "completion", {"prompt": [1, 2]}, so_far, 0) == "the prompt is not one piece of text"
    echoed = resume_refusal(small, "completion", {"prompt": "a", "echo": True}, so_far, 0)
    assert echoed == "the prompt is echoed (echo)"
    assert completion_features({"model": "small", "prompt": "a"}, {}).prompt_tokens >= 1


def test_the_output_budget_left_is_the_clients_less_what_was_produced() -> None:
    assert left_to_generate({"max_tokens": 50}, 12) == 38
    assert left_to_generate({"max_completion_tokens": 20, "max_tokens": 50}, 12) == 8
    assert left_to_generate({"max_tokens": 10}, 12) == 0
    assert left_to_generate({}, 12) is None
