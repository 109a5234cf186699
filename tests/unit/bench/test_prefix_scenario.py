"""The prefix scenario's pure parts: the agents workload and the oracle."""

from __future__ import annotations

import itertools

from switchyard.bench.prompts import SynthText, unique_key
from switchyard.bench.scenarios.prefix.oracle import choose, offline, unbounded_bound
from switchyard.bench.scenarios.prefix.workloads import AgentShape, agent_sessions
from switchyard.bench.spec import Labels, RequestSpec, Workload
from switchyard.sim.config import EngineConfig

SHAPE = AgentShape(sessions_per_s=2.0, tenants=5)


def _segments(spec: RequestSpec) -> tuple[tuple[int, int], ...]:
    assert isinstance(spec.prompt, SynthText)
    return spec.prompt.segments


def test_agents_are_deterministic_in_the_seed() -> None:
    a, b, c = agent_sessions(SHAPE, 30.0, 1), agent_sessions(SHAPE, 30.0, 1), agent_sessions(SHAPE, 30.0, 2)
    assert [(s.arrival_s, s.prompt, s.max_tokens) for s in a.specs] == [(s.arrival_s, s.prompt, s.max_tokens)
                                                                         for s in b.specs]
    assert [s.prompt for s in a.specs] != [s.prompt for s in c.specs]
    assert [s.index for s in a.specs] == list(range(len(a)))
    assert all(x.arrival_s <= y.arrival_s < 30.0 for x, y in itertools.pairwise(a.specs))


def test_every_agent_prompt_opens_with_the_shared_system_prompt_then_its_tenants() -> None:
    w = agent_sessions(SHAPE, 30.0, 1)
    system = _segments(w.specs[0])[0]
    assert system == (unique_key("agents-system", 1), SHAPE.system_tokens)
    tenants: dict[str, set[tuple[int, int]]] = {}
    for spec in w.specs:
        first, tenant = _segments(spec)[:2]
        assert first == system and tenant[1] == SHAPE.tenant_tokens
        tenants.setdefault(spec.prefix_group.split(".")[0] if spec.prefix_group else "", set()).add(tenant)
    assert len(tenants) > 1 and all(len(keys) == 1 for keys in tenants.values())


def test_each_turn_resends_the_whole_history_plus_a_call_and_a_tool_output() -> None:
    w = agent_sessions(SHAPE, 60.0, 1)
    sessions: dict[str, list[RequestSpec]] = {}
    for spec in w.specs:
        sessions.setdefault(spec.prefix_group or "", []).append(spec)
    grown = 0
    for turns in sessions.values():
        for before, after in itertools.pairwise(turns):
            old, new = _segments(before), _segments(after)
            assert new[:len(old)] == old and len(new) == len(old) + 2  # the call and the tool's output
            assert SHAPE.tool_tokens[0] <= new[-1][1] <= SHAPE.tool_tokens[1]
            assert after.arrival_s - before.arrival_s >= SHAPE.gap_s[0]
            grown += 1
    assert grown > 20
    hits, total = unbounded_bound(w)
    assert 0.6 < hits / total < 1.0  # most of every prompt was sent before


def test_agent_prompts_fit_the_context_window() -> None:
    w = agent_sessions(AgentShape(sessions_per_s=1.0, turns=(30, 30), tool_tokens=(400, 500)), 200.0, 1,
                       labels=Labels(), max_model_len=4096)
    assert w.clipped > 0
    assert all(s.prompt_tokens + s.max_tokens <= 4096 for s in w.specs)


def test_the_oracle_takes_the_longest_cached_prefix_within_the_margin() -> None:
    assert choose([3, 0, 1], [100, 0, 50], herd_margin=4) == 0
    assert choose([5, 0, 1], [100, 0, 50], herd_margin=4) == 2  # the first is too busy for its cache
    assert choose([2, 0, 1], [0, 0, 0], herd_margin=4) == 1  # nothing cached anywhere: the least loaded
    assert choose([2, 1, 1], [64, 64, 0], herd_margin=4) == 1  # equal prefixes: the less loaded


#: Four replicas of this engine.
ENGINE = EngineConfig(served_model="sim-8b", port=0, profile="h100-8b", kv_cache_tokens=20_000, max_model_len=8192)


def test_the_oracle_keeps_sessions_where_their_history_is_and_beats_the_baselines() -> None:
    w = agent_sessions(AgentShape(sessions_per_s=1.0, tenants=3, system_tokens=200, tenant_tokens=64), 30.0, 4,
                       labels=Labels(model="chat", extra_body={"ignore_eos": True}), max_model_len=8192)
    runs = {p: offline(ENGINE, 4, w, time_scale=1.0, placement=p) for p in ("oracle", "least-loaded", "round-robin")}
    oracle = runs["oracle"]
    assert oracle.queries > 0 and sum(oracle.per_engine) == len(w) == len(oracle.ttft_s)
    assert oracle.hit_ratio is not None
    for name in ("least-loaded", "round-robin"):
        other = runs[name].hit_ratio
        assert other is not None and oracle.hit_ratio > other
    hits, total = unbounded_bound(w)
    assert oracle.hit_ratio <= hits / total + 0.05  # the template's tokens shift the engines' count a little


def test_the_oracle_is_deterministic() -> None:
    specs = tuple(RequestSpec(i, 0.5 * i, SynthText(((unique_key("p", i % 3), 300),)), 8, Labels(model="chat"))
                  for i in range(12))
    w = Workload(specs, 6.0, {"source": "test"})
    a, b = offline(ENGINE, 4, w, time_scale=1.0), offline(ENGINE, 4, w, time_scale=1.0)
    assert (a.hits, a.queries, a.per_engine) == (b.hits, b.queries, b.per_engine)
    assert a.hits > 0
