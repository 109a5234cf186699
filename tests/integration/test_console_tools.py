"""The console's tools: the dry-run (the policy tests' evaluator, through a form), the response cache's page and
its audited purge, and the audit log with filters and paging. In process, on SQLite and PostgreSQL; the
policy is ``tests.unit.policy.base.base()`` (routes ``auto``; models ``small``, ``large``; cache rule
``cache[0]`` on ``small``; tier ``free`` may call ``auto`` and ``small``)."""

from __future__ import annotations

import html
import re
from typing import Any

from litestar.testing import TestClient

from switchyard.decide.dryrun import DryRun, dry_run
from switchyard.decide.policy_tests import body_of_request, features_of_request
from switchyard.gateway.runtime import GatewayRuntime
from switchyard.policy import compile_policy
from switchyard.policy.policy_tests import PolicyTestRequest
from switchyard.policy.rollout import Rollout
from switchyard.store import canary as canary_store
from switchyard.store import db
from switchyard.store.audit import append_event, list_events
from switchyard.store.cache import CacheEntry
from switchyard.store.models import TenantCreate
from switchyard.store.tenants import create_tenant, get_tenant
from tests.integration.conftest import console_login, csrf_headers
from tests.unit.policy.base import base, to_yaml

# --- helpers -------------------------------------------------------------------------------------------


def runtime_of(client: TestClient[Any]) -> GatewayRuntime:
    runtime: GatewayRuntime = client.app.state.runtime
    return runtime


def element(page: str, element_id: str) -> str:
    """The inner HTML of the element with ``id`` (the first closing tag of its kind ends it)."""
    found = re.search(rf'<(\w+)[^>]*\bid="{re.escape(element_id)}"[^>]*>(.*?)</\1>', page, re.S)
    assert found is not None, f"no #{element_id} in the page"
    return found.group(2)


def trace_of(page: str) -> list[str]:
    """The lines of the page's ``#dry-run-trace``, as text."""
    return [html.unescape(line).strip() for line in re.findall(r"<li>(.*?)</li>", element(page, "dry-run-trace"),
                                                                re.S)]


def alert_of(page: str) -> str:
    found = re.search(r'role="alert">(.*?)<', page, re.S)
    assert found is not None, "no role=alert element"
    return html.unescape(found.group(1))


def submit(client: TestClient[Any], **fields: str) -> Any:
    return client.post("/admin/dry-run", data=fields, headers=csrf_headers(client))


def direct(client: TestClient[Any], tier: str, key_region: str | None = None, stream: bool = False,
           **request: Any) -> DryRun:
    """The evaluator called directly, as the policy tests call it, with the gateway's settings."""
    runtime = runtime_of(client)
    req = PolicyTestRequest(tier=tier, **request)
    body = body_of_request(req)
    if stream:
        body["stream"] = True
    return dry_run(runtime.policy.snapshot, tier, features_of_request(req), strategy=runtime.settings.picker,
                   priority=req.priority, key_region=key_region, gateway_region=runtime.settings.region, body=body,
                   kind=req.kind)


def put(client: TestClient[Any], key: str, tenant: str | None, model: str) -> None:
    """Store an entry in the app's response cache through the cache's own API (on the app's event loop)."""
    entry = CacheEntry(body=b'{"choices":[]}', model=model, tenant=tenant, rule="cache[0]", created=1.7e9,
                       prompt_tokens=3, completion_tokens=1)
    cache = runtime_of(client).cache.cache
    assert client.blocking_portal.call(cache.put, "cache[0]", key, entry, 600.0, 100)


def entries(client: TestClient[Any]) -> int:
    return client.blocking_portal.call(runtime_of(client).cache.cache.stats).entries


def tenant_id(client: TestClient[Any], name: str) -> str:
    with db.session_scope(runtime_of(client).engine) as session:
        return str(get_tenant(session, name).id)


def purges(client: TestClient[Any]) -> list[Any]:
    with db.session_scope(runtime_of(client).engine) as session:
        return list_events(session, action="cache.purge")


# --- dry-run -------------------------------------------------------------------------------------------


def test_the_dry_run_form_lists_tenants_models_and_routes(console: TestClient[Any]) -> None:
    page = console.get("/admin/dry-run")
    assert page.status_code == 200
    form = element(page.text, "dry-run-form")
    assert '<form id="dry-run-form" method="post" action="/admin/dry-run"' in page.text and 'name="_csrf_token"' in form
    assert '<option value="acme">acme (tier free)</option>' in form
    for name in ("auto", "small", "large"):
        assert f'<option value="{name}">{name}</option>' in form
    for field in ("dry-run-tenant", "dry-run-model", "dry-run-prompt", "dry-run-max-tokens", "dry-run-temperature",
                  "dry-run-stream", "dry-run-priority-header", "dry-run-region-header"):
        assert f'<label for="{field}"' in form, field
    assert 'id="dry-run-result"' not in page.text


def test_a_dry_run_shows_what_the_evaluator_decides_at_every_stage(console: TestClient[Any]) -> None:
    answer = submit(console, tenant="acme", model="auto", prompt="hi", temperature="0", max_tokens="50",
                    region_header="eu-west", stream="1")
    assert answer.status_code == 200, answer.text
    expected = direct(console, "free", model="auto", prompt="hi", temperature=0, max_tokens=50,
                      headers={"x-switchyard-region": "eu-west"}, stream=True)
    assert (expected.status, expected.model, expected.pool, expected.region) == (200, "small", "small-eu", "eu-west")
    result = answer.text.split('id="dry-run-result"', 1)[1]
    assert element(answer.text, "dry-run-decided-model") == "small"
    assert element(answer.text, "dry-run-decided-pool") == "small-eu"
    assert element(answer.text, "dry-run-decided-region") == "eu-west"
    assert element(answer.text, "dry-run-decided-class") == expected.priority == "sheddable"
    assert expected.endpoint is not None and expected.endpoint in result
    # Every trace line the evaluator gives, in its order: route, home region, class, cache rule, fallbacks, endpoint.
    assert trace_of(answer.text) == list(expected.trace)
    assert any(line.startswith("route auto: rule short matched → small") for line in expected.trace)
    assert any(line.startswith("cache rule cache[0] (exact, tenant)") for line in expected.trace)
    assert expected.trace[-2].startswith("fallback plan:")
    assert expected.trace[-1].startswith(f"endpoint {expected.endpoint} of pool small-eu")
    # the limits it would be charged: the free tier's tokens per minute and per day
    limits = element(answer.text, "dry-run-limits")
    assert "tokens_per_minute" in limits and "tokens_per_day" in limits and "tier free" in limits
    # the form keeps what was asked
    form = element(answer.text, "dry-run-form")
    assert 'value="50"' in form and '<option value="auto" selected>' in form and "checked" in form


def test_a_dry_run_sends_the_request_to_the_api_chosen(console: TestClient[Any]) -> None:
    form = element(console.get("/admin/dry-run").text, "dry-run-form")
    assert '<label for="dry-run-kind"' in form
    for kind in ("chat", "completion", "embedding", "responses", "tokenize", "detokenize"):
        assert f'<option value="{kind}"' in form, kind
    # The Responses API: the input read as the chat it is rendered into (the route's rule sees its text).
    answer = submit(console, tier="pro", model="auto", prompt="please prove this", kind="responses",
                    max_tokens="64")
    assert answer.status_code == 200, answer.text
    expected = direct(console, "pro", model="auto", prompt="please prove this", kind="responses", max_tokens=64)
    assert element(answer.text, "dry-run-decided-model") == expected.model
    assert trace_of(answer.text)[0] == expected.trace[0]
    # A generating model at /v1/embeddings: the 400 the gateway would answer, with why.
    refused = submit(console, tier="pro", model="small", prompt="hi", kind="embedding")
    assert refused.status_code == 200 and "model_not_supported" in refused.text
    assert any("kind embedding" in line for line in trace_of(refused.text))
    # The tokenizer endpoints: nothing charged.
    tokenize = submit(console, tier="free", model="small", prompt="hi", kind="tokenize")
    assert any("tokenize: uses only the model's tokenizer" in line for line in trace_of(tokenize.text))
    assert '<option value="tokenize" selected>' in element(tokenize.text, "dry-run-form")
    bad = submit(console, tier="pro", model="small", prompt="hi", kind="moderations")
    assert bad.status_code == 400 and "unknown API" in alert_of(bad.text)


def test_a_refused_request_is_a_dry_run_answer_not_a_form_error(console: TestClient[Any]) -> None:
    answer = submit(console, tenant="acme", model="large", prompt="prove it")
    assert answer.status_code == 200
    expected = direct(console, "free", model="large", prompt="prove it")
    assert (expected.status, expected.code) == (403, "model_not_allowed")
    assert "Refused: 403 model_not_allowed" in element(answer.text, "dry-run-verdict")
    assert trace_of(answer.text) == list(expected.trace)
    too_big = submit(console, tenant="acme", model="small", prompt="hi", max_tokens="5000")
    assert too_big.status_code == 200
    expected = direct(console, "free", model="small", prompt="hi", max_tokens=5000)
    assert (expected.status, expected.limit) == (429, "tokens_per_minute")
    assert "Refused: 429 request_too_large (limit tokens_per_minute)" in too_big.text
    assert "larger than the limit" in element(too_big.text, "dry-run-limits")
    assert trace_of(too_big.text) == list(expected.trace)


def test_the_tenants_home_region_is_where_the_dry_run_places_it(console: TestClient[Any]) -> None:
    with db.session_scope(runtime_of(console).engine) as session:
        create_tenant(session, TenantCreate(name="euro", tier="free", region="eu-west"))
    answer = submit(console, tenant="euro", model="small", prompt="hi")
    expected = direct(console, "free", key_region="eu-west", model="small", prompt="hi")
    assert answer.status_code == 200 and expected.region == "eu-west"
    assert element(answer.text, "dry-run-decided-region") == "eu-west"
    assert trace_of(answer.text) == list(expected.trace)


def test_bad_input_gives_the_form_again_with_an_alert_and_400(console: TestClient[Any]) -> None:
    for fields, message in (
        ({"model": "nope"}, "unknown model 'nope'"),
        ({"model": "small", "max_tokens": "lots"}, "Max tokens: 'lots' is not a whole number"),
        ({"model": "small", "temperature": "warm"}, "Temperature: 'warm' is not a number"),
        ({"model": "small", "temperature": "7"}, "Temperature: Input should be less than or equal to 2"),
        ({"model": "small", "max_tokens": "0"}, "Max tokens: Input should be greater than 0"),
        ({"model": "small", "tenant": "ghost"}, "unknown tenant 'ghost'"),
    ):
        answer = submit(console, **{"tenant": "acme", "prompt": "hi", **fields})
        assert answer.status_code == 400, (fields, answer.status_code)
        assert message in alert_of(answer.text), (fields, alert_of(answer.text))
        assert 'id="dry-run-form"' in answer.text and 'id="dry-run-result"' not in answer.text


def test_a_viewer_may_dry_run_but_not_without_the_csrf_token(console: TestClient[Any]) -> None:
    console.cookies.clear()
    assert console_login(console, "viewer").status_code == 303
    answer = submit(console, tenant="acme", model="auto", prompt="hi")
    assert answer.status_code == 200 and element(answer.text, "dry-run-decided-model") == "small"
    assert console.post("/admin/dry-run", data={"tenant": "acme", "model": "auto"}).status_code == 403


# --- the cache page and purge --------------------------------------------------------------------------


def test_the_cache_page_shows_the_caches_state_and_rules(console: TestClient[Any]) -> None:
    acme = tenant_id(console, "acme")
    put(console, "k1", acme, "small")
    put(console, "k2", acme, "small")
    page = console.get("/admin/cache")
    assert page.status_code == 200
    stats = page.text.split('id="cache-stats"', 1)[1].split("</section>", 1)[0]
    assert element(stats, "cache-backend") == "memory" and element(stats, "cache-entries") == "2"
    assert element(stats, "cache-bytes") == str(2 * len(b'{"choices":[]}'))
    rules = element(stats, "cache-rules")
    assert "cache[0]" in rules and "models small" in rules and "<th" in rules
    assert 'id="purge-form"' in page.text and 'id="purge-scope"' in page.text  # the admin may purge


def test_purge_by_tenant_model_and_everything_is_done_and_audited(console: TestClient[Any]) -> None:
    with db.session_scope(runtime_of(console).engine) as session:
        create_tenant(session, TenantCreate(name="beta", tier="free"))
    acme, beta = tenant_id(console, "acme"), tenant_id(console, "beta")
    put(console, "a-small", acme, "small")
    put(console, "a-large", acme, "large")
    put(console, "b-small", beta, "small")
    put(console, "b-large", beta, "large")
    put(console, "global", None, "small")
    assert entries(console) == 5

    answer = console.post("/admin/cache/purge", data={"scope": "tenant", "tenant": "acme", "model": "small"},
                          headers=csrf_headers(console), follow_redirects=False)
    assert answer.status_code == 303 and answer.headers["location"].startswith("/admin/cache?purged=2")
    assert entries(console) == 3  # the model field is not used for a tenant purge
    note = console.get(answer.headers["location"])
    assert "Purged 2 entries (tenant acme)." in element(note.text, "cache-note")
    (event,) = purges(console)
    assert (event.actor, event.action, event.target) == ("console:ada", "cache.purge", "cache:tenant acme")
    assert event.origin.startswith("console") and event.detail == {"removed": 2, "tenant": "acme", "model": None}

    answer = console.post("/admin/cache/purge", data={"scope": "model", "model": "small", "tenant": "beta"},
                          headers=csrf_headers(console), follow_redirects=False)
    assert answer.status_code == 303 and "purged=2" in answer.headers["location"]
    assert entries(console) == 1  # b-large is left
    assert purges(console)[0].detail == {"removed": 2, "tenant": None, "model": "small"}

    answer = console.post("/admin/cache/purge", data={"scope": "all"}, headers=csrf_headers(console))
    assert answer.status_code == 200 and "Purged 1 entry (everything)." in answer.text
    assert entries(console) == 0
    assert [e.target for e in purges(console)] == ["cache:everything", "cache:model small", "cache:tenant acme"]


def test_a_bad_purge_gives_the_page_again_with_an_alert(console: TestClient[Any]) -> None:
    for data, message in (({"scope": "tenant", "tenant": "ghost"}, "ghost"),
                          ({"scope": "tenant"}, "choose the tenant"),
                          ({"scope": "model"}, "choose the model"),
                          ({"scope": "some"}, "choose what to purge")):
        answer = console.post("/admin/cache/purge", data=data, headers=csrf_headers(console))
        assert answer.status_code == 400, data
        assert message in alert_of(answer.text), data
    assert purges(console) == []


def test_a_viewer_sees_the_cache_but_may_not_purge_it(console: TestClient[Any]) -> None:
    put(console, "k", tenant_id(console, "acme"), "small")
    console.cookies.clear()
    assert console_login(console, "viewer").status_code == 303
    page = console.get("/admin/cache")
    assert page.status_code == 200 and 'id="purge-form"' not in page.text and "operator role" in page.text
    refused = console.post("/admin/cache/purge", data={"scope": "all"}, headers=csrf_headers(console))
    assert refused.status_code == 403 and entries(console) == 1 and purges(console) == []
    assert console_login(console, "operator").status_code == 303
    done = console.post("/admin/cache/purge", data={"scope": "all"}, headers=csrf_headers(console),
                        follow_redirects=False)
    assert done.status_code == 303 and entries(console) == 0
    assert purges(console)[0].actor == "console:otto"


# --- the audit log -------------------------------------------------------------------------------------


def _ids(page: str) -> list[int]:
    return [int(i) for i in re.findall(r'<tr id="audit-(\d+)"', element(page, "audit-log"))]


def test_the_audit_log_lists_events_newest_first_with_filters_and_paging(console: TestClient[Any]) -> None:
    with db.session_scope(runtime_of(console).engine) as session:
        made = [append_event(session, actor=f"cli:{who}", origin="cli", action=action, target=f"thing:{i}",
                             detail={"n": i, "note": "<b>x</b>"})
                for i, (who, action) in enumerate([("alice", "demo.publish"), ("bob", "demo.rollback"),
                                                   ("alice", "other.region"), ("alice", "demo.publish"),
                                                   ("bob", "other.purge")])]
    ids = [e.id for e in made]
    page = console.get("/admin/audit")
    assert page.status_code == 200 and 'id="audit-filter"' in page.text
    shown = _ids(page.text)
    assert shown == sorted(shown, reverse=True) and shown[:5] == ids[::-1]
    row = re.search(rf'<tr id="audit-{ids[0]}">(.*?)</tr>', page.text, re.S)
    assert row is not None
    assert "cli:alice" in row.group(1) and "demo.publish" in row.group(1) and "thing:0" in row.group(1)
    # the detail as readable fields, escaped
    assert '<div><dt>n</dt><dd>0</dd></div><div><dt>note</dt><dd>&lt;b&gt;x&lt;/b&gt;</dd></div>' in row.group(1)

    assert _ids(console.get("/admin/audit", params={"action": "demo."}).text) == [ids[3], ids[1], ids[0]]
    assert _ids(console.get("/admin/audit", params={"actor": "cli:bob"}).text) == [ids[4], ids[1]]
    both = console.get("/admin/audit", params={"action": "demo.publish", "actor": "cli:alice"})
    assert _ids(both.text) == [ids[3], ids[0]]
    assert 'value="demo.publish"' in both.text  # the filter form keeps its values

    first = console.get("/admin/audit", params={"actor": "cli:", "limit": "2"})
    assert _ids(first.text) == [ids[4], ids[3]]
    older = html.unescape(re.search(r'id="audit-older" href="([^"]+)"', first.text).group(1))  # type: ignore[union-attr]
    assert "actor=cli%3A" in older and "limit=2" in older and f"before={ids[3]}" in older
    second = console.get(older)
    assert _ids(second.text) == [ids[2], ids[1]] and 'id="audit-newest"' in second.text
    third = console.get(html.unescape(re.search(r'id="audit-older" href="([^"]+)"', second.text).group(1)))  # type: ignore[union-attr]
    assert _ids(third.text) == [ids[0]] and 'id="audit-older"' not in third.text

    empty = console.get("/admin/audit", params={"action": "nothing."})
    assert empty.status_code == 200 and 'id="audit-empty"' in empty.text


def test_a_bad_audit_filter_is_a_400_with_an_alert(console: TestClient[Any]) -> None:
    for params, message in (({"limit": "many"}, "Limit: 'many' is not a whole number"),
                            ({"limit": "0"}, "Limit: 0 is not between 1 and 500"),
                            ({"before": "x"}, "Before id: 'x' is not a whole number")):
        answer = console.get("/admin/audit", params=params)
        assert answer.status_code == 400 and message in alert_of(answer.text), params


def test_a_viewer_may_read_the_audit_log(console: TestClient[Any]) -> None:
    console.cookies.clear()
    assert console_login(console, "viewer").status_code == 303
    assert console.get("/admin/audit").status_code == 200


def test_list_events_filters_by_actor_prefix_and_pages_before_an_id(console: TestClient[Any]) -> None:
    with db.session_scope(runtime_of(console).engine) as session:
        a = append_event(session, actor="x_y", origin="t", action="t.a", target="t")
        b = append_event(session, actor="xzy", origin="t", action="t.b", target="t")
        c = append_event(session, actor="x_y:2", origin="t", action="t.a", target="t")
    with db.session_scope(runtime_of(console).engine) as session:
        assert [e.id for e in list_events(session, actor="x_y")] == [c.id, a.id]  # "_" is no wildcard
        assert [e.id for e in list_events(session, action="t.", before_id=c.id)] == [b.id, a.id]
        assert [e.id for e in list_events(session, 1, action="t.a")] == [c.id]  # the old callers' way


def test_a_dry_run_may_name_a_tier_instead_of_a_tenant(console: TestClient[Any]) -> None:
    answer = submit(console, tier="pro", model="auto", prompt="Please prove that it halts.", priority="batch")
    expected = direct(console, "pro", model="auto", prompt="Please prove that it halts.", priority="batch")
    assert answer.status_code == 200 and (expected.model, expected.priority) == ("large", "batch")
    assert element(answer.text, "dry-run-decided-model") == "large"
    assert element(answer.text, "dry-run-decided-class") == "batch"
    assert "tier pro" in element(answer.text, "dry-run-who") and trace_of(answer.text) == list(expected.trace)
    assert "tokens_per_minute" in element(answer.text, "dry-run-limits")  # pro's own limit on large
    bad = submit(console, tier="platinum", model="auto")
    assert bad.status_code == 400 and "unknown tier 'platinum'" in alert_of(bad.text)


# --- dry-run against a named version ---------------------------------------------------------------------


def _start_canary(client: TestClient[Any], doc: dict[str, Any], percent: float = 10) -> int:
    """A canary of ``doc`` (stored as v2, not active) next to the serving v1; its candidate's version number."""
    with db.session_scope(runtime_of(client).engine) as session:
        row = canary_store.start(session, Rollout(percent=percent), author="test", origin="test", text=to_yaml(doc))
        return row.version


def test_a_dry_run_names_the_version_it_runs_against(console: TestClient[Any]) -> None:
    """The form offers the serving version (the default), the running canary's candidate and the other stored
    versions; the answer is the evaluator's against the version chosen, with the same form."""
    doc = base()
    doc["models"][0]["pools"] = ["small-eu"]  # the candidate keeps small in eu-west
    doc["models"][0]["fallback"] = []
    number = _start_canary(console, doc, percent=10)
    assert number == 2 and runtime_of(console).policy.snapshot.label == "v1"
    form = element(console.get("/admin/dry-run").text, "dry-run-version")
    assert '<option value="" selected>v1 (serving)</option>' in form
    assert "<option value=\"2\">v2 (the running canary's candidate, 10%)</option>" in form

    fields = {"tenant": "acme", "model": "auto", "prompt": "hi"}
    candidate = compile_policy(to_yaml(doc), "v2", 2)
    req = PolicyTestRequest(tier="free", model="auto", prompt="hi")
    expected = dry_run(candidate, "free", features_of_request(req), strategy=runtime_of(console).settings.picker,
                       gateway_region=runtime_of(console).settings.region, body=body_of_request(req))
    serving = direct(console, "free", model="auto", prompt="hi")
    assert (expected.pool, expected.region) == ("small-eu", "eu-west") != (serving.pool, serving.region)
    for ref in ("2", "v2"):
        answer = submit(console, **fields, version=ref)
        assert answer.status_code == 200, answer.text
        assert element(answer.text, "dry-run-decided-pool") == "small-eu"
        assert trace_of(answer.text) == list(expected.trace)
        assert html.unescape(element(answer.text, "dry-run-policy")) == "v2 (the running canary's candidate)"
        assert "<option value=\"2\" selected>" in element(answer.text, "dry-run-version")
    for ref in ("", "active", "1", "v1"):
        answer = submit(console, **fields, version=ref)
        assert answer.status_code == 200, (ref, answer.text)
        assert element(answer.text, "dry-run-decided-pool") == serving.pool
        assert trace_of(answer.text) == list(serving.trace)
        assert element(answer.text, "dry-run-policy") == "v1 (serving)"
    for ref, message in (("9", "there is no policy version 9"), ("latest", "'latest' is not a policy version")):
        bad = submit(console, **fields, version=ref)
        assert bad.status_code == 400 and message in alert_of(bad.text), ref


def test_a_version_without_the_tier_or_model_asked_for_is_a_form_error(console: TestClient[Any]) -> None:
    doc = base()
    doc["tiers"][0]["name"] = "starter"  # acme's tier, free, is gone in this version
    doc["tests"] = []
    _start_canary(console, doc)
    bad = submit(console, tenant="acme", model="auto", prompt="hi", version="2")
    assert bad.status_code == 400
    assert "tenant 'acme' is in tier 'free', which policy v2 does not define" in alert_of(bad.text)
    assert "<option value=\"2\" selected>" in element(bad.text, "dry-run-version")  # still v2, to correct
    assert submit(console, tier="starter", model="auto", prompt="hi", version="2").status_code == 200
