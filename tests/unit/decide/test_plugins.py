"""The endpoint picker's plugins (filters, scorers, pickers) and profiles, as pure functions."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from switchyard.decide.pick import pick_endpoint, profile_for
from switchyard.decide.picking import Option, PickRequest, Subject
from switchyard.decide.plugins import build, compile_profile
from switchyard.decide.views import Candidate, EndpointView
from switchyard.policy import PolicyError, compile_policy
from switchyard.policy import routing as spec
from switchyard.policy.fleet import Pool
from switchyard.policy.routing import BASELINE_PROFILES, DEFAULT_PROFILE, EndpointProfile
from tests.unit.policy.base import base, to_yaml

US = Pool(name="p-us", region="us-east", served_model="m", endpoints=["http://us1", "http://us2"],
          kv_cache_tokens=100_000)
EU = Pool(name="p-eu", region="eu-west", served_model="m", endpoints=["http://eu1"], kv_cache_tokens=400_000)
CANDIDATES = [Candidate(US, "http://us1"), Candidate(US, "http://us2"), Candidate(EU, "http://eu1")]
#: A prompt long enough to have blocks, in a session.
SUBJECT = Subject({"messages": [{"role": "user", "content": "p" * 600}]}, {"x-session-id": "s1"}, "t")


class Remembers:
    """Scorer memory that remembers what the test says (prefix affinity per URL, a session's endpoint)."""

    def __init__(self, affinity: dict[str, float] | None = None, session: str | None = None) -> None:
        self.prefixes, self.sessions = self, self
        self.held = affinity or {}
        self.session = session
        self.recorded: list[tuple[str, str]] = []

    def affinity(self, hashes: Any, urls: Any, now: float) -> dict[str, float]:
        return {u: self.held.get(u, 0.0) for u in urls}

    def get(self, key: str, now: float) -> str | None:
        return self.session

    def record(self, key: Any, url: str, now: float) -> None:
        self.recorded.append(("prefix" if isinstance(key, list) else "session", url))


def req(affinity: dict[str, float] | None = None, session_url: str | None = None, **kwargs: Any) -> PickRequest:
    """A pick for a request whose scorer memory holds ``affinity`` and ``session_url``."""
    return PickRequest(Remembers(affinity, session_url), SUBJECT, "m", len(CANDIDATES), **kwargs)


REQ = req()


def options(*views: EndpointView) -> list[Option]:
    return [Option(c.pool, c.url, v) for c, v in zip(CANDIDATES, views, strict=True)]


def run_filter(item: Any, opts: list[Option], request: PickRequest = REQ) -> list[str]:
    plugin = build(item)
    return [o.url for o in plugin.keep(opts, request)]  # type: ignore[union-attr]


def run_scorer(item: Any, opts: list[Option], request: PickRequest = REQ) -> list[float]:
    return list(build(item).score(opts, request))  # type: ignore[union-attr]


def pick(views: dict[str, EndpointView], request: PickRequest = REQ, profile: EndpointProfile = DEFAULT_PROFILE,
         exclude: frozenset[str] = frozenset()) -> str | None:
    choice = pick_endpoint(compile_profile("t", profile), CANDIDATES, lambda c: views.get(c.url, EndpointView()),
                           request, exclude)
    return None if choice is None else choice.url


# --- filters ------------------------------------------------------------------------------------

def test_healthy_filter_leaves_out_endpoints_in_cool_down() -> None:
    opts = options(EndpointView(healthy=False), EndpointView(), EndpointView())
    assert run_filter(spec.HealthyFilter(type="healthy"), opts) == ["http://us2", "http://eu1"]


def test_serves_model_filter_trusts_only_a_fresh_report() -> None:
    opts = options(EndpointView(models=frozenset({"other"})), EndpointView(models=frozenset({"m", "x"})),
                   EndpointView(models=None))
    assert run_filter(spec.ServesModelFilter(type="serves-model"), opts) == ["http://us2", "http://eu1"]


def test_under_saturation_filter_uses_the_class_ceiling_unless_the_profile_sets_one() -> None:
    opts = options(EndpointView(utilisation=0.5), EndpointView(utilisation=0.85), EndpointView(utilisation=1.2))
    under = spec.UnderSaturationFilter(type="under-saturation")
    assert run_filter(under, opts) == ["http://us1", "http://us2"]
    assert run_filter(under, opts, req(ceiling=0.8)) == ["http://us1"]
    fixed = spec.UnderSaturationFilter(type="under-saturation", max_utilisation=0.6)
    assert run_filter(fixed, opts, req(ceiling=1.0)) == ["http://us1"]


def test_a_filter_that_would_leave_none_is_ignored() -> None:
    # Out of service is not a filter: a stage whose endpoints are all out is passed over.
    down = {c.url: EndpointView(healthy=False) for c in CANDIDATES}
    assert pick(down) is None
    # Every replica's scrape names another model: try one anyway, its answer says what is wrong.
    wrong = {c.url: EndpointView(models=frozenset({"other"})) for c in CANDIDATES}
    choice = pick_endpoint(compile_profile("t", DEFAULT_PROFILE), CANDIDATES, lambda c: wrong[c.url], REQ)
    assert choice is not None and "serves-model: none passes, all 3 kept" in choice.trace
    full = {c.url: EndpointView(utilisation=1.5) for c in CANDIDATES}
    assert pick(full) is not None
    assert pick({}, exclude=frozenset(c.url for c in CANDIDATES)) is None
    # Once a stage's only endpoint in service was tried, the request moves on to the next stage
    # instead of trying endpoints that are out.
    cooling = {"http://us2": EndpointView(healthy=False), "http://eu1": EndpointView(healthy=False)}
    assert pick(cooling, exclude=frozenset({"http://us1"})) is None
    choice = pick_endpoint(compile_profile("t", DEFAULT_PROFILE), CANDIDATES,
                           lambda c: cooling.get(c.url, EndpointView()), REQ)
    assert choice is not None and choice.url == "http://us1" and "2 out of service left out" in choice.trace


# --- scorers ------------------------------------------------------------------------------------

def test_load_queue_kv_and_inflight_scorers_are_in_unit_range_and_favour_the_idle() -> None:
    opts = options(EndpointView(load=0, queued=0, utilisation=0.1, inflight_tokens=0),
                   EndpointView(load=3, queued=2, utilisation=0.75, inflight_tokens=999),
                   EndpointView(load=9, queued=5, utilisation=1.4, inflight_tokens=4_000))
    assert run_scorer(spec.LoadScorer(type="load"), opts) == [1.0, 0.25, 0.1]
    assert run_scorer(spec.QueueDepthScorer(type="queue-depth"), opts) == pytest.approx([1.0, 1 / 3, 1 / 6])
    assert run_scorer(spec.KvCacheScorer(type="kv-cache"), opts) == pytest.approx([0.9, 0.25, 0.0])
    assert run_scorer(spec.InflightTokensScorer(type="inflight-tokens"), opts) == pytest.approx(
        [1.0, 1 / 1000, 1 / 4001])


def test_prefix_affinity_scores_held_blocks_and_yields_when_busy() -> None:
    scorer = spec.PrefixAffinityScorer(type="prefix-affinity")
    request = req({"http://us1": 1.0, "http://us2": 0.5, "http://eu1": 0.25})
    idle = options(EndpointView(), EndpointView(), EndpointView())
    assert run_scorer(scorer, idle, request) == [1.0, 0.5, 0.25]
    assert run_scorer(scorer, idle, req()) == [0.0, 0.0, 0.0]
    # Herding guard: a queue inside the engine, utilisation at the yield level, or a load more than
    # herd_margin above the least loaded candidate, each zero the affinity.
    queued = options(EndpointView(queued=1, load=1), EndpointView(), EndpointView())
    assert run_scorer(scorer, queued, request)[0] == 0.0
    hot = options(EndpointView(utilisation=1.0), EndpointView(), EndpointView())
    assert run_scorer(scorer, hot, request)[0] == 0.0
    piled = options(EndpointView(load=5), EndpointView(load=0), EndpointView(load=1))
    assert run_scorer(scorer, piled, request) == [0.0, 0.5, 0.25]
    within = options(EndpointView(load=4), EndpointView(load=0), EndpointView(load=1))
    assert run_scorer(scorer, within, request)[0] == 1.0


def test_session_affinity_holds_while_the_endpoint_is_healthy_and_unsaturated() -> None:
    scorer = spec.SessionAffinityScorer(type="session-affinity", yield_above_utilisation=0.8)
    request = req(session_url="http://us2")
    assert run_scorer(scorer, options(EndpointView(), EndpointView(), EndpointView()), request) == [0, 1, 0]
    busy = options(EndpointView(), EndpointView(utilisation=0.8), EndpointView())
    assert run_scorer(scorer, busy, request) == [0, 0, 0]
    down = options(EndpointView(), EndpointView(healthy=False), EndpointView())
    assert run_scorer(scorer, down, request) == [0, 0, 0]
    assert run_scorer(scorer, options(EndpointView(), EndpointView(), EndpointView()), REQ) == [0, 0, 0]


# --- pickers ------------------------------------------------------------------------------------

def test_max_score_breaks_ties_at_random_or_by_order_without_a_generator() -> None:
    picker = build(spec.MaxScorePicker(type="max-score"))
    opts = options(EndpointView(), EndpointView(), EndpointView())
    assert picker.pick(opts, [0.2, 0.9, 0.9], REQ) == 1  # type: ignore[call-arg, arg-type]
    rng = random.Random(7)
    seen = Counter(picker.pick(opts, [0.9, 0.9, 0.1], req(rng=rng)) for _ in range(200))  # type: ignore[call-arg, arg-type]
    assert set(seen) == {0, 1} and min(seen.values()) > 60


def test_power_of_two_takes_the_better_of_two_random_candidates() -> None:
    picker = build(spec.PowerOfTwoPicker(type="power-of-two"))
    opts = options(EndpointView(), EndpointView(), EndpointView())
    scores = [0.1, 0.5, 0.9]
    rng = random.Random(1)
    seen = Counter(picker.pick(opts, scores, req(rng=rng)) for _ in range(300))  # type: ignore[call-arg, arg-type]
    # The worst candidate never wins a pair; the best wins every pair it is drawn into (2 of 3).
    assert 0 not in seen and seen[2] > seen[1] > 50
    assert picker.pick(opts, scores, REQ) == 2  # type: ignore[call-arg, arg-type]


def test_round_robin_ignores_scores() -> None:
    picker = build(spec.RoundRobinPicker(type="round-robin"))
    opts = options(EndpointView(), EndpointView(), EndpointView())
    assert [picker.pick(opts, [1, 0, 0], req(rotation=r)) for r in range(4)] == [0, 1, 2, 0]  # type: ignore[call-arg, arg-type]


# --- profiles -----------------------------------------------------------------------------------

def test_the_default_profile_weighs_prefix_against_load() -> None:
    affinity = req({"http://us1": 1.0})
    assert pick({}, affinity) == "http://us1"
    # Affinity yields once us1 is more than herd_margin requests busier than the least loaded.
    assert pick({"http://us1": EndpointView(load=5)}, affinity) in ("http://us2", "http://eu1")
    choice = pick_endpoint(compile_profile("t", DEFAULT_PROFILE), CANDIDATES, lambda c: EndpointView(), affinity)
    assert choice is not None
    assert choice.trace.startswith("endpoint http://us1 of pool p-us (us-east): score ")
    assert "prefix-affinity 1.00" in choice.trace and "max-score of 3" in choice.trace
    # Why it won: the runners-up, best first, with their own scores (as the dry-run shows them).
    scores = [score for _, score, _ in choice.others]
    assert scores == sorted(scores, reverse=True)
    assert {url for url, _, _ in choice.others} == {"http://us2", "http://eu1"}
    assert all(score <= choice.score for _, score, _ in choice.others)
    runners = choice.trace.split("; runners-up: ")[1]
    assert "http://us2 " in runners and "http://eu1 " in runners and "prefix-affinity 0.00" in runners


def test_home_region_is_preferred_until_it_is_saturated_then_the_roomiest_region_takes_over() -> None:
    home_us = req(home_region="us-east")
    home_eu = req(home_region="eu-west")
    assert pick({}, home_eu) == "http://eu1"
    assert pick({"http://us1": EndpointView(load=2)}, home_us) == "http://us2"
    # eu-west saturated: spill to us-east, the only region with room.
    full_eu = {"http://eu1": EndpointView(utilisation=1.1)}
    choice = pick_endpoint(compile_profile("t", DEFAULT_PROFILE), CANDIDATES,
                           lambda c: full_eu.get(c.url, EndpointView()), home_eu)
    assert choice is not None and choice.pool.region == "us-east"
    assert "home region eu-west is saturated: spilled to us-east" in choice.trace
    # us-east saturated on both replicas: eu-west has room.
    full_us = {"http://us1": EndpointView(utilisation=1.0), "http://us2": EndpointView(healthy=False)}
    assert pick(full_us, home_us) == "http://eu1"


def test_spill_over_goes_by_capacity_left_not_by_list_order() -> None:
    ap = Pool(name="p-ap", region="ap-south", served_model="m", endpoints=["http://ap1"], kv_cache_tokens=100_000)
    cands = [*CANDIDATES, Candidate(ap, "http://ap1")]
    views = {"http://us1": EndpointView(utilisation=1.2), "http://us2": EndpointView(utilisation=1.0),
             "http://eu1": EndpointView(utilisation=0.9),   # 0.1 x 400k = 40k tokens of room
             "http://ap1": EndpointView(utilisation=0.5)}   # 0.5 x 100k = 50k tokens of room
    request = req(home_region="us-east")
    choice = pick_endpoint(compile_profile("t", DEFAULT_PROFILE), cands, lambda c: views[c.url], request)
    assert choice is not None and choice.url == "http://ap1"
    views["http://eu1"] = EndpointView(utilisation=0.8)  # 80k tokens of room now
    choice = pick_endpoint(compile_profile("t", DEFAULT_PROFILE), cands, lambda c: views[c.url], request)
    assert choice is not None and choice.url == "http://eu1"
    # Nowhere has room: every candidate stays and the scorers decide.
    everywhere = {c.url: EndpointView(utilisation=1.3) for c in cands}
    choice = pick_endpoint(compile_profile("t", DEFAULT_PROFILE), cands, lambda c: everywhere[c.url], request)
    assert choice is not None and "no other region has room" in choice.trace


def test_session_affinity_keeps_a_conversation_on_its_replica() -> None:
    session = req(session_url="http://us2")
    assert pick({}, session) == "http://us2"
    assert pick({"http://us2": EndpointView(utilisation=0.95)}, session) == "http://us2"
    assert pick({"http://us2": EndpointView(utilisation=1.0)}, session) != "http://us2"


def test_baseline_profiles() -> None:
    least = BASELINE_PROFILES["least-loaded"]
    loads = {"http://us1": EndpointView(load=5), "http://us2": EndpointView(load=0), "http://eu1": EndpointView(load=1)}
    assert pick(loads, req({"http://us1": 1.0}), least) == "http://us2"
    robin = BASELINE_PROFILES["round-robin"]
    assert [pick(loads, req(rotation=r), robin) for r in range(3)] == ["http://us1", "http://us2",
                                                                                   "http://eu1"]
    down = {**loads, "http://us2": EndpointView(healthy=False)}
    assert {pick(down, req(rotation=r), robin) for r in range(4)} == {"http://us1", "http://eu1"}


def test_a_policy_declares_profiles_and_models_use_them() -> None:
    doc = base()
    doc["endpoint_profiles"] = {"spread": {"scorers": [{"type": "kv-cache", "weight": 2}, {"type": "queue-depth"}],
                                           "picker": {"type": "power-of-two"}}}
    doc["models"][0]["endpoint_profile"] = "spread"
    snapshot = compile_policy(to_yaml(doc))
    profile = profile_for(snapshot, snapshot.models["small"])
    assert [s.name for s in profile.scorers] == ["kv-cache", "queue-depth"] and profile.picker.name == "power-of-two"
    assert [f.name for f in profile.filters] == ["healthy", "serves-model", "under-saturation"]
    assert profile_for(snapshot, snapshot.models["large"]).name == "default"
    assert profile_for(snapshot, snapshot.models["small"], "round-robin").picker.name == "round-robin"


@pytest.mark.parametrize(("profile", "where", "message"), [
    ({"scorers": [{"type": "gpu-vibes"}]}, "endpoint_profiles.p.scorers[0]", "gpu-vibes"),
    ({"scorers": [{"type": "load", "weight": 0}]}, "endpoint_profiles.p.scorers[0]", "must be > 0"),
    ({"scorers": [{"type": "load"}, {"type": "load"}]}, "endpoint_profiles.p", "a scorer is listed twice"),
    ({"scorers": []}, "endpoint_profiles.p", "needs at least one scorer"),
    ({"filters": [{"type": "healthy", "extra": 1}], "scorers": [{"type": "load"}]},
     "endpoint_profiles.p.filters[0]", "unknown field 'extra'"),
])
def test_bad_profiles_are_rejected_at_their_location(profile: dict[str, Any], where: str, message: str) -> None:
    doc = base()
    doc["endpoint_profiles"] = {"p": profile}
    with pytest.raises(PolicyError) as err:
        compile_policy(to_yaml(doc))
    text = str(err.value)
    assert message in text and where in text, text


def test_a_model_naming_an_unknown_profile_is_rejected() -> None:
    doc = base()
    doc["endpoint_profiles"] = {"spread": {"scorers": [{"type": "load"}]}}
    doc["models"][0]["endpoint_profile"] = "sprad"
    with pytest.raises(PolicyError, match="unknown endpoint profile 'sprad'; did you mean 'spread'"):
        compile_policy(to_yaml(doc))


# --- LoRA adapters --------------------------------------------------------------------------------

LORA = spec.LoraAffinityScorer(type="lora-affinity")


def test_lora_affinity_prefers_where_the_adapter_is_loaded_then_a_free_slot() -> None:
    adapter = req(adapter="support")
    views = options(EndpointView(adapters=frozenset({"support"}), max_loras=1),
                    EndpointView(adapters=frozenset({"legal"}), max_loras=1),
                    EndpointView(adapters=frozenset(), max_loras=1))
    assert run_scorer(LORA, views, adapter) == [1.0, 0.0, 0.5]
    # Lately sent there (likely still in the engine's adapter cache), and a second slot free.
    views = options(EndpointView(recent_adapters=frozenset({"support"}), max_loras=1),
                    EndpointView(adapters=frozenset({"legal"}), max_loras=2),
                    EndpointView(adapters=frozenset({"legal", "other"}), max_loras=2))
    assert run_scorer(LORA, views, adapter) == [0.8, 0.5, 0.0]
    # A slot free now but holding a lately used adapter scores less than one free of both.
    views = options(EndpointView(recent_adapters=frozenset({"legal"}), max_loras=1),
                    EndpointView(max_loras=1), EndpointView(adapters=frozenset({"legal"}), max_loras=1))
    assert run_scorer(LORA, views, adapter) == [0.3, 0.5, 0.0]
    # A base model's request is indifferent to adapters.
    assert run_scorer(LORA, views) == [1.0, 1.0, 1.0]


def test_lora_affinity_yields_at_a_busy_replica_so_a_hot_adapter_spreads() -> None:
    adapter = req(adapter="support")
    busy = options(EndpointView(adapters=frozenset({"support"}), load=20, max_loras=2),
                   EndpointView(load=0, max_loras=2), EndpointView(load=0, max_loras=2, utilisation=0.5))
    assert run_scorer(LORA, busy, adapter) == [0.5, 0.5, 0.5]  # (its own slot is still free for it)
    full = options(EndpointView(adapters=frozenset({"support"}), utilisation=1.0, max_loras=1),
                   EndpointView(max_loras=1), EndpointView(max_loras=1))
    assert run_scorer(LORA, full, adapter) == [0.5, 0.5, 0.5]


def test_the_default_profile_keeps_an_adapter_where_it_is_loaded_against_a_little_load() -> None:
    adapter = req(adapter="support")
    views = {"http://us1": EndpointView(load=2, adapters=frozenset({"support"})),
             "http://us2": EndpointView(load=0, adapters=frozenset({"legal"})),
             "http://eu1": EndpointView(load=1, adapters=frozenset({"legal"}))}
    assert pick(views, adapter) == "http://us1"
    least = EndpointProfile.model_validate(BASELINE_PROFILES["least-loaded"].model_dump())
    assert pick(views, adapter, least) == "http://us2"  # the baseline the bench compares against
