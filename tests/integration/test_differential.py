"""One procedure, three executors: the gateway, the dry-run and the what-if replay decide alike.

Hypothesis generates policies (models with context windows, output caps, fallback chains and
downgrades; an ``auto`` route; tiers with classes, allowed models, limits and regions), requests (a
model or route, a tier, short to overlong prompts, ``max_tokens``, ``n``, priorities by header or
body, a home region), tenant and key limit overrides, and the fleet's state (saturated endpoints,
open breakers). Each case goes through:

- the gateway, in process (an app on a test client), against simulated engines (real processes),
  with the case's policy published through its admin API and the fleet's state put into its
  endpoint registry (saturation as its engines would report it, open breakers);
- the dry-run, reading the same gateway's live view (before the gateway's request);
- the replay, on simulated engines with the same state (saturated engines already running other
  traffic, endpoints out of service).

and the three must reach the same decision: served or refused (status, code, the limit), the
resolved model, the class, the pool and region, the fallback plan. The drifts found when the order
was written three times (the context window checked by the gateway only, ``n`` counted by it only,
the tenant's limit overrides ignored by the dry-run) are pinned as examples, and
``test_the_comparison_catches_a_planted_drift`` plants each of them back into one executor and checks
that the comparison fails.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from litestar.testing import TestClient

from switchyard.app import create_app
from switchyard.bench.prompts import LiteralText
from switchyard.bench.spec import Labels, RequestSpec
from switchyard.decide import procedure
from switchyard.decide.decision import Caller
from switchyard.decide.dryrun import dry_run
from switchyard.decide.features import chat_features
from switchyard.engines.breakers import CircuitBreaker
from switchyard.engines.endpoints import EngineSignals
from switchyard.gateway.runtime import GatewayRuntime
from switchyard.policy import compile_policy
from switchyard.policy.tiers import Limits
from switchyard.settings import Settings
from switchyard.store import db
from switchyard.store.keys import create_key
from switchyard.store.models import TenantCreate
from switchyard.store.tenants import create_tenant
from switchyard.store.usage import set_limits
from switchyard.whatif import replay_policy
from tests.conftest import SECRETS
from tests.helpers import free_port
from tests.integration.conftest import ADMIN_AUTH, ADMIN_TOKEN, SIM_TIME_SCALE, SWITCHYARD, stop, wait_http
from tests.unit.policy.base import to_yaml

#: Generated cases per run: the same 50 every run by default; ``SWITCHYARD_DIFFERENTIAL_EXAMPLES=N`` draws N
#: random ones instead.
DEFAULT_EXAMPLES = 50
EXAMPLES = int(os.environ.get("SWITCHYARD_DIFFERENTIAL_EXAMPLES", DEFAULT_EXAMPLES))
REGIONS = ("us-east", "eu-west")
MODELS = ("small", "large")
#: A model's pool in a region runs on its own simulated engine (one per model and region).
SLOTS = {("small", "us-east"): 0, ("large", "us-east"): 1, ("small", "eu-west"): 2, ("large", "eu-west"): 3}
CLASSES = ("critical", "standard", "sheddable", "bulk")
WORD = "lorem "


# --- the fleet the cases run on ----------------------------------------------------------------------

@dataclass
class Bench:
    """Four simulated engines, and an in-process gateway over them."""

    urls: list[str]
    client: TestClient[Any]
    cases: int = 0

    @property
    def runtime(self) -> GatewayRuntime:
        runtime: GatewayRuntime = self.client.app.state.runtime
        return runtime


def _skeleton(urls: list[str]) -> str:
    """A policy naming the four engines (what ``switchyard sim --policy`` starts)."""
    pools = "\n".join(f"  - {{name: e{i}, region: {REGIONS[i // 2]}, served_model: m, endpoints: [{url}], "
                      f"kv_cache_tokens: 200000, max_num_seqs: 8}}" for i, url in enumerate(urls))
    return f"""schema: 1
regions: [us-east, eu-west]
pools:
{pools}
models:
  - {{name: m, pools: [e0, e1, e2, e3], context_window: 32768, price: {{input_per_mtok: 1, output_per_mtok: 1}}}}
priorities:
  standard: {{max_queue_ms: 1000}}
tiers:
  - {{name: t, priority: standard, models: ["*"]}}
"""


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    folder = tmp_path_factory.mktemp("differential")
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(4)]
    policy = folder / "policies.yaml"
    policy.write_text(_skeleton(urls))
    sims = subprocess.Popen([SWITCHYARD, "sim", "--policy", str(policy), "--time-scale", str(SIM_TIME_SCALE)])
    try:
        for url in urls:
            wait_http(url + "/health", sims)
        # The engines' load is what each case says it is: the scraper reads them once, at start-up.
        settings = Settings(data_dir=folder, database_url=f"sqlite:///{folder / 'switchyard.db'}", policy_file=policy,
                            policy_source="db", admin_token=ADMIN_TOKEN, region="us-east", scrape_interval_s=3600,
                            request_log=False, batch_worker=False)
        with TestClient(app=create_app(settings)) as client:
            yield Bench(urls, client)
    finally:
        stop(sims)


# --- cases ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """A policy, a request and the fleet's state."""

    policy: dict[str, Any]
    tier: str
    model: str
    prompt_words: int
    max_tokens: int
    n: int = 1
    body_priority: str | int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    tenant_limits: dict[str, int] | None = None
    key_limits: dict[str, int] | None = None
    saturated: frozenset[int] = frozenset()
    broken: frozenset[int] = frozenset()


def _pools(models: dict[str, list[str]], seqs: dict[int, int], urls: list[str]) -> list[dict[str, Any]]:
    return [{"name": f"{model}-{region[:2]}", "region": region, "served_model": "m",
             "endpoints": [urls[SLOTS[model, region]]], "kv_cache_tokens": 200_000,
             "max_num_seqs": seqs[SLOTS[model, region]]}
            for model, regions in models.items() for region in regions]


@st.composite
def policies(draw: st.DrawFn) -> dict[str, Any]:
    """A valid policy document over the four engines (their URLs filled in when the case runs)."""
    count = draw(st.sampled_from([1, 2]))
    names = list(MODELS[:count]) if count == 2 else [draw(st.sampled_from(MODELS))]
    regions = {m: draw(st.sampled_from([["us-east"], ["eu-west"], ["us-east", "eu-west"]])) for m in names}
    models = []
    for m in names:
        model: dict[str, Any] = {"name": m, "pools": [f"{m}-{r[:2]}" for r in regions[m]],
                                 "context_window": draw(st.sampled_from([2048, 8192, 32768])),
                                 "price": {"input_per_mtok": 1.0 if m == "large" else 0.1,
                                           "output_per_mtok": 3.0 if m == "large" else 0.2}}
        if draw(st.booleans()):
            model["max_output_tokens"] = draw(st.sampled_from([512, 1024]))
        others = [o for o in names if o != m]
        # The first model may fall back to the second; the second may be downgraded to the first (no cycles).
        if others and m == names[0] and draw(st.booleans()):
            other = others[0]
            model["fallback"] = [draw(st.sampled_from([other, *(f"{other}@{r}" for r in regions[other])]))]
        if others and m == names[1] and draw(st.booleans()):
            model["on_saturation"] = {"downgrade_to": others[0],
                                      "classes": draw(st.lists(st.sampled_from(CLASSES[1:3]), min_size=1,
                                                               unique=True))}
        models.append(model)
    routes = []
    if draw(st.booleans()):
        rules = [{"name": "short", "when": {"prompt_tokens_lt": draw(st.sampled_from([50, 500]))},
                  "model": draw(st.sampled_from(names))},
                 {"name": "gold", "when": {"tier": ["gold"]}, "model": draw(st.sampled_from(names))}]
        routes.append({"name": "auto", "rules": rules, "default": draw(st.sampled_from(names))})
    priorities = {"critical": {"max_queue_ms": 150}, "standard": {"max_queue_ms": 100},
                  "sheddable": {"max_queue_ms": 80, "shed_above_utilisation": draw(st.sampled_from([0.5, 0.9]))},
                  "bulk": {"lane": "batch", "max_queue_ms": 100, "max_utilisation": 0.9}}
    callable_ = names + [r["name"] for r in routes]
    tiers = []
    for tier, classes in (("gold", ["critical", "standard"]), ("free", ["standard", "sheddable", "bulk"])):
        entry: dict[str, Any] = {"name": tier, "priority": draw(st.sampled_from(classes)),
                                 "models": draw(st.one_of(st.just(["*"]),
                                                          st.lists(st.sampled_from(callable_), min_size=1,
                                                                   unique=True)))}
        limits = {name: draw(st.sampled_from([2_000, 50_000])) for name in ("tokens_per_minute",)
                  if draw(st.booleans())}
        if limits:
            entry["limits"] = limits
        usable = [m for m in names if entry["models"] == ["*"] or m in entry["models"]]
        if usable and draw(st.integers(0, 3)) == 3:
            entry["model_limits"] = {draw(st.sampled_from(usable)): {"tokens_per_minute": 1_500}}
        if draw(st.integers(0, 5)) == 5:
            entry["regions"] = [draw(st.sampled_from(REGIONS))]
        tiers.append(entry)
    return {"schema": 1, "regions": list(REGIONS), "pools": [], "models": models, "routes": routes,
            "priorities": priorities, "tiers": tiers, "cache": [], "tests": [], "_regions": regions,
            "resilience": {"health": {"probe_interval": 600},
                           "breakers": {"endpoint": {"consecutive_failures": 1, "open_for": 600},
                                        "pool": {"consecutive_failures": 1000, "open_for": 600}},
                           "retries": {"max_attempts": draw(st.sampled_from([1, 2, 3]))}}}


@st.composite
def cases(draw: st.DrawFn) -> Case:
    policy = draw(policies())
    names = [m["name"] for m in policy["models"]] + [r["name"] for r in policy["routes"]]
    headers: dict[str, str] = {}
    if draw(st.integers(0, 3)) == 3:
        headers["x-switchyard-priority"] = draw(st.sampled_from(CLASSES))
    if draw(st.integers(0, 3)) == 3:
        headers["x-switchyard-region"] = draw(st.sampled_from([*REGIONS, "mars"]))
    # (Hypothesis leans to the smallest draws: the rare choices take the largest values.)
    model = draw(st.sampled_from(names)) if draw(st.integers(0, 19)) < 19 else "unknown"
    return Case(policy, draw(st.sampled_from(["gold", "free"])), model,
                draw(st.sampled_from([3, 30, 400, 3_000, 12_000])), draw(st.sampled_from([8, 200, 200, 3_000, 9_000])),
                draw(st.sampled_from([1, 1, 2, 3])),
                draw(st.one_of(st.none(), st.sampled_from(CLASSES), st.integers(-5, 40))), headers,
                draw(st.one_of(st.none(), st.just({"tokens_per_minute": 600}))),
                draw(st.one_of(st.none(), st.just({"tokens_per_minute": 900}))),
                frozenset(draw(st.lists(st.integers(0, 3), max_size=2, unique=True))),
                frozenset(draw(st.lists(st.integers(0, 3), max_size=1, unique=True))))


# --- running a case through each executor ------------------------------------------------------------------

@dataclass(frozen=True)
class Verdict:
    """What an executor decided for a request."""

    served: bool
    status: int | None
    code: str | None
    limit: str | None
    model: str | None
    priority: str | None
    pool: str | None
    region: str | None
    plan: tuple[str, ...]


def _document(case: Case, urls: list[str]) -> str:
    doc = {k: v for k, v in case.policy.items() if not k.startswith("_")}
    seqs = dict.fromkeys(range(4), 4)
    doc["pools"] = _pools(case.policy["_regions"], seqs, urls)
    return to_yaml(doc)


def _spec(case: Case, nonce: str) -> RequestSpec:
    """The request (its prompt made unique, so no earlier case's prefix is in any engine or index)."""
    extra: dict[str, Any] = {}
    if case.n > 1:
        extra["n"] = case.n
    if case.body_priority is not None:
        extra["priority"] = case.body_priority
    text = f"case {nonce}: " + WORD * case.prompt_words
    return RequestSpec(0, 0.0, LiteralText(text), case.max_tokens,
                       Labels(tenant="case", model=case.model, stream=False, extra_body=extra, headers=case.headers))


def _plan(trace: list[Any]) -> tuple[str, ...]:
    """The stages of the ``fallback plan: a (pools) → b (pools); ...`` line of a trace."""
    lines = [str(line) for line in trace if str(line).startswith("fallback plan: ")]
    if not lines:
        return ()
    stages = lines[-1][len("fallback plan: "):].split("; ")[0]
    return tuple(stage.split(" (")[0] for stage in stages.split(" → "))


def _set_fleet(bench: Bench, case: Case, pools: list[dict[str, Any]]) -> None:
    """Put the case's fleet state into the gateway's registry: saturated engines report every sequence slot
    taken; broken ones have an open breaker; every breaker else is closed."""
    registry = bench.runtime.endpoints
    resilience = bench.runtime.policy.snapshot.document.resilience
    registry.configure(resilience)
    now = time.monotonic()
    for slot, url in enumerate(bench.urls):
        state = registry.state(url)
        state.up = True
        state.breaker = CircuitBreaker("endpoint", url, resilience.breakers.endpoint)
        if slot in case.broken:
            state.breaker.failure(now, "differential test: broken")
        seqs = next((p["max_num_seqs"] for p in pools if p["endpoints"] == [url]), 4)
        running = seqs if slot in case.saturated else 0
        registry.record_scrape(url, EngineSignals(running, 0, 0.0, 0, 0, frozenset({"m"})), now=now)


def _prepare(bench: Bench, case: Case, text: str, pools: list[dict[str, Any]]) -> str:
    """The gateway made ready for the case: its policy published through the admin API, the fleet's state set,
    the case's tenant and key made (with their limit overrides); the key's secret."""
    client, runtime = bench.client, bench.runtime
    published = client.post("/admin/api/policy/versions", json={"yaml": text, "message": "differential"},
                            headers=ADMIN_AUTH)
    assert published.status_code in (200, 201), published.text
    assert runtime.policy.snapshot.text == text
    _set_fleet(bench, case, pools)
    tenant = f"diff-{bench.cases}"
    with db.session_scope(runtime.engine) as session:
        create_tenant(session, TenantCreate(name=tenant, tier=case.tier))
        if case.tenant_limits is not None:
            set_limits(session, tenant=tenant, limits=case.tenant_limits, actor="test", origin="test")
        secret, key = create_key(session, tenant)
        if case.key_limits is not None:
            set_limits(session, key_id=key.id, limits=case.key_limits, actor="test", origin="test")
    SECRETS.add(secret)
    return secret


def _gateway(bench: Bench, case: Case, secret: str, body: dict[str, Any]) -> Verdict:
    """The request through the gateway, and what its record says was decided."""
    answer = bench.client.post("/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {secret}", **case.headers})
    record = bench.runtime.activity.get(answer.headers["x-request-id"])
    assert record is not None
    assert record.status == answer.status_code
    served = record.pool is not None
    error = answer.json().get("error") if answer.status_code >= 400 else None
    return Verdict(served, None if served else answer.status_code,
                   None if served or error is None else error["code"], answer.headers.get("x-switchyard-limit"),
                   record.resolved_model, record.priority, record.pool, record.region, _plan(record.trace))


def _dry_run(bench: Bench, case: Case, body: dict[str, Any]) -> Verdict:
    runtime = bench.runtime
    headers = {k.lower(): v for k, v in case.headers.items()}
    run = dry_run(runtime.policy.snapshot, case.tier, chat_features(body, headers), body=body,
                  gateway_region="us-east", tenant="dry-run",
                  tenant_limits=Limits.model_validate(case.tenant_limits) if case.tenant_limits else None,
                  key_limits=Limits.model_validate(case.key_limits) if case.key_limits else None,
                  fleet=runtime.view)
    served = run.status == 200
    return Verdict(served, None if served else run.status, None if served else run.code, run.limit, run.model,
                   run.priority, run.pool, run.region, run.plan)


def _replay(bench: Bench, case: Case, text: str, spec: RequestSpec, pools: list[dict[str, Any]]) -> Verdict:
    caller = Caller(case.tier, "case", "case-key",
                    Limits.model_validate(case.tenant_limits) if case.tenant_limits else None,
                    Limits.model_validate(case.key_limits) if case.key_limits else None)
    used = {p["endpoints"][0]: p["max_num_seqs"] for p in pools}
    busy = {bench.urls[slot]: used[bench.urls[slot]] for slot in case.saturated if bench.urls[slot] in used}
    arm = replay_policy(compile_policy(text), [spec], callers={"case": caller}, gateway_region="us-east",
                        down=[bench.urls[slot] for slot in case.broken], background=busy)
    outcome = arm.outcomes[0]
    served = outcome.pool is not None
    return Verdict(served, None if served else outcome.status, None if served else outcome.code, outcome.limit,
                   outcome.resolved_model, outcome.priority, outcome.pool, outcome.region, outcome.plan)


#: Drifts to plant in one executor (``test_the_comparison_catches_a_planted_drift``): the three the
#: executors had when each wrote the order of the decisions itself.
DRIFTS = ("dry-run skips the context window", "replay ignores n", "dry-run ignores the tenant's limits")


def verdicts(bench: Bench, case: Case, drift: str | None = None) -> dict[str, Verdict]:
    """The case's decision by each executor (with ``drift`` planted in one of them)."""
    bench.cases += 1
    text = _document(case, bench.urls)
    pools = _pools(case.policy["_regions"], dict.fromkeys(range(4), 4), bench.urls)
    spec = _spec(case, str(bench.cases))
    body = spec.body()
    secret = _prepare(bench, case, text, pools)
    # The dry-run and the replay first: the gateway's request changes what its view holds (its prefix index).
    with _planted(drift == DRIFTS[0], "check_fits", lambda *_args, **_kw: None):
        dry = _dry_run(bench, case if drift != DRIFTS[2] else _without_overrides(case), body)
    with _planted(drift == DRIFTS[1], "estimate", _estimate_one_choice):
        replayed = _replay(bench, case, text, spec, pools)
    return {"gateway": _gateway(bench, case, secret, body), "dry-run": dry, "replay": replayed}


@contextlib.contextmanager
def _planted(active: bool, name: str, replacement: Any) -> Iterator[None]:
    """``decide.procedure.<name>`` replaced while the block runs (when ``active``)."""
    if not active:
        yield
        return
    original = getattr(procedure, name)
    setattr(procedure, name, replacement)
    try:
        yield
    finally:
        setattr(procedure, name, original)


_ESTIMATE = procedure.estimate


def _estimate_one_choice(model: Any, prompt_tokens: int, max_tokens: int | None, choices: int = 1) -> Any:
    return _ESTIMATE(model, prompt_tokens, max_tokens)


def _without_overrides(case: Case) -> Case:
    return Case(case.policy, case.tier, case.model, case.prompt_words, case.max_tokens, case.n, case.body_priority,
                case.headers, None, None, case.saturated, case.broken)


def disagreement(found: dict[str, Verdict]) -> str | None:
    """Where the executors disagree (None: they agree)."""
    gateway = found["gateway"]
    wrong = {name: v for name, v in found.items() if v != gateway}
    return None if not wrong else f"gateway {gateway}; " + "; ".join(f"{k} {v}" for k, v in wrong.items())


# --- the drifts, pinned ----------------------------------------------------------------------------------------

def _simple(tweak: Any = None, **changes: Any) -> Case:
    """A two-model policy (small in us-east, falling back to large in both regions) with a token limit on the free
    tier, and a request that fits it; ``tweak`` changes the policy document."""
    policy: dict[str, Any] = {
        "schema": 1, "regions": list(REGIONS), "pools": [], "routes": [], "cache": [], "tests": [],
        "_regions": {"small": ["us-east"], "large": ["us-east", "eu-west"]},
        "models": [{"name": "small", "pools": ["small-us"], "context_window": 2048,
                    "price": {"input_per_mtok": 0.1, "output_per_mtok": 0.2}, "fallback": ["large"]},
                   {"name": "large", "pools": ["large-us", "large-eu"], "context_window": 32768,
                    "price": {"input_per_mtok": 1.0, "output_per_mtok": 3.0}}],
        "priorities": {"standard": {"max_queue_ms": 100},
                       "sheddable": {"max_queue_ms": 80, "shed_above_utilisation": 0.5},
                       "bulk": {"lane": "batch", "max_queue_ms": 100, "max_utilisation": 0.9}},
        "tiers": [{"name": "gold", "priority": "standard", "models": ["*"]},
                  {"name": "free", "priority": "standard", "models": ["*"], "limits": {"tokens_per_minute": 2_000}}],
        "resilience": {"health": {"probe_interval": 600},
                       "breakers": {"endpoint": {"consecutive_failures": 1, "open_for": 600}}}}
    if tweak is not None:
        tweak(policy)
    base = {"policy": policy, "tier": "free", "model": "small", "prompt_words": 30, "max_tokens": 200}
    return Case(**{**base, **changes})


def _downgrades(policy: dict[str, Any]) -> None:
    policy["models"][1]["on_saturation"] = {"downgrade_to": "small", "classes": ["standard"]}


def _small_everywhere(policy: dict[str, Any]) -> None:
    policy["_regions"]["small"] = ["us-east", "eu-west"]
    policy["models"][0]["pools"] = ["small-us", "small-eu"]


#: How the fleet's state and the classes steer decisions: each executor must agree on every one.
FLEET_CASES = [
    _simple(_downgrades, model="large", saturated=frozenset({1, 3})),  # large saturated: downgraded to small
    _simple(model="large", saturated=frozenset({1, 3})),  # no downgrade: queued until the deadline
    _simple(_small_everywhere, saturated=frozenset({0})),  # home pool saturated: spilled to eu-west
    _simple(broken=frozenset({0})),  # small's only endpoint out: its fallback, large, serves
    _simple(_small_everywhere, broken=frozenset({0}), headers={"x-switchyard-region": "us-east"}),
    _simple(model="large", saturated=frozenset({1, 3}), headers={"x-switchyard-priority": "sheddable"}),  # shed
    _simple(body_priority="bulk", saturated=frozenset({1})),  # the batch lane, room left
    _simple(model="large", broken=frozenset({1, 3})),  # no endpoint in service anywhere: 503
]
#: The prompt is far longer than small's 2,048-token window (even a quarter of its estimate is): the gateway
#: refuses it (400) before any engine sees it.
LONG_PROMPT = _simple(prompt_words=12_000, tier="gold")
#: Three choices of up to 700 tokens: 2,100 and more tokens reserved, over the free tier's 2,000 a minute.
THREE_CHOICES = _simple(n=3, max_tokens=700)
#: The tenant's own limit (600 tokens a minute) replaces the tier's 2,000: 30 + 700 tokens do not fit it.
TENANT_OVERRIDE = _simple(max_tokens=700, tenant_limits={"tokens_per_minute": 600})
DRIFT_CASES = {DRIFTS[0]: LONG_PROMPT, DRIFTS[1]: THREE_CHOICES, DRIFTS[2]: TENANT_OVERRIDE}


# --- the tests ------------------------------------------------------------------------------------------------

@settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES == DEFAULT_EXAMPLES, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@example(case=LONG_PROMPT)
@example(case=THREE_CHOICES)
@example(case=TENANT_OVERRIDE)
@given(case=cases())
def test_the_gateway_the_dry_run_and_the_replay_decide_alike(bench: Bench, case: Case) -> None:
    found = verdicts(bench, case)
    gateway = found["gateway"]
    # (What the cases came to: `pytest --hypothesis-show-statistics` shows the mix.)
    event("served" if gateway.served else f"refused {gateway.status} {gateway.code}")
    if gateway.served and gateway.pool is not None and gateway.model is not None:
        if not gateway.pool.startswith(gateway.model):
            event("served by another model (a fallback or a downgrade)")
        elif gateway.region != "us-east":
            event("served outside the gateway's home region")
    assert disagreement(found) is None, disagreement(found)


@pytest.mark.parametrize("case", FLEET_CASES)
def test_the_fleets_state_steers_every_executor_alike(bench: Bench, case: Case) -> None:
    found = verdicts(bench, case)
    assert disagreement(found) is None, disagreement(found)


@pytest.mark.parametrize("drift", DRIFTS)
def test_the_comparison_catches_a_planted_drift(bench: Bench, drift: str) -> None:
    case = DRIFT_CASES[drift]
    assert disagreement(verdicts(bench, case)) is None
    caught = disagreement(verdicts(bench, case, drift))
    assert caught is not None, f"the planted drift ({drift}) went unnoticed"
