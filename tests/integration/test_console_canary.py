"""The console's policy canaries on a real app, over SQLite and PostgreSQL: publish as canary from the editor
(the form's rollout, refusals that write nothing), the live panel (slice, figures side by side, guardrails, the
next step, shadow differences, the end reason), Promote and Abort (audited as the console user), and roles."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from switchyard.decide.canary import Tally
from switchyard.policy.rollout import DEFAULT_GUARDS
from switchyard.store import canary as canary_store
from switchyard.store import db
from switchyard.store.audit import list_events
from switchyard.store.models import PolicyCanary, utcnow
from switchyard.store.policy_versions import active_version, get_version, list_versions
from tests.integration.conftest import add_console_users, console_login, csrf_headers, eventually
from tests.integration.test_admin_policy_api import V2, _client
from tests.unit.policy.base import free_tokens_per_day

PAGE = "/admin/policy/canary"
START = "/admin/policy/canary/start"
HTMX = {"HX-Request": "true"}
V3 = free_tokens_per_day(7000)
#: The editor's canary fields as a person fills them in (the guards: the defaults, TTFT loosened to 2x).
FORM = {"yaml": V2, "message": "free: 5000 tokens a day", "canary_steps": "1:1m 10:2m 50:5m", "canary_percent": "",
        "canary_by": "key", "canary_tiers": "free", "canary_regions": "", "canary_models": "small, auto",
        "canary_guards": "ttft_p99=2x\r\nerror_rate=+1%\r\nshed_rate=+2%\r\nrate_limited_rate=+2%\r\ncost_per_1k=1.25x",
        "canary_window": "90s", "canary_min_requests": "20"}


@pytest.fixture
def db_console(tmp_path: Path, database_url: str) -> Iterator[TestClient[Any]]:
    """A gateway whose policy lives in the database (v1 from the file), the console users, logged in as the
    operator."""
    with _client(tmp_path, database_url, "db") as client:
        del client.headers["Authorization"]  # the console goes by its session, never the admin token
        add_console_users(client.app.state.runtime.engine)
        assert console_login(client, "operator").status_code == 303
        yield client


def _post(client: TestClient[Any], path: str, data: dict[str, Any], **headers: str) -> Any:
    return client.post(path, data=data, headers={**csrf_headers(client), **headers}, follow_redirects=False)


def _in_db(client: TestClient[Any], work: Any) -> Any:
    with db.session_scope(client.app.state.runtime.engine) as session:
        return work(session)


def _canaries(client: TestClient[Any]) -> list[PolicyCanary]:
    return list(_in_db(client, lambda s: canary_store.history(s, 50)))


def _running(client: TestClient[Any]) -> PolicyCanary | None:
    return _in_db(client, canary_store.running)  # type: ignore[no-any-return]


def _active(client: TestClient[Any]) -> tuple[int, str]:
    """The active version's number and text."""
    def read(session: Any) -> tuple[int, str]:
        row = active_version(session)
        assert row is not None
        return row.number, row.yaml_text

    return _in_db(client, read)  # type: ignore[no-any-return]


def _events(client: TestClient[Any], action: str) -> list[Any]:
    return _in_db(client, lambda s: list_events(s, 50, action=action))  # type: ignore[no-any-return]


def _start(client: TestClient[Any], **fields: str) -> int:
    answer = _post(client, START, {**FORM, **fields})
    assert answer.status_code == 303, answer.text
    found = re.fullmatch(r"/admin/policy/canary\?started=(\d+)", answer.headers["location"])
    assert found is not None, answer.headers["location"]
    return int(found.group(1))


def _record(client: TestClient[Any], canary_id: int, rows: list[tuple[str, str, dict[str, Any]]]) -> None:
    _in_db(client, lambda s: canary_store.record_figures(s, canary_id, "gw-test", rows))


def _tally(requests: int, errors: int, ttft_ms: float, spend: float) -> dict[str, Any]:
    t = Tally()
    for i in range(requests):
        t.count("error" if i < errors else "ok", ttft_ms, spend)
    return t.as_json()


def _text(page: str) -> str:
    """A page's text without its tags, spaces collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page)).split())


def test_the_editor_offers_publish_as_canary_with_the_default_guards(db_console: TestClient[Any]) -> None:
    editor = db_console.get("/admin/policy/edit").text
    assert 'id="canary-options"' in editor and 'formaction="/admin/policy/canary/start"' in editor
    guards = re.search(r'<textarea id="canary-guards-field"[^>]*>(.*?)</textarea>', editor, re.DOTALL)
    assert guards is not None
    assert guards.group(1).split() == ["ttft_p99=1.5x", "error_rate=+1%", "shed_rate=+2%", "rate_limited_rate=+2%",
                                       "cost_per_1k=1.25x"]
    assert set(DEFAULT_GUARDS) == {g.split("=")[0] for g in guards.group(1).split()}
    assert 'name="canary_steps" value="1:1m 10:2m 50:5m"' in editor and 'name="canary_window" value="2m"' in editor
    assert 'name="canary_min_requests" value="200"' in editor
    assert "Tiers: free, pro" in editor  # the names the scope can take
    assert 'id="open-canary" href="/admin/policy/canary"' in db_console.get("/admin/policy").text


def test_publish_as_canary_starts_a_canary_of_the_candidate_with_the_forms_rollout(
        db_console: TestClient[Any]) -> None:
    canary_id = _start(db_console)
    row = _running(db_console)
    assert row is not None and row.id == canary_id
    assert (row.version, row.base, row.step, row.percent, row.author) == (2, 1, 0, 1.0, "console:otto")
    rollout = canary_store.rollout_of(row)
    assert [(s.percent, s.hold) for s in rollout.steps] == [(1, 60), (10, 120), (50, 300)]
    assert rollout.by == "key" and not rollout.shadow
    assert (rollout.only.tiers, rollout.only.regions, rollout.only.models) == (["free"], [], ["small", "auto"])
    assert rollout.guards == {"ttft_p99": 2.0, "error_rate": 0.01, "shed_rate": 0.02, "rate_limited_rate": 0.02,
                              "cost_per_1k": 1.25}
    assert (rollout.window, rollout.min_requests) == (90.0, 20)
    # the candidate is stored, not active: v1 serves, and this process serves the slice already
    versions = _in_db(db_console, lambda s: [(v.number, v.source, v.active) for v in list_versions(s)])
    assert versions == [(2, "console", False), (1, "file", True)]
    assert _in_db(db_console, lambda s: get_version(s, 2).yaml_text) == V2
    runtime = db_console.app.state.runtime
    assert runtime.policy.snapshot.version == 1
    assert runtime.canary.live is not None and (runtime.canary.live.id, runtime.canary.live.version) == (canary_id, 2)
    event = _events(db_console, "policy.canary.")[0]
    assert (event.action, event.actor, event.target) == ("policy.canary.start", "console:otto", "policy:v2")
    assert event.origin.startswith("console ")
    # the panel it lands on, and the banner on the policy page
    page = db_console.get(f"{PAGE}?started={canary_id}")
    assert page.status_code == 200
    assert f"Canary {canary_id} started" in page.text
    banner = _text(db_console.get("/admin/policy").text)
    assert f"Canary {canary_id} is running: v2 serves 1% of the traffic next to v1" in banner
    assert "Sliced by key, step 1 of 3" in banner
    assert 'id="canary-running-note"' in db_console.get("/admin/policy/edit").text


@pytest.mark.parametrize(("fields", "says"), [
    ({"canary_steps": "10:1m 5:1m"}, "steps' percentages must increase strictly"),
    ({"canary_steps": "10:1m", "canary_percent": "20"}, "the starting percent (20) is above the first step's 10%"),
    ({"canary_steps": "", "canary_percent": ""}, "give steps, or a percent to hold until promoted or aborted"),
    ({"canary_guards": "ttft_p99=+2x"}, "guard ttft_p99 is a ratio: write it like ttft_p99=1.5x"),
    ({"canary_guards": "latency=2x"}, "invalid guard 'latency=2x'"),
    ({"canary_steps": "ten"}, "invalid step 'ten'"),
    ({"canary_window": "soon"}, "window: invalid duration 'soon'"),
    ({"canary_min_requests": "5"}, "min_requests: Input should be greater than or equal to 20"),
    ({"canary_percent": "abc", "canary_steps": ""}, "percent: 'abc' is not a number"),
    ({"canary_by": "planet"}, "slice by: one of tenant, key, session, request"),
])
def test_an_invalid_rollout_is_refused_with_the_form_as_typed_and_nothing_written(
        db_console: TestClient[Any], fields: dict[str, str], says: str) -> None:
    answer = _post(db_console, START, {**FORM, **fields})
    assert answer.status_code == 400, answer.text
    assert "Not started: the canary&#39;s rollout is not valid (see below); nothing was written." in answer.text
    error = re.search(r'<p id="canary-error" class="alert" role="alert">(.*?)</p>', answer.text, re.DOTALL)
    assert error is not None and says in html.unescape(error.group(1)), answer.text
    assert '<details id="canary-options" class="replay" open>' in answer.text  # the fields in view, as typed
    for name, value in fields.items():
        if name != "canary_guards":
            assert f'name="{name}" value="{html.escape(value)}"' in answer.text or name == "canary_by"
    assert "free: 5000 tokens a day" in answer.text  # the message and the candidate are kept too
    assert _canaries(db_console) == [] and len(_in_db(db_console, list_versions)) == 1


def test_an_invalid_candidate_or_a_running_canary_is_refused_and_nothing_written(
        db_console: TestClient[Any]) -> None:
    broken = _post(db_console, START, {**FORM, "yaml": V2.replace("priority: sheddable", "priority: nowhere", 1)})
    assert broken.status_code == 422 and "Not started: the candidate has 1 issue; nothing was written." in broken.text
    assert "nowhere" in broken.text
    same = _post(db_console, START, {**FORM, "yaml": _active(db_console)[1]})
    assert same.status_code == 409 and "the candidate is the active version" in html.unescape(same.text)
    assert _canaries(db_console) == [] and len(_in_db(db_console, list_versions)) == 1
    first = _start(db_console)
    clash = _post(db_console, START, {**FORM, "yaml": V3})
    assert clash.status_code == 409, clash.text
    refused = html.unescape(clash.text)
    assert f"Not started: canary {first} of v2 is running: promote or abort it first. Nothing was written." in refused
    assert 'href="/admin/policy/canary">Open the canary panel</a>' in clash.text
    assert [c.id for c in _canaries(db_console)] == [first] and len(_in_db(db_console, list_versions)) == 2


def test_the_panel_shows_the_slice_figures_guardrails_and_the_next_step(db_console: TestClient[Any]) -> None:
    canary_id = _start(db_console)
    empty = _text(db_console.get(PAGE).text)
    assert "No request of the canary's scope has been counted in the window yet" in empty
    assert "Not tested yet: each side needs 20 requests in the window." in empty
    same = _tally(400, 4, 120.0, 0.002)  # both sides alike: every guard holds
    _record(db_console, canary_id, [("canary", "*", same), ("control", "*", _tally(800, 8, 120.0, 0.002)),
                                    ("canary", "sheddable", same), ("control", "sheddable", same)])
    page = db_console.get(PAGE)
    assert page.status_code == 200
    text = _text(page.text)
    assert f"Canary {canary_id}: v2 next to v1 running" in text
    assert "1% of the scope's traffic, hashed by key" in text
    assert "tiers: free; models: small, auto" in text
    assert "1% for 1m (now) 10% for 2m 50% for 5m promote" in text
    assert re.search(r"Holding: step 1 of 3 at 1%; the step's hold ends in (1m 00s|\d\ds)", text), text
    assert "The slice and the rest, per class (last 90s)" in text
    # side by side: each class's slice and rest (requests, error, shed and 429 rates, TTFT p99, cost per 1,000)
    assert "all classes slice (v2) 400 1.00% 0.00% 0.00%" in text and "rest (v1) 800 1.00% 0.00% 0.00%" in text
    assert "sheddable slice (v2) 400 1.00%" in text
    assert "2.0000" in text  # cost per 1,000 requests: 1,000 x 0.002
    assert re.search(r"slice \(v2\) 400 1\.00% 0\.00% 0\.00% 1\d\d ms 2\.0000", text), text
    # the guardrails tested: in each class, with p-values, none breached
    guards = page.text[page.text.index('id="canary-guards"'):]
    assert guards.count('<tr id="canary-guard-') == 10 and 'class="fail"' not in guards[:guards.index("</table>")]
    assert "TTFT p99 at most 2x the rest's" in text and "error rate at most 1 point above the rest's" in text
    assert re.search(r"error rate all classes 1\.00% 1\.00% 2\.00% [\d.e-]+ 400 / 800 holds", text), text
    assert "Reported by 1 gateway process (gw-test)" in text
    # the live part alone, for htmx: polling every 2 s while the canary runs, the actions left alone
    live = db_console.get(PAGE, params={"live": canary_id}, headers=HTMX)
    assert live.status_code == 200 and live.text.lstrip().startswith('<section id="canary-live"')
    assert f'hx-get="/admin/policy/canary?live={canary_id}" hx-trigger="every 2s" hx-swap="outerHTML"' in live.text
    assert "400" in live.text and 'id="canary-actions"' not in live.text


def test_a_shadow_canary_shows_where_the_candidate_decided_otherwise(db_console: TestClient[Any]) -> None:
    canary_id = _start(db_console, canary_shadow="on", canary_steps="", canary_percent="25")
    row = _running(db_console)
    assert row is not None and canary_store.rollout_of(row).shadow and row.percent == 25
    _record(db_console, canary_id, [("shadow", "*", {"requests": 12, "diffs": {"model": 3, "pool": 1}})])
    text = _text(db_console.get(PAGE).text)
    assert "shadow: v2 decides the slice's requests alongside v1" in text
    assert ("12 requests decided alongside; differences by field: Field Requests decided otherwise model 3 pool 1"
            in text)
    assert "A shadow serves nothing, so no guardrail is tested." in text
    assert "25%, held until promoted or aborted" in text


def test_abort_and_promote_from_the_panel_are_audited_and_followed_at_once(db_console: TestClient[Any]) -> None:
    runtime = db_console.app.state.runtime
    first = _start(db_console)
    panel = db_console.get(PAGE).text
    assert 'id="canary-abort"' in panel and 'id="canary-promote"' in panel
    assert f'<input type="hidden" name="canary" value="{first}">' in panel and 'name="_csrf_token"' in panel
    aborted = _post(db_console, f"{PAGE}/abort", {"canary": str(first), "reason": "TTFT looks off in eu-west"})
    assert aborted.status_code == 303 and aborted.headers["location"] == f"{PAGE}?aborted={first}"
    row = _canaries(db_console)[0]
    assert (row.status, row.reason) == ("aborted", "TTFT looks off in eu-west")
    assert runtime.canary.live is None and runtime.policy.snapshot.version == 1  # followed at once
    event = _events(db_console, "policy.canary.abort")[0]
    assert (event.actor, event.target) == ("console:otto", "policy:v2") and event.origin.startswith("console ")
    text = _text(db_console.get(aborted.headers["location"]).text)
    assert f"Canary {first} aborted: the active version serves every request again." in text
    assert re.search(r"Aborted at [\d-]+ [\d:]+ UTC: TTFT looks off in eu-west", text), text  # the end reason
    assert f"Canary {first} has ended (aborted): there is nothing to promote or abort." in text
    assert 'id="canary-abort"' not in db_console.get(PAGE).text
    # a panel still polling for it learns it ended, and loses its buttons (out of band)
    polled = db_console.get(PAGE, params={"live": first}, headers=HTMX).text
    assert "hx-trigger" not in polled
    assert '<section id="canary-actions" aria-labelledby="canary-actions-heading" hx-swap-oob="true">' in polled
    # a form for a canary that is no longer running changes nothing
    stale = _post(db_console, f"{PAGE}/promote", {"canary": str(first)})
    assert stale.status_code == 409 and f"canary {first} is not running any more" in stale.text

    second = _start(db_console, yaml=V3)
    promoted = _post(db_console, f"{PAGE}/promote", {"canary": str(second), "reason": ""})
    assert promoted.status_code == 303 and promoted.headers["location"] == f"{PAGE}?promoted={second}"
    row = _canaries(db_console)[0]
    assert (row.id, row.status, row.reason) == (second, "promoted", "promoted by console:otto")
    assert _active(db_console) == (row.version, V3)
    assert runtime.policy.snapshot.version == row.version  # this process serves it already
    assert runtime.canary.live is None
    event = _events(db_console, "policy.canary.promote")[0]
    assert (event.actor, event.target) == ("console:otto", f"policy:v{row.version}")
    assert f"Canary {second} promoted: its version is now the active version." in db_console.get(
        promoted.headers["location"]).text
    history = _text(db_console.get(PAGE).text)
    assert f"{second} v{row.version} next to v1 canary promoted" in history
    assert f"{first} v2 next to v1 canary aborted" in history
    assert _post(db_console, f"{PAGE}/abort", {}).status_code == 400  # which canary?


def test_a_breach_rolls_the_canary_back_and_the_panel_says_why(db_console: TestClient[Any]) -> None:
    canary_id = _start(db_console)
    _record(db_console, canary_id, [("canary", "*", _tally(400, 80, 100.0, 0.0)),  # 20% errors against 1%
                                    ("control", "*", _tally(400, 4, 100.0, 0.0))])
    assert eventually(lambda: _running(db_console) is None, timeout=15), "the gateway never rolled it back"
    text = _text(db_console.get(PAGE).text)
    assert re.search(r"Rolled back at [\d-]+ [\d:]+ UTC: error_rate in class \*: canary 0\.2 vs rest 0\.01", text), text
    event = _events(db_console, "policy.canary.rollback")[0]
    assert event.actor.startswith("canary@")


def test_viewers_see_the_panel_but_cannot_start_promote_or_abort(db_console: TestClient[Any]) -> None:
    canary_id = _start(db_console)
    assert console_login(db_console, "viewer").status_code == 303
    panel = db_console.get(PAGE)
    assert panel.status_code == 200 and f"Canary {canary_id}: v2 next to v1" in panel.text
    assert 'id="canary-promote"' not in panel.text and 'id="canary-abort"' not in panel.text
    assert "Promoting or aborting a canary needs the operator role." in panel.text
    assert 'id="canary-options"' not in db_console.get("/admin/policy/edit").text
    for path, data in ((f"{PAGE}/promote", {"canary": str(canary_id)}), (f"{PAGE}/abort", {"canary": str(canary_id)}),
                       (START, {**FORM, "yaml": V3})):
        answer = _post(db_console, path, data)
        assert answer.status_code == 403, (path, answer.status_code)
        assert "this needs the operator role" in answer.text
    row = _running(db_console)
    assert row is not None and row.id == canary_id and len(_canaries(db_console)) == 1


def test_file_mode_starts_no_canary_from_the_console(console: TestClient[Any]) -> None:
    """The ``console`` fixture's gateway runs in the default mode: the policy file is the truth."""
    answer = _post(console, START, FORM)
    assert answer.status_code == 409 and "policy_source is file" in answer.text
    assert _canaries(console) == []
    assert 'id="canary-options"' not in console.get("/admin/policy/edit").text
    assert "No canary has run" in console.get(PAGE).text
    assert "No canary has run." in console.get(PAGE, params={"live": 1}, headers=HTMX).text


def test_a_passed_step_shows_what_it_passed_on(db_console: TestClient[Any]) -> None:
    """The next step's own span starts afresh; the panel says what each passed step passed on, as its audit entry
    keeps it, and that the new step is tested over the whole window until it has its own evidence."""
    canary_id = _start(db_console)
    _in_db(db_console, lambda s: s.execute(
        PolicyCanary.__table__.update().where(PolicyCanary.__table__.c.id == canary_id)  # type: ignore[attr-defined]
        .values(step_started_at=utcnow() - timedelta(minutes=2))))
    same = _tally(400, 4, 120.0, 0.002)
    _record(db_console, canary_id, [("canary", "*", same), ("control", "*", _tally(800, 8, 120.0, 0.002))])
    assert eventually(lambda: (r := _running(db_console)) is not None and r.step == 1, timeout=15), \
        "the gateway never moved it on"
    event = _events(db_console, "policy.canary.step")[0]
    assert event.actor.startswith("canary@") and event.detail["step"] == 1
    assert [g["guard"] for g in event.detail["guards_tested"]] == ["ttft_p99", "error_rate", "shed_rate",
                                                                   "rate_limited_rate", "cost_per_1k"]
    text = _text(db_console.get(PAGE).text)
    assert re.search(r"1% for 1m \(passed at [\d-]+ [\d:]+ UTC on 5 guard tests, least p [\d.e-]+\) "
                     r"10% for 2m \(now\) 50% for 5m promote", text), text
    # the new step has no request of its own yet: meanwhile the whole window's figures and guardrails
    assert "This step has not had 20 requests on each side yet: meanwhile the figures and guardrails are those of " \
           "the whole last 90s, the steps before included" in text, text
    assert "all classes slice (v2) 400" in text
