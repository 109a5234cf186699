"""The failover scenario's pure parts: the counters at the outages' edges, the phases, what a result says and
the figures per outage and over the run."""

from __future__ import annotations

import pytest

from switchyard.bench.results import Result
from switchyard.bench.scenarios.failover.analysis import analyse, detection, records_in
from switchyard.bench.scenarios.failover.phases import complete, in_phase, phase_windows, tried_first, wait_s
from switchyard.bench.scenarios.failover.report import _goals
from switchyard.bench.scenarios.failover.timeline import (
    Counters,
    EndpointChange,
    Outage,
    Timeline,
    counter_deltas,
    engine_received,
    read_counters,
    run_received,
)
from switchyard.bench.scenarios.failover.workload import mix
from tests.unit.bench.helpers import result

US = ("http://127.0.0.1:1", "http://127.0.0.1:2")
EU = "http://127.0.0.1:3"

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
# TYPE switchyard_hedges_total counter
switchyard_hedges_total{{pool="chat-us",outcome="won"}} {hedges}
switchyard_hedges_total{{pool="chat-us",outcome="not_sent"}} 5.0
# TYPE switchyard_stream_resumes_total counter
switchyard_stream_resumes_total{{model="chat-us",outcome="resumed"}} {resumes}
switchyard_stream_resumes_total{{model="chat-us",outcome="closed"}} 1.0
# TYPE switchyard_streams_broken_total counter
switchyard_streams_broken_total{{pool="chat-us"}} {resumes}
# TYPE switchyard_endpoint_hangs_total counter
"""
ENGINE = """\
vllm:request_success_total{{model_name="sim-8b",finished_reason="stop"}} 0.0
vllm:request_success_total{{model_name="sim-8b",finished_reason="length"}} {length}
vllm:num_requests_running{{model_name="sim-8b"}} {running}
vllm:num_requests_waiting{{model_name="sim-8b"}} 0.0
"""


def _counters(at: float, *, us_ok: int = 0, us_refused: int = 0, eu_ok: int = 0, fallbacks: int = 0,
              hedges: int = 0, resumes: int = 0, us: tuple[float | None, ...] = (0, 0),
              eu: tuple[float | None, ...] = (0, 0)) -> Counters:
    gateway = GATEWAY.format(us_ok=us_ok, us_refused=us_refused, eu_ok=eu_ok, fallbacks=fallbacks, hedges=hedges,
                             resumes=resumes)
    return read_counters(at, gateway, {"us-east": list(us), "eu-west": list(eu)})


def _served(i: int, sent: float, region: str, *, cls: str = "us-east", stream: bool = True, status: int = 200,
            ttft: float = 0.05, e2e: float = 0.5, moved_on: str = "", finish: str | None = "length",
            itl: tuple[float, ...] = ()) -> Result:
    route = (f"model=chat; pool=p; region={region}; endpoint={EU if region == 'eu-west' else US[0]}"
             + (f"; attempt=2; moved_on={moved_on}" if moved_on else ""))
    r = result(i, cls=cls, scheduled=sent, status=status, route=route, ttft=ttft, e2e=e2e, itl=itl)
    r.stream = stream
    r.finish_reason = finish if 200 <= status < 300 else None
    return r


def test_an_engine_received_what_it_finished_holds_and_saw_abandoned() -> None:
    assert engine_received(ENGINE.format(length=4, running=2), 3.0) == 4 + 2 + 3
    assert engine_received(None, 3.0) is None and engine_received(ENGINE.format(length=1, running=0), None) is None


def test_counters_are_read_from_the_gateway_and_every_region() -> None:
    c = _counters(1.0, us_ok=5, us_refused=2, eu_ok=7, fallbacks=2, hedges=1, resumes=3, us=(3, 4), eu=(1, None))
    assert c.attempts == {"chat-us": {"ok": 5, "connect_error": 2}, "chat-eu": {"ok": 7}}
    assert c.fallbacks == {"connect_error": 2} and c.budget_exhausted == 0 and c.hangs == 0
    assert c.hedges == {"won": 1, "not_sent": 5} and c.resumes == {"resumed": 3, "closed": 1} and c.broken == 3
    assert c.engines == {"us-east": 7, "eu-west": None}  # one eu-west engine unread: the region unknown
    bare = read_counters(1.0, 'switchyard_upstream_attempts_total{pool="p",outcome="ok"} 1.0\n', {})
    assert bare.fallbacks is None and bare.hedges is None and bare.hangs is None and bare.attempts == {"p": {"ok": 1}}
    later = _counters(2.0, us_ok=5, us_refused=4, eu_ok=9, fallbacks=4, hedges=3, resumes=5, us=(3, 6), eu=(2, 2))
    deltas = counter_deltas(c, later)
    assert deltas["attempts_by_pool"] == {"chat-us": {"connect_error": 2}, "chat-eu": {"ok": 2}}
    assert deltas["attempts"] == 4 and deltas["fallbacks"] == 2 and deltas["budget_exhausted"] == 0
    assert deltas["hedges"] == 2 and deltas["hedges_by_outcome"] == {"won": 2}  # not_sent sent nothing
    assert deltas["resumes"] == 2 and deltas["broken"] == 2
    assert deltas["received"] == {"us-east": 2, "eu-west": None}
    assert counter_deltas(None, c)["attempts"] is None


def _run() -> tuple[list[Result], Timeline]:
    results = [
        _served(0, 1.0, "us-east"), _served(1, 2.5, "us-east", e2e=1.0),  # 1 in flight at the down fault
        _served(2, 3.2, "eu-west", moved_on=f"{US[0]} connect_error", ttft=0.1),
        _served(3, 3.5, "-", status=502),
        _served(4, 5.0, "eu-west", stream=False, e2e=0.4), _served(5, 8.0, "us-east"),
        _served(6, 4.0, "eu-west", cls="eu-west"),
        _served(7, 10.5, "us-east", e2e=2.0, itl=(0.01, 1.2)),  # in flight at the kill, resumed
        _served(8, 11.0, "eu-west", finish=None),  # 2xx without a finish_reason: not complete
        _served(9, 17.0, "us-east"),
        _served(10, 21.2, "eu-west", moved_on=f"{US[1]} hung, chat-us unavailable", ttft=1.4, e2e=2.0),
        _served(11, 21.5, "eu-west", moved_on="chat-us unavailable"), _served(12, 26.0, "us-east")]
    line = Timeline(start=0.0, wall_start=1000.0, outages=[
        Outage("down", 3.0, 3.05, 7.0, 7.01, 7.1, 7.9, _counters(3.0, us_ok=20, eu_ok=10, us=(4, 4), eu=(5, 5)),
               _counters(7.0, us_ok=20, us_refused=3, eu_ok=14, fallbacks=3, us=(None, None), eu=(7, 7))),
        Outage("kill", 11.0, 11.1, 15.0, 16.0, 16.0, 17.0,
               _counters(11.0, us_ok=22, us_refused=3, eu_ok=16, fallbacks=3, us=(5, 5), eu=(8, 8)),
               _counters(15.0, us_ok=22, us_refused=5, eu_ok=19, fallbacks=5, resumes=1, us=(None, None),
                         eu=(10, 10)), restarted="us-east"),
        Outage("hang", 21.0, 21.0, 25.0, 25.0, 25.0, 27.0,
               _counters(21.0, us_ok=25, us_refused=5, eu_ok=20, fallbacks=5, resumes=1, us=(1, 1), eu=(11, 11)),
               _counters(25.0, us_ok=25, us_refused=5, eu_ok=22, fallbacks=6, hedges=1, resumes=2, us=(2, 2),
                         eu=(12, 12)))],
        first=_counters(0.0), last=_counters(28.0, us_ok=26, us_refused=5, eu_ok=22, fallbacks=6, hedges=1,
                                             resumes=2, us=(2, 3), eu=(12, 13)))
    line.changes = [EndpointChange(0.0, US[0], True, "closed", None), EndpointChange(0.0, US[1], True, "closed", None),
                    EndpointChange(3.1, US[0], False, "closed", "health: refused"),
                    EndpointChange(3.2, US[1], False, "open", "breaker open: 5 failures"),
                    EndpointChange(7.5, US[0], True, "closed", None), EndpointChange(7.9, US[1], True, "closed", None),
                    EndpointChange(22.1, US[0], False, "open", "breaker open: hung"),
                    EndpointChange(22.3, US[1], False, "open", "breaker open: hung")]
    line.records = {"a": {"time": "1970-01-01T00:16:51.000+00:00", "outcome": "ok", "resumes": 1, "duration_ms": 2000},
                    "b": {"time": "1970-01-01T00:17:02.500+00:00", "outcome": "error", "resumes": 0, "hedges": 1,
                          "trace": ["one", "two"], "moved_on": ["x hung"], "duration_ms": 10}}
    return results, line


def test_the_seven_phases_follow_the_outages_and_a_restart_counts_from_zero() -> None:
    _, line = _run()
    windows = phase_windows(line)
    assert [(name, lo, hi) for name, lo, hi, _, _ in windows] == [
        ("before", None, 3.0), ("down", 3.0, 7.0), ("between-1", 7.0, 11.0), ("kill", 11.0, 15.0),
        ("between-2", 15.0, 21.0), ("hang", 21.0, 25.0), ("after", 25.0, None)]
    after_kill = windows[4][3]
    assert after_kill is not None and after_kill.engines == {"us-east": 0.0, "eu-west": 20}
    assert run_received(line) == {"us-east": (10 - 0) + 5, "eu-west": 25}  # the killed process's 10, then 5 more
    line.outages[2] = Outage("hang", start_s=21.0)  # staged, never ended
    assert [w[0] for w in phase_windows(line)][-2:] == ["between-2", "hang"]
    assert phase_windows(Timeline(outages=[Outage("down")]))[0][:3] == ("before", None, None)


def test_what_a_result_says() -> None:
    r = _served(0, 1.0, "eu-west", moved_on=f"{US[1]} hung, chat-us unavailable")
    assert tried_first(r, US) and not tried_first(_served(1, 1.0, "eu-west", moved_on="chat-us unavailable"), US)
    assert not tried_first(_served(2, 1.0, "us-east"), US)
    assert complete(r) and not complete(_served(3, 1.0, "us-east", finish=None))
    assert not complete(_served(4, 1.0, "-", status=502))
    assert wait_s(_served(5, 1.0, "us-east", ttft=0.3)) == pytest.approx(0.3)
    assert wait_s(_served(6, 1.0, "-", status=502, e2e=2.5)) == pytest.approx(2.5)  # no first token: all of it
    rs = [_served(7, 1.0, "us-east", e2e=3.0), _served(8, 2.0, "us-east"), _served(9, 5.0, "us-east")]
    assert [r.index for r in in_phase(rs, 2.0, 5.0)] == [7, 8]  # in flight at the start, and sent during it


def test_detection_is_when_the_gateway_took_every_endpoint_out_and_back() -> None:
    _, line = _run()
    down = detection(line.changes, US, 3.0, 7.0)
    assert down["out_first_s"] == pytest.approx(0.1) and down["out_all_s"] == pytest.approx(0.2)
    assert down["out_reasons"] == "health: refused; breaker open: 5 failures"
    assert down["back_s"] == pytest.approx(0.9)
    assert detection(line.changes, US, 11.0, 15.0)["out_all_s"] is None  # never seen out
    assert detection(line.changes, US, 3.15, 7.0)["out_first_s"] == 0.0  # one was out already
    assert detection(line.changes, US, 21.0, 25.0)["back_s"] is None  # never seen back


def test_the_outages_figures() -> None:
    results, line = _run()
    a = analyse(results, line, US)
    down, kill, hang = a["outages"]
    assert down["requests"] == 5 and down["in_flight"] == 1 and down["sent"] == 4  # 1 was running at the fault
    assert down["complete"] == 4 and down["failures"] == "502 http_error (1)" and down["in_flight_failed"] == 0
    assert down["out_all_s"] == pytest.approx(0.2) and down["first_away_s"] == pytest.approx(0.3)
    assert down["tried_home"] == 1 and down["moved_s"] == pytest.approx(0.2)
    assert down["recover_s"] == pytest.approx(1.05)  # 8.0 served at home, its first token 0.05 later
    assert down["fallbacks"] == 3 and down["resumes"] == 0
    assert kill["requests"] == 2 and kill["complete"] == 1 and kill["failures"] == "200 no finish_reason (1)"
    assert kill["resumes"] == 1 and kill["records"] == 1 and kill["resumed_requests"] == 1
    assert kill["gap_max_s"] == pytest.approx(1.2) and kill["moved_s"] == 0.0  # none tried us-east
    assert hang["out_all_s"] == pytest.approx(1.3) and hang["tried_home"] == 1
    assert hang["moved_s"] == pytest.approx(0.2) and hang["wait_max_s"] == pytest.approx(1.4)
    assert hang["hedges"] == 1 and hang["failed_records"] == 1 and hang["hedged_requests"] == 1
    run = a["run"]
    assert run["requests"] == 13 and run["failures"] == 2 and run["wait_max_phase"] == "hang"
    assert run["engine_requests"] == 15 + 25 and run["engine_ratio"] == pytest.approx(40 / 13)
    assert run["hedges"] == 1 and run["resumes"] == 2
    load = {row["phase"]: row for row in a["load"]}
    assert load["before"]["engine_ratio"] == pytest.approx(18 / 2) and load["down"]["engine_ratio"] is None
    assert load["between-2"]["home_received"] == 2 and load["hang"]["healthy_received"] == 2
    assert [f["sent_s"] for f in a["failed"]] == [3.5, 11.0] and a["failed"][1]["error"] == "no finish_reason"
    assert [(r["phase"], r["trace"]) for r in a["records"]] == [("hang", "one | two")]
    slowest = a["slowest"][0]
    assert (slowest["sent_s"], slowest["wait_s"], slowest["moved_on"]) == (21.2, pytest.approx(1.4),
                                                                          f"{US[1]} hung, chat-us unavailable")
    assert len(records_in(line, 11.0, 15.0)) == 1 and records_in(Timeline(), 0.0, None) == []
    goals = {g["goal"]: g for g in _goals(a)}
    assert goals["requests answered completely in the down phase"]["met"] is False
    assert goals["hang detected and traffic moved off us-east"]["value"] == pytest.approx(1.3)
    assert goals["engine requests per client request over the run"]["met"] is False
    assert len(goals) == 6


def test_without_an_outage_the_figures_say_none() -> None:
    a = analyse([_served(0, 1.0, "us-east")], Timeline(outages=[Outage("down")]))
    assert a["outages"] == [] and a["run"]["complete_rate"] == 1.0 and a["run"]["engine_ratio"] is None
    assert [p["phase"] for p in a["phases"]] == ["before", "before"]  # one phase, both home regions
    assert a["load"][0]["attempts"] is None and a["load"][0]["engine_ratio"] is None


def test_half_the_requests_are_streamed_in_each_home_region() -> None:
    templates = mix()
    assert sorted((t.request_class, t.stream) for t in templates) == [
        ("eu-west", False), ("eu-west", True), ("us-east", False), ("us-east", True)]
    shortest_stream = min(t.output_tokens[0] for t in templates if t.stream)
    assert all(t.output_tokens[1] <= shortest_stream for t in templates if not t.stream)
