"""The watchdog over the tries in flight: a complete answer's deadline, a stalled stream, and the three ways an
engine is found hung (its metrics, its silent streams, two silent first-token timeouts), each taking it out."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest

from switchyard.engines.endpoints import EndpointRegistry, EngineSignals
from switchyard.gateway.watchdog import Watchdog, Watched

URL = "http://e1"


@dataclass
class FakeRelay:
    """A stream being passed on: when its last byte came, and what cut it."""

    last_byte_at: float
    leg: object = field(default_factory=object)
    aborted: list[str] = field(default_factory=list)

    def abort(self, why: str) -> None:
        self.aborted.append(why)


class Setup:
    def __init__(self, enabled: bool = True, after: float = 1.0) -> None:
        self.registry = EndpointRegistry(signal_max_age=3)
        self.hung: list[tuple[str, str]] = []
        self.settings = (enabled, after)
        self.dog = Watchdog(self.registry, lambda url, why: self.hung.append((url, why)), lambda: self.settings,
                            lambda: [URL])

    def stream(self, sent_at: float, last_byte_at: float, deadline: float = 10.0) -> tuple[Watched, FakeRelay]:
        relay = FakeRelay(last_byte_at)
        watched = Watched(URL, True, sent_at, deadline, relay=relay, leg=relay.leg)  # type: ignore[arg-type]
        self.dog.add(watched)
        return watched, relay


def test_a_stream_silent_past_its_deadline_is_cut_to_be_resumed() -> None:
    s = Setup(enabled=False)
    _, relay = s.stream(0.0, last_byte_at=1.0, deadline=2.0)
    s.dog.tick(2.5)
    assert relay.aborted == []
    s.dog.tick(3.1)
    assert relay.aborted and relay.aborted[0].startswith("sent nothing for 2.1 s mid-stream")


def test_an_engine_whose_streams_all_went_silent_is_hung_and_taken_out() -> None:
    s = Setup()
    _, a = s.stream(0.0, last_byte_at=5.0)
    _, b = s.stream(0.0, last_byte_at=5.2)
    s.dog.tick(6.0)
    assert s.hung == []
    s.dog.tick(6.3)
    assert [url for url, _ in s.hung] == [URL]
    assert s.hung[0][1] == "none of its 2 streams from this gateway got a byte for 1.1 s (nor any other request)"
    state = s.registry.state(URL)
    assert state.breaker.state(6.3) == "open" and state.breaker.last_reason.startswith("hung: none of its 2")
    assert a.aborted == b.aborted == ["its engine is hung: " + s.hung[0][1]]  # both to be resumed elsewhere
    s.dog.tick(6.4)
    assert len(s.hung) == 1  # once, while it is out


def test_an_engine_whose_counters_stop_while_busy_is_hung_without_any_request_of_ours() -> None:
    s = Setup()
    for at, progress in ((1.0, 10.0), (2.0, 20.0), (3.0, 20.0), (3.5, 20.0)):
        s.registry.record_scrape(URL, EngineSignals(4, 0, 0.5, 0, 0, progress=progress), now=at)
    s.dog.tick(3.0 + 0.6)
    assert s.hung[0][1] == "it reported 4 requests running and no progress for 1.5 s across its /metrics"
    # Once it moves again (and its breaker closed), old evidence does not find it hung a second time.
    s.registry.state(URL).breaker.state_ = "closed"
    s.dog.tick(4.0)
    assert len(s.hung) == 1
    s.settings = (False, 1.0)
    s.registry.record_scrape(URL, EngineSignals(4, 0, 0.5, 0, 0, progress=30.0), now=9.0)
    s.registry.record_scrape(URL, EngineSignals(4, 0, 0.5, 0, 0, progress=30.0), now=11.0)
    s.dog.tick(11.0)
    assert len(s.hung) == 1  # detection off


async def test_a_complete_answer_moves_on_at_its_deadline_only_when_its_engine_shows_no_progress() -> None:
    s = Setup(enabled=False)
    loop = asyncio.get_running_loop()
    now = time.monotonic()
    s.registry.record_scrape(URL, EngineSignals(1, 0, 0.1, 0, 0, progress=5.0), now=now - 5)
    waiting = Watched(URL, False, now - 2.0, 1.0)

    async def wait() -> str:
        try:
            async with asyncio.timeout(None) as timer:
                waiting.timer = timer
                await asyncio.sleep(10)
        except TimeoutError:
            return f"{waiting.abort_kind}: {waiting.abort_reason}"
        return "slept"

    task = loop.create_task(wait())
    await asyncio.sleep(0)
    s.dog.add(waiting)
    moving = Watched(URL, False, now - 2.0, 1.0)
    s.dog.add(moving)
    s.dog.tick(now)
    assert await asyncio.wait_for(task, 1) == "first_token_timeout: its engine showed no progress within 1 s"
    # A byte from the engine since the send (another request's) says it is alive: that one waits on.
    s.registry.state(URL).heard(now - 1.0)
    other = Watched(URL, False, now - 2.0, 1.0)
    s.dog.add(other)
    s.dog.tick(now + 0.1)
    assert other.abort_kind is None


def test_two_first_tokens_missed_with_nothing_heard_make_a_hang() -> None:
    s = Setup()
    first, second = Watched(URL, True, 1.0, 1.0), Watched(URL, True, 1.5, 1.0)
    s.dog.expired(first, 2.0)
    assert s.hung == []
    s.dog.expired(second, 2.5)
    assert s.hung and "2 requests got no first byte" in s.hung[0][1]
    heard = Setup()
    heard.registry.state(URL).heard(1.2)
    heard.dog.expired(Watched(URL, True, 1.0, 1.0), 2.0)
    heard.dog.expired(Watched(URL, True, 1.0, 1.0), 2.0)
    assert heard.hung == []  # the engine answered something after they were sent: not silent


@pytest.mark.parametrize("enabled", [True, False])
def test_disabled_detection_finds_no_hang(enabled: bool) -> None:
    s = Setup(enabled=enabled)
    s.stream(0.0, last_byte_at=0.0)
    s.dog.tick(5.0)
    assert bool(s.hung) is enabled


def test_an_engine_that_does_not_count_the_requests_it_was_sent_is_hung() -> None:
    s = Setup()
    for at in (1.0, 2.0, 3.0):  # idle, and it stays "idle" while requests are sent to it: its stats stand still
        s.registry.record_scrape(URL, EngineSignals(0, 0, 0.0, 0, 0, progress=10.0), now=at)
    for sent in (1.5, 1.8):
        s.dog.add(Watched(URL, True, sent, 10.0))
    s.dog.tick(3.1)
    assert s.hung == []  # the scrape is too recent to judge (what finished just before it may be on its way)
    s.dog.tick(3.3)
    assert s.hung and s.hung[0][1] == ("2 requests from this gateway waited there over 1 s without a byte while it "
                                       "reported 0 running and waiting")
    busy = Setup()
    busy.registry.record_scrape(URL, EngineSignals(1, 1, 0.2, 0, 0, progress=10.0), now=3.0)
    for sent in (1.5, 1.8):
        busy.dog.add(Watched(URL, True, sent, 10.0))
    busy.dog.add(Watched(URL, True, 2.5, 10.0))  # (too recent to be in the count)
    busy.dog.tick(3.3)
    assert busy.hung == []  # it counts them: prefilling or queued, not hung
    slow = Setup()
    for at in (1.0, 2.0, 3.0):
        slow.registry.record_scrape(URL, EngineSignals(0, 0, 0.0, 0, 0, progress=10.0), now=at)
    for sent in (1.5, 1.8):
        slow.dog.add(Watched(URL, True, sent, 10.0))
    slow.registry.state(URL).heard(2.4)  # it answered another request after they were sent
    slow.dog.tick(3.3)
    assert slow.hung == []  # slow to take work in (a starved host), not stuck: the deadlines judge it
