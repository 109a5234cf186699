"""The pure parts of the scenarios: the prefix bound, the failover analysis, overhead's latency."""

from __future__ import annotations

from pathlib import Path

import pytest

from switchyard.bench.prompts import LiteralText, SynthText, block_key
from switchyard.bench.results import Result
from switchyard.bench.scenarios import SCENARIOS
from switchyard.bench.scenarios.failover import (
    Counters,
    Outage,
    Timeline,
    analyse,
    counter_deltas,
    phase_windows,
    read_counters,
)
from switchyard.bench.scenarios.overhead import _shifted
from switchyard.bench.scenarios.overhead_figures import service_latency
from switchyard.bench.scenarios.prefix import unbounded_bound
from switchyard.bench.spec import Labels, RequestSpec, Workload
from switchyard.bench.traces import mooncake
from tests.unit.bench.helpers import result

DATA = Path(__file__).parent / "data"


def _workload(*prompts: SynthText | LiteralText) -> Workload:
    specs = tuple(RequestSpec(i, float(i), p, 4, Labels()) for i, p in enumerate(prompts))
    return Workload(specs, float(len(specs)), {"source": "test"})


def _blocks(*ids_tokens: tuple[int, int]) -> SynthText:
    return SynthText(tuple((block_key(b), n) for b, n in ids_tokens))


def test_the_bound_counts_leading_blocks_seen_before() -> None:
    w = _workload(_blocks((0, 64), (1, 64)),            # all new: 0 of 128
                  _blocks((0, 64), (1, 64), (2, 30)),   # 128 of 158
                  _blocks((0, 64), (3, 64), (1, 64)),   # block 3 is new, so block 1 after it cannot hit: 64
                  _blocks((0, 64), (2, 50)))            # block 2 was seen with 30 tokens only: 64 + 30
    hits, total = unbounded_bound(w)
    assert total == 128 + 158 + 192 + 114
    assert hits == 0 + 128 + 64 + 94


def test_the_bound_of_a_trace_replay_is_the_fraction_of_shared_prefix_tokens() -> None:
    w = mooncake(DATA / "mooncake_small.jsonl", block_tokens=512)
    hits, total = unbounded_bound(w)
    assert total == sum(s.prompt_tokens for s in w.specs)
    assert 0 < hits < total


def test_text_prompts_count_as_misses() -> None:
    assert unbounded_bound(_workload(LiteralText("hello there"), LiteralText("hello there"))) == (0, 4)


def _served(i: int, sent: float, region: str, *, status: int = 200, fallback: bool = False,
            cls: str = "us-east", ttft: float = 0.05, attempt: int = 1, e2e: float = 0.5) -> Result:
    route = (f"model=chat; {'fallback_from=chat-us; ' if fallback else ''}pool=p; region={region}; endpoint=e"
             + (f"; attempt={attempt}" if attempt > 1 else ""))
    r = result(i, cls=cls, scheduled=sent, status=status, route=route, ttft=ttft, e2e=e2e)
    r.sent_s = sent
    return r


GATEWAY = """\
# TYPE switchyard_upstream_attempts_total counter
switchyard_upstream_attempts_total{{pool="chat-us",outcome="ok"}} {us_ok}
switchyard_upstream_attempts_total{{pool="chat-us",outcome="connect_error"}} {us_refused}
switchyard_upstream_attempts_total{{pool="chat-eu",outcome="ok"}} {eu_ok}
switchyard_upstream_attempts_created{{pool="chat-eu",outcome="ok"}} 1.7e9
# TYPE switchyard_fallbacks_total counter
switchyard_fallbacks_total{{model="chat-us",reason="connect_error"}} {fallbacks}
# TYPE switchyard_retry_budget_exhausted counter
switchyard_retry_budget_exhausted_total 0.0
"""
ENGINE = """\
vllm:request_success_total{{model_name="sim-8b",engine="0",finished_reason="stop"}} 0.0
vllm:request_success_total{{model_name="sim-8b",engine="0",finished_reason="length"}} {length}
vllm:request_success_total{{model_name="sim-8b",engine="0",finished_reason="abort"}} {abort}
vllm:num_requests_running{{model_name="sim-8b",engine="0"}} {running}
vllm:num_requests_waiting{{model_name="sim-8b",engine="0"}} 0.0
"""


def _counters(at: float, us_ok: int, us_refused: int, eu_ok: int, fallbacks: int, eu: tuple[int, int],
              running: int = 0) -> Counters:
    gateway = GATEWAY.format(us_ok=us_ok, us_refused=us_refused, eu_ok=eu_ok, fallbacks=fallbacks)
    return read_counters(at, gateway, [ENGINE.format(length=eu[0], abort=0, running=running),
                                       ENGINE.format(length=eu[1], abort=1, running=0)])


def _outage_run() -> tuple[list[Result], Timeline]:
    results = [_served(0, 1.0, "us-east"), _served(1, 2.0, "us-east"),
               _served(9, 2.9, "-", status=0, e2e=0.3),  # in flight at the fault, cut by it
               _served(2, 3.2, "eu-west", fallback=True, attempt=2, ttft=0.1),
               _served(3, 3.5, "-", status=502),
               _served(4, 5.0, "eu-west", fallback=True), _served(5, 7.5, "eu-west", fallback=True),
               _served(6, 8.0, "us-east"), _served(7, 4.0, "eu-west", cls="eu-west"),
               _served(8, 12.0, "eu-west", fallback=True, attempt=2, ttft=2.3),
               _served(10, 15.5, "us-east")]
    line = Timeline(start=0.0, outages=[
        Outage("down", start_s=3.0, applied_s=3.05, end_s=7.0, restored_s=7.01, ready_s=7.1,
               before=_counters(3.0, 20, 0, 10, 0, (4, 6)), after=_counters(7.0, 20, 3, 14, 3, (8, 8))),
        Outage("hang", start_s=11.0, applied_s=11.0, end_s=15.0, restored_s=15.0, ready_s=15.0,
               before=_counters(11.0, 22, 3, 16, 3, (9, 9)), after=_counters(15.0, 22, 3, 17, 4, (10, 9)))],
        first=_counters(0.0, 0, 0, 0, 0, (0, 0)), last=_counters(16.0, 23, 3, 17, 4, (10, 9)))
    return results, line


def test_counters_are_read_from_the_gateway_and_the_healthy_engines() -> None:
    c = _counters(1.0, 5, 2, 7, 2, (3, 4), running=2)
    assert c.attempts == {"chat-us": {"ok": 5, "connect_error": 2}, "chat-eu": {"ok": 7}}
    assert c.fallbacks == {"connect_error": 2} and c.budget_exhausted == 0
    assert c.healthy_received == 3 + 4 + 1 + 2  # every finish reason counts, aborts too, and what runs
    old = read_counters(1.0, "switchyard_upstream_attempts_total{pool=\"p\",outcome=\"ok\"} 1.0\n", [None])
    assert old.fallbacks is None and old.budget_exhausted is None and old.healthy_received is None
    unused = read_counters(1.0, "# TYPE switchyard_fallbacks_total counter\n", [])
    assert unused.fallbacks == {} and unused.attempts == {} and unused.budget_exhausted is None
    deltas = counter_deltas(c, _counters(2.0, 5, 4, 9, 4, (5, 4)))
    assert deltas["attempts_by_pool"] == {"chat-us": {"connect_error": 2}, "chat-eu": {"ok": 2}}
    assert deltas["attempts"] == 4
    assert deltas["fallbacks"] == 2 and deltas["budget_exhausted"] == 0 and deltas["healthy_received"] == 0
    assert counter_deltas(None, c)["attempts"] is None


def test_the_phases_follow_the_outages() -> None:
    _, line = _outage_run()
    windows = [(name, lo, hi) for name, lo, hi, _, _ in phase_windows(line)]
    assert windows == [("before", None, 3.0), ("down", 3.0, 7.0), ("between", 7.0, 11.0), ("hang", 11.0, 15.0),
                       ("after", 15.0, None)]
    line.outages[1] = Outage("hang", start_s=11.0)  # staged, never ended
    assert [w[0] for w in phase_windows(line)] == ["before", "down", "between", "hang"]
    assert phase_windows(Timeline(outages=[Outage("down")]))[0][:3] == ("before", None, None)


def test_failover_analysis_finds_detection_recovery_and_the_load() -> None:
    results, line = _outage_run()
    a = analyse(results, line, first_token_timeout_s=2.0)
    down, hang = a["outages"]
    assert down["detect_s"] == pytest.approx(0.3)  # sent at 3.2, first token 0.1 later
    assert down["recover_s"] == pytest.approx(1.05)  # 7.5 went to eu-west; 8.0 is back home (first token 8.05)
    assert down["requests"] == 4 and down["ok"] == 3 and down["ok_rate"] == pytest.approx(0.75)
    assert down["home_requests"] == 3 and down["failures"] == "502 http_error (1)"
    assert down["tried_home_first"] == 1 and down["last_tried_home_s"] == pytest.approx(0.2)
    assert down["cut_in_flight"] == 1 and down["cut_kinds"] == "- http_error (1)"
    assert down["attempts"] == 7 and down["home_attempts"] == 3 and down["home_failed_attempts"] == 3
    assert down["healthy_attempts"] == 4 and down["fallbacks"] == 3
    assert down["healthy_received"] == 6 and down["healthy_ratio"] == pytest.approx(6 / 4)
    assert down["client_attempts"] == 5 and down["attempts_per_request"] == pytest.approx(5 / 4)
    assert hang["detect_s"] == pytest.approx(3.3)  # waited out the first-token timeout before eu-west served it
    assert hang["waited_timeout"] == 1 and hang["recover_s"] == pytest.approx(0.55)
    assert a["requests"] == 11 and a["failures"] == 2 and a["success"] == pytest.approx(9 / 11)
    phases = {(p["phase"], p["home"]): p for p in a["phases"]}
    assert [phases[(k, "us-east")]["requests"] for k in ("before", "down", "between", "hang", "after")] == \
        [3, 3, 2, 1, 1]
    assert phases[("down", "us-east")]["ok_rate"] == pytest.approx(2 / 3)
    assert phases[("down", "us-east")]["in_home"] == 0.0 and phases[("between", "us-east")]["in_home"] == 0.5
    assert phases[("down", "eu-west")]["requests"] == 1
    load = {row["phase"]: row for row in a["load"]}
    assert load["before"]["healthy_received"] == 10 and load["before"]["requests"] == 3
    assert load["down"]["healthy_ratio"] == down["healthy_ratio"]
    assert load["after"]["attempts"] == 1
    failed = a["failed"]
    assert [(f["sent_s"], f["phase"], f["status"]) for f in failed] == [(2.9, "before", 0), (3.5, "down", 502)]


def test_chaos_is_the_failover_scenario() -> None:
    assert SCENARIOS["chaos"] is SCENARIOS["failover"] and SCENARIOS["chaos"].name == "failover"


def test_failover_analysis_without_an_outage_reports_none() -> None:
    a = analyse([_served(0, 1.0, "us-east")], Timeline(outages=[Outage("down")]))
    assert a["outages"] == [] and a["success"] == 1.0
    assert [p["phase"] for p in a["phases"]] == ["before", "before"]  # one phase, both home regions
    assert a["load"][0]["attempts"] is None and a["load"][0]["healthy_ratio"] is None


def test_overhead_latency_is_from_send_and_the_warmup_is_cut_off() -> None:
    r = result(0, scheduled=2.0, late=0.5, ttft=0.7, e2e=0.9)
    assert service_latency(r, stream=True) == pytest.approx(0.2)
    assert service_latency(r, stream=False) == pytest.approx(0.4)
    assert service_latency(result(1, status=500), stream=False) is None
    shifted = _shifted(r, 1.0)
    assert (shifted.scheduled_s, shifted.sent_s, shifted.first_token_s, shifted.done_s) == \
        pytest.approx((1.0, 1.5, 1.7, 1.9))
