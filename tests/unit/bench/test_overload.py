"""The pure parts of the overload scenario: its policy and mix, and how it reads results and metrics."""

from __future__ import annotations

from typing import Any

import pytest

from switchyard.bench.results import Result
from switchyard.bench.sampler import by_label, samples
from switchyard.bench.scenarios.overload.figures import (
    class_rows,
    downgraded,
    gateway_view,
    ratio_rows,
    shed_reason,
    shed_rows,
)
from switchyard.bench.scenarios.overload.workload import (
    ARMS,
    BASELINE,
    CLASS_SHARE,
    CLASSES,
    MAX_NUM_SEQS,
    MODEL,
    SHED_ABOVE,
    SLO_TTFT_S,
    SMALL_MODEL,
    mix,
    overload_policy,
    slo_spec,
)
from switchyard.policy import compile_policy
from tests.unit.bench.helpers import result

ON, OFF = ARMS


def test_the_policy_declares_the_pools_classes_tiers_and_the_downgrade() -> None:
    snapshot = compile_policy(overload_policy([9001, 9002], [9003]), "overload.yaml")
    assert list(snapshot.priorities) == list(CLASSES)  # best first
    assert snapshot.priorities["sheddable"].shed_above_utilisation == SHED_ABOVE
    assert all(snapshot.priorities[c].shed_above_utilisation is None for c in ("critical", "standard"))
    main, small = snapshot.pools["main"], snapshot.pools["small"]
    assert main.endpoints == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert small.endpoints == ["http://127.0.0.1:9003"]
    assert main.max_num_seqs == small.max_num_seqs == MAX_NUM_SEQS
    assert main.priority_scheduling and small.priority_scheduling
    fcfs = compile_policy(overload_policy([9001, 9002], [9003], priority_scheduling=False), "overload.yaml")
    assert not any(pool.priority_scheduling for pool in fcfs.pools.values())  # the baseline arm
    rule = snapshot.models[MODEL].on_saturation
    assert rule is not None and rule.downgrade_to == SMALL_MODEL and rule.classes == ["standard"]
    assert {name: tier.priority for name, tier in snapshot.tiers.items()} == {c: c for c in CLASSES}


def test_the_mix_has_a_noisy_and_a_quiet_tenant_per_class() -> None:
    templates = mix()
    assert sum(t.weight for t in templates) == pytest.approx(1.0)
    for cls in CLASSES:
        mine = {t.tenant: t.weight for t in templates if t.request_class == cls}
        assert mine == pytest.approx({f"{cls}-noisy": 0.75 * CLASS_SHARE[cls], f"{cls}-quiet": 0.25 * CLASS_SHARE[cls]})
    assert all(t.stream and t.model == MODEL for t in templates)
    assert {t.model for t in mix("sim-8b")} == {"sim-8b"}


def _r(i: int, arm: str, cls: str, *, tenant: str = "noisy", ttft: float | None = 0.1, status: int = 200,
       code: str | None = None, downgraded_from: str | None = None, timed_out: bool = False,
       tokens: int = 10) -> Result:
    route = None
    if status == 200:
        route = "model=chat-lite; downgraded_from=chat; class=standard; pool=small" if downgraded_from \
            else f"model=chat; class={cls}; pool=main"
    r = result(i, arm=arm, cls=cls, tenant=f"{cls}-{tenant}", status=status, ttft=ttft, e2e=(ttft or 0) + 0.2,
               tokens=tokens, route=route, timed_out=timed_out)
    r.error_code = code
    return r


def test_downgrades_and_sheds_are_read_from_the_route_header_and_the_error_code() -> None:
    assert downgraded(_r(0, ON, "standard", downgraded_from="chat"))
    assert not downgraded(_r(0, ON, "standard"))
    assert not downgraded(_r(0, ON, "standard", status=503))
    assert shed_reason(_r(0, ON, "sheddable", status=503, code="shed_utilisation")) == "shed_utilisation"
    assert shed_reason(_r(0, ON, "sheddable", status=503)) == "503"
    assert shed_reason(_r(0, ON, "sheddable", status=502, code="upstream_error")) is None
    assert shed_reason(_r(0, ON, "sheddable")) is None


@pytest.fixture
def arms() -> dict[str, list[Result]]:
    on = [_r(0, ON, "critical", ttft=0.1), _r(1, ON, "critical", tenant="quiet", ttft=0.2),
          _r(2, ON, "standard", ttft=0.3, downgraded_from="chat"), _r(3, ON, "standard", tenant="quiet", ttft=2.5),
          _r(4, ON, "sheddable", status=503, code="shed_utilisation"),
          _r(5, ON, "sheddable", status=503, code="queue_deadline_exceeded"),
          _r(6, ON, "sheddable", tenant="quiet", ttft=0.2), _r(7, ON, "sheddable", ttft=0.2)]
    off = [_r(0, OFF, "critical", ttft=3.0), _r(1, OFF, "critical", tenant="quiet", ttft=0.5),
           _r(2, OFF, "standard", ttft=1.0),
           _r(3, OFF, "standard", tenant="quiet", ttft=None, status=0, timed_out=True),
           _r(4, OFF, "sheddable", ttft=5.0), _r(5, OFF, "sheddable", ttft=3.0),
           _r(6, OFF, "sheddable", tenant="quiet", ttft=6.0), _r(7, OFF, "sheddable", ttft=0.5, status=502)]
    return {ON: on, OFF: off}


def test_class_rows_hold_attainment_goodput_and_the_rates(arms: dict[str, list[Result]]) -> None:
    rows = {(r["class"], r["arm"]): r for r in class_rows(arms, slo_spec(), window_s=2.0)}
    assert set(rows) == {(c, a) for c in (*CLASSES, "all") for a in ARMS}
    crit_on, crit_off = rows[("critical", ON)], rows[("critical", OFF)]
    assert crit_on["slo_ttft_s"] == SLO_TTFT_S["critical"]
    assert crit_on["attainment"] == 1.0 and crit_off["attainment"] == 0.5
    assert crit_on["goodput_rps"] == pytest.approx(1.0)  # 2 met in a 2 s window
    assert crit_on["goodput_tps"] == pytest.approx(10.0)
    assert crit_off["noisy_attainment"] == 0.0 and crit_off["quiet_attainment"] == 1.0
    std_on, std_off = rows[("standard", ON)], rows[("standard", OFF)]
    assert std_on["downgrade_rate"] == 0.5 and std_on["attainment"] == 0.5  # 2.5 s misses the 2 s SLO
    assert std_off["error_rate"] == 0.5 and std_off["timeout_rate"] == 0.5  # a hung request is an error
    shed_on, shed_off = rows[("sheddable", ON)], rows[("sheddable", OFF)]
    assert shed_on["shed_rate"] == 0.5 and shed_on["error_rate"] == 0.0 and shed_on["attainment"] == 0.5
    assert shed_off["shed_rate"] == 0.0 and shed_off["error_rate"] == 0.25  # a 502 is an error, not a shed
    assert shed_off["attainment"] == 0.25  # 3.0 s met the 4 s SLO; 5 and 6 s did not; the 502 failed
    assert rows[("all", ON)]["slo_ttft_s"] is None and rows[("all", ON)]["requests"] == 8
    assert rows[("all", ON)]["attainment"] == pytest.approx(5 / 8)
    assert rows[("all", ON)]["quiet_attainment"] == pytest.approx(2 / 3)


def test_ratios_divide_on_by_off_and_leave_a_zero_baseline_out(arms: dict[str, list[Result]]) -> None:
    rows = class_rows(arms, slo_spec(), window_s=2.0)
    ratios = {r["class"]: r for r in ratio_rows(rows)}
    assert list(ratios) == [*CLASSES, "all"]
    assert ratios["critical"]["attainment"] == pytest.approx(2.0)
    assert ratios["sheddable"]["attainment"] == pytest.approx(2.0)  # 0.5 / 0.25
    zero = [dict(r, attainment=0.0) if r["arm"] == BASELINE else r for r in rows]
    assert ratio_rows(zero)[0]["attainment"] is None


METRICS = """\
# HELP switchyard_shed_total Requests refused with 503 by flow control.
# TYPE switchyard_shed_total counter
switchyard_shed_total{class="sheddable",reason="utilisation"} 1.0
switchyard_shed_total{class="sheddable",reason="deadline"} 1.0
switchyard_shed_created{class="sheddable",reason="deadline"} 1.7e+09
switchyard_downgrades_total{class="standard",model="chat",reason="saturated"} 1.0
switchyard_queue_wait_seconds_bucket{class="critical",lane="interactive",pool="main",le="0.1"} 2.0
switchyard_queue_wait_seconds_count{class="critical",lane="interactive",pool="main"} 2.0
switchyard_queue_wait_seconds_sum{class="critical",lane="interactive",pool="main"} 0.08
switchyard_queue_wait_seconds_count{class="standard",lane="interactive",pool="main"} 0.0
switchyard_queue_wait_seconds_sum{class="standard",lane="interactive",pool="main"} 0.0
switchyard_queue_depth{class="a \\"quoted\\" one",lane="interactive",pool="main"} 3.0
"""


def test_prometheus_samples_are_read_exactly_by_name_and_summed_by_label() -> None:
    shed = samples(METRICS, "switchyard_shed_total")
    assert shed == [({"class": "sheddable", "reason": "utilisation"}, 1.0),
                    ({"class": "sheddable", "reason": "deadline"}, 1.0)]
    assert by_label(METRICS, "switchyard_shed_total", "class") == {"sheddable": 2.0}
    assert by_label(METRICS, "switchyard_shed_total", "nope") == {}
    assert samples(METRICS, "switchyard_queue_depth") == [
        ({"class": 'a \\"quoted\\" one', "lane": "interactive", "pool": "main"}, 3.0)]
    assert samples("nothing_here 1\n", "switchyard_shed_total") == []


def test_the_gateway_view_counts_sheds_downgrades_and_queue_waits_per_class() -> None:
    view = gateway_view(METRICS)
    assert view["shed"] == {"sheddable": 2}
    assert view["downgrades"] == {"standard": 1}
    assert view["queued"] == {"critical": 2, "standard": 0}
    assert view["queue_wait_mean_s"] == pytest.approx({"critical": 0.04})


def test_shed_rows_break_sheds_down_and_set_the_gateway_beside_them(arms: dict[str, list[Result]]) -> None:
    gateway: dict[str, dict[str, Any]] = {ON: gateway_view(METRICS), OFF: {}}
    rows = {(r["class"], r["arm"]): r for r in shed_rows(arms, gateway)}
    on = rows[("sheddable", ON)]
    assert on["shed"] == 2 and on["shed_utilisation"] == 1 and on["queue_deadline_exceeded"] == 1
    assert on["queue_wait_too_long"] == 0 and on["other_503"] == 0
    assert on["gateway_shed"] == 2 and on["gateway_downgrades"] == 0  # read, and counted none: 0
    assert rows[("standard", ON)]["downgraded"] == rows[("standard", ON)]["gateway_downgrades"] == 1
    assert rows[("critical", ON)]["queue_wait_mean_s"] == pytest.approx(0.04)
    off = rows[("sheddable", OFF)]
    assert off["shed"] == 0 and off["gateway_shed"] is None and off["queued"] is None  # not read: unknown
