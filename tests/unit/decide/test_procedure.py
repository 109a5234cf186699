"""The decision procedure as a generator: the effects it asks for, in order, and what it makes of the answers.

A scripted executor answers each effect; the fleet is an idle one (:class:`~switchyard.decide.dryrun.IdleFleet`)
or a small fake where a test needs load, yielders or a memory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from switchyard.decide.admit import LimitAnswer, Reserve
from switchyard.decide.decision import (
    Ask,
    Attempt,
    CacheHit,
    Caller,
    Decision,
    LookupCache,
    Mark,
    Retry,
    Score,
    Tried,
)
from switchyard.decide.dryrun import IdleFleet
from switchyard.decide.features import chat_features
from switchyard.decide.flow import Queue, Waited, steer
from switchyard.decide.pick import EndpointChoice
from switchyard.decide.procedure import decide
from switchyard.decide.views import Candidate, EndpointView
from switchyard.policy import PolicySnapshot, compile_policy
from switchyard.policy.fleet import Pool
from switchyard.policy.tiers import Lane
from tests.unit.policy.base import base, to_yaml

LONG = "the same long system prompt, " * 40  # 1,200 characters: four prefix blocks


@pytest.fixture(scope="module")
def snapshot() -> PolicySnapshot:
    return compile_policy(to_yaml(base()))


def ask(model: str = "small", tier: str = "pro", flow_control: bool = True, headers: dict[str, str] | None = None,
        **body: Any) -> Ask:
    request = {"model": model, "messages": [{"role": "user", "content": LONG + "?"}], "max_tokens": 50, **body}
    return Ask("chat", request, chat_features(request, headers or {}), Caller(tier, "7", "9"),
               gateway_region="us-east", flow_control=flow_control)


@dataclass
class Script:
    """Answers the procedure's effects as a test says, and keeps what it was asked."""

    tries: list[Tried] = field(default_factory=list)
    limits: LimitAnswer = field(default_factory=lambda: LimitAnswer(True))
    hit: CacheHit | None = None
    queue: Waited = field(default_factory=lambda: Waited("granted", 0.2))
    retries: bool = True
    asked: list[Any] = field(default_factory=list)

    def answer(self, effect: Any) -> Any:
        self.asked.append(effect)
        if isinstance(effect, Attempt):
            return self.tries.pop(0) if self.tries else Tried("ok")
        if isinstance(effect, Reserve):
            return self.limits
        if isinstance(effect, LookupCache):
            return self.hit
        if isinstance(effect, Queue):
            return self.queue
        if isinstance(effect, Retry):
            return self.retries or effect.number == 1
        assert isinstance(effect, Score | Mark)
        return None

    def kinds(self) -> list[str]:
        return [type(e).__name__ if not isinstance(e, Mark) else f"Mark:{e.stage}" for e in self.asked]


def run(snapshot: PolicySnapshot, request: Ask, script: Script, fleet: Any = None) -> Decision:
    d = Decision(snapshot, request)
    steps = decide(d, fleet or IdleFleet())
    answer = None
    while True:
        try:
            effect = steps.send(answer)
        except StopIteration as done:
            result: Decision = done.value
            return result
        answer = script.answer(effect)


def test_the_effects_come_in_the_order_of_the_request_path(snapshot: PolicySnapshot) -> None:
    script = Script()
    d = run(snapshot, ask(), script)
    assert d.outcome == "served" and d.choice is not None and d.choice.pool.name == "small-us"
    # The cache's lookup (small has an exact rule; not deterministic here: no lookup), the reservation, flow
    # control's stage, the try (the first try of a dispatch needs no retry budget).
    assert script.kinds() == ["Reserve", "Mark:queue", "Attempt"]
    retried = Script(tries=[Tried("failed", "timeout", "slow")])
    run(snapshot, ask(), retried)
    assert retried.kinds() == ["Reserve", "Mark:queue", "Attempt", "Retry", "Attempt"]
    assert [s.label for s in d.stages] == ["small", "small@eu-west"]
    lines = [str(line) for line in d.trace]  # (the plan's and the pick's lines are put in words when read)
    assert lines[-2].startswith("fallback plan: small") and lines[-1].startswith("endpoint http://127.0.0.1:900")


def test_with_nothing_to_charge_the_executor_still_admits(snapshot: PolicySnapshot) -> None:
    script = Script()
    d = run(snapshot, ask(tier="pro"), script)
    reserve = next(e for e in script.asked if isinstance(e, Reserve))
    assert reserve.charges == () and d.charges == ()
    refused = run(snapshot, ask(tier="free"), Script(limits=LimitAnswer(False, "t:7:tokens_per_minute",
                                                                        retry_after_s=2.5, remaining=10)))
    assert refused.outcome == "refused" and refused.refusal is not None
    assert (refused.refusal.status, refused.refusal.limit, refused.refusal.retry_after_s) == (
        429, "tokens_per_minute", 3)
    assert "remaining 10" in refused.refusal.message


def test_a_cache_hit_ends_it_after_its_charge(snapshot: PolicySnapshot) -> None:
    script = Script(hit=CacheHit(40, 10))
    d = run(snapshot, ask(temperature=0), script)
    assert d.outcome == "cache_hit" and d.hit == CacheHit(40, 10)
    assert script.kinds() == ["LookupCache"]  # hit_charge 0: nothing to reserve, no engine
    doc = base()
    doc["cache"][0]["hit_charge"] = 0.5
    charged = Script(hit=CacheHit(40, 10), limits=LimitAnswer(False, "t:7:tokens_per_minute", never=True,
                                                              remaining=1000))
    refused = run(compile_policy(to_yaml(doc)), ask(tier="free", temperature=0), charged)
    assert charged.kinds() == ["LookupCache", "Reserve"] and refused.outcome == "refused"


def test_turned_off_flow_control_never_queues_or_sheds(snapshot: PolicySnapshot) -> None:
    full = Loaded(utilisation=1.0)
    for klass in ("critical", "sheddable", "batch"):
        script = Script()
        d = run(snapshot, ask(flow_control=False, priority=klass), script, full)
        assert not any(isinstance(e, Queue) for e in script.asked) and d.refusal is None
        assert d.scheduled is not None and d.scheduled.model.name == "small"


def test_a_saturated_pool_queues_and_the_wait_decides(snapshot: PolicySnapshot) -> None:
    full = Loaded(utilisation=1.0)
    granted = run(snapshot, ask(), Script(), full)
    assert granted.outcome == "served" and granted.scheduled is not None and granted.scheduled.waited_s == 0.2
    expired = run(snapshot, ask(), Script(queue=Waited("expired", 5.0)), full)
    assert expired.refusal is not None and (expired.refusal.code, expired.refusal.shed) == (
        "queue_deadline_exceeded", "deadline")
    left = run(snapshot, ask(), Script(queue=Waited("left", 0.1)), full)
    assert left.refusal is not None and left.refusal.status == 499
    shed = run(snapshot, ask(tier="free"), Script(), full)  # sheddable above its 0.8 threshold
    assert shed.refusal is not None and (shed.refusal.code, shed.refusal.shed) == ("shed_utilisation", "utilisation")


def test_failed_tries_move_along_the_plan_within_the_budget(snapshot: PolicySnapshot) -> None:
    failed = Tried("failed", "connect_error", "refused", "error-object")
    d = run(snapshot, ask(), Script(tries=[failed, Tried("ok")]))
    assert d.outcome == "served" and d.attempts is not None and d.attempts.count == 2
    assert d.attempts.moved_on[0].endswith(" connect_error")
    spent = run(snapshot, ask(), Script(tries=[failed], retries=False))
    assert spent.outcome == "failed" and spent.attempts is not None and spent.attempts.budget_spent
    assert spent.attempts.last is failed
    everywhere = run(snapshot, ask(), Script(tries=[failed] * 3))
    assert everywhere.outcome == "failed" and everywhere.attempts is not None and everywhere.attempts.count == 3


def test_nothing_in_service_is_a_503_that_names_why(snapshot: PolicySnapshot) -> None:
    d = run(snapshot, ask(), Script(), Loaded(healthy=False))
    assert d.refusal is not None and (d.refusal.status, d.refusal.code) == (503, "no_healthy_endpoint")
    assert "small: all out" in d.refusal.message


def test_a_preempted_request_queues_again_and_counts_its_preemptions(snapshot: PolicySnapshot) -> None:
    script = Script(tries=[Tried("preempted"), Tried("ok")])
    d = run(snapshot, ask(priority="batch"), script)
    assert d.outcome == "served" and d.preemptions == 1
    assert script.kinds().count("Mark:queue") == 2
    assert any(str(line).startswith("preempted at ") for line in d.trace)
    assert d.gives_way  # a batch-lane request answered whole
    d.preemptions = 8
    assert not d.gives_way  # preempted often enough: it runs to its end


def test_stateful_scorers_record_what_the_engines_hold(snapshot: PolicySnapshot) -> None:
    fleet = Loaded()
    # The first try (at the less loaded 9002) fails: nothing is recorded there; the second is answered at 9001.
    run(snapshot, ask(headers={"x-session-id": "s1"}), Script(tries=[Tried("failed", "timeout", "slow")]), fleet)
    assert fleet.memory.records == [("prefix", "http://127.0.0.1:9001"), ("session", "http://127.0.0.1:9001")]
    fleet.memory.records.clear()
    run(snapshot, ask(priority="batch"), Script(tries=[Tried("preempted"), Tried("ok")]), fleet)
    # Preempted after running there: its prompt is in that engine's cache, but the session did not end there.
    assert [kind for kind, _ in fleet.memory.records] == ["prefix", "prefix"]


def test_interactive_work_is_steered_to_the_youngest_batch_request() -> None:
    pool = Pool(name="p", region="r", served_model="m", endpoints=["http://a", "http://b"], kv_cache_tokens=1000)
    options = [Candidate(pool, "http://a"), Candidate(pool, "http://b")]
    choice = EndpointChoice(pool, "http://a", 1.0, (), "max-score", 2, ())
    fleet = Loaded(full=True, yielders={"http://a": [1.0], "http://b": [2.0]})
    assert steer(choice, options, set(), 1.0, fleet, 3.0).url == "http://b"
    assert steer(choice, options, {"http://b"}, 1.0, fleet, 3.0) is choice
    assert steer(choice, options, set(), 1.0, Loaded(full=False), 3.0) is choice


# --- a small fleet for the tests -------------------------------------------------------------------------------

@dataclass
class Memory:
    """Scorer memory that remembers what was recorded (and knows nothing)."""

    records: list[tuple[str, str]] = field(default_factory=list)

    @property
    def prefixes(self) -> Memory:
        return self

    @property
    def sessions(self) -> Memory:
        return self

    def affinity(self, hashes: Sequence[bytes], urls: Sequence[str], now: float) -> dict[str, float]:
        return dict.fromkeys(urls, 0.0)

    def get(self, key: str, now: float) -> str | None:
        return None

    def record(self, key: Any, url: str, now: float) -> None:
        self.records.append(("session" if isinstance(key, str) else "prefix", url))


class Loaded(IdleFleet):
    """An idle fleet but for what a test says: every endpoint at ``utilisation``, in service or not, full or not,
    with yielders sent at the given times."""

    def __init__(self, utilisation: float = 0.0, healthy: bool = True, full: bool = False,
                 yielders: dict[str, list[float]] | None = None) -> None:
        self.u = utilisation
        self.healthy = healthy
        self.is_full = full
        self.started = yielders or {}
        self.memory = Memory()  # type: ignore[assignment]

    def endpoint(self, candidate: Candidate, lane: Lane, now: float) -> EndpointView:
        # The first small-us endpoint looks busier, so picks are not ties.
        load = 1.0 if candidate.url.endswith(":9001") else 0.0
        return EndpointView(self.healthy, load, 0.0, self.u)

    def pool_utilisation(self, pool: Pool, lane: Lane, now: float) -> float:
        return self.u

    def out_of_service(self, options: Sequence[Candidate], now: float) -> tuple[str, float]:
        return "all out", 2.0

    def yielders(self, url: str) -> Sequence[float]:
        return self.started.get(url, [])

    def available(self, candidate: Candidate, now: float) -> bool:
        return self.healthy

    def full(self, candidate: Candidate, ceiling: float, now: float, preempting: bool) -> bool:
        return self.is_full and not preempting



def test_a_chat_its_models_renderer_renders_is_counted_by_that_render_once(snapshot: PolicySnapshot) -> None:
    """With the model's exact counter and renderer, the prompt's count is the rendered ids' (the template's own
    tokens exact), and the picks use that same render: the prompt is rendered once, not counted and rendered."""
    from switchyard.gateway.prompts import SimPromptRenderer
    from switchyard.gateway.tokenizers import sim_counter

    sim = SimPromptRenderer()
    renders: list[Any] = []

    def render(body: Any) -> list[int] | None:
        renders.append(body)
        return sim(body)

    request = ask(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": LONG}])
    request.counters, request.renderers = {"small": sim_counter()}, {"small": render}
    d = run(snapshot, request, Script())
    assert d.outcome == "served" and len(renders) == 1
    ids = sim(request.body)
    assert ids is not None and d.prompt_tokens == len(ids)
    assert d.subject is not None and d.subject.tokens("small") == ids
    # A chat it cannot render (the sim renders no cache_salt'ed prompt) is counted by the counter, as before.
    salted = ask(cache_salt="s")
    salted.counters, salted.renderers = {"small": sim_counter()}, {"small": render}
    counted = run(snapshot, salted, Script())
    assert counted.prompt_tokens == sim_counter().count_chat([LONG + "?"])
