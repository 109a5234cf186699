"""The replay models the kv-cache-precise scorer: its truth is the simulated engines' own block pools."""

from __future__ import annotations

from switchyard.bench.policies import replicas_policy
from switchyard.bench.prompts import SynthText, unique_key
from switchyard.bench.spec import Labels, RequestSpec, Workload
from switchyard.policy import compile_policy
from switchyard.sim.request import SimRequest
from switchyard.whatif import replay_policy
from switchyard.whatif.fleet import Fleet
from switchyard.whatif.outcomes import prompt_ids
from switchyard.whatif.view import FleetCaches

PORTS = [9100, 9101, 9102, 9103]


def _policy(events: bool) -> str:
    return replicas_policy(PORTS, model="chat", served_model="sim-8b", profile="h100-8b", kv_cache_tokens=20_000,
                           context_window=8192, kv_events=(100, 200) if events else None)


def _sessions(count: int = 6, turns: int = 5) -> Workload:
    """``count`` sessions whose prompts grow by a segment per turn, turns 2 s apart, sessions interleaved."""
    specs = []
    for turn in range(turns):
        for s in range(count):
            segments = tuple((unique_key("t", s, i), 300) for i in range(turn + 1))
            specs.append((turn * 2.0 + s * 0.1, SynthText(segments)))
    labels = Labels(tenant="bench", model="chat", extra_body={"ignore_eos": True})
    return Workload(tuple(RequestSpec(i, at, p, 8, labels) for i, (at, p) in enumerate(specs)), turns * 2.0,
                    {"source": "test"})


def test_the_precise_view_is_what_the_engine_holds_in_whole_blocks() -> None:
    snapshot = compile_policy(_policy(True))
    fleet = Fleet(snapshot)
    caches = FleetCaches(fleet)
    url = f"http://127.0.0.1:{PORTS[0]}"
    ids = prompt_ids({"messages": [{"role": "user", "content": SynthText(((7, 200),)).text()}]})
    assert caches.held(url, ids, 0.0) == 0
    endpoint = fleet.endpoints[url]
    endpoint.submit(SimRequest(request_id="a", prompt=ids, max_output=4, budget=4))
    fleet.drain()
    size = endpoint.core.block_size
    assert caches.held(url, ids, 0.0) == len(ids) // size * size
    assert caches.held(url, ids + [1] * 40, 0.0) == len(ids) // size * size  # the longest leading run
    assert caches.held(f"http://127.0.0.1:{PORTS[1]}", ids, 0.0) == 0


def test_pools_without_kv_events_are_not_reported_on() -> None:
    caches = FleetCaches(Fleet(compile_policy(_policy(False))))
    assert caches.held(f"http://127.0.0.1:{PORTS[0]}", [1, 2, 3] * 20, 0.0) is None


def test_a_precise_profile_keeps_growing_sessions_where_their_prefix_is() -> None:
    work = _sessions()
    precise = replay_policy(compile_policy(_policy(True)), work, strategy="prefix-aware")
    rr = replay_policy(compile_policy(_policy(True)), work, strategy="round-robin")
    cached = {name: sum(o.cached_tokens for o in arm.outcomes) for name, arm in (("p", precise), ("rr", rr))}
    prompt = sum(o.prompt_tokens for o in precise.outcomes)
    assert all(o.status == 200 for o in precise.outcomes)
    # Every turn after the first finds its whole previous prompt (less a partial block) where it went before.
    assert cached["p"] > 0.6 * prompt > cached["rr"]
    by_session: dict[int, set[str]] = {}
    for o in precise.outcomes:
        by_session.setdefault(o.index % 6, set()).add(o.endpoint or "")
    assert all(len(urls) == 1 for urls in by_session.values())
