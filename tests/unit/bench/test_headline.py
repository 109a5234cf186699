"""The headline scenario's policies and figures (its day: ``test_headline_day``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from switchyard.bench.procs import Processes
from switchyard.bench.prompts import LiteralText
from switchyard.bench.results import Result
from switchyard.bench.scenarios import SCENARIOS
from switchyard.bench.scenarios.arms import Arm, Capacity
from switchyard.bench.scenarios.base import BenchOptions, ScenarioContext
from switchyard.bench.scenarios.headline.day import day
from switchyard.bench.scenarios.headline.figures import (
    attainment_series,
    cost_per_1k,
    goals_of,
    goodput_series,
    measure,
    tables_of,
    write_day_plot,
)
from switchyard.bench.scenarios.headline.fleet import (
    ARMS,
    AUTO_SMALL_BELOW,
    BASELINES,
    CLASSES,
    CONTEXT,
    LARGE,
    MAX_NUM_SEQS,
    MODELS,
    NO_BACKLOG,
    REGIONS,
    REPLICAS,
    ROUND_ROBIN,
    SLO_TTFT_S,
    SMALL,
    SWITCHYARD,
    TENANTS,
    TIERS,
    TOKEN_SCALE,
    policy,
    ports_of,
)
from switchyard.bench.scenarios.headline.scenario import BACKLOG_SHARE, Headline
from switchyard.bench.spec import Labels, RequestSpec, Workload
from switchyard.policy import compile_policy
from tests.unit.bench.helpers import result

PORTS = ports_of(list(range(9000, 9000 + len(REGIONS) * len(MODELS) * REPLICAS)))


def test_every_arm_has_the_same_fleet_and_only_switchyard_the_controls() -> None:
    snapshots = {arm: compile_policy(policy(arm, PORTS), f"{arm}.yaml") for arm in ARMS}
    for arm, snapshot in snapshots.items():
        full = arm not in BASELINES
        assert sorted(snapshot.pools) == sorted(f"{m}-{r}" for r in REGIONS for m in MODELS)
        assert {p.region for p in snapshot.pools.values()} == set(REGIONS)
        assert all(len(p.endpoints) == REPLICAS and p.max_num_seqs == MAX_NUM_SEQS for p in snapshot.pools.values())
        assert all(p.priority_scheduling is full for p in snapshot.pools.values())
        assert {n: t.priority for n, t in snapshot.tiers.items()} == TIERS
        assert (snapshot.models[LARGE].on_saturation is not None) is full
        assert ("batch" in snapshot.priorities) is full
        assert (snapshot.tiers["free"].limits is not None and snapshot.tiers["free"].limits.tokens_per_minute
                is not None) is full
        assert (snapshot.priorities["sheddable"].shed_above_utilisation is not None) is full
        assert bool(snapshot.document.cache) is full
        assert all((snapshot.priorities[c].ttft_objective is not None) is full for c in CLASSES)
        assert "auto" in snapshot.routes
    # Every endpoint appears once across the pools.
    urls = [u for p in snapshots[SWITCHYARD].pools.values() for u in p.endpoints]
    assert len(urls) == len(set(urls)) == len(REGIONS) * len(MODELS) * REPLICAS


def test_the_scenario_is_registered_but_not_a_default() -> None:
    from switchyard.bench.scenarios import DEFAULT_SCENARIOS
    assert "headline" in SCENARIOS and "headline" not in DEFAULT_SCENARIOS


def _day(arm: str, good: bool) -> list[Result]:
    out = []
    for i in range(100):
        cls = ("critical", "standard", "sheddable")[i % 3]
        ttft = SLO_TTFT_S[cls] / 2 if good or i % 2 else SLO_TTFT_S[cls] * 2
        r = result(i, arm=arm, cls=cls, tenant="bank" if cls == "critical" else "shop", scheduled=i * 1.0,
                   ttft=ttft, route=f"model={SMALL if i % 2 else LARGE}; route=auto", prompt_tokens=1000, tokens=100)
        out.append(r)
    return out


def test_goodput_attainment_and_the_goals_from_the_results() -> None:
    arms = []
    for name in ARMS:
        arm = Arm(name)
        arm.results = _day(name, good=name not in BASELINES)
        # Busy 90% of the day, but an engine that did not answer a sample (None: down) counts for nothing.
        arm.busy = [0.9] * 99 + [None]  # type: ignore[attr-defined]
        arm.occupancy = [0.85, 0.95] * 50  # type: ignore[attr-defined]
        arm.lag_s = [0.001] * 98 + [0.004, None]  # type: ignore[attr-defined]
        arms.append(arm)
    workload = Workload((), 100.0, {})
    capacity = Capacity(32, 4.0, 40, 0, 10.0, 100.0, 1.0)
    measured = measure(arms, workload)
    sy, rr = measured[SWITCHYARD], measured[ROUND_ROBIN]
    assert sy["goodput_rps"] == pytest.approx(1.0) and rr["goodput_rps"] == pytest.approx(0.5)
    assert sy["critical_attainment"] == 1.0 and rr["attainment"] == pytest.approx(0.5)
    assert sy["busy"] == pytest.approx(0.9) and sy["utilisation"] == pytest.approx(0.9)
    assert sy["lag_max_s"] == pytest.approx(0.004)
    assert sy["offered_rps"] == pytest.approx(1.0)
    goals = {g["goal"]: g for g in goals_of(measured)}
    assert goals["goodput at SLO, Switchyard ÷ round-robin"]["value"] == pytest.approx(2.0)
    assert goals["goodput at SLO, Switchyard ÷ round-robin"]["met"] is True
    # Round-robin served half the day within its objectives: no arm could do better than twice that.
    assert "at most 2.00x" in goals["goodput at SLO, Switchyard ÷ round-robin"]["note"]
    assert goals["goodput at SLO, Switchyard ÷ least-loaded"]["met"] is True
    assert goals["engine utilisation over the day, with the backlog"]["met"] is True
    lost = goals["interactive attainment lost to the backlog (without - with)"]
    assert lost["value"] == 0.0 and lost["met"] is True and NO_BACKLOG in measured
    assert len(tables_of(measured, capacity, workload, {SMALL: 7.0, LARGE: 3.0})) == 4
    # 50 answers by each model of 1,000 prompt and 100 answer tokens: (1000*0.1 + 100*0.2) / 1e6 dollars for
    # small, (1000*0.4 + 100*1.2) / 1e6 for large, per answer.
    assert cost_per_1k(arms[0].results) == pytest.approx((120e-6 + 520e-6) / 2 * 1000)
    series = goodput_series(arms[2].results, 100.0, bins=10)
    assert series == [1.0] * 10


def test_the_utilisation_goal_reads_the_throughput_in_use_where_the_engines_report_it() -> None:
    arms = []
    for name in ARMS:
        arm = Arm(name)
        arm.results = _day(name, good=True)
        arm.busy = [0.95] * 100  # type: ignore[attr-defined]
        arm.occupancy = [0.9] * 100  # type: ignore[attr-defined]
        arm.in_use = [0.8] * 99 + [None]  # type: ignore[attr-defined]
        arms.append(arm)
    measured = measure(arms, Workload((), 100.0, {}))
    assert measured[SWITCHYARD]["in_use"] == pytest.approx(0.8)
    goal = {g["goal"]: g for g in goals_of(measured)}["engine utilisation over the day, with the backlog"]
    # Slots 90% taken would meet the goal; the throughput in use (80%) is what it is judged on.
    assert goal["value"] == pytest.approx(0.8) and goal["met"] is False
    assert "slots taken 90.0%" in goal["note"] and "busy 95.0%" in goal["note"]
    fleet = tables_of(measured, Capacity(32, 4.0, 40, 0, 10.0, 100.0, 1.0), Workload((), 100.0, {}))[3]
    assert [row["in_use"] for row in fleet["rows"]] == pytest.approx([0.8] * len(ARMS))


def test_the_attainable_estimate_gives_capacity_to_the_best_class_first() -> None:
    from types import SimpleNamespace

    from switchyard.bench.scenarios.headline.figures import attainable

    def day(rates: dict[str, float], seconds: float) -> Workload:
        specs = [SimpleNamespace(arrival_s=i / rate, request_class=cls)
                 for cls, rate in rates.items() for i in range(int(rate * seconds))]
        return SimpleNamespace(specs=specs, duration_s=seconds)  # type: ignore[return-value]

    # Under capacity every class gets everything.
    assert attainable(day({"critical": 2, "standard": 3, "sheddable": 4}, 60.0), 10.0, None, 0.5) == {
        "critical": 1.0, "standard": 1.0, "sheddable": 1.0}
    # At twice the capacity for a minute: critical whole; standard the rest of the capacity (6 of its 8 a second),
    # and after the last arrival the 3 s of it still waiting; sheddable only what is left after that.
    shares = attainable(day({"critical": 4, "standard": 8, "sheddable": 8}, 60.0), 10.0, None, 0.5)
    assert shares["critical"] == 1.0
    assert 6 / 8 < shares["standard"] <= (6 * 60 + 3 * 8) / (8 * 60)
    assert shares["sheddable"] < 0.15
    # Half the capacity for half the minute: critical takes 4 of the 5 a second, standard 1 of its 6; when the
    # region is back, the 3 s of standard still waiting (15) are served too, and everything after.
    down = attainable(day({"critical": 4, "standard": 6}, 60.0), 10.0, (0.0, 30.0), 0.5)
    assert down["critical"] == 1.0 and down["standard"] == pytest.approx((30 + 15 + 180) / 360, abs=0.02)


def test_the_backlog_lasts_the_day_for_both_models_and_mixes_them_through_the_file(tmp_path: Path) -> None:
    """Each model gets lines for twice what its pools leave idle (the small model's lines are cheaper than the
    day's requests: at 1.2x its pools ran out before the day's end), and the lines are shuffled: read in the
    order chosen, the large model's count was reached first and the file's second half had none of its lines."""
    headline = Headline(ScenarioContext(BenchOptions(out_dir=tmp_path, quick=True), tmp_path, Processes(tmp_path)))
    headline.pool_capacity = {SMALL: 40.0, LARGE: 20.0}
    capacity = Capacity(32, 4.0, 240, 0, 60.0, 2000.0, 0.5)
    workload = day(60.0, 60.0, 0, tenants=TENANTS, class_of_tier=TIERS, model="auto", token_scale=TOKEN_SCALE,
                   max_model_len=CONTEXT)
    lines = headline.backlog_lines(capacity, workload)
    assert [line.index for line in lines] == list(range(len(lines)))
    assert BACKLOG_SHARE == 2.0 and min(headline.backlog_models.values()) > 0

    def large_share(part: list[RequestSpec]) -> float:
        return sum(line.prompt_tokens >= AUTO_SMALL_BELOW for line in part) / len(part)

    whole = large_share(lines)
    half = len(lines) // 2
    assert 0.0 < whole < 1.0
    assert large_share(lines[:half]) == pytest.approx(whole, abs=0.1)
    assert large_share(lines[half:]) == pytest.approx(whole, abs=0.1)


def test_each_class_attainment_over_the_day_and_the_plot_of_it(tmp_path: Path) -> None:
    good, poor = _day(SWITCHYARD, good=True), _day(ROUND_ROBIN, good=False)
    assert attainment_series(good, 100.0, bins=10) == {cls: [1.0] * 10 for cls in CLASSES}
    # Round-robin's even-numbered requests miss their objective: bin 0 holds critical 0, 3, 6, 9 (3 and 9 met),
    # standard 1, 4, 7 (1 and 7), sheddable 2, 5, 8 (5).
    poor_series = attainment_series(poor, 100.0, bins=10)
    assert [poor_series[cls][0] for cls in CLASSES] == pytest.approx([2 / 4, 2 / 3, 1 / 3])
    assert attainment_series(poor[:10], 100.0, bins=10)["critical"][5] is None  # nothing sent then
    arms = []
    for name in ARMS:
        arm = Arm(name)
        arm.results = _day(name, good=name not in BASELINES)
        arms.append(arm)
    measured = measure(arms, Workload((), 100.0, {}))
    assert measured[ROUND_ROBIN]["attainment_series"] == attainment_series(poor, 100.0)
    workload = Workload(tuple(RequestSpec(i, i * 1.0, LiteralText("hello"), 5, Labels(model="auto"))
                              for i in range(100)), 100.0, {})
    plot = write_day_plot(measured, workload, Capacity(32, 4.0, 40, 0, 10.0, 100.0, 1.0), tmp_path / "day.png")
    assert plot.read_bytes()[:4] == b"\x89PNG"
