"""No request lost to an engine fault: streams that survive their engine, hung engines caught from their own
reports, complete answers that move on at their deadline, hedged first tokens, through a real gateway and
real simulated engines (the official SDK as the client).

Engines (one ``switchyard sim`` process with a fault control server): model ``main`` has two replicas in
us-east (``us-a``, ``us-b``, pool ``main-us``) and one in eu-west (``eu``, pool ``main-eu``), falling back to
``main@eu-west``; ``solo`` (pool ``solo-us``: ``so``) does not resume its streams. The gateway runs in us-east.
Tier ``gold`` is class ``critical`` (TTFT objective 0.5 s: a 1 s first-token deadline); tier ``hedge`` is class
``hedged``, which hedges a first token later than 0.3 s.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.conftest import (
    FAULTS_CLEAR,
    FaultFleet,
    Gateway,
    client,
    endpoints,
    fault_fleet,
    gateway_counter,
    http_json,
    route,
    stop,
)

NAMES = ("us-a", "us-b", "eu", "so")
CLEAR = FAULTS_CLEAR
MESSAGES = [{"role": "user", "content": "tell me a long story about a lighthouse"}]


def _policy(ports: dict[str, int]) -> str:
    def url(name: str) -> str:
        return f"http://127.0.0.1:{ports[name]}"

    price = "{input_per_mtok: 1, output_per_mtok: 2}"
    return f"""\
schema: 1
regions: [us-east, eu-west]
pools:
  - {{name: main-us, region: us-east, served_model: sim-m, endpoints: [{url("us-a")}, {url("us-b")}],
      kv_cache_tokens: 100000}}
  - {{name: main-eu, region: eu-west, served_model: sim-m, endpoints: [{url("eu")}], kv_cache_tokens: 100000}}
  - {{name: solo-us, region: us-east, served_model: sim-m, endpoints: [{url("so")}], kv_cache_tokens: 100000}}
models:
  - {{name: main, pools: [main-us, main-eu], context_window: 4096, price: {price}, fallback: [main@eu-west]}}
  - {{name: solo, pools: [solo-us], context_window: 4096, price: {price}, resume_streams: false,
      fallback: [main@eu-west]}}
priorities:
  critical: {{max_queue_ms: 10000, ttft_objective: 0.5}}
  hedged: {{max_queue_ms: 10000, first_token_deadline: 5, hedge: {{after: 0.3}}}}
tiers:
  - {{name: gold, priority: critical, models: ["*"]}}
  - {{name: hedge, priority: hedged, models: ["*"]}}
resilience:
  health: {{probe_interval: 60}}
  breakers:
    endpoint: {{consecutive_failures: 1000, min_requests: 100000, open_for: 60}}
    pool: {{consecutive_failures: 1000, min_requests: 100000}}
  hang_detection: {{after: 1}}
"""


Fleet = FaultFleet


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    yield from fault_fleet(tmp_path_factory.mktemp("stream-faults"), NAMES, lambda ports: {"policies": _policy(ports)},
                           "policies")


@pytest.fixture
def gw(fleet: Fleet, tmp_path: Path) -> Iterator[Gateway]:
    """A fresh gateway per test (breakers and health start clean); every engine left without faults."""
    gateway = fleet.gateway(tmp_path, "policies", {"SWITCHYARD_UPSTREAM_READ_TIMEOUT_S": "30",
                                                   "SWITCHYARD_SCRAPE_INTERVAL_S": "0.25"},
                            {"gold": ("gold-co", "gold"), "hedge": ("hedge-co", "hedge")})
    try:
        yield gateway
    finally:
        fleet.fault(**CLEAR)
        assert stop(gateway.proc)


def _stream(gw: Gateway, key: str = "gold", model: str = "main", max_tokens: int = 40,
            **extra: Any) -> tuple[dict[str, str], list[Any]]:
    """A streamed chat answer: its route header's parts (and ``request_id``), its chunks."""
    raw = client(gw, key).chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
        **extra)
    return {**route(raw), "request_id": raw.headers["x-request-id"]}, list(raw.parse())


def _text(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _record(gw: Gateway, request_id: str) -> dict[str, Any]:
    """The request's record (it is kept when the stream's end has been handled, just after the client's last
    byte)."""
    deadline = time.monotonic() + 5
    while True:
        status, _, body = http_json("GET", f"{gw.base_url}/admin/api/requests/{request_id}")
        if status == 200 or time.monotonic() > deadline:
            assert status == 200, body
            return dict(body)
        time.sleep(0.05)


def _trace(gw: Gateway, request_id: str) -> list[str]:
    return list(_record(gw, request_id)["trace"])


def _direct(fleet: Fleet, name: str, body: dict[str, Any]) -> dict[str, Any]:
    """A chat completion straight from one engine (what it answers a request of its own)."""
    status, _, answer = http_json("POST", fleet.url(name) + "/v1/chat/completions", body)
    assert status == 200, answer
    return dict(answer)


# --- streams that survive their engine ----------------------------------------------------------------------


def test_a_stream_cut_mid_answer_is_finished_elsewhere_as_one_answer(fleet: Fleet, gw: Gateway) -> None:
    fleet.down("us-b", mode="down")
    fleet.down("us-a", abort_rate=1.0, abort_after_tokens=5)
    completion_before = gateway_counter(gw, "switchyard_tokens_total", model="main", kind="completion")
    prompt_before = gateway_counter(gw, "switchyard_tokens_total", model="main", kind="prompt")
    raw = client(gw, "gold").chat.completions.with_raw_response.create(
        model="main", messages=MESSAGES, max_tokens=40, stream=True, stream_options={"include_usage": True})
    parts = route(raw)
    chunks = list(raw.parse())
    assert parts["endpoint"] == fleet.url("us-a")  # the stream started there
    # One uninterrupted answer: one id, one role delta, text throughout, one usage object at the end.
    assert len({c.id for c in chunks}) == 1
    roles = [c for c in chunks if c.choices and c.choices[0].delta.role]
    assert len(roles) == 1 and roles[0] is chunks[0]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and chunks[-1].usage is not None
    text = _text(chunks)
    first = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content][:5]
    head = "".join(first)
    assert text.startswith(head) and len(text) > len(head)
    # The continuation is what eu-west's engine answers the original request continued from the text so far
    # (continue_final_message, 35 tokens left), spliced in as it came.
    continued = _direct(fleet, "eu", {
        "model": "sim-m", "messages": [*MESSAGES, {"role": "assistant", "content": head}], "max_tokens": 35,
        "continue_final_message": True, "add_generation_prompt": False})
    assert text == head + continued["choices"][0]["message"]["content"]
    # The usage charges both engines' real work: the first one's 5 tokens and prompt, the second one's.
    second = continued["usage"]
    assert usage[0].completion_tokens == 5 + second["completion_tokens"]
    assert usage[0].prompt_tokens > second["prompt_tokens"]  # the first engine's prompt counted too
    assert usage[0].total_tokens == usage[0].prompt_tokens + usage[0].completion_tokens
    # The ledger and metrics: both engines' work.
    deadline = time.monotonic() + 5
    while gateway_counter(gw, "switchyard_tokens_total", model="main", kind="completion") < completion_before + 5:
        assert time.monotonic() < deadline, "never accounted"
        time.sleep(0.05)
    assert (gateway_counter(gw, "switchyard_tokens_total", model="main", kind="completion") - completion_before
            == usage[0].completion_tokens)
    assert (gateway_counter(gw, "switchyard_tokens_total", model="main", kind="prompt") - prompt_before
            == usage[0].prompt_tokens)
    # The usage ledger: one request, charged for both engines' tokens.
    deadline = time.monotonic() + 10
    while True:
        _, _, report = http_json("GET", gw.base_url + "/admin/api/usage?tenant=gold-co")
        totals = report.get("totals") if isinstance(report, dict) else None
        if (totals and totals["requests"] == 1) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert totals == {"requests": 1, "prompt_tokens": usage[0].prompt_tokens,
                      "completion_tokens": usage[0].completion_tokens, "cached_tokens": 0,
                      "spend": pytest.approx((usage[0].prompt_tokens + 2 * usage[0].completion_tokens) / 1e6)}
    record = _record(gw, raw.headers["x-request-id"])
    assert record["resumes"] == 1 and record["status"] == 200 and record["outcome"] == "ok"
    assert record["endpoint"] == fleet.url("eu")
    assert any(line.startswith("stream: resuming after 5 tokens") for line in record["trace"])
    assert any(line.startswith(f"stream: resumed at {fleet.url('eu')} after 5 tokens") for line in record["trace"])
    assert gateway_counter(gw, "switchyard_stream_resumes_total", outcome="resumed") == 1
    assert gateway_counter(gw, "switchyard_streams_broken_total", pool="main-us") == 1
    assert endpoints(gw)[fleet.url("us-a")]["breaker"]["consecutive_failures"] == 1  # type: ignore[index]


def test_a_text_completion_stream_is_continued_from_its_prompt_plus_the_text_so_far(fleet: Fleet,
                                                                                    gw: Gateway) -> None:
    fleet.down("us-b", mode="down")
    fleet.down("us-a", abort_rate=1.0, abort_after_tokens=3)
    chunks = list(client(gw, "gold").completions.create(model="main", prompt="Once upon a time", max_tokens=20,
                                                        stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    head = "".join([c.choices[0].text for c in chunks if c.choices and c.choices[0].text][:3])
    status, _, direct = http_json("POST", fleet.url("eu") + "/v1/completions",
                                  {"model": "sim-m", "prompt": "Once upon a time" + head, "max_tokens": 17})
    assert status == 200
    assert text == head + direct["choices"][0]["text"]
    assert len({c.id for c in chunks}) == 1


def test_an_error_event_mid_stream_is_resumed_too(fleet: Fleet, gw: Gateway) -> None:
    fleet.down("us-b", mode="down")
    fleet.down("us-a", abort_rate=1.0, abort_after_tokens=4, abort_with="error")
    parts, chunks = _stream(gw)
    assert parts["endpoint"] == fleet.url("us-a")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 40
    assert len(_text(chunks)) > 0


@pytest.mark.parametrize(("extra", "why"), [
    ({"n": 2}, "more than one answer was asked for"),
    ({"logprobs": True, "top_logprobs": 2}, "log-probabilities were asked for"),
])
def test_a_stream_that_cannot_be_continued_safely_ends_with_the_error_event(fleet: Fleet, gw: Gateway,
                                                                          extra: dict[str, Any], why: str) -> None:
    fleet.down("us-b", mode="down")
    fleet.down("us-a", abort_rate=1.0, abort_after_tokens=3)
    raw = client(gw, "gold").chat.completions.with_raw_response.create(
        model="main", messages=MESSAGES, max_tokens=40, stream=True, **extra)
    with pytest.raises(openai.APIError) as caught:
        list(raw.parse())
    assert "mid-stream" in caught.value.message
    trace = _trace(gw, raw.headers["x-request-id"])
    assert any(line.startswith(f"stream: not resumed: {why}") for line in trace), trace
    assert gateway_counter(gw, "switchyard_stream_resumes_total", outcome="refused") == 1


def test_a_model_that_does_not_resume_ends_its_broken_stream(fleet: Fleet, gw: Gateway) -> None:
    fleet.down("so", abort_rate=1.0, abort_after_tokens=3)
    raw = client(gw, "gold").chat.completions.with_raw_response.create(
        model="solo", messages=MESSAGES, max_tokens=40, stream=True)
    with pytest.raises(openai.APIError):
        list(raw.parse())
    assert "stream: not resumed: resume_streams is off for model solo" in _trace(gw, raw.headers["x-request-id"])


def test_resumes_are_capped_per_request(fleet: Fleet, gw: Gateway) -> None:
    # Every engine breaks off after 3 tokens: the request resumes twice (max_resumes), then gives up.
    fleet.fault(abort_rate=1.0, abort_after_tokens=3)
    raw = client(gw, "gold").chat.completions.with_raw_response.create(
        model="main", messages=MESSAGES, max_tokens=40, stream=True)
    pieces: list[str] = []
    with pytest.raises(openai.APIError):
        for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
    assert len(pieces) == 9  # three engines' 3 tokens each
    record = _record(gw, raw.headers["x-request-id"])
    assert record["resumes"] == 2
    assert "stream: not resumed: it was resumed 2 times already (max_resumes 2)" in record["trace"]


# --- hung engines, deadlines ---------------------------------------------------------------------------------


@pytest.mark.alone  # it compares timings (or orders) that a busy second worker would shift
def test_a_hang_mid_stream_is_detected_in_about_a_second_and_the_stream_finishes_elsewhere(fleet: Fleet,
                                                                                          gw: Gateway) -> None:
    fleet.down("us-b", mode="down")
    raw = client(gw, "gold").chat.completions.with_raw_response.create(
        model="main", messages=MESSAGES, max_tokens=200, stream=True, stream_options={"include_usage": True})
    assert route(raw)["endpoint"] == fleet.url("us-a")
    stream = raw.parse()
    got = [next(stream) for _ in range(4)]
    fleet.down("us-a", mode="hang")
    hung_at = time.monotonic()
    rest = list(stream)
    took = time.monotonic() - hung_at
    chunks = got + rest
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 200
    assert took < 6  # detected after about 1 s of silence, then the rest of the answer elsewhere
    row = endpoints(gw)[fleet.url("us-a")]
    assert row["breaker"]["state"] == "open" and "hung" in row["breaker"]["last_reason"]  # type: ignore[index]
    assert row["up"] is True  # its /health never said a word
    assert gateway_counter(gw, "switchyard_endpoint_hangs_total", endpoint=fleet.url("us-a")) == 1
    record = _record(gw, raw.headers["x-request-id"])
    assert record["resumes"] == 1 and record["endpoint"] == fleet.url("eu")


def test_a_complete_answer_moves_on_at_its_deadline_when_its_engine_shows_no_progress(fleet: Fleet,
                                                                                     gw: Gateway) -> None:
    fleet.down("us-b", mode="down")
    fleet.down("us-a", mode="hang")
    started = time.monotonic()
    raw = client(gw, "gold").chat.completions.with_raw_response.create(model="main", messages=MESSAGES,
                                                                       max_tokens=4)
    took = time.monotonic() - started
    parts = route(raw)
    assert parts["endpoint"] == fleet.url("eu")
    assert f"{fleet.url('us-a')} first_token_timeout" in parts["moved_on"]
    assert 1.0 <= took < 3.0  # the class's deadline (2 x its 0.5 s objective), then eu-west at once
    assert raw.parse().choices[0].message.content


def test_a_complete_answer_that_is_running_is_not_moved_at_its_deadline(fleet: Fleet, gw: Gateway) -> None:
    # A long answer keeps its engine's counters moving: past its 1 s deadline it is left to finish.
    fleet.down("us-b", mode="down")
    fleet.down("us-a", mode="slow", slow_factor=20)
    started = time.monotonic()
    raw = client(gw, "gold").chat.completions.with_raw_response.create(model="main", messages=MESSAGES,
                                                                       max_tokens=300)
    assert time.monotonic() - started > 1.5
    parts = route(raw)
    assert parts["endpoint"] == fleet.url("us-a")
    assert "first_token_timeout" not in parts.get("moved_on", "")  # (us-b may have refused its connection first)
    answer = raw.parse()
    assert answer.usage is not None and answer.usage.completion_tokens == 300


def test_hanging_streams_that_never_start_take_their_engine_out(fleet: Fleet, gw: Gateway) -> None:
    fleet.down("us-b", mode="down")
    fleet.down("us-a", mode="hang")
    for _ in range(2):
        parts, chunks = _stream(gw)
        assert parts["endpoint"] == fleet.url("eu") and chunks[-1].usage is not None
    # Two first tokens missed their deadline with nothing heard from us-a since: it is hung, and out.
    row = endpoints(gw)[fleet.url("us-a")]
    assert row["breaker"]["state"] == "open" and "hung" in row["breaker"]["last_reason"]  # type: ignore[index]
    parts, _ = _stream(gw)
    assert parts["endpoint"] == fleet.url("eu") and "moved_on" not in parts


# --- hedged first tokens -------------------------------------------------------------------------------------


def _aborted(fleet: Fleet, name: str) -> int:
    return int(fleet.state(name)["aborted"])


@pytest.mark.alone  # it compares timings (or orders) that a busy second worker would shift
def test_a_late_first_token_is_hedged_and_the_loser_is_aborted(fleet: Fleet, gw: Gateway) -> None:
    # us-a (home) is picked first; its first token would take a second or more; the hedge goes to eu-west.
    fleet.down("us-b", mode="down")
    fleet.down("us-a", mode="slow", slow_factor=2000)
    aborted = _aborted(fleet, "us-a")
    started = time.monotonic()
    parts, chunks = _stream(gw, key="hedge")
    took = time.monotonic() - started
    assert parts["endpoint"] == fleet.url("eu") and parts["hedged"] == fleet.url("us-a")
    assert chunks[-1].usage is not None and took < 1.5
    assert gateway_counter(gw, "switchyard_hedges_total", pool="main-us", outcome="won") == 1
    deadline = time.monotonic() + 5
    while _aborted(fleet, "us-a") <= aborted:  # the twin was aborted at once
        assert time.monotonic() < deadline, "the losing try was never aborted at its engine"
        time.sleep(0.05)
    trace = _trace(gw, parts["request_id"])
    assert any(line.startswith(f"hedge: no first token from {fleet.url('us-a')} within 0.3 s; also sent to "
                               f"{fleet.url('eu')}") for line in trace), trace
    assert f"hedge: {fleet.url('eu')} answered first; {fleet.url('us-a')} aborted" in trace


def test_hedges_are_bounded_by_the_retry_budget(fleet: Fleet, tmp_path: Path) -> None:
    (fleet.folder / "no-budget.yaml").write_text((fleet.folder / "policies.yaml").read_text().replace(
        "  hang_detection: {after: 1}",
        "  hang_detection: {after: 1}\n  retries: {budget_ratio: 0, min_retries_per_s: 0}"))
    gateway = fleet.gateway(tmp_path, "no-budget", {}, {"hedge": ("hedge-co", "hedge")})
    try:
        fleet.fault(mode="slow", slow_factor=1000)  # whichever is picked first is late
        parts, _ = _stream(gateway, key="hedge", max_tokens=3)
        assert "hedged" not in parts
        assert gateway_counter(gateway, "switchyard_hedges_total", outcome="not_sent") == 1
        trace = _trace(gateway, parts["request_id"])
        assert any("not hedged: the retry budget is spent" in line for line in trace), trace
    finally:
        fleet.fault(**CLEAR)
        assert stop(gateway.proc)

