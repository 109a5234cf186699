"""The kv-cache-precise scorer: engine truth where the engine reports, the approximate index elsewhere."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from switchyard.decide.pick import pick_endpoint
from switchyard.decide.picking import PickRequest, Subject
from switchyard.decide.plugins import compile_profile
from switchyard.decide.views import Candidate, EndpointView
from switchyard.policy.fleet import Pool
from switchyard.policy.routing import EndpointProfile

POOL = Pool(name="p", region="r", served_model="m", endpoints=["http://a", "http://b", "http://c"],
            kv_cache_tokens=100_000)
CANDIDATES = [Candidate(POOL, u) for u in POOL.endpoints]
TOKENS = list(range(1000, 1100))
PROFILE = compile_profile("precise", EndpointProfile.model_validate(
    {"scorers": [{"type": "kv-cache-precise", "weight": 2}, {"type": "load", "weight": 1}],
     "picker": {"type": "max-score"}}))


class Engines:
    """Engine caches as the test says (None: not known), with the expectations noted."""

    def __init__(self, held: dict[str, int | None]) -> None:
        self._held = held
        self.expected: list[tuple[str, int]] = []

    def knows(self, url: str, now: float) -> bool:
        return self._held.get(url) is not None

    def held(self, url: str, tokens: Sequence[int], now: float) -> int | None:
        return self._held.get(url)

    def expect(self, url: str, tokens: Sequence[int], held: int, now: float) -> None:
        self.expected.append((url, held))


class Memory:
    def __init__(self, held: dict[str, int | None], guessed: dict[str, float]) -> None:
        self.engine_caches = Engines(held)
        self.prefixes = self
        self.sessions = self
        self._guessed = guessed
        self.recorded: list[str] = []

    def affinity(self, hashes: Any, urls: Sequence[str], now: float) -> dict[str, float]:
        return {u: self._guessed.get(u, 0.0) for u in urls}

    def record(self, hashes: Any, url: str, now: float) -> None:
        self.recorded.append(url)

    def get(self, key: str, now: float) -> None:
        return None


def request(memory: Memory, render: bool = True) -> PickRequest:
    body = {"messages": [{"role": "user", "content": "x" * 2000}]}
    subject = Subject(body, {}, "t", {"m": lambda _b: list(TOKENS)} if render else {})
    return PickRequest(memory, subject, "m", len(CANDIDATES))  # type: ignore[arg-type]


def view(load: float = 0.0, queued: float = 0.0) -> EndpointView:
    return EndpointView(load=load, queued=queued)


def test_the_endpoint_holding_the_longest_prefix_now_wins_and_the_trace_says_engine_events() -> None:
    memory = Memory({"http://a": 16, "http://b": 96, "http://c": 0}, {"http://a": 1.0})
    choice = pick_endpoint(PROFILE, CANDIDATES, lambda c: view(), request(memory))
    assert choice is not None and choice.url == "http://b"
    assert dict(choice.parts)["kv-cache-precise"] == 0.96
    assert any("engine events: 96 of 100 prompt tokens" in n for n in choice.notes), choice.notes


def test_an_endpoint_not_reported_on_is_scored_by_the_approximate_index_and_the_trace_says_so() -> None:
    memory = Memory({"http://a": None, "http://b": 10, "http://c": None}, {"http://a": 0.5, "http://c": 0.9})
    choice = pick_endpoint(PROFILE, CANDIDATES, lambda c: view(), request(memory))
    assert choice is not None and choice.url == "http://c"
    assert any("approximate index (no engine report for it)" in n for n in choice.notes), choice.notes


def test_without_exact_tokens_every_endpoint_falls_back_to_the_approximate_index() -> None:
    memory = Memory({"http://a": 100, "http://b": 0, "http://c": 0}, {"http://b": 1.0})
    choice = pick_endpoint(PROFILE, CANDIDATES, lambda c: view(), request(memory, render=False))
    assert choice is not None and choice.url == "http://b"
    assert any("no exact prompt tokens for m" in n for n in choice.notes)


def test_nothing_is_rendered_while_no_engine_is_reported_on() -> None:
    rendered: list[object] = []
    memory = Memory({"http://a": None, "http://b": None, "http://c": None}, {"http://b": 0.5})
    body = {"messages": [{"role": "user", "content": "x" * 2000}]}
    subject = Subject(body, {}, "t", {"m": lambda b: rendered.append(b) or list(TOKENS)})
    choice = pick_endpoint(PROFILE, CANDIDATES, lambda c: view(),
                           PickRequest(memory, subject, "m", len(CANDIDATES)))  # type: ignore[arg-type]
    assert choice is not None and choice.url == "http://b" and rendered == []
    assert any("approximate index (no engine report for it)" in n for n in choice.notes)


def test_a_holder_too_far_above_the_least_loaded_yields_but_requests_waiting_there_alone_do_not() -> None:
    memory = Memory({"http://a": 100, "http://b": 0, "http://c": 0}, {})
    views = {"http://a": view(load=9), "http://b": view(load=1), "http://c": view(load=2)}  # 9 > 1 + margin 4
    choice = pick_endpoint(PROFILE, CANDIDATES, lambda c: views[c.url], request(memory))
    assert choice is not None and choice.url == "http://b"
    full = {"http://a": view(load=1), "http://b": view(), "http://c": view()}
    full["http://a"].utilisation = 1.0  # at the ceiling
    choice = pick_endpoint(PROFILE, CANDIDATES, lambda c: full[c.url], request(memory))
    assert choice is not None and choice.url != "http://a"
    # The engine reports the whole prompt cached at a: a request or two waiting there cost less than
    # computing it again elsewhere (prefix-affinity, a guess, yields here).
    queued = {"http://a": view(load=2, queued=1), "http://b": view(), "http://c": view(load=1)}
    choice = pick_endpoint(PROFILE, CANDIDATES, lambda c: queued[c.url], request(memory))
    assert choice is not None and choice.url == "http://a"


def test_the_pick_tells_the_engine_view_what_to_expect_and_the_answer_feeds_the_approximate_index() -> None:
    memory = Memory({"http://a": 32, "http://b": 0, "http://c": 0}, {})
    req = request(memory)
    choice = pick_endpoint(PROFILE, CANDIDATES, lambda c: view(), req)
    assert choice is not None
    PROFILE.picked(choice.url, req)
    PROFILE.answered(choice.url, req, "ok")
    assert memory.engine_caches.expected == [("http://a", 32)]
    assert memory.recorded == ["http://a"]
