"""One answer out of several engines' streams: the transcript of what the client received, a continuation
spliced into the first stream, the relay's legs (a break, a resume, an error event, a stall), and the
engines' progress as their scrapes show it."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import msgspec
import pytest
import yarl

from switchyard.engines import splice
from switchyard.engines.breakers import CircuitBreaker
from switchyard.engines.endpoints import EndpointRegistry, EngineSignals
from switchyard.engines.latency import MIN_SAMPLES, PoolLatencies, TtftWindow
from switchyard.engines.splice import Splice, Transcript, closing_events
from switchyard.engines.streams import Break, Leg, LegEnd, Resumed, StreamRelay, first_chunk
from switchyard.engines.upstream import post
from switchyard.policy.resilience import BreakerSpec
from tests.unit.engines.test_upstream import (  # noqa: F401 - upstream: the fixture
    DONE,
    ScriptedServer,
    Upstream,
    chunked,
    read_request,
    upstream,
)


def chat(content: str | None = None, *, role: str | None = None, finish: str | None = None, id_: str = "chat-1",
         model: str = "m", **delta: Any) -> bytes:
    d: dict[str, Any] = dict(delta)
    if role is not None:
        d["role"] = role
    if content is not None:
        d["content"] = content
    chunk = {"id": id_, "object": "chat.completion.chunk", "created": 100, "model": model,
             "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]}
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


def usage(prompt: int, completion: int, id_: str = "chat-1") -> bytes:
    chunk = {"id": id_, "object": "chat.completion.chunk", "created": 100, "model": "m", "choices": [],
             "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                       "total_tokens": prompt + completion}}
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


def decode(out: bytes) -> list[Any]:
    return [msgspec.json.decode(e[6:]) if e != b"data: [DONE]" else "[DONE]"
            for e in out.split(b"\n\n") if e.strip()]


# --- the transcript -----------------------------------------------------------------------------------------


def test_the_transcript_reads_back_the_text_head_tokens_and_what_was_streamed() -> None:
    t = Transcript("chat")
    t.feed(chat("", role="assistant") + chat("Once") + chat(" upon"))
    t.feed(chat(" a", reasoning_content=""))
    so_far = t.read()
    assert so_far.text == "Once upon a" and so_far.tokens == 3 and so_far.finished is None
    assert so_far.head == {"id": "chat-1", "object": "chat.completion.chunk", "created": 100, "model": "m"}
    assert not so_far.tool_calls and not so_far.reasoning
    t.feed(chat(tool_calls=[{"index": 0, "function": {"name": "f"}}]))
    assert t.read().tool_calls
    t.feed(chat(" time", finish="length"))
    assert t.read().finished == "length" and t.read().text == "Once upon a time"
    text = Transcript("completion")
    text.feed(b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
              b'"text":"ab","logprobs":null,"finish_reason":null}]}\n\n')
    assert text.read().text == "ab" and text.read().head["object"] == "text_completion"


def test_a_long_transcript_is_folded_into_what_it_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(splice, "KEEP_BYTES", 500)
    t = Transcript("chat")
    for i in range(40):
        t.feed(chat(f"w{i} "))
    assert len(t._kept) <= 500 + len(chat("w99 "))  # (the bytes kept stay bounded)
    so_far = t.read()
    assert so_far.text == "".join(f"w{i} " for i in range(40)) and so_far.tokens == 40
    assert so_far.head["id"] == "chat-1"


# --- the splice -----------------------------------------------------------------------------------------------


def test_a_continuation_takes_the_first_streams_head_drops_its_role_and_adds_up_the_usage() -> None:
    head = {"id": "chat-1", "object": "chat.completion.chunk", "created": 100, "model": "m",
            "system_fingerprint": "fp-1"}
    merged = Splice("chat", head, lambda u: {**u, "prompt_tokens": u["prompt_tokens"] + 10}, keep_usage=True)
    out = decode(merged.events(chat("", role="assistant", id_="chat-2", model="other") + chat(" time", id_="chat-2")
                               + chat(".", finish="stop", id_="chat-2") + usage(20, 2, "chat-2") + DONE))
    assert len(out) == 4 and out[-1] == "[DONE]"
    assert all(c["id"] == "chat-1" and c["model"] == "m" and c["system_fingerprint"] == "fp-1" for c in out[:3])
    assert [c["choices"][0]["delta"] for c in out[:2]] == [{"content": " time"}, {"content": "."}]
    assert out[2]["usage"] == {"prompt_tokens": 30, "completion_tokens": 2, "total_tokens": 22}
    stripped = Splice("chat", head, lambda u: u, keep_usage=False)
    assert decode(stripped.events(chat("x", role="assistant") + usage(1, 1) + DONE))[-1] == "[DONE]"
    assert len(decode(stripped.events(usage(1, 1)))) == 0  # the usage the client did not ask for is left out


def test_a_stream_that_only_lacks_its_end_is_closed() -> None:
    head = {"id": "chat-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    out = decode(closing_events("chat", head, "length", {"prompt_tokens": 3, "completion_tokens": 4,
                                                         "total_tokens": 7}))
    assert out[0]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    assert out[1]["usage"]["total_tokens"] == 7 and out[2] == "[DONE]"
    assert decode(closing_events("completion", {"id": "c"}, None, None)) == ["[DONE]"]


# --- the relay's legs ---------------------------------------------------------------------------------------


async def _relay(up: Upstream, pieces: list[bytes], resume: Any, transcript: bool = True
                 ) -> tuple[bytes, StreamRelay, list[LegEnd], list[bool]]:
    response = await up.post(*pieces)
    ends: list[LegEnd] = []
    finished: list[bool] = []
    relay = StreamRelay(Leg(response, await first_chunk(response), ends.append), finished.append, resume=resume,
                        transcript=Transcript("chat") if transcript else None)
    out = b"".join([c async for c in relay.chunks()])
    return out, relay, ends, finished


async def test_a_broken_leg_is_followed_by_the_continuation_the_resume_gives(upstream: Upstream) -> None:  # noqa: F811
    breaks: list[Break] = []
    second = await upstream.post(*chunked("text/event-stream", chat("", role="assistant", id_="x")
                                          + chat(" more", id_="x"), chat("!", finish="stop", id_="x") + DONE))

    async def resume(broke: Break) -> Resumed:
        breaks.append(broke)
        assert broke.transcript is not None and broke.transcript.read().text == "Hi there"
        head = broke.transcript.read().head
        return Leg(second, await first_chunk(second), ends.append, Splice("chat", head, lambda u: u, False))

    ends: list[LegEnd] = []
    out, relay, first_ends, finished = await _relay(
        upstream, chunked("text/event-stream", chat("", role="assistant") + chat("Hi"), chat(" there"), end=False),
        resume)
    events = decode(out)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == "Hi there more!"
    assert {e["id"] for e in events[:-1]} == {"chat-1"} and events[-1] == "[DONE]"
    assert sum("role" in e["choices"][0]["delta"] for e in events[:-1]) == 1
    assert breaks[0].kind == "broken" and "broke off" in breaks[0].why
    assert [e.broken is not None for e in first_ends] == [True] and [e.completed for e in ends] == [True]
    assert relay.resumed == 1 and relay.broken and finished == [True]


async def test_an_error_event_mid_stream_is_a_break_and_reaches_the_client_when_not_resumed(
        upstream: Upstream) -> None:  # noqa: F811
    error = b'data: {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}\n\n'
    kinds: list[str] = []

    async def give_up(broke: Break) -> Resumed:
        kinds.append(broke.kind)
        return None

    out, relay, ends, finished = await _relay(upstream, chunked("text/event-stream", chat("Hi") + error, DONE),
                                              give_up)
    assert kinds == ["error_event"] and out == chat("Hi") + error
    assert relay.broken and finished == [False] and ends[0].kind == "error_event"


async def test_a_resume_that_ends_the_answer_itself_completes_the_stream(upstream: Upstream) -> None:  # noqa: F811
    async def close(broke: Break) -> Resumed:
        return b"data: [DONE]\n\n"

    out, _, _, finished = await _relay(upstream, chunked("text/event-stream", chat("Hi", finish="stop"),
                                                             end=False), close)
    assert out == chat("Hi", finish="stop") + DONE and finished == [True]


class HoldingServer(ScriptedServer):
    """Writes its pieces, then holds the connection open without another byte (a stalled engine)."""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        for piece in self.pieces:
            writer.write(piece)
        await writer.drain()
        await asyncio.sleep(5)
        writer.close()


async def test_an_aborted_leg_breaks_as_stalled(upstream: Upstream) -> None:  # noqa: F811
    url = await upstream.serve(HoldingServer(*chunked("text/event-stream", chat("Hi"), end=False)))
    response = await post(upstream.client, yarl.URL(url + "/v1/completions"), b"{}",
                          {"content-type": "application/json"})
    ends: list[LegEnd] = []
    relay = StreamRelay(Leg(response, await first_chunk(response), ends.append), lambda _: None)
    chunks = relay.chunks()
    assert await anext(chunks) == chat("Hi")
    waiting = asyncio.ensure_future(anext(chunks))
    await asyncio.sleep(0.05)
    relay.abort("sent nothing for 2 s")
    last = await asyncio.wait_for(waiting, 2)
    assert b"sent nothing for 2 s" in last and ends[0].kind == "stalled"


# --- progress, latencies, breakers -----------------------------------------------------------------------------


def signals(running: float, progress: float | None) -> EngineSignals:
    return EngineSignals(running, 0, 0.0, 0, 0, progress=progress)


def test_an_engine_that_stops_moving_while_busy_is_stalled_and_one_that_went_busy_without_moving_is_not() -> None:
    registry = EndpointRegistry(signal_max_age=3)
    url = "http://e"
    registry.record_scrape(url, signals(2, 100), now=1.0)
    registry.record_scrape(url, signals(2, 150), now=2.0)
    state = registry.state(url)
    assert state.stalled_for(2.0, 3) == 0 and state.alive_since(1.5)
    registry.record_scrape(url, signals(2, 150), now=3.0)
    registry.record_scrape(url, signals(2, 150), now=4.0)
    assert state.stalled_for(4.0, 3) == 2.0 and not state.alive_since(2.5)
    assert state.stalled_for(10.0, 3) == 0  # nothing fresh known
    idle = "http://idle"
    registry.record_scrape(idle, signals(0, 10), now=1.0)
    registry.record_scrape(idle, signals(1, 10), now=2.0)  # a lone long prefill moves no counter
    registry.record_scrape(idle, signals(1, 10), now=3.0)
    assert registry.state(idle).stalled_for(3.0, 3) == 0
    silent = "http://silent"
    registry.record_scrape(silent, signals(3, None), now=1.0)
    registry.record_scrape(silent, signals(3, None), now=5.0)
    assert registry.state(silent).stalled_for(5.0, 10) == 0  # an engine without progress counters is not judged
    registry.state(url).heard(4.5)
    assert registry.state(url).alive_since(4.0)


def test_a_pools_quantile_needs_enough_observations_and_follows_the_newest() -> None:
    window = TtftWindow()
    for _ in range(MIN_SAMPLES - 1):
        window.add(0.1)
    assert window.quantile(0.95, 0.0) is None
    window.add(1.0)
    assert window.quantile(0.99, 0.0) == 1.0 and window.quantile(0.95, 0.0) == 0.1  # nearest rank: 19th of 20
    latencies = PoolLatencies()
    assert latencies.quantile("p", 0.95, 0.0) is None
    for _ in range(300):
        latencies.window("p").add(0.2)
    assert latencies.quantile("p", 0.95, 5.0) == 0.2


def test_a_tripped_breaker_opens_at_once_and_keeps_saying_why() -> None:
    breaker = CircuitBreaker("endpoint", "http://e", BreakerSpec(open_for=5))
    assert breaker.trip(10.0, "hung: no progress") and breaker.state(10.0) == "open"
    assert not breaker.trip(11.0, "again")
    breaker.failure(11.0, "a late failure")
    assert breaker.last_reason == "hung: no progress"
    assert breaker.state(15.0) == "half_open" and math.isfinite(breaker.open_until)
