"""The pure parts of the scenarios: the prefix bound, the failover analysis, overhead's latency."""

from __future__ import annotations

from pathlib import Path

import pytest

from switchyard.bench.prompts import LiteralText, SynthText, block_key
from switchyard.bench.scenarios.failover import Timeline, analyse
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
            cls: str = "us-east") -> object:
    route = f"model=chat; {'fallback_from=chat-us; ' if fallback else ''}pool=p; region={region}; endpoint=e"
    r = result(i, cls=cls, scheduled=sent, status=status, route=route, ttft=0.05)
    r.sent_s = sent
    return r


def test_failover_analysis_finds_detection_and_recovery() -> None:
    results = [_served(0, 1.0, "us-east"), _served(1, 2.0, "us-east"),
               _served(2, 3.2, "eu-west", fallback=True), _served(3, 3.5, "-", status=502),
               _served(4, 5.0, "eu-west", fallback=True), _served(5, 7.5, "eu-west", fallback=True),
               _served(6, 8.0, "us-east"), _served(7, 4.0, "eu-west", cls="eu-west")]
    line = Timeline(start=0.0, stop_s=3.0, stopped_s=3.1, restart_s=6.0, ready_s=7.0)
    a = analyse(results, line)  # type: ignore[arg-type]
    assert a["detect_s"] == pytest.approx(0.2)
    assert a["recover_s"] == pytest.approx(1.0)  # 7.5 went to eu-west; 8.0 is back home
    assert a["back_after_restart_s"] == pytest.approx(2.0)
    assert a["requests"] == 8 and a["failures"] == 1
    assert a["success"] == pytest.approx(7 / 8)
    phases = {p["phase"]: p for p in a["phases"]}
    assert [phases[k]["requests"] for k in ("before", "outage", "after")] == [2, 3, 2]
    assert phases["outage"]["ok_rate"] == pytest.approx(2 / 3)
    assert phases["after"]["in_home"] == pytest.approx(0.5)


def test_failover_analysis_without_an_outage_reports_none() -> None:
    a = analyse([_served(0, 1.0, "us-east")], Timeline())  # type: ignore[list-item]
    assert a["detect_s"] is None and a["recover_s"] is None and a["success"] == 1.0


def test_overhead_latency_is_from_send_and_the_warmup_is_cut_off() -> None:
    r = result(0, scheduled=2.0, late=0.5, ttft=0.7, e2e=0.9)
    assert service_latency(r, stream=True) == pytest.approx(0.2)
    assert service_latency(r, stream=False) == pytest.approx(0.4)
    assert service_latency(result(1, status=500), stream=False) is None
    shifted = _shifted(r, 1.0)
    assert (shifted.scheduled_s, shifted.sent_s, shifted.first_token_s, shifted.done_s) == \
        pytest.approx((1.0, 1.5, 1.7, 1.9))
